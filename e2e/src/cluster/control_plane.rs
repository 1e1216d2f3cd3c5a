//! The control plane: etcd, kube-apiserver, kube-controller-manager and kube-scheduler as
//! child processes, their flags, the stop and restart of the apiserver, and their stop in
//! order on teardown.

use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::Cluster;
use crate::cluster_info::client_from_kubeconfig;
use crate::error::{Error, Result};
use crate::net;
use crate::node::NodeKind;
use crate::pki::Pki;
use crate::process::Component;

/// The apiserver's `--authentication-config` in the run dir: no JWT issuer at start. A test
/// that needs one (an OIDC issuer it serves itself) rewrites the file, and the apiserver
/// reloads it within seconds (it watches the file).
pub const AUTHENTICATION_CONFIG_FILE: &str = "authentication-config.yaml";
/// The initial content of [`AUTHENTICATION_CONFIG_FILE`].
pub const EMPTY_AUTHENTICATION_CONFIG: &str =
    "apiVersion: apiserver.config.k8s.io/v1\nkind: AuthenticationConfiguration\njwt: []\n";

/// How long each control-plane component gets to stop after SIGTERM.
const GRACE: Duration = Duration::from_secs(10);

/// The ports of the control plane, claimed before any of it starts.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ports {
    pub etcd: u16,
    pub etcd_peer: u16,
    /// On the pod gateway `host` (pods and host clients reach the apiserver there).
    pub apiserver: u16,
    pub controller_manager: u16,
    pub scheduler: u16,
}

impl Ports {
    /// Free ports: the apiserver's on `host`, the others on loopback.
    pub fn claim(host: Ipv4Addr) -> Result<Ports> {
        let lo = Ipv4Addr::LOCALHOST;
        Ok(Ports {
            etcd: net::free_port(lo)?,
            etcd_peer: net::free_port(lo)?,
            apiserver: net::free_port(host)?,
            controller_manager: net::free_port(lo)?,
            scheduler: net::free_port(lo)?,
        })
    }
}

/// What the components' flags name: binaries, directories, certificates, addresses.
pub(super) struct Launch<'a> {
    /// Holds `etcd`, `kube-apiserver`, `kube-controller-manager`, `kube-scheduler`.
    pub bin_dir: PathBuf,
    pub run_dir: PathBuf,
    pub log_dir: PathBuf,
    /// etcd's data lives here (tmpfs).
    pub shm_dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub pki: &'a Pki,
    /// The pod gateway the apiserver listens on.
    pub host: Ipv4Addr,
    pub ports: Ports,
    pub node: NodeKind,
}

impl Launch<'_> {
    fn start(&self, name: &str, args: &[String]) -> Result<Component> {
        Component::start(
            name,
            &self.bin_dir.join(name),
            args,
            &[],
            &self.log_dir.join(format!("{name}.log")),
            GRACE,
            true,
        )
    }

    fn etcd_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.etcd)
    }
}

fn p(p: &Path) -> String {
    p.display().to_string()
}

fn etcd_args(l: &Launch<'_>) -> Vec<String> {
    let etcd_url = l.etcd_url();
    let peer_url = format!("http://127.0.0.1:{}", l.ports.etcd_peer);
    vec![
        "--name=cli-mcp".to_string(),
        format!("--data-dir={}", p(&l.shm_dir.join("etcd"))),
        format!("--listen-client-urls={etcd_url}"),
        format!("--advertise-client-urls={etcd_url}"),
        format!("--listen-peer-urls={peer_url}"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--initial-cluster=cli-mcp={peer_url}"),
        "--unsafe-no-fsync".into(),
        "--auto-compaction-mode=periodic".into(),
        "--auto-compaction-retention=5m".into(),
        "--log-level=warn".into(),
    ]
}

fn apiserver_args(l: &Launch<'_>, auth_config: &Path) -> Vec<String> {
    let (host, pki) = (l.host, l.pki);
    let mut api_args = vec![
        format!("--authentication-config={}", p(auth_config)),
        format!("--etcd-servers={}", l.etcd_url()),
        format!("--bind-address={host}"),
        format!("--advertise-address={host}"),
        format!("--secure-port={}", l.ports.apiserver),
        format!("--cert-dir={}", p(&l.run_dir.join("apiserver"))),
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
            match l.node {
                NodeKind::Process => "none",
                NodeKind::Real => "lease",
            }
        ),
        "--allow-privileged=true".into(),
        "--enable-aggregator-routing=true".into(),
        "--profiling=false".into(),
        "--event-ttl=1h".into(),
    ];
    if l.node == NodeKind::Real {
        api_args.extend([
            // The real kubelet serves logs/exec/port-forward; the apiserver calls it as
            // the admin identity (which the kubelet's webhook authorizer accepts).
            format!("--kubelet-client-certificate={}", p(&pki.admin_cert)),
            format!("--kubelet-client-key={}", p(&pki.admin_key)),
            "--kubelet-preferred-address-types=InternalIP".into(),
        ]);
    }
    api_args
}

