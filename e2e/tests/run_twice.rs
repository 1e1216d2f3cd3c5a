//! Stop, start, stop, start: the local cluster as `make run` twice in a row uses it.
//!
//! - `cluster_up_stops_at_every_phase_and_starts_again`: `cli-mcp-cluster up` (run dir of its
//!   own) gets a signal while it builds the control plane (a cold cache), while etcd is
//!   starting, and while the kubelet is up but the cluster not yet ready; each time it must
//!   exit within [`STOP_WITHIN`] and leave nothing of that run behind. Then it starts to ready,
//!   stops on SIGTERM, starts to ready again and stops through `cli-mcp-cluster down`.
//! - `run_sh_readiness_ignores_a_stale_log`: hack/run.sh's readiness wait (hack/lib/start.sh)
//!   with the previous run's `CLI_MCP_READY` line and `cluster.json` still in place returns
//!   only once the cluster it started is ready; killed outright, it leaves no cluster behind.
//!
//! "Nothing left" is: no process with an argument naming the run dir or the run's etcd tmpfs
//! dir, no tmpfs dir and no pod-network claim of the owner, and the run-dir lock free.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use cli_mcp_e2e::cluster::{locate_control_plane, ClusterInfo, INFO_FILE};
use cli_mcp_e2e::process::{isolate, processes_with_arg, running, spawn_detached};
use cli_mcp_e2e::testing::{binaries_dir, workspace_root, READY_PREFIX};
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::sync::mpsc;

/// A stop must take at most this long, whatever the phase (a teardown is a few seconds).
const STOP_WITHIN: Duration = Duration::from_secs(30);
/// Start to ready (about 5-20 s here, more while other builds run).
const READY_WITHIN: Duration = Duration::from_secs(180);
/// For a process of the run to show up.
const APPEAR_WITHIN: Duration = Duration::from_secs(60);

enum Event {
    Line(String),
    Exit(ExitStatus),
}

/// A child process whose stdout lines and exit arrive through a channel (a thread reads them
/// and reaps it, so `cli-mcp-cluster down`, which watches /proc, sees it go).
struct Child {
    what: String,
    pid: i32,
    events: mpsc::UnboundedReceiver<Event>,
    lines: Vec<String>,
    exit: Option<ExitStatus>,
    /// When [`Child::signal`] was last called (stop times are measured from it).
    signalled: Option<Instant>,
}

impl Child {
    fn spawn(what: &str, mut cmd: Command, log: &Path) -> Child {
        let log_file = File::create(log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file);
        // Own process group (a signal to the test's group does not reach it) and SIGTERM
        // should the test process die.
        isolate(&mut cmd, Signal::SIGTERM);
        let mut child = spawn_detached(cmd).unwrap_or_else(|e| panic!("starting {what}: {e}"));
        let pid = child.id() as i32;
        let stdout = child.stdout.take().expect("stdout");
        let (tx, events) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                let _ = tx.send(Event::Line(line));
            }
            if let Ok(status) = child.wait() {
                let _ = tx.send(Event::Exit(status));
            }
        });
        Child {
            what: what.to_string(),
            pid,
            events,
            lines: Vec::new(),
            exit: None,
            signalled: None,
        }
    }

    fn take(&mut self, e: Event) {
        match e {
            Event::Line(l) => self.lines.push(l),
            Event::Exit(s) => self.exit = Some(s),
        }
    }

    /// Take in what has arrived so far, without waiting.
    fn drain(&mut self) {
        while let Ok(e) = self.events.try_recv() {
            self.take(e);
        }
    }

    /// Wait (at most `within`) for a stdout line starting with `prefix`; its rest.
    async fn line(&mut self, prefix: &str, within: Duration, log: &Path) -> String {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(l) = self.lines.iter().find_map(|l| l.strip_prefix(prefix)) {
                return l.to_string();
            }
            assert!(
                self.exit.is_none(),
                "{} exited ({:?}) before printing {prefix:?}; log {}:\n{}",
                self.what,
                self.exit,
                log.display(),
                tail(log)
            );
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(e)) => self.take(e),
                Ok(None) => panic!("{}: output channel closed", self.what),
                Err(_) => panic!(
                    "{} printed no {prefix:?} within {within:?}; log {}:\n{}",
                    self.what,
                    log.display(),
                    tail(log)
                ),
            }
        }
    }

    /// Wait (at most `within`) for the process to exit; its status and how long it took
    /// since the last [`Child::signal`] (or since this call).
    async fn exited(&mut self, within: Duration, log: &Path) -> (ExitStatus, Duration) {
        let started = self.signalled.unwrap_or_else(Instant::now);
        let deadline = tokio::time::Instant::now() + within;
        while self.exit.is_none() {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(e)) => self.take(e),
                Ok(None) => panic!("{}: output channel closed", self.what),
                Err(_) => panic!(
                    "{} (pid {}) still running {within:?} after being told to stop; log {}:\n{}",
                    self.what,
                    self.pid,
                    log.display(),
                    tail(log)
                ),
            }
        }
        (self.exit.expect("exit"), started.elapsed())
    }

    fn signal(&mut self, sig: Signal) {
        self.signalled = Some(Instant::now());
        kill(Pid::from_raw(self.pid), sig).unwrap_or_else(|e| panic!("{sig} to {}: {e}", self.pid));
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        // A failed assertion must not leave a cluster (or a control-plane build) running.
        if self.exit.is_none() {
            let _ = kill(Pid::from_raw(self.pid), Signal::SIGTERM);
        }
    }
}

