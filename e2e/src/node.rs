//! The real node: kubelet and kube-proxy (built from the same Kubernetes module as the
//! control plane by `hack/build-control-plane.sh`) on containerd + runc from Debian, with the
//! CNI `ptp` plugin for pod networking. It is the alternative to the process kubelet
//! ([`NodeKind::Real`], `CLI_MCP_NODE=real`, `cli-mcp-cluster up --node real`): pods run as
//! real containers from local images.
//!
//! Everything lives under `<run dir>/node` (containerd's config, root, state, socket and
//! netns mounts; the CNI config and IPAM state; the kubelet's root dir; the node's
//! kubeconfigs and images). Pods get addresses in the cluster's `10.244.N.0/24` with the same
//! gateway on `lo` as the process kubelet (see [`crate::net`]), so pod traffic stays on this
//! host. The render functions below are pure; [`RealNode`] starts and tears down the three
//! processes.
//!
//! Host-wide state the node touches, and gives back on teardown:
//! - kube-proxy's iptables chains (`KUBE-*`, one set per host network namespace): only one
//!   real node runs at a time on a host (a lock in [`crate::net::STATE_DIR`]), and teardown
//!   runs `kube-proxy --cleanup`;
//! - the kubelet's `KUBE-KUBELET-CANARY` chains, deleted on teardown;
//! - the sysctls the kubelet insists on ([`KUBELET_SYSCTLS`]): saved before it starts and
//!   restored on teardown;
//! - the cgroup subtree `/cli-mcp-node-N` (the kubelet's `cgroupRoot`) in every hierarchy:
//!   its processes are killed and the directories removed on teardown (and on the next start
//!   if an earlier owner died).

use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::process::Component;

/// Environment variable selecting the node: `process` (default) or `real`.
pub const NODE_ENV: &str = "CLI_MCP_NODE";
/// The cluster DNS Service IP the kubelet writes into pods' resolv.conf.
pub const CLUSTER_DNS: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The cluster domain.
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// All pod addresses of every local cluster (kube-proxy's `clusterCIDR`).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The sandbox ("pause") image, built from Debian's static catatonit and imported at start.
pub const PAUSE_IMAGE: &str = "localhost/cli-mcp-pause:1";
/// Where Debian's `catatonit` package puts the static binary.
pub const CATATONIT: &str = "/usr/bin/catatonit";
/// containerd namespace of the CRI plugin.
pub const CRI_NAMESPACE: &str = "k8s.io";
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
/// The sysctls the kubelet sets when they differ (`setupKernelTunables`), saved and restored.
pub const KUBELET_SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// Which node a cluster runs its pods on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeKind {
    /// `cli-mcp-kubelet`: pods as local processes in their own netns (the default).
    #[default]
    Process,
    /// kubelet + kube-proxy on containerd/runc: pods as real containers from local images.
    Real,
}

impl std::str::FromStr for NodeKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "" | "process" => Ok(NodeKind::Process),
            "real" => Ok(NodeKind::Real),
            other => Err(Error::Prerequisite(format!(
                "unknown node kind {other:?}: use `process` (cli-mcp-kubelet) or `real` \
                 (kubelet + kube-proxy on containerd)"
            ))),
        }
    }
}

impl NodeKind {
    /// `$CLI_MCP_NODE`, or the process kubelet when it is unset.
    pub fn from_env() -> Result<Self> {
        std::env::var(NODE_ENV).unwrap_or_default().parse()
    }
}

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
    /// The CRI plugin's `registry.config_path`: `hosts.toml` files sending pulls to the
    /// node's image mirror ([`crate::registry`]).
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
    fn gateway(&self) -> String {
        self.node_ip.to_string()
    }
}

/// containerd's config: its own root, state, sockets and netns mounts under the node dir,
/// runc with cgroupfs (there is no systemd), overlayfs, the CNI plugins from Debian.
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
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
  # Pulls go to the node's loopback image mirror, never to a registry on the network.
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{hosts}"
"#,
        root = d(&c.join("root")),
        state = d(&c.join("state")),
        sock = d(&p.socket()),
        pause = PAUSE_IMAGE,
        runc_root = d(&c.join("runc")),
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