fn controller_manager_args(l: &Launch<'_>) -> Vec<String> {
    let kc = p(&l.kubeconfig);
    let pki = l.pki;
    vec![
        format!("--kubeconfig={kc}"),
        format!("--authentication-kubeconfig={kc}"),
        format!("--authorization-kubeconfig={kc}"),
        "--bind-address=127.0.0.1".into(),
        format!("--secure-port={}", l.ports.controller_manager),
        format!("--cert-dir={}", p(&l.run_dir.join("controller-manager"))),
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
    ]
}

fn scheduler_args(l: &Launch<'_>) -> Vec<String> {
    let kc = p(&l.kubeconfig);
    vec![
        format!("--kubeconfig={kc}"),
        format!("--authentication-kubeconfig={kc}"),
        format!("--authorization-kubeconfig={kc}"),
        "--bind-address=127.0.0.1".into(),
        format!("--secure-port={}", l.ports.scheduler),
        "--leader-elect=false".into(),
        "--profiling=false".into(),
    ]
}

/// The control plane's components, in start order.
#[derive(Debug, Default)]
pub(super) struct ControlPlane {
    components: Vec<Component>,
}

impl ControlPlane {
    /// etcd, then kube-apiserver with an empty authentication config. The caller waits for
    /// the apiserver's `/readyz` before [`ControlPlane::start_controllers`].
    pub fn start_etcd_and_apiserver(&mut self, l: &Launch<'_>) -> Result<()> {
        self.components.push(l.start("etcd", &etcd_args(l))?);
        let auth_config = l.run_dir.join(AUTHENTICATION_CONFIG_FILE);
        fs::write(&auth_config, EMPTY_AUTHENTICATION_CONFIG)
            .map_err(|e| Error::io("writing", &auth_config, e))?;
        let args = apiserver_args(l, &auth_config);
        self.components.push(l.start("kube-apiserver", &args)?);
        Ok(())
    }

    /// kube-controller-manager, then kube-scheduler.
    pub fn start_controllers(&mut self, l: &Launch<'_>) -> Result<()> {
        let args = controller_manager_args(l);
        self.components
            .push(l.start("kube-controller-manager", &args)?);
        self.components
            .push(l.start("kube-scheduler", &scheduler_args(l))?);
        Ok(())
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Component> {
        self.components.iter_mut()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Component> {
        self.components.iter()
    }

    fn apiserver(&mut self) -> Result<&mut Component> {
        self.components
            .iter_mut()
            .find(|c| c.name() == "kube-apiserver")
            .ok_or_else(|| Error::Other("this cluster has no kube-apiserver component".into()))
    }

    /// Controllers first (in parallel), then the apiserver, then etcd.
    pub fn stop(&mut self) {
        let mut rest: Vec<Component> = self.components.drain(..).collect();
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
    }
}

impl Cluster {
    /// Stop kube-apiserver gracefully (SIGTERM; SIGKILL after its grace period), leaving
    /// etcd, the controllers and the kubelet running: clients see the API go away as they
    /// would during a control-plane upgrade. Returns how long the shutdown took.
    pub async fn stop_apiserver(&mut self) -> Result<Duration> {
        let api = self.control_plane.apiserver()?;
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
        self.control_plane.apiserver()?.start_again()?;
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
}
