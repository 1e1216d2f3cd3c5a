//! A running real node: the image registry its containerd pulls from, containerd, the
//! kubelet and kube-proxy, started in order and torn down with everything they left on the
//! host.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::fcntl::Flock;

use super::cgroup::{create_cgroup, sweep_cgroup};
use super::config::{cni_conflist, containerd_config, kube_proxy_config, kubelet_config};
use super::credentials::{client_cert, write_private};
use super::host::{lock_host, preflight, read_sysctl, which, KUBELET_SYSCTLS};
use super::image::{build_image_archive, ctr, import_image, CATATONIT, PAUSE_IMAGE};
use super::mounts::unmount_under;
use super::params::NodeParams;
use super::run;
use crate::error::{Error, Result};
use crate::process::Component;

/// The binaries of a real node.
#[derive(Debug, Clone)]
pub struct NodeBins {
    pub kubelet: PathBuf,
    pub kube_proxy: PathBuf,
    pub containerd: PathBuf,
    /// The directory with gVisor's `runsc` and shim ([`super::gvisor`]); set once located
    /// with the add-ons.
    pub gvisor_bin: Option<PathBuf>,
    /// The directory with distribution's `registry` and `crane` ([`crate::registry`]); set
    /// once located with the add-ons. Without it the node starts no registry, and nothing
    /// but imported images runs.
    pub registry_bin: Option<PathBuf>,
}