/// A client certificate `CN=cn, O=orgs...` signed by the cluster CA: `(cert, key)` PEMs.
pub fn client_cert(
    ca_cert_pem: &str,
    ca_key_pem: &str,
    cn: &str,
    orgs: &[&str],
) -> Result<(String, String)> {
    let ca_key = KeyPair::from_pem(ca_key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(ca_cert_pem, ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2099, 12, 31);
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    for o in orgs {
        dn.push(DnType::OrganizationName, *o);
    }
    params.distinguished_name = dn;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// The image config of a one-layer image (docker-archive `<sha>.json`).
pub fn image_config_json(entrypoint: &[&str], diff_id: &str) -> String {
    json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": entrypoint,
            "Env": ["PATH=/bin:/usr/bin"],
            "WorkingDir": "/"
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]}
    })
    .to_string()
}

/// The docker-archive `manifest.json` of a one-layer image.
pub fn image_manifest_json(config_file: &str, tag: &str, layer_file: &str) -> String {
    json!([{"Config": config_file, "RepoTags": [tag], "Layers": [layer_file]}]).to_string()
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(|e| Error::io("opening", path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| Error::io("reading", path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

fn run(cmd: &mut Command) -> Result<String> {
    let command = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| Error::Command {
        command: command.clone(),
        detail: e.to_string(),
    })?;
    if !out.status.success() {
        return Err(Error::Command {
            command,
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn tar_cmd() -> Command {
    let mut c = Command::new("tar");
    c.args([
        "--sort=name",
        "--mtime=@0",
        "--owner=0",
        "--group=0",
        "--numeric-owner",
    ]);
    c
}

/// Pack the directory `rootfs` as a one-layer image `tag` with `entrypoint` into the
/// docker-archive `out` (what `ctr images import` reads). `work` is a scratch directory.
pub fn build_image_archive(
    rootfs: &Path,
    tag: &str,
    entrypoint: &[&str],
    work: &Path,
    out: &Path,
) -> Result<()> {
    let _ = fs::remove_dir_all(work);
    fs::create_dir_all(work).map_err(|e| Error::io("creating", work, e))?;
    let layer = work.join("layer.tar");
    run(tar_cmd()
        .arg("-C")
        .arg(rootfs)
        .arg("-cf")
        .arg(&layer)
        .arg("."))?;
    let diff_id = sha256_file(&layer)?;
    let layer_dir = work.join(&diff_id);
    fs::create_dir_all(&layer_dir).map_err(|e| Error::io("creating", &layer_dir, e))?;
    let layer_file = format!("{diff_id}/layer.tar");
    fs::rename(&layer, work.join(&layer_file)).map_err(|e| Error::io("moving", &layer, e))?;
    let config = image_config_json(entrypoint, &diff_id);
    let config_file = format!("{}.json", hex::encode(Sha256::digest(config.as_bytes())));
    let config_path = work.join(&config_file);
    fs::write(&config_path, &config).map_err(|e| Error::io("writing", &config_path, e))?;
    let manifest = work.join("manifest.json");
    fs::write(
        &manifest,
        image_manifest_json(&config_file, tag, &layer_file),
    )
    .map_err(|e| Error::io("writing", &manifest, e))?;
    run(tar_cmd().arg("-C").arg(work).arg("-cf").arg(out).args([
        "manifest.json",
        &config_file,
        &diff_id,
    ]))?;
    let _ = fs::remove_dir_all(work);
    Ok(())
}

/// `ctr` against the node's containerd, in the CRI namespace.
fn ctr(socket: &Path) -> Command {
    let mut c = Command::new("ctr");
    c.arg("--address")
        .arg(socket)
        .arg("--namespace")
        .arg(CRI_NAMESPACE);
    c
}

/// Import a docker-archive into the node's containerd (pods use it with
/// `imagePullPolicy: Never` or `IfNotPresent`).
pub fn import_image(socket: &Path, archive: &Path) -> Result<()> {
    run(ctr(socket).args(["images", "import"]).arg(archive)).map(|_| ())
}

/// What the real node needs from the host; the error names the fix.
pub fn preflight(bin_dir: &Path) -> Result<()> {
    let mut problems = Vec::new();
    for (tool, pkg) in [
        ("containerd", "containerd"),
        ("ctr", "containerd"),
        ("containerd-shim-runc-v2", "containerd"),
        ("runc", "runc"),
        ("iptables", "iptables"),
        ("conntrack", "conntrack"),
        ("tar", "tar"),
    ] {
        if which(tool).is_none() {
            problems.push(format!("`{tool}` is not on PATH (apt package {pkg})"));
        }
    }
    if !Path::new(CATATONIT).is_file() {
        problems.push(format!(
            "{CATATONIT} is missing (apt package catatonit; the pause image)"
        ));
    }
    if !Path::new(crate::net::CNI_BIN_DIR).join("portmap").is_file() {
        problems.push(format!(
            "{}/portmap is missing (apt package containernetworking-plugins)",
            crate::net::CNI_BIN_DIR
        ));
    }
    if !Path::new("/sys/fs/cgroup/memory").is_dir()
        && !Path::new("/sys/fs/cgroup/cgroup.controllers").is_file()
    {
        problems.push("no memory cgroup controller is mounted under /sys/fs/cgroup".into());
    }
    for b in ["kubelet", "kube-proxy"] {
        if !bin_dir.join(b).is_file() {
            problems.push(format!(
                "{} is missing; build it with hack/build-control-plane.sh",
                bin_dir.join(b).display()
            ));
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(Error::Prerequisite(format!(
        "the real node cannot run here: {}; hack/prereqs.sh installs the packages",
        problems.join("; ")
    )))
}

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// The host-wide lock of the real node (one kube-proxy per host network namespace), waiting
/// at most `wait` for another real-node cluster to release it.
async fn lock_host(wait: Duration) -> Result<Flock<File>> {
    let deadline = Instant::now() + wait;
    let dir = Path::new(crate::net::STATE_DIR);
    fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;
    let path = dir.join("real-node.lock");
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io("opening", &path, e))?;
    let mut said = false;
    loop {
        match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(lock),
            Err((back, _)) if Instant::now() < deadline => {
                if !said {
                    eprintln!(
                        "real node: another real-node cluster holds {}; waiting up to {} s for it \
                         to stop",
                        path.display(),
                        wait.as_secs()
                    );
                    said = true;
                }
                f = back;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => {
                return Err(Error::Prerequisite(format!(
                    "another real-node cluster runs on this host (it held {} for {} s; \
                     kube-proxy's iptables chains exist once per host); stop it or use the \
                     process node",
                    path.display(),
                    wait.as_secs()
                )))
            }
        }
    }
}

/// The cgroup v1 hierarchies (and the v2 one) mounted under /sys/fs/cgroup.
fn cgroup_mounts() -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir("/sys/fs/cgroup") else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && !p.is_symlink())
        .collect()
}

/// Create the cgroup `root` in every hierarchy (the kubelet insists that its cgroupRoot
/// exists); cpuset gets its parent's CPUs and memory nodes.
fn create_cgroup(root: &str) -> Result<()> {
    let rel = root.trim_start_matches('/');
    for m in cgroup_mounts() {
        let dir = m.join(rel);
        fs::create_dir_all(&dir).map_err(|e| Error::io("creating cgroup", &dir, e))?;
        for f in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(v) = fs::read_to_string(m.join(f)) {
                let cur = fs::read_to_string(dir.join(f)).unwrap_or_default();
                if cur.trim().is_empty() {
                    fs::write(dir.join(f), v.trim())
                        .map_err(|e| Error::io("writing", dir.join(f), e))?;
                }
            }
        }
    }
    Ok(())
}

/// Kill every process in the cgroup subtree `root` (in all hierarchies) and remove its
/// directories, deepest first. Returns how many processes were killed.
fn sweep_cgroup(root: &str) -> usize {
    let rel = root.trim_start_matches('/');
    if rel.is_empty() {
        return 0;
    }
    let mut killed = 0;
    let mut dirs = Vec::new();
    for m in cgroup_mounts() {
        let top = m.join(rel);
        if top.is_dir() {
            collect_dirs(&top, &mut dirs);
        }
    }
    for _ in 0..50 {
        let mut any = false;
        for d in &dirs {
            let Ok(procs) = fs::read_to_string(d.join("cgroup.procs")) else {
                continue;
            };
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                any = true;
                if nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .is_ok()
                {
                    killed += 1;
                }
            }
        }
        if !any {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    for d in dirs {
        let _ = fs::remove_dir(&d);
    }
    killed
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                collect_dirs(&p, out);
            }
        }
    }
}

/// Mount points at or below `dir`, deepest first (from /proc/self/mountinfo; octal escapes
/// such as `\040` decoded).
pub fn mounts_under(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape_mount(m)))
        .filter(|m| m.starts_with(dir))
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    v.dedup();
    v
}

fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            if let Ok(n) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                out.push(n);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Unmount everything at or below `dir` (lazily, deepest first). Returns how many.
pub fn unmount_under(dir: &Path) -> usize {
    let mut n = 0;
    // Unmounting one can reveal another (stacked mounts): repeat until none is left.
    for _ in 0..10 {
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mounts = mounts_under(&info, dir);
        if mounts.is_empty() {
            break;
        }
        for m in mounts {
            if nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH).is_ok() {
                n += 1;
            }
        }
    }
    n
}

