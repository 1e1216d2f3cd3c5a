//! Bring a local cluster up and down: etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler (built by `hack/build-control-plane.sh`) and a node, all as child processes
//! of the harness. The node is the process kubelet (`cli-mcp-kubelet`, the default) or the
//! real node ([`crate::node`]: kubelet + kube-proxy on containerd, `CLI_MCP_NODE=real`).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::Flock;

mod control_plane;
mod node_start;
mod readiness;
mod run_dir;

use control_plane::{ControlPlane, Launch, Ports};
use run_dir::RunDir;

pub use control_plane::{AUTHENTICATION_CONFIG_FILE, EMPTY_AUTHENTICATION_CONFIG};
pub use run_dir::RUN_DIR_WAIT;

pub use crate::build_scripts::{
    locate_control_plane, locate_control_plane_async, CONTROL_PLANE_BIN_ENV,
};
pub use crate::cluster_info::{
    client_from_kubeconfig, ClusterInfo, ENV_FILE, INFO_FILE, KUBECONFIG_ENV,
};
use crate::error::{Error, Result};
use crate::net::{self, PodNetwork};
use crate::node::{gvisor, NodeBins, NodeKind, RealNode};
use crate::pki::{self, Pki};
use crate::process::Component;
use crate::project_images::{self, ProjectImages};

/// Name of the kubeconfig in the run directory.
pub const KUBECONFIG_FILE: &str = "kubeconfig";

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Directory holding `etcd`, `kube-apiserver`, `kube-controller-manager`, `kube-scheduler`.
    pub control_plane_bin: PathBuf,
    /// The `cli-mcp-kubelet` binary.
    pub kubelet_bin: PathBuf,
    /// Certificates, kubeconfig, logs, kubelet state. Cleared at start (logs of the previous
    /// run are kept until then).
    pub run_dir: PathBuf,
    /// Image pattern -> absolute path of a local binary (see the kubelet's contract).
    pub images: BTreeMap<String, PathBuf>,
    /// Node name the kubelet registers.
    pub node_name: String,
    /// Pod subnet `10.244.N.0/24`: `Some(N)` to insist on one, `None` for the first free.
    pub pod_subnet: Option<u8>,
    /// Prefix length of the pod subnet: 24 (253 pods), or down to 20 for a node that must
    /// hold more pods (a scale benchmark); `N` is then aligned to the size.
    pub pod_prefix: u8,
    /// Deadline for each startup phase (apiserver ready; node and namespace ready).
    pub timeout: Duration,
    /// The real node only: how long to wait for another real-node cluster on this host to
    /// stop (one kube-proxy per host) before giving up. Not part of `timeout`.
    pub host_lock_wait: Duration,
    /// Which node runs the pods: the process kubelet or the real node.
    pub node: NodeKind,
    /// The real node only: the project's images to import into its containerd before the
    /// cluster counts as ready ([`crate::project_images`]).
    pub project_images: Option<ProjectImages>,
}

impl ClusterConfig {
    /// Defaults: node `cli-mcp-node`, first free pod subnet, 120 s per phase, no images.
    pub fn new(control_plane_bin: PathBuf, kubelet_bin: PathBuf, run_dir: PathBuf) -> Self {
        ClusterConfig {
            control_plane_bin,
            kubelet_bin,
            run_dir,
            images: BTreeMap::new(),
            node_name: "cli-mcp-node".into(),
            pod_subnet: None,
            pod_prefix: 24,
            timeout: Duration::from_secs(120),
            host_lock_wait: Duration::from_secs(120),
            node: NodeKind::Process,
            project_images: None,
        }
    }
}

impl ClusterConfig {
    /// The project's usual cluster: the control plane from [`locate_control_plane`], the
    /// kubelet and the project's images ([`default_images`]) from `bin_dir` (a cargo
    /// profile dir such as `target/debug`), the node from `$CLI_MCP_NODE`.
    pub fn local(bin_dir: &Path, run_dir: PathBuf) -> Result<Self> {
        let mut cfg = ClusterConfig::new(
            locate_control_plane(None)?,
            bin_dir.join("cli-mcp-kubelet"),
            run_dir,
        );
        cfg.images = default_images(bin_dir);
        cfg.node = NodeKind::from_env()?;
        Ok(cfg)
    }
}