impl NodeBins {
    /// kubelet and kube-proxy from the control-plane bin dir, containerd from PATH.
    pub fn locate(control_plane_bin: &Path) -> Result<NodeBins> {
        preflight(control_plane_bin)?;
        Ok(NodeBins {
            kubelet: control_plane_bin.join("kubelet"),
            kube_proxy: control_plane_bin.join("kube-proxy"),
            containerd: which("containerd").unwrap_or_else(|| PathBuf::from("containerd")),
            gvisor_bin: None,
            registry_bin: None,
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
    /// The registry containerd's CRI pulls the project's images from.
    registry: Option<crate::registry::Registry>,
    /// Where pulls of any other registry go: closed at once, on loopback.
    refuser: Option<crate::registry::Refuser>,
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
        check_socket_path(&params)?;
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
            registry: None,
            refuser: None,
        };
        node.clean_after_dead_node();
        create_cgroup(&node.params.cgroup_root)?;
        node.write_files(&s)?;
        node.start_registry(&s, deadline).await?;
        node.saved_sysctls = KUBELET_SYSCTLS
            .iter()
            .filter_map(|n| read_sysctl(n).map(|v| (n.to_string(), v)))
            .collect();
        node.start_containerd(s.log_dir)?;
        node.wait_containerd(deadline).await?;
        node.import_pause_image()?;
        node.start_kubelet(s.log_dir)?;
        node.start_kube_proxy(s.log_dir)?;
        Ok(node)
    }

    /// A node of a cluster whose owner died may have left containers in this cgroup root,
    /// and kube-proxy rules nobody maintains.
    fn clean_after_dead_node(&self) {
        let stale = sweep_cgroup(&self.params.cgroup_root);
        if stale > 0 {
            tracing::info!(
                processes = stale,
                "killed processes a dead real node left in {}",
                self.params.cgroup_root
            );
        }
        self.proxy_cleanup();
        self.remove_host_files(&[]);
    }

    /// The image registry containerd's CRI pulls from (TLS with a certificate of the
    /// cluster CA, on loopback), the refusing port, and the `hosts.toml` files that send
    /// every pull to one of them.
    async fn start_registry(&mut self, s: &NodeStart<'_>, deadline: Instant) -> Result<()> {
        let bin_dir = self.bins.registry_bin.clone().ok_or_else(|| {
            Error::Prerequisite(
                "the real node needs the image registry's binaries (hack/build-registry.sh)".into(),
            )
        })?;
        let refuser = crate::registry::Refuser::start().await?;
        let dir = self.params.dir.join("registry");
        fs::create_dir_all(&dir).map_err(|e| Error::io("creating", &dir, e))?;
        let registry = crate::registry::Registry::start(crate::registry::RegistryStart {
            dir: &dir,
            bin_dir: &bin_dir,
            ca_cert: &self.params.ca_cert,
            ca_cert_pem: s.ca_cert_pem,
            ca_key_pem: s.ca_key_pem,
            log_dir: s.log_dir,
            deadline,
        })
        .await?;
        let info = registry.info();
        let certs = self.params.registry_hosts_dir();
        crate::registry::write_hosts(&certs, &info.host, &info.ca, refuser.addr())?;
        self.registry = Some(registry);
        self.refuser = Some(refuser);
        Ok(())
    }

    /// The node's image registry (`None` only once stopped).
    pub fn registry(&self) -> Option<&crate::registry::RegistryInfo> {
        self.registry.as_ref().map(crate::registry::Registry::info)
    }

    fn start_containerd(&mut self, log_dir: &Path) -> Result<()> {
        let config = self.params.containerd_config().display().to_string();
        // containerd finds a runtime's shim on its PATH: gVisor's goes first.
        let mut env = Vec::new();
        if let Some(bin) = &self.params.gvisor_bin {
            let path = std::env::var("PATH").unwrap_or_default();
            env.push(("PATH", format!("{}:{path}", bin.display())));
        }
        self.containerd = Some(Component::start(
            "containerd",
            &self.bins.containerd,
            &["--config".into(), config],
            &env,
            &log_dir.join("containerd.log"),
            Duration::from_secs(10),
            false,
        )?);
        Ok(())
    }

    /// The sandbox image ([`PAUSE_IMAGE`]): Debian's static catatonit alone, packed and
    /// imported into containerd before the kubelet asks for it.
    fn import_pause_image(&self) -> Result<()> {
        let started = Instant::now();
        let images = self.params.dir.join("images");
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
        import_image(&self.params.socket(), &pause_tar)?;
        tracing::debug!(took = ?started.elapsed(), "pause image imported");
        Ok(())
    }

    fn start_kubelet(&mut self, log_dir: &Path) -> Result<()> {
        let p = &self.params;
        let d = |x: &Path| x.display().to_string();
        let kubelet_args = vec![
            format!("--config={}", d(&p.kubelet_config())),
            format!("--kubeconfig={}", d(&p.kubelet_kubeconfig())),
            format!("--root-dir={}", d(&p.kubelet_root())),
            format!("--cert-dir={}", d(&p.dir.join("kubelet-pki"))),
            format!("--hostname-override={}", p.node_name),
            format!("--node-ip={}", p.node_ip),
            "--v=1".into(),
        ];
        self.kubelet = Some(Component::start(
            "kubelet",
            &self.bins.kubelet,
            &kubelet_args,
            &[],
            &log_dir.join("kubelet.log"),
            Duration::from_secs(10),
            false,
        )?);
        Ok(())
    }

    fn start_kube_proxy(&mut self, log_dir: &Path) -> Result<()> {
        let config = self.params.proxy_config().display().to_string();
        let proxy_args = vec![format!("--config={config}"), "--v=1".into()];
        self.kube_proxy = Some(Component::start(
            "kube-proxy",
            &self.bins.kube_proxy,
            &proxy_args,
            &[],
            &log_dir.join("kube-proxy.log"),
            Duration::from_secs(10),
            false,
        )?);
        Ok(())
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
        if let Some(bin) = &p.gvisor_bin {
            w(
                p.runsc_toml(),
                super::gvisor::runsc_toml(bin, &p.containerd_dir().join("runsc")),
            )?;
        }
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
        if let Some(e) = self.registry.as_mut().and_then(|r| r.exited_error()) {
            return Some(e);
        }
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
            .chain(
                self.registry
                    .iter()
                    .filter_map(|r| r.pid().map(|p| ("registry".to_string(), p))),
            )
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
        // Once containerd pulls no more: the registry and what was pushed to it.
        if let Some(mut r) = self.registry.take() {
            r.stop();
        }
        self.refuser = None;
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

/// containerd's ttrpc socket path must fit a unix socket address (108 bytes, with room).
fn check_socket_path(params: &NodeParams) -> Result<()> {
    let sock_len = params.socket().as_os_str().len() + ".ttrpc".len();
    if sock_len > 100 {
        return Err(Error::Prerequisite(format!(
            "the run dir is too long for containerd's socket path ({}); use a shorter --run-dir",
            params.socket().display()
        )));
    }
    Ok(())
}
