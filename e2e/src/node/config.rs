//! The real node's configuration files, rendered from its [`NodeParams`]: containerd's, the
//! CNI network's, the kubelet's and kube-proxy's. Pure functions.

use std::net::Ipv4Addr;
use std::path::Path;

use serde_json::json;

use super::image::PAUSE_IMAGE;
use super::params::NodeParams;

/// The cluster DNS Service IP the kubelet writes into pods' resolv.conf.
pub const CLUSTER_DNS: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The cluster domain.
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// All pod addresses of every local cluster (kube-proxy's `clusterCIDR`).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The kubelet's `podPidsLimit`: each pod's pids cgroup. The per-pod bound on a sandbox's
/// processes (the agent's `RLIMIT_NPROC` counts the uid on the whole node, so sandbox pods
/// set none). Far more than a shell, its builds and the agent's threads need. It bounds a
/// pod, not the node: where `kernel.pid_max` is 32768, 32 pods at it would exhaust it.
pub const POD_PIDS_LIMIT: i64 = 1024;
/// The kubelet's `volumeStatsAggPeriod` (default 1m): how often it measures each pod's
/// disk-backed volumes (a walk of the files, jittered to between one and two periods). A
/// sandbox past its workspace `sizeLimit` or `ephemeral-storage` limit is evicted at the
/// first eviction pass (every 10 s) after a measurement shows it: within ~2 × 5 s + 10 s
/// here, ~130 s at the default.
pub const VOLUME_STATS_AGG_PERIOD: &str = "5s";

/// containerd's config: its own root, state, sockets and netns mounts under the node dir,
/// runc with cgroupfs (there is no systemd) and, given gVisor's binaries, gVisor beside it as
/// the runtime `runsc`; overlayfs, the CNI plugins from Debian.
pub fn containerd_config(p: &NodeParams) -> String {
    let c = p.containerd_dir();
    let d = |x: &Path| x.display().to_string();
    format!(
        r#"# Written by the cli-mcp e2e harness (real node).
version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  netns_mounts_under_state_dir = true
  enable_selinux = false
  # The harness may lack CAP_SYS_RESOURCE (true of this project's CI sandbox): a negative
  # oom_score_adj (the sandbox's -998) then fails in runc with "can't get final child's PID
  # from pipe". Clamp scores at containerd's own instead.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{runc_root}"
{runsc}  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
  # Pulls go to the node's own image registry on loopback, never to one on the network.
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{hosts}"
"#,
        root = d(&c.join("root")),
        state = d(&c.join("state")),
        sock = d(&p.socket()),
        pause = PAUSE_IMAGE,
        runc_root = d(&c.join("runc")),
        runsc = p
            .gvisor_bin
            .as_ref()
            .map(|_| super::gvisor::containerd_runtime(&p.runsc_toml()))
            .unwrap_or_default(),
        cni_bin = crate::net::CNI_BIN_DIR,
        cni_conf = d(&p.cni_conf_dir()),
        hosts = d(&p.registry_hosts_dir()),
    )
}

/// The CNI network: `ptp` veths with host-local IPAM in the node's `/24` (gateway on the
/// host side, the same address the apiserver listens on), `portmap` for hostPorts,
/// `loopback`. No masquerading: pod traffic never leaves the host.
pub fn cni_conflist(p: &NodeParams) -> String {
    let v = json!({
        "cniVersion": "0.4.0",
        "name": p.network_name(),
        "plugins": [
            {
                "type": "ptp",
                "ipMasq": false,
                "mtu": 1500,
                "ipam": {
                    "type": "host-local",
                    "dataDir": p.cni_ipam_dir(),
                    "ranges": [[{"subnet": p.pod_cidr, "gateway": p.gateway()}]],
                    "routes": [{"dst": "0.0.0.0/0"}]
                }
            },
            {"type": "portmap", "capabilities": {"portMappings": true}},
            {"type": "loopback"}
        ]
    });
    format!("{v:#}\n")
}

/// The most pods the real node runs: its `/24` holds 253 pod addresses, and idle sessions
/// cost little enough (docs/benchmarks.md, density) that the kubelet's default of 110, not
/// memory or CPU, would be what fills it.
pub const MAX_PODS: u32 = 250;

