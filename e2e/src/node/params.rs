//! Where the real node keeps everything (under `<run dir>/node`) and the addresses and ports
//! its configuration files name.

use std::net::Ipv4Addr;
use std::path::PathBuf;

/// Everything the node's configuration files depend on.
#[derive(Debug, Clone)]
pub struct NodeParams {
    /// `<run dir>/node`.
    pub dir: PathBuf,
    pub node_name: String,
    /// The host address pods and the apiserver share (`10.244.N.1`, on `lo`); also the
    /// kubelet's and kube-proxy's bind address and the Node's InternalIP.
    pub node_ip: Ipv4Addr,
    /// `10.244.N.0/24`.
    pub pod_cidr: String,
    pub kubelet_port: u16,
    pub kubelet_healthz_port: u16,
    pub proxy_healthz_port: u16,
    pub proxy_metrics_port: u16,
    /// The cluster CA (client certificates the kubelet accepts).
    pub ca_cert: PathBuf,
    /// The kubelet's `cgroupRoot`, e.g. `/cli-mcp-node-3`.
    pub cgroup_root: String,
    /// The directory with gVisor's `runsc` and shim, registered as containerd's runtime
    /// `runsc` ([`super::gvisor`]).
    pub gvisor_bin: Option<PathBuf>,
}

impl NodeParams {
    pub fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }
    pub fn containerd_dir(&self) -> PathBuf {
        self.dir.join("containerd")
    }
    pub fn containerd_config(&self) -> PathBuf {
        self.containerd_dir().join("config.toml")
    }
    /// gVisor's shim options ([`super::gvisor::runsc_toml`]).
    pub fn runsc_toml(&self) -> PathBuf {
        self.containerd_dir().join("runsc.toml")
    }
    /// The CRI plugin's `registry.config_path`: `hosts.toml` files sending pulls to the
    /// node's image registry ([`crate::registry`]).
    pub fn registry_hosts_dir(&self) -> PathBuf {
        self.containerd_dir().join("certs.d")
    }
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.dir.join("cni/net.d")
    }
    pub fn cni_ipam_dir(&self) -> PathBuf {
        self.dir.join("cni/ipam")
    }
    pub fn kubelet_root(&self) -> PathBuf {
        self.dir.join("kubelet")
    }
    /// The kubelet's `podLogsDir` (`<ns>_<pod>_<uid>/<container>/<restart>.log`).
    pub fn pod_logs_dir(&self) -> PathBuf {
        self.dir.join("pod-logs")
    }
    pub fn kubelet_config(&self) -> PathBuf {
        self.dir.join("kubelet.yaml")
    }
    pub fn kubelet_kubeconfig(&self) -> PathBuf {
        self.dir.join("kubelet.kubeconfig")
    }
    pub fn proxy_config(&self) -> PathBuf {
        self.dir.join("kube-proxy.yaml")
    }
    pub fn proxy_kubeconfig(&self) -> PathBuf {
        self.dir.join("kube-proxy.kubeconfig")
    }
    /// The CNI network name (libcni's cache in /var/lib/cni/results is keyed by it).
    pub fn network_name(&self) -> String {
        format!("cli-mcp{}", self.cgroup_root.replace('/', "-"))
    }
    /// The pod subnet's gateway (`10.244.N.1`): the first address of [`Self::pod_cidr`].
    pub(super) fn gateway(&self) -> String {
        self.node_ip.to_string()
    }
}
