//! Helpers for end-to-end tests: one shared cluster per test run, a namespace per test,
//! and the watch-based waits with deadlines of [`crate::wait`].
//!
//! **Sharing a cluster.** [`cluster`] returns the cluster of this test run:
//! - If `$CLI_MCP_KUBECONFIG` is set (what `make test` does through
//!   `cli-mcp-cluster exec -- cargo test ...`), the cluster it names is used, and
//!   `cluster.json` next to the kubeconfig tells where the kubelet's state (pod logs) is.
//! - Otherwise the first call in a test process starts `cli-mcp-cluster up` as a child
//!   process (run dir `.run/e2e-<test binary>` in the workspace) and every test in that
//!   process shares it. The child gets SIGTERM when the test process exits and then tears
//!   the cluster down cleanly.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, OnceLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use kube::{Api, Client, Resource, ResourceExt};
use nix::sys::signal::Signal;

use crate::cluster::{
    client_from_kubeconfig, Cluster, ClusterConfig, ClusterInfo, INFO_FILE, KUBECONFIG_ENV,
};
use crate::error::{Error, Result};
use crate::process::{isolate, log_tail};
pub use crate::wait::{
    wait_deployment_ready, wait_for, wait_for_set, wait_gone, wait_restarted, AfterRestart, TIMEOUT,
};
pub use crate::workspace::workspace_root;

/// Environment variable overriding where the `cli-mcp-cluster` binary is.
pub const CLUSTER_BIN_ENV: &str = "CLI_MCP_CLUSTER_BIN";
/// Prefix of the line `cli-mcp-cluster up` prints on stdout once the cluster is ready,
/// followed by the path of `cluster.json`.
pub const READY_PREFIX: &str = "CLI_MCP_READY ";

/// How long a private cluster with a real node waits for the host's real node: every
/// real-node suite of `make test` in turn (together about 8 minutes), with room to spare.
pub const REAL_NODE_QUEUE: Duration = Duration::from_secs(30 * 60);

/// The cluster of this test run and an admin client for it.
#[derive(Clone)]
pub struct TestCluster {
    pub info: ClusterInfo,
    pub client: Client,
}

impl Debug for TestCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCluster")
            .field("info", &self.info)
            .finish()
    }
}

/// The shared cluster of this test run (see the module docs).
pub async fn cluster() -> Result<TestCluster> {
    let info = if let Some(kc) = std::env::var_os(KUBECONFIG_ENV) {
        let kc = PathBuf::from(kc);
        let dir = kc.parent().unwrap_or(Path::new("."));
        let info = ClusterInfo::load(dir).map_err(|e| {
            Error::Prerequisite(format!(
                "${KUBECONFIG_ENV}={} but {e}; point it at the kubeconfig in the run dir of \
                 `cli-mcp-cluster up`, or unset it to let the tests start their own cluster",
                kc.display()
            ))
        })?;
        if !Path::new(&format!("/proc/{}", info.pid)).exists() {
            return Err(Error::Prerequisite(format!(
                "${KUBECONFIG_ENV}={} names a cluster whose owner (pid {}) is no longer running; \
                 start it again (`cli-mcp-cluster up`) or unset ${KUBECONFIG_ENV}",
                kc.display(),
                info.pid
            )));
        }
        info
    } else {
        tokio::task::spawn_blocking(own_cluster)
            .await
            .map_err(|e| Error::Other(format!("starting the test cluster panicked: {e}")))??
    };
    let client = client_from_kubeconfig(&info.kubeconfig).await?;
    Ok(TestCluster { info, client })
}

fn own_cluster() -> Result<ClusterInfo> {
    static OWN: OnceLock<std::result::Result<ClusterInfo, String>> = OnceLock::new();
    OWN.get_or_init(|| start_cluster_process().map_err(|e| e.to_string()))
        .clone()
        .map_err(Error::Other)
}

fn cluster_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(CLUSTER_BIN_ENV) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()
        .map_err(|e| Error::Other(format!("locating the test executable: {e}")))?;
    // target/<profile>/deps/<test> -> target/<profile>/cli-mcp-cluster
    for dir in exe.ancestors().skip(1).take(2) {
        let candidate = dir.join("cli-mcp-cluster");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(Error::Prerequisite(format!(
        "cli-mcp-cluster not found next to {}; build it with \
         `cargo build -p cli-mcp-e2e --bin cli-mcp-cluster`, set ${CLUSTER_BIN_ENV}, or run the \
         tests through `make test` (which shares one cluster via ${KUBECONFIG_ENV})",
        exe.display()
    )))
}