/// The image map of the project's images to binaries in `bin_dir`: cli-mcp-{agent,server,
/// operator}:* to those binaries, cli-mcp-sandbox:* to the agent (bash and CLIs come from
/// the host), cli-mcp-shell:* to /bin/sh.
pub fn default_images(bin_dir: &Path) -> BTreeMap<String, PathBuf> {
    let mut images = BTreeMap::new();
    for name in [
        "cli-mcp-agent",
        "cli-mcp-server",
        "cli-mcp-operator",
        "cli-mcp-proxy",
    ] {
        images.insert(format!("{name}:*"), bin_dir.join(name));
    }
    images.insert("cli-mcp-sandbox:*".into(), bin_dir.join("cli-mcp-agent"));
    images.insert("cli-mcp-shell:*".into(), PathBuf::from("/bin/sh"));
    images
}

/// A running local cluster. Dropping it tears everything down.
#[derive(Debug)]
pub struct Cluster {
    info: ClusterInfo,
    kubelet: Option<Component>,
    /// The real node (instead of `kubelet`).
    real_node: Option<RealNode>,
    /// Cluster DNS of the process kubelet: CoreDNS on the host, at the pod gateway (the real
    /// node runs it as a kube-system pod instead).
    dns: Option<crate::addons::ClusterDns>,
    /// The real node's NetworkPolicy enforcer (kube-router's firewall): a cluster on the real
    /// node enforces the policies it is given, as a user's cluster would, so `make run` and
    /// every test on the real node see the same isolation.
    enforcer: Option<crate::addons::Enforcer>,
    /// etcd, kube-apiserver, kube-controller-manager, kube-scheduler (start order).
    control_plane: ControlPlane,
    net: Option<PodNetwork>,
    shm_dir: PathBuf,
    _run_lock: Flock<File>,
    started: Instant,
    ready_after: Duration,
    /// When the real node's first process was started, and how long until its Node was Ready.
    node_started: Option<Instant>,
    node_ready_after: Option<Duration>,
    /// Deadline of each startup phase (also bounds an apiserver restart).
    timeout: Duration,
}

/// What must be there before anything starts (the error names the fix): the pod network's
/// host setup, the control plane's binaries and the node's. Returns the real node's
/// binaries (located after its host preflight), `None` for the process kubelet.
fn check_prerequisites(config: &ClusterConfig) -> Result<Option<NodeBins>> {
    net::preflight()?;
    for bin in [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
    ] {
        if !config.control_plane_bin.join(bin).is_file() {
            return Err(Error::Prerequisite(format!(
                "{} is missing; build the control plane with hack/build-control-plane.sh \
                 (or point ${CONTROL_PLANE_BIN_ENV} at its bin dir)",
                config.control_plane_bin.join(bin).display()
            )));
        }
    }
    let node_bins = match config.node {
        NodeKind::Real => Some(NodeBins::locate(&config.control_plane_bin)?),
        NodeKind::Process => None,
    };
    if config.node == NodeKind::Process && !config.kubelet_bin.is_file() {
        return Err(Error::Prerequisite(format!(
            "the process kubelet {} is missing; build it with `cargo build -p cli-mcp-kubelet`",
            config.kubelet_bin.display()
        )));
    }
    Ok(node_bins)
}

/// The add-ons' bin dir ([`crate::addons::locate_addons_async`]), by what the cluster's node
/// runs from it.
struct AddonBins {
    /// The process kubelet: CoreDNS on the host.
    host_dns: Option<PathBuf>,
    /// The real node: the NetworkPolicy enforcer (its DNS pod's image is built from the
    /// same dir by [`crate::addons::deploy_dns_pod`]).
    enforcer: Option<PathBuf>,
    /// The real node: gVisor's `runsc` and shim, a runtime beside runc
    /// ([`crate::node::gvisor`]).
    gvisor_bin: Option<PathBuf>,
    /// The real node: distribution's `registry` and `crane` ([`crate::registry`]).
    registry_bin: Option<PathBuf>,
}