fn read_sysctl(name: &str) -> Option<String> {
    fs::read_to_string(Path::new("/proc/sys").join(name))
        .ok()
        .map(|v| v.trim().to_string())
}

/// The binaries of a real node.
#[derive(Debug, Clone)]
pub struct NodeBins {
    pub kubelet: PathBuf,
    pub kube_proxy: PathBuf,
    pub containerd: PathBuf,
}

impl NodeBins {
    /// kubelet and kube-proxy from the control-plane bin dir, containerd from PATH.
    pub fn locate(control_plane_bin: &Path) -> Result<NodeBins> {
        preflight(control_plane_bin)?;
        Ok(NodeBins {
            kubelet: control_plane_bin.join("kubelet"),
            kube_proxy: control_plane_bin.join("kube-proxy"),
            containerd: which("containerd").unwrap_or_else(|| PathBuf::from("containerd")),
        })
    }
}

/// A running real node: containerd, kubelet, kube-proxy. Dropping it tears it down.
#[derive(Debug)]
pub struct RealNode {
    params: NodeParams,
    bins: NodeBins,
    containerd: Option<Component>,
    kubelet: Option<Component>,
    kube_proxy: Option<Component>,
    saved_sysctls: Vec<(String, String)>,
    _host_lock: Option<Flock<File>>,
    torn_down: bool,
    /// Answers the pulls of containerd's CRI from its own content store.
    mirror: Option<crate::registry::Mirror>,
}