/// On a failed assertion, stops whatever `cli-mcp-cluster` of the run still runs (e.g. one a
/// shell started).
struct StopOnDrop(PathBuf);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        for (pid, argv) in processes_with_arg(&self.0.display().to_string()) {
            if argv[0].ends_with("cli-mcp-cluster") {
                let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
            }
        }
    }
}

fn tail(log: &Path) -> String {
    cli_mcp_e2e::process::log_tail(log, 30)
}

/// Poll /proc (no event says a process started) until `pred` holds, at most `within`.
async fn until(what: &str, within: Duration, mut pred: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !pred() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The processes of the run `run_dir` owned by `owner`: an argument names the run dir (the
/// owner, kube-apiserver, the controllers, the kubelet) or the owner's etcd tmpfs dir.
fn processes_of(run_dir: &Path, owner: i32) -> Vec<(i32, Vec<String>)> {
    let mut found = processes_with_arg(&run_dir.display().to_string());
    found.extend(processes_with_arg(&shm_prefix(owner)));
    found
}

fn shm_prefix(owner: i32) -> String {
    format!("/dev/shm/cli-mcp-e2e-{owner}-")
}

/// Asserts that nothing of the run is left: no process, no etcd tmpfs dir, no pod-network
/// claim, and the run-dir lock is free. Processes killed as a group may take a moment to be
/// gone, so the process check waits (bounded).
async fn assert_nothing_left(run_dir: &Path, owner: i32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = processes_of(run_dir, owner);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "processes of the run in {} (owner {owner}) are still running: {left:?}",
            run_dir.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let shm: Vec<PathBuf> = std::fs::read_dir("/dev/shm")
        .expect("/dev/shm")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.display().to_string().starts_with(&shm_prefix(owner)))
        .collect();
    assert!(shm.is_empty(), "etcd tmpfs dirs left: {shm:?}");
    let claims: Vec<PathBuf> = std::fs::read_dir(cli_mcp_e2e::net::STATE_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("pod-net-"))
                && std::fs::read_to_string(p).is_ok_and(|t| t.trim() == owner.to_string())
        })
        .collect();
    assert!(
        claims.is_empty(),
        "pod-network claims of pid {owner} left: {claims:?}"
    );
    // A run stopped before it got to the run dir has no lock to release.
    let lock = run_dir.join(".lock");
    if let Ok(f) = OpenOptions::new().write(true).open(&lock) {
        assert!(
            Flock::lock(f, FlockArg::LockExclusiveNonblock).is_ok(),
            "the run-dir lock {} is still held",
            lock.display()
        );
    }
}

fn cluster_bin() -> PathBuf {
    binaries_dir().expect("binaries").join("cli-mcp-cluster")
}

fn up(run_dir: &Path, control_plane: Option<&Path>) -> Command {
    let mut cmd = Command::new(cluster_bin());
    cmd.arg("up").arg("--run-dir").arg(run_dir);
    if let Some(bin) = control_plane {
        cmd.arg("--control-plane-bin").arg(bin);
    }
    cmd.env_remove("CLI_MCP_CONTROL_PLANE_BIN");
    cmd
}

/// `/readyz` of the cluster described by the run dir's cluster.json answers "ok", and that
/// file names `owner`.
async fn assert_ready(run_dir: &Path, owner: i32) -> ClusterInfo {
    let info = ClusterInfo::load(run_dir).expect("cluster.json of the ready cluster");
    assert_eq!(info.pid as i32, owner, "cluster.json names another owner");
    let client = info.client().await.expect("client");
    let req = http::Request::get("/readyz")
        .body(Vec::new())
        .expect("request");
    let body = client.request_text(req).await.expect("/readyz");
    assert_eq!(body.trim(), "ok");
    info
}

fn log_mentions(log: &Path, text: &str) -> bool {
    std::fs::read_to_string(log).is_ok_and(|l| l.contains(text))
}