/// gVisor's binaries when this host can run them; else `None`, saying why on stderr and in
/// the log: the node then runs runc alone (no RuntimeClass `gvisor`), which `make run` tells
/// its user, and a pod naming `gvisor` is refused by the API server with that name.
async fn locate_gvisor() -> Option<PathBuf> {
    let found = match gvisor::locate_async().await {
        Ok(dir) => gvisor::checked_bin_dir(&dir),
        Err(e) => Err(e),
    };
    let checked = match found {
        Ok(dir) => tokio::task::spawn_blocking(move || gvisor::preflight(&dir).map(|()| dir))
            .await
            .unwrap_or_else(|e| Err(Error::Other(format!("gVisor preflight: {e}")))),
        Err(e) => Err(e),
    };
    match checked {
        Ok(dir) => Some(dir),
        Err(e) => {
            tracing::warn!(error = %e, "{}", gvisor::UNAVAILABLE);
            eprintln!("cli-mcp-cluster: {}: {e}", gvisor::UNAVAILABLE);
            None
        }
    }
}

impl AddonBins {
    async fn locate(node: NodeKind) -> Result<AddonBins> {
        let addons = crate::addons::locate_addons_async(None).await?;
        // The process kubelet runs CoreDNS on the host; the real node deploys it as a pod and
        // runs the NetworkPolicy enforcer next to its kube-proxy.
        let mut gvisor_bin = None;
        let mut registry_bin = None;
        if node == NodeKind::Real {
            crate::addons::enforcer_preflight()?;
            gvisor_bin = locate_gvisor().await;
            registry_bin = Some(crate::registry::locate_async().await?);
        }
        Ok(AddonBins {
            gvisor_bin,
            registry_bin,
            enforcer: (node == NodeKind::Real).then(|| addons.clone()),
            host_dns: (node == NodeKind::Process).then_some(addons),
        })
    }
}

impl Cluster {
    /// Start everything and wait until the apiserver is ready, the node is Ready and the
    /// `default` namespace has its ServiceAccount and `kube-root-ca.crt`.
    pub async fn up(config: ClusterConfig) -> Result<Cluster> {
        let started = Instant::now();
        let node_bins = check_prerequisites(&config)?;
        // The add-ons (CoreDNS for either node's cluster DNS; kube-router for the real node),
        // located (built once, cached) before anything starts, so a cold build never counts
        // against a startup deadline: on a fresh machine the real node's first `make run`
        // built them (217 s) inside the wait for ServiceAccount default/default and timed out.
        let addons = AddonBins::locate(config.node).await?;
        let node_bins = node_bins.map(|bins| NodeBins {
            gvisor_bin: addons.gvisor_bin.clone(),
            registry_bin: addons.registry_bin.clone(),
            ..bins
        });
        let kubelet_state = match config.node {
            NodeKind::Process => "kubelet",
            NodeKind::Real => "node/kubelet",
        };
        let run_dir = RunDir::claim(&config.run_dir, kubelet_state).await?;
        let pod_net = PodNetwork::claim_sized(config.pod_subnet, config.pod_prefix)?;
        let host = pod_net.gateway();
        let ports = Ports::claim(host)?;
        let pki = Pki::generate(&run_dir.path.join("pki"), &[IpAddr::V4(host)])?;
        let mut cluster = Cluster::prepare(&config, run_dir, pod_net, &pki, ports, started)?;

        let launch = cluster.launch(&config, &pki, ports);
        cluster.control_plane.start_etcd_and_apiserver(&launch)?;
        let client = client_from_kubeconfig(&cluster.info.kubeconfig).await?;
        let deadline = Instant::now() + config.timeout;
        cluster.wait_readyz(&client, deadline).await?;
        tracing::info!(elapsed = ?started.elapsed(), "kube-apiserver ready at {}", cluster.info.apiserver);
        cluster.control_plane.start_controllers(&launch)?;
        cluster.start_node(&config, node_bins, &pki).await?;

        let deadline = Instant::now() + config.timeout;
        cluster.wait_node_ready(&client, deadline).await?;
        cluster.start_addons(addons, deadline).await?;
        cluster.wait_default_namespace(&client, deadline).await?;
        if let Some(images) = &config.project_images {
            cluster.import_project_images(images)?;
        }

        cluster.ready_after = started.elapsed();
        run_dir::write_info(&cluster.info)?;
        tracing::info!(elapsed = ?cluster.ready_after, "cluster ready");
        Ok(cluster)
    }