/// What [`RealNode::start`] needs besides the parameters.
pub struct NodeStart<'a> {
    pub bins: NodeBins,
    pub apiserver: &'a str,
    pub ca_cert_pem: &'a str,
    pub ca_key_pem: &'a str,
    pub log_dir: &'a Path,
    pub timeout: Duration,
    /// How long to wait for another real-node cluster on this host to stop.
    pub host_lock_wait: Duration,
}

impl RealNode {
    /// Take the host lock, clean what a dead earlier node left, write the configuration,
    /// start containerd, import the pause image, then start the kubelet and kube-proxy.
    /// Node readiness is the caller's wait (the Node object's Ready condition).
    pub async fn start(params: NodeParams, s: NodeStart<'_>) -> Result<RealNode> {
        let sock_len = params.socket().as_os_str().len() + ".ttrpc".len();
        if sock_len > 100 {
            return Err(Error::Prerequisite(format!(
                "the run dir is too long for containerd's socket path ({}); use a shorter --run-dir",
                params.socket().display()
            )));
        }
        let lock = lock_host(s.host_lock_wait).await?;
        // The node's own deadline starts once the host is ours: queueing behind another
        // real-node cluster is not this node being slow.
        let deadline = Instant::now() + s.timeout;
        let mut node = RealNode {
            params,
            bins: s.bins.clone(),
            containerd: None,
            kubelet: None,
            kube_proxy: None,
            saved_sysctls: Vec::new(),
            _host_lock: Some(lock),
            torn_down: false,
            mirror: None,
        };
        // A node of a cluster whose owner died may have left containers in this cgroup root,
        // and kube-proxy rules nobody maintains.
        let stale = sweep_cgroup(&node.params.cgroup_root);
        if stale > 0 {
            tracing::info!(
                processes = stale,
                "killed processes a dead real node left in {}",
                node.params.cgroup_root
            );
        }
        node.proxy_cleanup();
        node.remove_host_files(&[]);
        create_cgroup(&node.params.cgroup_root)?;
        node.write_files(&s)?;
        let mirror = crate::registry::Mirror::start(crate::registry::Store {
            socket: node.params.socket(),
            root: node.params.containerd_dir().join("root"),
            namespace: CRI_NAMESPACE.into(),
        })
        .await?;
        crate::registry::write_hosts(&node.params.registry_hosts_dir(), &mirror.url())?;
        node.mirror = Some(mirror);
        node.saved_sysctls = KUBELET_SYSCTLS
            .iter()
            .filter_map(|n| read_sysctl(n).map(|v| (n.to_string(), v)))
            .collect();
        let p = &node.params;
        let d = |x: &Path| x.display().to_string();

        node.containerd = Some(Component::start(
            "containerd",
            &node.bins.containerd,
            &["--config".into(), d(&p.containerd_config())],
            &[],
            &s.log_dir.join("containerd.log"),
            Duration::from_secs(10),
            false,
        )?);
        node.wait_containerd(deadline).await?;
        let started = Instant::now();
        let images = node.params.dir.join("images");
        let pause_root = images.join("pause-rootfs");
        fs::create_dir_all(&pause_root).map_err(|e| Error::io("creating", &pause_root, e))?;
        fs::copy(CATATONIT, pause_root.join("catatonit"))
            .map_err(|e| Error::io("copying", CATATONIT, e))?;
        let pause_tar = images.join("pause.tar");
        build_image_archive(
            &pause_root,
            PAUSE_IMAGE,
            &["/catatonit", "-P"],
            &images.join("work"),
            &pause_tar,
        )?;
        import_image(&node.params.socket(), &pause_tar)?;
        tracing::debug!(took = ?started.elapsed(), "pause image imported");

        let p = &node.params;
        let kubelet_args = vec![
            format!("--config={}", d(&p.kubelet_config())),
            format!("--kubeconfig={}", d(&p.kubelet_kubeconfig())),
            format!("--root-dir={}", d(&p.kubelet_root())),
            format!("--cert-dir={}", d(&p.dir.join("kubelet-pki"))),
            format!("--hostname-override={}", p.node_name),
            format!("--node-ip={}", p.node_ip),
            "--v=1".into(),
        ];
        node.kubelet = Some(Component::start(
            "kubelet",
            &node.bins.kubelet,
            &kubelet_args,
            &[],
            &s.log_dir.join("kubelet.log"),
            Duration::from_secs(10),
            false,
        )?);
        let proxy_args = vec![format!("--config={}", d(&p.proxy_config())), "--v=1".into()];
        node.kube_proxy = Some(Component::start(
            "kube-proxy",
            &node.bins.kube_proxy,
            &proxy_args,
            &[],
            &s.log_dir.join("kube-proxy.log"),
            Duration::from_secs(10),
            false,
        )?);
        Ok(node)
    }

