//! Bring a local cluster up and down: etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler (built by `hack/build-control-plane.sh`) and a node, all as child processes
//! of the harness. The node is the process kubelet (`cli-mcp-kubelet`, the default) or the
//! real node ([`crate::node`]: kubelet + kube-proxy on containerd, `CLI_MCP_NODE=real`).

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Node, ServiceAccount};
use kube::runtime::wait::await_condition;
use kube::{Api, Client};
use nix::fcntl::{Flock, FlockArg};

pub use crate::build_scripts::{
    locate_control_plane, locate_control_plane_async, CONTROL_PLANE_BIN_ENV,
};
pub use crate::cluster_info::{
    client_from_kubeconfig, ClusterInfo, ENV_FILE, INFO_FILE, KUBECONFIG_ENV,
};
use crate::error::{Error, Result};
use crate::net::{self, PodNetwork};
use crate::node::{NodeBins, NodeKind, NodeParams, NodeStart, RealNode};
use crate::pki::{self, Pki};
use crate::process::Component;
use crate::project_images::{self, ProjectImages};

/// Name of the kubeconfig in the run directory.
pub const KUBECONFIG_FILE: &str = "kubeconfig";
/// The apiserver's `--authentication-config` in the run dir: no JWT issuer at start. A test
/// that needs one (an OIDC issuer it serves itself) rewrites the file, and the apiserver
/// reloads it within seconds (it watches the file).
pub const AUTHENTICATION_CONFIG_FILE: &str = "authentication-config.yaml";
/// The initial content of [`AUTHENTICATION_CONFIG_FILE`].
pub const EMPTY_AUTHENTICATION_CONFIG: &str =
    "apiVersion: apiserver.config.k8s.io/v1\nkind: AuthenticationConfiguration\njwt: []\n";

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
    control_plane: Vec<Component>,
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

fn sweep_stale_shm() {
    let Ok(entries) = fs::read_dir("/dev/shm") else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("cli-mcp-e2e-") else {
            continue;
        };
        let pid: i32 = rest
            .split('-')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if pid > 0 && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// How long `up` waits for a previous cluster with the same run dir to finish tearing down.
pub const RUN_DIR_WAIT: Duration = Duration::from_secs(90);

async fn lock_run_dir(run_dir: &Path) -> Result<Flock<File>> {
    fs::create_dir_all(run_dir).map_err(|e| Error::io("creating", run_dir, e))?;
    let path = run_dir.join(".lock");
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io("opening", &path, e))?;
    // A previous cluster with this run dir may still be tearing down (a test process that
    // just exited, a `make run` stopped a moment ago): wait as long as a teardown can take
    // (the kubelet 45 s, then 10 s for each control-plane component).
    let deadline = Instant::now() + RUN_DIR_WAIT;
    let mut f = f;
    let mut warned = false;
    loop {
        match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(lock),
            Err((back, _)) if Instant::now() < deadline => {
                f = back;
                if !warned {
                    tracing::info!(run_dir = %run_dir.display(), "waiting for the cluster that holds this run dir to stop");
                    warned = true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_) => {
                return Err(Error::Prerequisite(format!(
                    "another cluster is running with run dir {}; stop it (`cli-mcp-cluster down \
                     --run-dir {0}` or Ctrl-C its `cli-mcp-cluster up`) or choose another --run-dir",
                    run_dir.display()
                )))
            }
        }
    }
}

fn clear_run_dir(run_dir: &Path) -> Result<()> {
    let entries = fs::read_dir(run_dir).map_err(|e| Error::io("reading", run_dir, e))?;
    for e in entries.flatten() {
        if e.file_name() == ".lock" {
            continue;
        }
        let p = e.path();
        let r = if p.is_dir() && !p.is_symlink() {
            fs::remove_dir_all(&p)
        } else {
            fs::remove_file(&p)
        };
        r.map_err(|err| Error::io("removing stale", &p, err))?;
    }
    Ok(())
}