fn start_cluster_process() -> Result<ClusterInfo> {
    let bin = cluster_binary()?;
    let exe = std::env::current_exe().unwrap_or_default();
    let stem = exe
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "tests".into());
    // Drop cargo's `-<hash>` suffix so that reruns reuse (and clear) one run dir.
    let name = match stem.rsplit_once('-') {
        Some((base, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            base.to_string()
        }
        _ => stem,
    };
    let run_base = workspace_root().join(".run");
    std::fs::create_dir_all(&run_base).map_err(|e| Error::io("creating", &run_base, e))?;
    let run_dir = run_base.join(format!("e2e-{name}"));
    let log = run_base.join(format!("e2e-{name}.cluster.log"));
    let log_file = File::create(&log).map_err(|e| Error::io("creating", &log, e))?;
    eprintln!(
        "e2e: starting a local cluster for this test process ({} up --run-dir {}); log: {}",
        bin.display(),
        run_dir.display(),
        log.display()
    );

    let (tx, rx) = mpsc::channel::<Result<PathBuf>>();
    let log_for_thread = log.clone();
    // The owner thread lives as long as the cluster process: the child's parent-death
    // signal fires when the thread that spawned it ends.
    std::thread::Builder::new()
        .name("cli-mcp-cluster-owner".into())
        .spawn(move || {
            let mut cmd = Command::new(&bin);
            cmd.arg("up")
                .arg("--run-dir")
                .arg(&run_dir)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(log_file);
            isolate(&mut cmd, Signal::SIGTERM);
            let mut child = match cmd.spawn() {
                Ok(c) => c,
                Err(e) => {
                    let _ = tx.send(Err(Error::Command {
                        command: format!("{} up", bin.display()),
                        detail: e.to_string(),
                    }));
                    return;
                }
            };
            let mut tx = Some(tx);
            if let Some(out) = child.stdout.take() {
                for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                    if let Some(path) = line.strip_prefix(READY_PREFIX) {
                        if let Some(tx) = tx.take() {
                            let _ = tx.send(Ok(PathBuf::from(path.trim())));
                        }
                    }
                }
            }
            let status = child.wait();
            if let Some(tx) = tx.take() {
                let _ = tx.send(Err(Error::Other(format!(
                    "cli-mcp-cluster up exited ({}) before the cluster was ready; last lines of {}:\n{}",
                    status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                    log_for_thread.display(),
                    log_tail(&log_for_thread, 40)
                ))));
            }
        })
        .map_err(|e| Error::Other(format!("spawning the cluster owner thread: {e}")))?;

    let info_path = rx
        .recv()
        .map_err(|_| Error::Other("the cluster owner thread died".into()))??;
    let dir = info_path.parent().unwrap_or(Path::new("."));
    debug_assert!(info_path.ends_with(INFO_FILE));
    ClusterInfo::load(dir)
}

/// A cluster owned by one test, in the test process itself (not shared through
/// `$CLI_MCP_KUBECONFIG`): for tests that disturb the control plane (restart the
/// apiserver), which must not run against the cluster the other tests share. Dropping it
/// tears the cluster down.
pub struct PrivateCluster {
    /// The running cluster (restart components through it).
    pub cluster: Cluster,
    /// What the helpers of this module take.
    pub test: TestCluster,
}

/// Environment variable with extra image mappings for [`private_cluster`],
/// `PATTERN=PATH[,PATTERN=PATH...]` (like `cli-mcp-cluster up --image`), e.g. to run a
/// fault test against a patched operator binary.
pub const IMAGES_ENV: &str = "CLI_MCP_IMAGES";