    fn write_files(&self, s: &NodeStart<'_>) -> Result<()> {
        let p = &self.params;
        for d in [
            p.dir.clone(),
            p.containerd_dir(),
            p.cni_conf_dir(),
            p.cni_ipam_dir(),
            p.kubelet_root(),
            p.pod_logs_dir(),
        ] {
            fs::create_dir_all(&d).map_err(|e| Error::io("creating", &d, e))?;
        }
        let w = |path: PathBuf, text: String| -> Result<()> {
            fs::write(&path, text).map_err(|e| Error::io("writing", &path, e))
        };
        w(p.containerd_config(), containerd_config(p))?;
        w(
            p.cni_conf_dir().join("10-cli-mcp.conflist"),
            cni_conflist(p),
        )?;
        w(p.kubelet_config(), kubelet_config(p))?;
        w(p.proxy_config(), kube_proxy_config(p))?;
        let node_user = format!("system:node:{}", p.node_name);
        let (cert, key) = client_cert(s.ca_cert_pem, s.ca_key_pem, &node_user, &["system:nodes"])?;
        write_private(
            &p.kubelet_kubeconfig(),
            &crate::pki::kubeconfig(s.apiserver, s.ca_cert_pem, &cert, &key, &node_user),
        )?;
        let (cert, key) = client_cert(s.ca_cert_pem, s.ca_key_pem, "system:kube-proxy", &[])?;
        write_private(
            &p.proxy_kubeconfig(),
            &crate::pki::kubeconfig(s.apiserver, s.ca_cert_pem, &cert, &key, "system:kube-proxy"),
        )
    }