    /// The cluster before any of its processes starts: the admin kubeconfig and the image
    /// map written into the run dir, etcd's directory on tmpfs, its [`ClusterInfo`]. From
    /// here on the `Cluster` owns the run dir's lock, the pod network and etcd's data (and
    /// gives them back on teardown).
    fn prepare(
        config: &ClusterConfig,
        run_dir: RunDir,
        pod_net: PodNetwork,
        pki: &Pki,
        ports: Ports,
        started: Instant,
    ) -> Result<Cluster> {
        let host = pod_net.gateway();
        let apiserver = format!("https://{host}:{}", ports.apiserver);
        let kubeconfig = run_dir.path.join(KUBECONFIG_FILE);
        pki::write_kubeconfig(&kubeconfig, &apiserver, pki)?;
        let image_map = run_dir.write_image_map(&config.images)?;
        // etcd's data, on tmpfs; from here on the `Cluster` below owns it (and removes it).
        let shm_dir = run_dir::create_shm_dir()?;
        let info = ClusterInfo {
            run_dir: run_dir.path,
            kubeconfig,
            apiserver,
            apiserver_host: host,
            apiserver_port: ports.apiserver,
            node_name: config.node_name.clone(),
            pod_cidr: pod_net.cidr(),
            kubelet_state_dir: run_dir.kubelet_state_dir,
            image_map,
            log_dir: run_dir.log_dir,
            pid: std::process::id(),
            node: config.node,
            containerd_socket: None,
            registry: None,
        };
        Ok(Cluster {
            info,
            kubelet: None,
            real_node: None,
            dns: None,
            enforcer: None,
            control_plane: ControlPlane::default(),
            net: Some(pod_net),
            shm_dir,
            _run_lock: run_dir.lock,
            started,
            ready_after: Duration::ZERO,
            node_started: None,
            node_ready_after: None,
            timeout: config.timeout,
        })
    }