/// The cargo profile dir (`target/debug`) holding the project's binaries, found next to
/// the test executable (`target/debug/deps/<test>`) or from `$CLI_MCP_CLUSTER_BIN`.
pub fn binaries_dir() -> Result<PathBuf> {
    let bin = cluster_binary()?;
    Ok(bin.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// Start a private cluster with run dir `.run/e2e-private-<name>` in the workspace (its
/// own pod subnet, ports and etcd; other clusters keep running). Images map to the binaries
/// in [`binaries_dir`], as with `cli-mcp-cluster up`, plus `$CLI_MCP_IMAGES`.
pub async fn private_cluster(name: &str) -> Result<PrivateCluster> {
    let run_dir = workspace_root().join(format!(".run/e2e-private-{name}"));
    let mut cfg = ClusterConfig::local(&binaries_dir()?, run_dir)?;
    if let Some(spec) = std::env::var_os(IMAGES_ENV) {
        for item in spec
            .to_string_lossy()
            .split(',')
            .filter(|s| !s.trim().is_empty())
        {
            let (pattern, path) = item.split_once('=').ok_or_else(|| {
                Error::Prerequisite(format!(
                    "${IMAGES_ENV}: {item:?} is not PATTERN=PATH (e.g. \
                     cli-mcp-operator:*=/tmp/cli-mcp-operator)"
                ))
            })?;
            cfg.images
                .insert(pattern.trim().to_owned(), PathBuf::from(path.trim()));
        }
    }
    private_cluster_with(cfg).await
}

/// [`private_cluster`] with a given configuration (e.g. images mapped to release builds).
pub async fn private_cluster_with(mut cfg: ClusterConfig) -> Result<PrivateCluster> {
    // The suites with a real node run on parallel lanes and take the host's one real node
    // in turn: a private cluster queues for it as long as the others together may take.
    cfg.host_lock_wait = cfg.host_lock_wait.max(REAL_NODE_QUEUE);
    eprintln!(
        "e2e: starting a private cluster in this process (run dir {})",
        cfg.run_dir.display()
    );
    let cluster = Cluster::up(cfg).await?;
    let info = cluster.info().clone();
    let client = client_from_kubeconfig(&info.kubeconfig).await?;
    Ok(PrivateCluster {
        cluster,
        test: TestCluster { info, client },
    })
}

/// A namespace owned by one test.
#[derive(Clone)]
pub struct TestNamespace {
    pub name: String,
    client: Client,
}

impl TestCluster {
    /// Create a fresh namespace `e2e-<prefix>-xxxxx` and wait until pods can be created in
    /// it (its `default` ServiceAccount and `kube-root-ca.crt` exist).
    pub async fn namespace(&self, prefix: &str) -> Result<TestNamespace> {
        let api = Api::<Namespace>::all(self.client.clone());
        let ns = Namespace {
            metadata: ObjectMeta {
                generate_name: Some(format!("e2e-{prefix}-")),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/part-of".to_string(),
                    "cli-mcp-e2e".to_string(),
                )])),
                ..Default::default()
            },
            ..Default::default()
        };
        let created = api.create(&PostParams::default(), &ns).await?;
        let name = created.name_any();
        wait_for(
            Api::<ServiceAccount>::namespaced(self.client.clone(), &name),
            "default",
            &format!("ServiceAccount {name}/default"),
            TIMEOUT,
            |o: Option<&ServiceAccount>| o.is_some(),
        )
        .await?;
        wait_for(
            Api::<ConfigMap>::namespaced(self.client.clone(), &name),
            "kube-root-ca.crt",
            &format!("ConfigMap {name}/kube-root-ca.crt"),
            TIMEOUT,
            |o: Option<&ConfigMap>| o.is_some(),
        )
        .await?;
        Ok(TestNamespace {
            name,
            client: self.client.clone(),
        })
    }

    /// The last `tail` lines of container `container`'s log in each pod of `namespace`
    /// (`usize::MAX`: all), for failure messages.
    pub fn pod_logs(&self, namespace: &str, container: &str, tail: usize) -> String {
        // The process kubelet writes `<state>/pods/<ns>_<pod>_<uid>/<container>.log`, the
        // real kubelet `<podLogsDir>/<ns>_<pod>_<uid>/<container>/<restarts>.log`.
        let real = self.info.node == crate::node::NodeKind::Real;
        let dir = if real {
            self.info.run_dir.join("node/pod-logs")
        } else {
            self.info.kubelet_state_dir.join("pods")
        };
        let pods = std::fs::read_dir(dir).into_iter().flatten().flatten();
        let read = |pod: &Path| {
            if !real {
                return std::fs::read_to_string(pod.join(format!("{container}.log"))).ok();
            }
            let mut logs: Vec<PathBuf> = std::fs::read_dir(pod.join(container))
                .ok()?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "log"))
                .collect();
            logs.sort();
            let texts: Vec<String> = logs
                .iter()
                .filter_map(|l| std::fs::read_to_string(l).ok())
                .collect();
            Some(texts.join(""))
        };
        let mut text: Vec<String> = pods
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("{namespace}_"))
            })
            .filter_map(|e| read(&e.path()))
            .collect();
        text.iter_mut().for_each(|t| {
            let lines: Vec<&str> = t.lines().collect();
            *t = lines[lines.len().saturating_sub(tail)..].join("\n");
        });
        text.join("\n---\n")
    }

    /// Contents of a container's log file, as written by the process kubelet.
    pub async fn container_log(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
    ) -> Result<String> {
        let p = Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get(pod)
            .await?;
        let uid = p.uid().unwrap_or_default();
        let path = self
            .info
            .container_log_path(namespace, pod, &uid, container);
        tokio::fs::read_to_string(&path)
            .await
            .map_err(|e| Error::io("reading container log", path, e))
    }
}

impl TestNamespace {
    /// A namespaced API in this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Delete the namespace (and everything in it) without waiting. Tests call this on
    /// success; a failed test leaves its namespace for inspection.
    pub async fn delete(self) -> Result<()> {
        Api::<Namespace>::all(self.client)
            .delete(&self.name, &DeleteParams::background())
            .await?;
        Ok(())
    }
}
/// The ready, not deleting pods of `selector`, waiting (up to [`TIMEOUT`]) until there are
/// at least `n`.
pub async fn ready_pods(api: Api<Pod>, selector: &str, n: usize) -> Vec<Pod> {
    let live =
        |p: &Pod| cli_mcp_api::pod_state::is_ready(p) && p.metadata.deletion_timestamp.is_none();
    let pods = wait_for_set(api, selector, selector, TIMEOUT, |ps: &[Pod]| {
        ps.iter().filter(|p| live(p)).count() >= n
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    pods.into_iter().filter(|p| live(p)).collect()
}

/// The pod's IP, once it has one.
pub fn pod_ip(pod: &Pod) -> Option<String> {
    pod.status.as_ref().and_then(|s| s.pod_ip.clone())
}