    async fn wait_containerd(&mut self, deadline: Instant) -> Result<()> {
        loop {
            if let Some(e) = self.first_exit() {
                return Err(e);
            }
            if self.params.socket().exists()
                && run(ctr(&self.params.socket()).args(["version"])).is_ok()
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("containerd's socket {}", self.params.socket().display()),
                    elapsed: Duration::ZERO,
                });
            }
            // containerd offers nothing to wait on before its socket exists: poll.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The first of the node's processes that exited, as an error.
    pub fn first_exit(&mut self) -> Option<Error> {
        self.containerd
            .iter_mut()
            .chain(self.kubelet.iter_mut())
            .chain(self.kube_proxy.iter_mut())
            .find_map(Component::exited_error)
    }

    /// Pids of the node's processes.
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.containerd
            .iter()
            .chain(self.kubelet.iter())
            .chain(self.kube_proxy.iter())
            .filter_map(|c| c.pid().map(|p| (c.name().to_string(), p)))
            .collect()
    }

    pub fn params(&self) -> &NodeParams {
        &self.params
    }

    /// `kube-proxy --cleanup`: removes the iptables (and ipvs/nftables) rules kube-proxy
    /// makes. Only run while holding the host lock, so no other real node's rules exist.
    fn proxy_cleanup(&self) {
        let mut cmd = Command::new(&self.bins.kube_proxy);
        cmd.arg("--cleanup").arg("--v=0");
        if let Err(e) = run(&mut cmd) {
            tracing::warn!("kube-proxy --cleanup: {e}");
        }
        // What the kubelet itself adds, in both families.
        let rules: &[(&str, &[&str])] = &[
            ("filter", &["-D", "INPUT", "-j", "KUBE-FIREWALL"]),
            ("filter", &["-D", "OUTPUT", "-j", "KUBE-FIREWALL"]),
            ("filter", &["-F", "KUBE-FIREWALL"]),
            ("filter", &["-X", "KUBE-FIREWALL"]),
            ("mangle", &["-F", "KUBE-KUBELET-CANARY"]),
            ("mangle", &["-X", "KUBE-KUBELET-CANARY"]),
            ("nat", &["-F", "KUBE-KUBELET-CANARY"]),
            ("nat", &["-X", "KUBE-KUBELET-CANARY"]),
            ("filter", &["-F", "KUBE-KUBELET-CANARY"]),
            ("filter", &["-X", "KUBE-KUBELET-CANARY"]),
            ("mangle", &["-X", "KUBE-IPTABLES-HINT"]),
        ];
        for ipt in ["iptables", "ip6tables"] {
            for (table, args) in rules {
                let _ = Command::new(ipt)
                    .args(["-w", "5", "-t", table])
                    .args(*args)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status();
            }
        }
    }

    /// Files the kubelet and libcni keep at fixed host paths: the kubelet's device-plugin
    /// socket, its `/var/log/containers` symlinks into this node's pod logs, libcni's
    /// result cache of this node's network (and of `ids`' loopback), and the shim sockets'
    /// directories containerd makes under /run/containerd. Directories go when empty.
    fn remove_host_files(&self, ids: &[String]) {
        let _ = fs::remove_file("/var/lib/kubelet/device-plugins/kubelet.sock");
        for d in ["/var/lib/kubelet/device-plugins", "/var/lib/kubelet"] {
            let _ = fs::remove_dir(d);
        }
        if let Ok(entries) = fs::read_dir("/var/log/containers") {
            for e in entries.flatten() {
                if fs::read_link(e.path()).is_ok_and(|t| t.starts_with(&self.params.dir)) {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        let _ = fs::remove_dir("/var/log/containers");
        let net = format!("{}-", self.params.network_name());
        if let Ok(entries) = fs::read_dir("/var/lib/cni/results") {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with(&net) || ids.iter().any(|id| name.contains(id.as_str())) {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        for d in [
            "/var/lib/cni/results",
            "/var/lib/cni",
            "/run/containerd/fifo",
            "/run/containerd/s",
            "/run/containerd/runc/k8s.io",
            "/run/containerd/runc",
            "/run/containerd",
        ] {
            let _ = fs::remove_dir(d);
        }
    }

    /// Stop the node and remove what it made: kube-proxy and its rules, the kubelet, every
    /// container (through containerd, so the shims exit), containerd, the mounts under the
    /// node dir (volumes, rootfs, netns), the cgroup subtree; restore the sysctls.
    pub fn stop(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        let started = Instant::now();
        if let Some(mut c) = self.kube_proxy.take() {
            c.stop();
        }
        if let Some(mut c) = self.kubelet.take() {
            c.stop();
        }
        let sock = self.params.socket();
        let mut ids: Vec<String> = Vec::new();
        if self
            .containerd
            .as_mut()
            .is_some_and(|c| c.exited().is_none())
        {
            ids = run(ctr(&sock).args(["containers", "ls", "-q"]))
                .unwrap_or_default()
                .lines()
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty())
                .collect();
            let list = |sock: &Path| -> Vec<String> {
                run(ctr(sock).args(["tasks", "ls", "-q"]))
                    .unwrap_or_default()
                    .lines()
                    .map(|l| l.trim().to_string())
                    .filter(|l| !l.is_empty())
                    .collect()
            };
            for id in list(&sock) {
                let _ = run(ctr(&sock).args(["tasks", "kill", "-s", "SIGKILL", &id]));
            }
            // Deleting a task makes its shim exit. A task whose shim already went is gone
            // from the list by itself; poll the list, with a deadline (there is no event to
            // wait on through ctr).
            let until = Instant::now() + Duration::from_secs(5);
            loop {
                let left = list(&sock);
                if left.is_empty() || Instant::now() >= until {
                    break;
                }
                for id in &left {
                    let _ = run(ctr(&sock).args(["tasks", "delete", "--force", id]));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if let Some(mut c) = self.containerd.take() {
            c.stop();
        }
        // Shims whose task could not be deleted still name our socket.
        let sock_s = sock.display().to_string();
        for (pid, _) in crate::process::processes_with_arg(&sock_s) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let killed = sweep_cgroup(&self.params.cgroup_root);
        let unmounted = unmount_under(&self.params.dir);
        self.proxy_cleanup();
        self.remove_host_files(&ids);
        for (name, value) in &self.saved_sysctls {
            if read_sysctl(name).as_deref() != Some(value.as_str()) {
                let path = Path::new("/proc/sys").join(name);
                if let Err(e) = fs::write(&path, value) {
                    tracing::warn!("restoring {}: {e}", path.display());
                }
            }
        }
        tracing::info!(took = ?started.elapsed(), killed, unmounted, "real node stopped");
        self._host_lock = None;
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        self.stop();
    }
}

fn write_private(path: &Path, contents: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::io("creating", path, e))?;
    f.write_all(contents.as_bytes())
        .map_err(|e| Error::io("writing", path, e))
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn node_kind_parses() {
        assert_eq!("".parse::<NodeKind>().expect("empty"), NodeKind::Process);
        assert_eq!("process".parse::<NodeKind>().expect("p"), NodeKind::Process);
        assert_eq!("real".parse::<NodeKind>().expect("r"), NodeKind::Real);
        assert!("docker".parse::<NodeKind>().is_err());
    }

    #[test]
    fn image_json_names_the_layer_and_the_tag() {
        let c: serde_json::Value =
            serde_json::from_str(&image_config_json(&["/catatonit", "-P"], "ab12")).expect("c");
        assert_eq!(c["rootfs"]["diff_ids"][0], "sha256:ab12");
        assert_eq!(c["config"]["Entrypoint"][1], "-P");
        let m: serde_json::Value = serde_json::from_str(&image_manifest_json(
            "cc.json",
            "localhost/x:1",
            "ab12/layer.tar",
        ))
        .expect("m");
        assert_eq!(m[0]["RepoTags"][0], "localhost/x:1");
        assert_eq!(m[0]["Layers"][0], "ab12/layer.tar");
        assert_eq!(m[0]["Config"], "cc.json");
    }

    #[test]
    fn mounts_under_picks_only_the_node_dir_deepest_first() {
        let info = "\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 27 0:50 / /r/node/kubelet rw shared:9 - ext4 /dev/vda rw
31 30 0:51 / /r/node/kubelet/pods/u/volumes/x rw - tmpfs tmpfs rw
32 27 0:52 / /r/node2/other rw - tmpfs tmpfs rw
33 27 0:53 / /r/node/with\\040space rw - tmpfs tmpfs rw
";
        let m = mounts_under(info, Path::new("/r/node"));
        assert_eq!(
            m,
            [
                PathBuf::from("/r/node/kubelet/pods/u/volumes/x"),
                PathBuf::from("/r/node/kubelet"),
                PathBuf::from("/r/node/with space"),
            ]
        );
    }

    #[test]
    fn client_cert_is_signed_by_the_cluster_ca() {
        let dir = std::env::temp_dir().join(format!("cli-mcp-node-pki-{}", std::process::id()));
        let pki = crate::pki::Pki::generate(&dir, &[]).expect("pki");
        let ca_key = fs::read_to_string(&pki.ca_key).expect("ca key");
        let (cert, key) = client_cert(
            &pki.ca_cert_pem,
            &ca_key,
            "system:node:n1",
            &["system:nodes"],
        )
        .expect("cert");
        assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(key.contains("PRIVATE KEY"));
        // The issuer of the new certificate is the CA's subject.
        let der = pem_der(&cert);
        let ca_der = pem_der(&pki.ca_cert_pem);
        let (_, c) = x509_parser::parse_x509_certificate(&der).expect("parse");
        let (_, ca) = x509_parser::parse_x509_certificate(&ca_der).expect("parse ca");
        assert_eq!(c.issuer(), ca.subject());
        assert!(c.verify_signature(Some(ca.public_key())).is_ok());
        let _ = fs::remove_dir_all(&dir);
    }

    fn pem_der(pem: &str) -> Vec<u8> {
        use base64::Engine;
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        base64::engine::general_purpose::STANDARD
            .decode(body)
            .expect("base64")
    }
}