    /// What the control plane's flags name, for [`ControlPlane`]'s starts.
    fn launch<'a>(&self, config: &ClusterConfig, pki: &'a Pki, ports: Ports) -> Launch<'a> {
        Launch {
            bin_dir: config.control_plane_bin.clone(),
            run_dir: self.info.run_dir.clone(),
            log_dir: self.info.log_dir.clone(),
            shm_dir: self.shm_dir.clone(),
            kubeconfig: self.info.kubeconfig.clone(),
            pki,
            host: self.info.apiserver_host,
            ports,
            node: config.node,
        }
    }

    /// Once the Node is Ready: cluster DNS (CoreDNS on the host for the process kubelet,
    /// the `kube-system` Deployment on the real node) and the real node's NetworkPolicy
    /// enforcer.
    async fn start_addons(&mut self, addons: AddonBins, deadline: Instant) -> Result<()> {
        if let Some(addons) = &addons.host_dns {
            let t = Instant::now();
            self.dns = Some(crate::addons::ClusterDns::start(&self.info, addons).await?);
            tracing::info!(took = ?t.elapsed(), "cluster DNS (CoreDNS on the pod gateway) ready");
        }
        if let Some(t) = self.node_started {
            self.node_ready_after = Some(t.elapsed());
            tracing::info!(took = ?t.elapsed(), "real node Ready (from starting containerd)");
            // Pods resolve through the kubelet's clusterDNS from their first lookup on.
            let t = Instant::now();
            crate::addons::deploy_dns_pod(
                &self.info,
                deadline.saturating_duration_since(Instant::now()),
            )
            .await?;
            tracing::info!(took = ?t.elapsed(), "cluster DNS (kube-system/coredns) ready");
        }
        if addons.gvisor_bin.is_some() {
            gvisor::install_runtime_class(&client_from_kubeconfig(&self.info.kubeconfig).await?)
                .await?;
        }
        if let Some(bin) = &addons.enforcer {
            // Before the cluster says it is ready: no pod of a user's (or a test's) starts
            // while its NetworkPolicies are still inert.
            let t = Instant::now();
            self.enforcer = Some(crate::addons::Enforcer::start(&self.info, bin).await?);
            tracing::info!(took = ?t.elapsed(), "NetworkPolicy enforcer (kube-router) synced");
        }
        Ok(())
    }

    /// Pushes the project's images to the real node's registry under the names pods use
    /// ([`project_images::push_into`]), from which the kubelet pulls them; returns those
    /// names. An error on the process kubelet, whose images are binaries. (Named for what it
    /// did when images were imported into containerd, which callers still rely on.)
    pub fn import_project_images(&self, images: &ProjectImages) -> Result<Vec<String>> {
        let registry = self.info.registry.as_ref().ok_or_else(|| {
            Error::Prerequisite(
                "only the real node runs images (--node real); the process kubelet maps image \
                 names to binaries"
                    .into(),
            )
        })?;
        let t = Instant::now();
        let work = self.info.run_dir.join("node/registry/push");
        let names = project_images::push_into(registry, images, &work)?;
        tracing::info!(took = ?t.elapsed(), dir = %images.dir.display(), "project images pushed to {}", registry.host);
        Ok(names)
    }

    /// Where everything is.
    pub fn info(&self) -> &ClusterInfo {
        &self.info
    }

    /// The process kubelet's cluster DNS (`None` on the real node, which runs it as a pod).
    /// The real node's NetworkPolicy enforcer, taken out of the cluster by a test that checks
    /// its clean stop itself ([`crate::addons::Enforcer::stop`]).
    pub fn take_enforcer(&mut self) -> Option<crate::addons::Enforcer> {
        self.enforcer.take()
    }

    /// An error if the real node's enforcer exited (it runs for the cluster's life).
    pub fn enforcer_error(&mut self) -> Option<Error> {
        self.enforcer.as_mut().and_then(|e| e.exited_error())
    }

    pub fn dns(&self) -> Option<&crate::addons::ClusterDns> {
        self.dns.as_ref()
    }

    /// Time from the start of [`Cluster::up`] until the cluster was ready.
    pub fn ready_after(&self) -> Duration {
        self.ready_after
    }

    /// Pids of all components (for memory accounting).
    pub fn pids(&self) -> Vec<(String, u32)> {
        let mut pids: Vec<(String, u32)> = self
            .control_plane
            .iter()
            .chain(self.kubelet.iter())
            .filter_map(|c| c.pid().map(|p| (c.name().to_string(), p)))
            .collect();
        if let Some(n) = &self.real_node {
            pids.extend(n.pids());
        }
        pids
    }

    /// For the real node: how long from starting containerd until the Node was Ready.
    pub fn node_ready_after(&self) -> Option<Duration> {
        self.node_ready_after
    }

    /// Stop everything: the kubelet first (it stops its pods and removes their network
    /// namespaces while the apiserver still answers), then the controllers, the apiserver and
    /// etcd. Removes the etcd data, the pod-network address and the ready markers; keeps logs.
    pub fn down(mut self) {
        self.teardown();
    }

    fn teardown(&mut self) {
        run_dir::remove_info(&self.info.run_dir);
        if let Some(mut k) = self.kubelet.take() {
            k.stop();
        }
        // CoreDNS and the enforcer (dropping either stops it; the enforcer's wrapper removes
        // its rules) while the apiserver still answers.
        self.dns = None;
        self.enforcer = None;
        // The real node goes first too: its kubelet and kube-proxy, every container, then
        // containerd, mounts, cgroups and iptables rules (see `RealNode::stop`).
        if let Some(mut n) = self.real_node.take() {
            n.stop();
        }
        self.control_plane.stop();
        self.net = None;
        let _ = fs::remove_dir_all(&self.shm_dir);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.teardown();
    }
}
