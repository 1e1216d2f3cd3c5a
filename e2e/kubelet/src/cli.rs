//! Command-line flags (the harness contract plus optional tunables).

use std::net::IpAddr;
use std::path::PathBuf;

use clap::Parser;
use ipnet::Ipv4Net;

/// Process kubelet: registers a Node and runs the pods bound to it as local processes, each in
/// its own network namespace (CNI ptp) and mount namespace.
#[derive(Debug, Parser)]
#[command(name = "cli-mcp-kubelet", version)]
pub struct Args {
    /// kubeconfig used to reach the apiserver.
    #[arg(long)]
    pub kubeconfig: PathBuf,
    /// Name of the Node to register.
    #[arg(long)]
    pub node_name: String,
    /// Directory for pod state, logs, volumes and IPAM data.
    #[arg(long)]
    pub state_dir: PathBuf,
    /// IPv4 pod CIDR of this node, e.g. 10.244.1.0/24; its first address is the gateway and
    /// the node's InternalIP.
    #[arg(long)]
    pub pod_cidr: Ipv4Net,
    /// JSON file mapping image patterns to local binaries, e.g. {"cli-mcp-agent:*": "/path"}.
    #[arg(long)]
    pub image_map: PathBuf,
    /// Value of KUBERNETES_SERVICE_HOST inside pods (an address pods can route to).
    #[arg(long)]
    pub apiserver_host: IpAddr,
    /// Value of KUBERNETES_SERVICE_PORT inside pods.
    #[arg(long)]
    pub apiserver_port: u16,
    /// The cluster's Service range: routed to the gateway inside every pod's network
    /// namespace, where the kubelet's NAT rules send ClusterIP traffic to the endpoints.
    #[arg(long, default_value = "10.96.0.0/12")]
    pub service_cidr: Ipv4Net,
    /// Cluster DNS server written into the resolv.conf of `ClusterFirst` pods (with the
    /// search path of --cluster-domain). Without it, pods' lookups go to their own loopback
    /// and fail (never to the host's resolver).
    #[arg(long)]
    pub cluster_dns: Option<IpAddr>,
    /// The cluster domain of the search path.
    #[arg(long, default_value = "cluster.local")]
    pub cluster_domain: String,
    /// Directory with the CNI plugins (ptp, host-local).
    #[arg(long, default_value = "/usr/lib/cni")]
    pub cni_bin_dir: PathBuf,
    /// HTTPS port on the node's InternalIP for `kubectl logs` (0 disables it).
    #[arg(long, default_value_t = 10250)]
    pub kubelet_port: u16,
    /// First CrashLoopBackOff delay in seconds (doubles up to --crash-backoff-max-secs).
    #[arg(long, default_value_t = 10)]
    pub crash_backoff_initial_secs: u64,
    #[arg(long, default_value_t = 300)]
    pub crash_backoff_max_secs: u64,
    /// Node Lease renewal interval in seconds.
    #[arg(long, default_value_t = 10)]
    pub lease_interval_secs: u64,
    /// Node status heartbeat interval in seconds.
    #[arg(long, default_value_t = 30)]
    pub node_status_interval_secs: u64,
    /// How often Secret/ConfigMap/token volumes are refreshed, in seconds.
    #[arg(long, default_value_t = 30)]
    pub volume_resync_secs: u64,
}