fn write_atomic(path: &Path, contents: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, contents).map_err(|e| Error::io("writing", &tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| Error::io("renaming into", path, e))
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

impl Cluster {
    /// Start everything and wait until the apiserver is ready, the node is Ready and the
    /// `default` namespace has its ServiceAccount and `kube-root-ca.crt`.
    pub async fn up(config: ClusterConfig) -> Result<Cluster> {
        let started = Instant::now();
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
        // The add-ons (CoreDNS for either node's cluster DNS; kube-router for the real node),
        // located (built once, cached) before anything starts, so a cold build never counts
        // against a startup deadline: on a fresh machine the real node's first `make run`
        // built them (217 s) inside the wait for ServiceAccount default/default and timed out.
        let addons = crate::addons::locate_addons_async(None).await?;
        // The process kubelet runs CoreDNS on the host; the real node deploys it as a pod and
        // runs the NetworkPolicy enforcer next to its kube-proxy.
        if config.node == NodeKind::Real {
            crate::addons::enforcer_preflight()?;
        }
        let enforcer_bin = (config.node == NodeKind::Real).then(|| addons.clone());
        let addons_bin = (config.node == NodeKind::Process).then_some(addons);

        let run_dir = std::path::absolute(&config.run_dir)
            .map_err(|e| Error::io("resolving", &config.run_dir, e))?;
        let run_lock = lock_run_dir(&run_dir).await?;
        // A real node whose owner died leaves mounts (volumes, rootfs, netns) in the run dir.
        crate::node::unmount_under(&run_dir);
        clear_run_dir(&run_dir)?;
        let log_dir = run_dir.join("logs");
        let kubelet_state_dir = match config.node {
            NodeKind::Process => run_dir.join("kubelet"),
            NodeKind::Real => run_dir.join("node/kubelet"),
        };
        for d in [&log_dir, &kubelet_state_dir] {
            fs::create_dir_all(d).map_err(|e| Error::io("creating", d, e))?;
        }
        sweep_stale_shm();

        let pod_net = PodNetwork::claim_sized(config.pod_subnet, config.pod_prefix)?;
        let host = pod_net.gateway();
        let lo = Ipv4Addr::LOCALHOST;
        let etcd_port = net::free_port(lo)?;
        let etcd_peer_port = net::free_port(lo)?;
        let api_port = net::free_port(host)?;
        let cm_port = net::free_port(lo)?;
        let sched_port = net::free_port(lo)?;

        let pki = Pki::generate(&run_dir.join("pki"), &[IpAddr::V4(host)])?;
        let apiserver = format!("https://{host}:{api_port}");
        let kubeconfig = run_dir.join(KUBECONFIG_FILE);
        pki::write_kubeconfig(&kubeconfig, &apiserver, &pki)?;

        let image_map = run_dir.join("images.json");
        for (pattern, path) in &config.images {
            if !path.is_file() {
                tracing::warn!(image = %pattern, path = %path.display(),
                    "mapped binary does not exist (yet); pods using this image will fail to start");
            }
        }
        let images_json = serde_json::to_string_pretty(&config.images)
            .map_err(|e| Error::Other(format!("serialising the image map: {e}")))?;
        fs::write(&image_map, images_json).map_err(|e| Error::io("writing", &image_map, e))?;

        // etcd's data, on tmpfs; from here on the `Cluster` below owns it (and removes it).
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shm_dir = PathBuf::from(format!("/dev/shm/cli-mcp-e2e-{}-{seq}", std::process::id()));
        let _ = fs::remove_dir_all(&shm_dir);
        fs::create_dir_all(&shm_dir).map_err(|e| Error::io("creating", &shm_dir, e))?;
        let info = ClusterInfo {
            run_dir: run_dir.clone(),
            kubeconfig: kubeconfig.clone(),
            apiserver: apiserver.clone(),
            apiserver_host: host,
            apiserver_port: api_port,
            node_name: config.node_name.clone(),
            pod_cidr: pod_net.cidr(),
            kubelet_state_dir: kubelet_state_dir.clone(),
            image_map: image_map.clone(),
            log_dir: log_dir.clone(),
            pid: std::process::id(),
            node: config.node,
            containerd_socket: None,
        };
        let mut cluster = Cluster {
            info,
            kubelet: None,
            real_node: None,
            dns: None,
            enforcer: None,
            control_plane: Vec::new(),
            net: Some(pod_net),
            shm_dir: shm_dir.clone(),
            _run_lock: run_lock,
            started,
            ready_after: Duration::ZERO,
            node_started: None,
            node_ready_after: None,
            timeout: config.timeout,
        };

        let bin = |name: &str| config.control_plane_bin.join(name);
        let p = |p: &Path| p.display().to_string();
        let grace = Duration::from_secs(10);

        // etcd
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer_port}");
        let etcd_args = vec![
            "--name=cli-mcp".to_string(),
            format!("--data-dir={}", p(&shm_dir.join("etcd"))),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=cli-mcp={peer_url}"),
            "--unsafe-no-fsync".into(),
            "--auto-compaction-mode=periodic".into(),
            "--auto-compaction-retention=5m".into(),
            "--log-level=warn".into(),
        ];
        cluster.control_plane.push(Component::start(
            "etcd",
            &bin("etcd"),
            &etcd_args,
            &[],
            &log_dir.join("etcd.log"),
            grace,
            true,
        )?);

        // kube-apiserver
        let auth_config = run_dir.join(AUTHENTICATION_CONFIG_FILE);
        fs::write(&auth_config, EMPTY_AUTHENTICATION_CONFIG)
            .map_err(|e| Error::io("writing", &auth_config, e))?;
        let api_args = vec![
            format!("--authentication-config={}", p(&auth_config)),
            format!("--etcd-servers={etcd_url}"),
            format!("--bind-address={host}"),
            format!("--advertise-address={host}"),
            format!("--secure-port={api_port}"),
            format!("--cert-dir={}", p(&run_dir.join("apiserver"))),
            format!("--tls-cert-file={}", p(&pki.apiserver_cert)),
            format!("--tls-private-key-file={}", p(&pki.apiserver_key)),
            format!("--client-ca-file={}", p(&pki.ca_cert)),
            "--authorization-mode=Node,RBAC".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", p(&pki.sa_pub)),
            format!("--service-account-signing-key-file={}", p(&pki.sa_key)),
            "--service-cluster-ip-range=10.96.0.0/16".into(),
            // Pods of the real node reach the API through the `kubernetes` Service
            // (10.96.0.1, via kube-proxy), which needs its endpoint; the process kubelet
            // points pods at the apiserver's address directly.
            format!(
                "--endpoint-reconciler-type={}",
                match config.node {
                    NodeKind::Process => "none",
                    NodeKind::Real => "lease",
                }
            ),
            "--allow-privileged=true".into(),
            "--enable-aggregator-routing=true".into(),
            "--profiling=false".into(),
            "--event-ttl=1h".into(),
        ];
        let mut api_args = api_args;
        if config.node == NodeKind::Real {
            api_args.extend([
                // The real kubelet serves logs/exec/port-forward; the apiserver calls it as
                // the admin identity (which the kubelet's webhook authorizer accepts).
                format!("--kubelet-client-certificate={}", p(&pki.admin_cert)),
                format!("--kubelet-client-key={}", p(&pki.admin_key)),
                "--kubelet-preferred-address-types=InternalIP".into(),
            ]);
        }
        cluster.control_plane.push(Component::start(
            "kube-apiserver",
            &bin("kube-apiserver"),
            &api_args,
            &[],
            &log_dir.join("kube-apiserver.log"),
            grace,
            true,
        )?);

        let client = client_from_kubeconfig(&kubeconfig).await?;
        let deadline = Instant::now() + config.timeout;
        cluster.wait_readyz(&client, deadline).await?;
        tracing::info!(elapsed = ?started.elapsed(), "kube-apiserver ready at {apiserver}");

        // controller-manager, scheduler, kubelet
        let kc = p(&kubeconfig);
        let cm_args = vec![
            format!("--kubeconfig={kc}"),
            format!("--authentication-kubeconfig={kc}"),
            format!("--authorization-kubeconfig={kc}"),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={cm_port}"),
            format!("--cert-dir={}", p(&run_dir.join("controller-manager"))),
            "--leader-elect=false".into(),
            format!("--service-account-private-key-file={}", p(&pki.sa_key)),
            format!("--root-ca-file={}", p(&pki.ca_cert)),
            "--use-service-account-credentials=false".into(),
            format!("--cluster-signing-cert-file={}", p(&pki.ca_cert)),
            format!("--cluster-signing-key-file={}", p(&pki.ca_key)),
            "--service-cluster-ip-range=10.96.0.0/16".into(),
            "--kube-api-qps=100".into(),
            "--kube-api-burst=200".into(),
            "--profiling=false".into(),
        ];
        cluster.control_plane.push(Component::start(
            "kube-controller-manager",
            &bin("kube-controller-manager"),
            &cm_args,
            &[],
            &log_dir.join("kube-controller-manager.log"),
            grace,
            true,
        )?);
        let sched_args = vec![
            format!("--kubeconfig={kc}"),
            format!("--authentication-kubeconfig={kc}"),
            format!("--authorization-kubeconfig={kc}"),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={sched_port}"),
            "--leader-elect=false".into(),
            "--profiling=false".into(),
        ];
        cluster.control_plane.push(Component::start(
            "kube-scheduler",
            &bin("kube-scheduler"),
            &sched_args,
            &[],
            &log_dir.join("kube-scheduler.log"),
            grace,
            true,
        )?);
        let kubelet_args = vec![
            "--kubeconfig".to_string(),
            kc.clone(),
            "--node-name".into(),
            config.node_name.clone(),
            "--state-dir".into(),
            p(&kubelet_state_dir),
            "--pod-cidr".into(),
            cluster.info.pod_cidr.clone(),
            "--image-map".into(),
            p(&image_map),
            "--apiserver-host".into(),
            host.to_string(),
            "--apiserver-port".into(),
            api_port.to_string(),
        ];
        let mut kubelet_args = kubelet_args;
        if config.node == NodeKind::Process {
            // Sandboxes reach their credential proxy by its Service name: every process
            // cluster has cluster DNS, CoreDNS on the pod gateway (started below).
            let dns = crate::addons::process_cluster_dns(host).ok_or_else(|| {
                Error::Prerequisite(format!(
                    "port 53 of {host} is taken on this host (a local resolver listening on \
                     every address?); the process kubelet's pods need cluster DNS there to \
                     reach Services by name: bind the resolver to 127.0.0.53 only, or stop it"
                ))
            })?;
            kubelet_args.extend(["--cluster-dns".into(), dns.to_string()]);
        }
        if let Some(bins) = node_bins {
            // 10.244.N.1: one cgroup root per pod subnet, so a dead owner's is found again.
            let n = host.octets()[2];
            let params = NodeParams {
                dir: run_dir.join("node"),
                node_name: config.node_name.clone(),
                node_ip: host,
                pod_cidr: cluster.info.pod_cidr.clone(),
                kubelet_port: net::free_port(host)?,
                kubelet_healthz_port: net::free_port(lo)?,
                proxy_healthz_port: net::free_port(lo)?,
                proxy_metrics_port: net::free_port(lo)?,
                ca_cert: pki.ca_cert.clone(),
                cgroup_root: format!("/cli-mcp-node-{n}"),
            };
            let ca_key_pem = fs::read_to_string(&pki.ca_key)
                .map_err(|e| Error::io("reading", &pki.ca_key, e))?;
            let node_started = Instant::now();
            let node = RealNode::start(
                params,
                NodeStart {
                    bins,
                    apiserver: &apiserver,
                    ca_cert_pem: &pki.ca_cert_pem,
                    ca_key_pem: &ca_key_pem,
                    log_dir: &log_dir,
                    timeout: config.timeout,
                    host_lock_wait: config.host_lock_wait,
                },
            )
            .await?;
            cluster.info.containerd_socket = Some(node.params().socket());
            cluster.real_node = Some(node);
            cluster.node_started = Some(node_started);
        } else {
            let rust_log = std::env::var("CLI_MCP_KUBELET_LOG").unwrap_or_else(|_| "info".into());
            cluster.kubelet = Some(Component::start(
                "cli-mcp-kubelet",
                &config.kubelet_bin,
                &kubelet_args,
                &[("RUST_LOG", rust_log)],
                &log_dir.join("cli-mcp-kubelet.log"),
                // Enough for the kubelet to stop pods with short grace periods and clean up.
                Duration::from_secs(45),
                false,
            )?);
        }

        let deadline = Instant::now() + config.timeout;
        cluster
            .wait_watched(
                &format!("node {} to be Ready", config.node_name),
                deadline,
                await_condition(
                    Api::<Node>::all(client.clone()),
                    &config.node_name,
                    node_ready,
                ),
            )
            .await?;
        if let Some(addons) = &addons_bin {
            let t = Instant::now();
            cluster.dns = Some(crate::addons::ClusterDns::start(&cluster.info, addons).await?);
            tracing::info!(took = ?t.elapsed(), "cluster DNS (CoreDNS on the pod gateway) ready");
        }
        if let Some(t) = cluster.node_started {
            cluster.node_ready_after = Some(t.elapsed());
            tracing::info!(took = ?t.elapsed(), "real node Ready (from starting containerd)");
            // Pods resolve through the kubelet's clusterDNS from their first lookup on.
            let t = Instant::now();
            crate::addons::deploy_dns_pod(
                &cluster.info,
                deadline.saturating_duration_since(Instant::now()),
            )
            .await?;
            tracing::info!(took = ?t.elapsed(), "cluster DNS (kube-system/coredns) ready");
        }
        if let Some(bin) = &enforcer_bin {
            // Before the cluster says it is ready: no pod of a user's (or a test's) starts
            // while its NetworkPolicies are still inert.
            let t = Instant::now();
            cluster.enforcer = Some(crate::addons::Enforcer::start(&cluster.info, bin).await?);
            tracing::info!(took = ?t.elapsed(), "NetworkPolicy enforcer (kube-router) synced");
        }
        cluster
            .wait_watched(
                "ServiceAccount default/default",
                deadline,
                await_condition(
                    Api::<ServiceAccount>::namespaced(client.clone(), "default"),
                    "default",
                    |o: Option<&ServiceAccount>| o.is_some(),
                ),
            )
            .await?;
        cluster
            .wait_watched(
                "ConfigMap default/kube-root-ca.crt",
                deadline,
                await_condition(
                    Api::<ConfigMap>::namespaced(client.clone(), "default"),
                    "kube-root-ca.crt",
                    |o: Option<&ConfigMap>| o.is_some(),
                ),
            )
            .await?;

        if let Some(images) = &config.project_images {
            cluster.import_project_images(images)?;
        }

        cluster.ready_after = started.elapsed();
        cluster.write_info()?;
        tracing::info!(elapsed = ?cluster.ready_after, "cluster ready");
        Ok(cluster)
    }

    async fn wait_readyz(&mut self, client: &Client, deadline: Instant) -> Result<()> {
        let mut last: String;
        loop {
            if let Some(e) = self.first_exit() {
                return Err(e);
            }
            let req = http::Request::get("/readyz")
                .body(Vec::new())
                .map_err(|e| Error::Other(format!("building /readyz request: {e}")))?;
            match tokio::time::timeout(Duration::from_secs(3), client.request_text(req)).await {
                Ok(Ok(body)) if body.trim() == "ok" => return Ok(()),
                Ok(Ok(body)) => last = body,
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "request timed out".into(),
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!(
                        "kube-apiserver /readyz (last answer: {last}); see {}",
                        self.info.log_dir.join("kube-apiserver.log").display()
                    ),
                    elapsed: self.started.elapsed(),
                });
            }
            // No watch exists for /readyz: poll it.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Wait for a watch-based condition while making sure no component died meanwhile.
    async fn wait_watched<K, F>(&mut self, what: &str, deadline: Instant, fut: F) -> Result<()>
    where
        F: std::future::Future<Output = std::result::Result<Option<K>, kube::runtime::wait::Error>>,
    {
        let mut fut = std::pin::pin!(tokio::time::timeout_at(deadline.into(), fut));
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                r = &mut fut => {
                    return match r {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err(source)) => Err(Error::Watch { what: what.to_string(), source }),
                        Err(_) => Err(Error::Timeout {
                            what: format!("{what}; logs are in {}", self.info.log_dir.display()),
                            elapsed: self.started.elapsed(),
                        }),
                    };
                }
                _ = tick.tick() => {
                    if let Some(e) = self.first_exit() {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// The first component that has exited, as an error.
    pub fn first_exit(&mut self) -> Option<Error> {
        if let Some(e) = self.real_node.as_mut().and_then(RealNode::first_exit) {
            return Some(e);
        }
        if let Some(e) = self.dns.as_mut().and_then(|d| d.exited_error()) {
            return Some(e);
        }
        self.control_plane
            .iter_mut()
            .chain(self.kubelet.iter_mut())
            .find_map(Component::exited_error)
    }

    fn write_info(&self) -> Result<()> {
        let json = serde_json::to_string_pretty(&self.info)
            .map_err(|e| Error::Other(format!("serialising cluster info: {e}")))?;
        write_atomic(&self.info.run_dir.join(INFO_FILE), &json)?;
        let mut env =
            String::from("# Written by cli-mcp-cluster; `source` it to use the cluster.\n");
        for (k, v) in self.info.env_vars() {
            env.push_str(&format!("export {k}={}\n", shell_quote(&v)));
        }
        write_atomic(&self.info.run_dir.join(ENV_FILE), &env)
    }

    fn apiserver(&mut self) -> Result<&mut Component> {
        self.control_plane
            .iter_mut()
            .find(|c| c.name() == "kube-apiserver")
            .ok_or_else(|| Error::Other("this cluster has no kube-apiserver component".into()))
    }

    /// Stop kube-apiserver gracefully (SIGTERM; SIGKILL after its grace period), leaving
    /// etcd, the controllers and the kubelet running: clients see the API go away as they
    /// would during a control-plane upgrade. Returns how long the shutdown took.
    pub async fn stop_apiserver(&mut self) -> Result<Duration> {
        let api = self.apiserver()?;
        match api.stop_async().await {
            Some((status, took)) => {
                tracing::info!(%status, ?took, "kube-apiserver stopped");
                Ok(took)
            }
            None => Err(Error::Other("kube-apiserver was not running".into())),
        }
    }

    /// Start kube-apiserver again with the same flags, ports and certificates (its log is
    /// appended to) and wait for `/readyz`. Returns how long it took to become ready.
    pub async fn start_apiserver(&mut self) -> Result<Duration> {
        let started = Instant::now();
        self.apiserver()?.start_again()?;
        let client = client_from_kubeconfig(&self.info.kubeconfig).await?;
        let deadline = started + self.timeout;
        self.wait_readyz(&client, deadline).await?;
        tracing::info!(took = ?started.elapsed(), "kube-apiserver ready again");
        Ok(started.elapsed())
    }

    /// [`Cluster::stop_apiserver`] then [`Cluster::start_apiserver`]; returns the time the
    /// API was unavailable (from the stop signal to ready).
    pub async fn restart_apiserver(&mut self) -> Result<Duration> {
        let down = self.stop_apiserver().await?;
        Ok(down + self.start_apiserver().await?)
    }

    /// Import the project's images into the real node's containerd under the names pods
    /// use ([`project_images::import_into`]); returns those names. An error on the process
    /// kubelet, whose images are binaries.
    pub fn import_project_images(&self, images: &ProjectImages) -> Result<Vec<String>> {
        let socket = self.info.containerd_socket.as_ref().ok_or_else(|| {
            Error::Prerequisite(
                "only the real node runs images (--node real); the process kubelet maps image \
                 names to binaries"
                    .into(),
            )
        })?;
        let t = Instant::now();
        let names = project_images::import_into(socket, images)?;
        tracing::info!(took = ?t.elapsed(), dir = %images.dir.display(), "project images imported");
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
        let _ = fs::remove_file(self.info.run_dir.join(ENV_FILE));
        let _ = fs::remove_file(self.info.run_dir.join(INFO_FILE));
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
        // Controllers first (in parallel), then the apiserver, then etcd.
        let mut rest: Vec<Component> = self.control_plane.drain(..).collect();
        let etcd_and_api: Vec<Component> = rest.drain(..rest.len().min(2)).collect();
        for c in rest.iter_mut() {
            c.signal_term();
        }
        for c in rest.iter_mut() {
            c.wait_or_kill();
        }
        for mut c in etcd_and_api.into_iter().rev() {
            c.stop();
        }
        self.net = None;
        let _ = fs::remove_dir_all(&self.shm_dir);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.teardown();
    }
}

fn node_ready(node: Option<&Node>) -> bool {
    node.and_then(|n| n.status.as_ref())
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}