/// The KubeletConfiguration file. cgroup v1 needs `failCgroupV1: false` (kubelet ≥ 1.35);
/// containerd 1.6 has no RuntimeConfig RPC, so the kubelet falls back to `cgroupDriver`.
/// What bounds a sandbox on its node: [`POD_PIDS_LIMIT`], [`VOLUME_STATS_AGG_PERIOD`].
pub fn kubelet_config(p: &NodeParams) -> String {
    format!(
        r#"# Written by the cli-mcp e2e harness (real node).
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: {cgroup_root}
failSwapOn: false
address: {ip}
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
containerRuntimeEndpoint: unix://{sock}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
podPidsLimit: {pids}
maxPods: {max_pods}
volumeStatsAggPeriod: {stats}
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
clusterDNS: ["{dns}"]
clusterDomain: {domain}
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: "{ca}"
authorization:
  mode: Webhook
serializeImagePulls: false
resolvConf: /etc/resolv.conf
staticPodPath: ""
podLogsDir: "{logs}"
"#,
        cgroup_root = p.cgroup_root,
        pids = POD_PIDS_LIMIT,
        max_pods = MAX_PODS,
        stats = VOLUME_STATS_AGG_PERIOD,
        ip = p.node_ip,
        port = p.kubelet_port,
        healthz = p.kubelet_healthz_port,
        sock = p.socket().display(),
        dns = CLUSTER_DNS,
        domain = CLUSTER_DOMAIN,
        ca = p.ca_cert.display(),
        logs = p.pod_logs_dir().display(),
    )
}