/// `cli-mcp-cluster up` of the run with the located control plane.
fn spawn_up(run_dir: &Path, control_plane: &Path, log: &Path) -> Child {
    Child::spawn("cli-mcp-cluster up", up(run_dir, Some(control_plane)), log)
}

/// [`spawn_up`], then waits until it says it is ready and [`assert_ready`] agrees.
async fn start_ready(run_dir: &Path, control_plane: &Path, log: &Path) -> Child {
    let started = Instant::now();
    let mut c = spawn_up(run_dir, control_plane, log);
    c.line(READY_PREFIX, READY_WITHIN, log).await;
    eprintln!("ready after {:?}", started.elapsed());
    assert_ready(run_dir, c.pid).await;
    c
}

/// Sends `sig` to a `cli-mcp-cluster up` that is not ready yet: it must exit with 130 within
/// [`STOP_WITHIN`] and log that the signal came during startup.
async fn stop_during_startup(c: &mut Child, sig: Signal, log: &Path, phase: &str) {
    c.signal(sig);
    let (status, took) = c.exited(STOP_WITHIN, log).await;
    eprintln!("stopped {phase}: {status} after {took:?}");
    assert_eq!(status.code(), Some(130), "{}", tail(log));
    assert!(
        log_mentions(log, &format!("{sig} during startup")),
        "{}",
        tail(log)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_up_stops_at_every_phase_and_starts_again() {
    let run_base = workspace_root().join(".run");
    let run_dir = run_base.join("e2e-run-twice-cycles");
    let log = run_base.join("e2e-run-twice-cycles.cluster.log");
    std::fs::create_dir_all(&run_base).expect("mkdir .run");
    let _stop = StopOnDrop(run_dir.clone());
    let control_plane = tokio::task::spawn_blocking(|| locate_control_plane(None))
        .await
        .expect("join")
        .expect("control plane (hack/build-control-plane.sh)");

    // 1. While building the control plane: a cold cache makes hack/build-control-plane.sh start
    //    `go build`; SIGTERM must stop the build too.
    let cold = run_base.join("e2e-run-twice-cold-cache");
    let _ = std::fs::remove_dir_all(&cold);
    std::fs::create_dir_all(&cold).expect("mkdir cold cache");
    let mut cmd = up(&run_dir, None);
    cmd.env("CLI_MCP_CACHE", &cold);
    let mut c = Child::spawn("cli-mcp-cluster up (cold control-plane cache)", cmd, &log);
    let building = format!("{}/control-plane/.build-", cold.display());
    until(
        "a control-plane build of the cold cache",
        APPEAR_WITHIN,
        || !processes_with_arg(&building).is_empty(),
    )
    .await;
    stop_during_startup(
        &mut c,
        Signal::SIGTERM,
        &log,
        "while building the control plane",
    )
    .await;
    until(
        "the cold build's processes to be gone",
        Duration::from_secs(10),
        || processes_with_arg(&cold.display().to_string()).is_empty(),
    )
    .await;
    assert_nothing_left(&run_dir, c.pid).await;
    let _ = std::fs::remove_dir_all(&cold);

    // 2. While starting the components: SIGINT (Ctrl-C) as soon as etcd runs.
    let mut c = spawn_up(&run_dir, &control_plane, &log);
    let etcd = shm_prefix(c.pid);
    until("etcd of the run", APPEAR_WITHIN, || {
        !processes_with_arg(&etcd).is_empty()
    })
    .await;
    stop_during_startup(&mut c, Signal::SIGINT, &log, "while starting etcd").await;
    assert_nothing_left(&run_dir, c.pid).await;

    // 3. In the last phase: the kubelet runs, the cluster is not ready yet.
    let mut c = spawn_up(&run_dir, &control_plane, &log);
    let kubelet_state = format!("{}/kubelet", run_dir.display());
    until("the kubelet of the run", READY_WITHIN, || {
        processes_with_arg(&kubelet_state)
            .iter()
            .any(|(_, argv)| argv[0].ends_with("cli-mcp-kubelet"))
    })
    .await;
    c.drain();
    assert!(
        c.exit.is_none() && !c.lines.iter().any(|l| l.starts_with(READY_PREFIX)),
        "the cluster was ready (or gone) before the kubelet was seen: {:?}",
        c.lines
    );
    stop_during_startup(&mut c, Signal::SIGTERM, &log, "while waiting for the node").await;
    assert!(
        !run_dir.join(INFO_FILE).exists(),
        "cluster.json of a cluster never ready"
    );
    assert_nothing_left(&run_dir, c.pid).await;

    // 4. Start to ready, stop with SIGTERM.
    let mut c = start_ready(&run_dir, &control_plane, &log).await;
    c.signal(Signal::SIGTERM);
    let (status, took) = c.exited(STOP_WITHIN, &log).await;
    eprintln!("stopped a ready cluster: {status} after {took:?}");
    assert!(status.success(), "{status}; {}", tail(&log));
    assert_nothing_left(&run_dir, c.pid).await;

    // 5. And again, stopped through `cli-mcp-cluster down` this time.
    let mut c = start_ready(&run_dir, &control_plane, &log).await;
    let mut down = Command::new(cluster_bin());
    down.arg("down").arg("--run-dir").arg(&run_dir);
    let down_log = run_base.join("e2e-run-twice-cycles.down.log");
    let mut d = Child::spawn("cli-mcp-cluster down", down, &down_log);
    let (status, took) = d.exited(STOP_WITHIN, &down_log).await;
    assert!(status.success(), "down: {status}; {}", tail(&down_log));
    let (owner, _) = c.exited(Duration::from_secs(5), &log).await;
    eprintln!("`down` stopped the cluster: {owner} after {took:?}");
    assert!(owner.success(), "{owner}; {}", tail(&log));
    assert_nothing_left(&run_dir, c.pid).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_sh_readiness_ignores_a_stale_log() {
    let base = workspace_root().join(".run/e2e-run-twice-script");
    let run_dir = base.join("cluster");
    let log = base.join("cluster.log");
    std::fs::create_dir_all(&run_dir).expect("mkdir");
    let _stop = StopOnDrop(run_dir.clone());
    let control_plane = tokio::task::spawn_blocking(|| locate_control_plane(None))
        .await
        .expect("join")
        .expect("control plane (hack/build-control-plane.sh)");

    // What the previous run left: its ready line in the log, and a cluster.json naming a live
    // process (this one) as the owner.
    let stale_json = run_dir.join(INFO_FILE);
    std::fs::write(&log, format!("{READY_PREFIX}{}\n", stale_json.display())).expect("log");
    std::fs::write(
        &stale_json,
        format!("{{\"pid\": {}}}\n", std::process::id()),
    )
    .expect("cluster.json");
    // A wait that greps the log (what hack/run.sh did) would take this for ready at once.
    assert!(log_mentions(&log, READY_PREFIX.trim()));

    let script = r#"set -euo pipefail
source "$1/hack/lib/start.sh"
start_logged "$2" "$3" up --run-dir "$4" --control-plane-bin "$5"
wait_cluster_ready "$2" "$start_pid" 300
echo "READY $start_pid $cluster_json"
wait "$start_pid"
"#;
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(script)
        .arg("bash")
        .arg(workspace_root())
        .arg(&log)
        .arg(cluster_bin())
        .arg(&run_dir)
        .arg(&control_plane)
        .env_remove("CLI_MCP_CONTROL_PLANE_BIN");
    let script_log = base.join("script.log");
    let started = Instant::now();
    let mut sh = Child::spawn(
        "hack/lib/start.sh start_logged + wait_cluster_ready",
        cmd,
        &script_log,
    );
    let ready = sh.line("READY ", READY_WITHIN, &script_log).await;
    eprintln!("the wait returned after {:?}", started.elapsed());
    let (pid, json) = ready.split_once(' ').expect("READY <pid> <cluster.json>");
    let pid: i32 = pid.parse().expect("pid");
    assert_eq!(
        Path::new(json),
        stale_json,
        "the ready line names the run's cluster.json"
    );
    // When the wait returns, the cluster it started is ready, not the previous run's.
    let argv = std::fs::read(format!("/proc/{pid}/cmdline")).expect("the started cluster runs");
    assert!(
        String::from_utf8_lossy(&argv).contains("cli-mcp-cluster"),
        "pid {pid} is not the cluster"
    );
    assert_ready(&run_dir, pid).await;
    let prev = std::fs::read_to_string(base.join("cluster.log.prev")).expect("cluster.log.prev");
    assert!(
        prev.starts_with(READY_PREFIX),
        "the previous run's log is kept as cluster.log.prev"
    );

    // The script killed outright (run.sh gone without its cleanup): the cluster it started
    // gets its parent-death signal and stops by itself.
    sh.signal(Signal::SIGKILL);
    let (status, _) = sh.exited(STOP_WITHIN, &script_log).await;
    assert_eq!(status.signal(), Some(Signal::SIGKILL as i32));
    let killed = Instant::now();
    until("the orphaned cluster to stop", STOP_WITHIN, || {
        !running(pid)
    })
    .await;
    eprintln!(
        "the cluster stopped {:?} after its script was killed",
        killed.elapsed()
    );
    assert!(
        log_mentions(&log, "SIGTERM; tearing down"),
        "{}",
        tail(&log)
    );
    assert_nothing_left(&run_dir, pid).await;
}