/// kube-proxy in iptables mode (the host's iptables is iptables-nft), bound to the node
/// address, NodePorts on the node address only, conntrack sysctls left alone.
pub fn kube_proxy_config(p: &NodeParams) -> String {
    format!(
        r#"# Written by the cli-mcp e2e harness (real node).
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: {cidr}
hostnameOverride: {name}
bindAddress: {ip}
healthzBindAddress: 127.0.0.1:{healthz}
metricsBindAddress: 127.0.0.1:{metrics}
nodePortAddresses: ["{ip}/32"]
clientConnection:
  kubeconfig: "{kc}"
iptables:
  localhostNodePorts: false
conntrack:
  maxPerCore: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
        cidr = CLUSTER_CIDR,
        name = p.node_name,
        ip = p.node_ip,
        healthz = p.proxy_healthz_port,
        metrics = p.proxy_metrics_port,
        kc = p.proxy_kubeconfig().display(),
    )
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn params() -> NodeParams {
        NodeParams {
            dir: PathBuf::from("/r/node"),
            node_name: "n1".into(),
            node_ip: Ipv4Addr::new(10, 244, 7, 1),
            pod_cidr: "10.244.7.0/24".into(),
            kubelet_port: 40001,
            kubelet_healthz_port: 40002,
            proxy_healthz_port: 40003,
            proxy_metrics_port: 40004,
            ca_cert: PathBuf::from("/r/pki/ca.crt"),
            cgroup_root: "/cli-mcp-node-7".into(),
            gvisor_bin: Some("/c/gvisor/bin".into()),
        }
    }

    #[test]
    fn containerd_config_keeps_everything_under_the_node_dir() {
        let c = containerd_config(&params());
        for want in [
            r#"root = "/r/node/containerd/root""#,
            r#"state = "/r/node/containerd/state""#,
            r#"address = "/r/node/containerd.sock""#,
            r#"address = "/r/node/containerd.sock.ttrpc""#,
            r#"sandbox_image = "localhost/cli-mcp-pause:1""#,
            "SystemdCgroup = false",
            r#"Root = "/r/node/containerd/runc""#,
            r#"snapshotter = "overlayfs""#,
            r#"bin_dir = "/usr/lib/cni""#,
            r#"conf_dir = "/r/node/cni/net.d""#,
            "netns_mounts_under_state_dir = true",
            "restrict_oom_score_adj = true",
            r#"config_path = "/r/node/containerd/certs.d""#,
            r#"runtime_type = "io.containerd.runsc.v1""#,
            r#"ConfigPath = "/r/node/containerd/runsc.toml""#,
        ] {
            assert!(c.contains(want), "missing {want:?} in\n{c}");
        }
    }

    #[test]
    fn cni_uses_the_node_subnet_with_the_host_gateway() {
        let v: serde_json::Value = serde_json::from_str(&cni_conflist(&params())).expect("json");
        let types: Vec<&str> = v["plugins"]
            .as_array()
            .expect("plugins")
            .iter()
            .filter_map(|p| p["type"].as_str())
            .collect();
        assert_eq!(types, ["ptp", "portmap", "loopback"]);
        assert_eq!(v["name"], "cli-mcp-cli-mcp-node-7");
        let ipam = &v["plugins"][0]["ipam"];
        assert_eq!(ipam["ranges"][0][0]["subnet"], "10.244.7.0/24");
        assert_eq!(ipam["ranges"][0][0]["gateway"], "10.244.7.1");
        assert_eq!(ipam["dataDir"], "/r/node/cni/ipam");
        assert_eq!(v["plugins"][0]["ipMasq"], false);
    }

    #[test]
    fn kubelet_config_parses_and_has_the_settings_this_host_needs() {
        let text = kubelet_config(&params());
        let v: serde_yaml::Value = serde_yaml::from_str(&text).expect("yaml");
        assert_eq!(v["kind"], "KubeletConfiguration");
        assert_eq!(v["failCgroupV1"], false);
        assert_eq!(v["cgroupDriver"], "cgroupfs");
        assert_eq!(v["cgroupRoot"], "/cli-mcp-node-7");
        assert_eq!(v["failSwapOn"], false);
        assert_eq!(v["address"], "10.244.7.1");
        assert_eq!(v["port"], 40001);
        assert_eq!(v["readOnlyPort"], 0);
        assert_eq!(v["imageGCHighThresholdPercent"], 100);
        assert_eq!(v["maxPods"], 250);
        assert_eq!(v["clusterDNS"][0], "10.96.0.10");
        assert_eq!(v["clusterDomain"], "cluster.local");
        assert_eq!(
            v["containerRuntimeEndpoint"],
            "unix:///r/node/containerd.sock"
        );
        assert_eq!(v["authentication"]["anonymous"]["enabled"], false);
        assert_eq!(v["authentication"]["webhook"]["enabled"], true);
        assert_eq!(v["authentication"]["x509"]["clientCAFile"], "/r/pki/ca.crt");
        assert_eq!(v["authorization"]["mode"], "Webhook");
        assert_eq!(v["podLogsDir"], "/r/node/pod-logs");
    }

    #[test]
    fn kubelet_config_bounds_each_pods_processes_and_measures_volumes_often() {
        let v: serde_yaml::Value = serde_yaml::from_str(&kubelet_config(&params())).expect("yaml");
        assert_eq!(v["podPidsLimit"], 1024);
        assert_eq!(v["volumeStatsAggPeriod"], "5s");
        // The agent's own kill (at three quarters of its bound) comes before the pod's pids
        // cgroup refuses every fork.
        let agent = cli_mcp_api::sandbox::limits::AGENT_MAX_PROCESSES;
        assert!(
            agent > 0 && i64::try_from(agent * 3 / 4).is_ok_and(|k| k < POD_PIDS_LIMIT),
            "the agent's --max-processes {agent} in a pod must trip below podPidsLimit {POD_PIDS_LIMIT}"
        );
    }

    #[test]
    fn kube_proxy_config_is_iptables_on_the_node_address() {
        let v: serde_yaml::Value =
            serde_yaml::from_str(&kube_proxy_config(&params())).expect("yaml");
        assert_eq!(v["kind"], "KubeProxyConfiguration");
        assert_eq!(v["mode"], "iptables");
        assert_eq!(v["clusterCIDR"], "10.244.0.0/16");
        assert_eq!(v["hostnameOverride"], "n1");
        assert_eq!(v["bindAddress"], "10.244.7.1");
        assert_eq!(v["healthzBindAddress"], "127.0.0.1:40003");
        assert_eq!(v["metricsBindAddress"], "127.0.0.1:40004");
        assert_eq!(v["nodePortAddresses"][0], "10.244.7.1/32");
        assert_eq!(v["iptables"]["localhostNodePorts"], false);
        assert_eq!(v["conntrack"]["maxPerCore"], 0);
        assert_eq!(
            v["clientConnection"]["kubeconfig"],
            "/r/node/kube-proxy.kubeconfig"
        );
    }
}
