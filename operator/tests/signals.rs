//! The operator binary stops on SIGTERM/SIGINT even when the API server cannot be reached:
//! its kubeconfig points at a loopback port nothing listens on (no cluster needed).

use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Well inside the Deployment's 30 s termination grace period.
const EXIT_WITHIN: Duration = Duration::from_secs(5);

/// A loopback port that was free a moment ago and is closed now: connects are refused.
fn closed_port() -> u16 {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    l.local_addr().expect("addr").port()
}

fn kubeconfig(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:{}\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: unused\ncontexts:\n- name: c\n  context: {{cluster: c, user: u, namespace: default}}\ncurrent-context: c\n",
        closed_port()
    );
    std::fs::write(&path, text).expect("write kubeconfig");
    path
}

struct Running {
    child: Child,
    log: std::path::PathBuf,
}

impl Running {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &std::path::Path, leader_elect: bool) -> Running {
    let log = dir.join(format!("operator-{leader_elect}.log"));
    let out = std::fs::File::create(&log).expect("log file");
    let err = out.try_clone().expect("log file");
    let child = Command::new(env!("CARGO_BIN_EXE_cli-mcp-operator"))
        .env("KUBECONFIG", kubeconfig(dir))
        .env("RELATED_IMAGE_SERVER", "cli-mcp-server:test")
        .env("CLI_MCP_HEALTH_LISTEN", "127.0.0.1:0")
        .env("CLI_MCP_LEADER_ELECT", leader_elect.to_string())
        .env("POD_NAMESPACE", "default")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawn cli-mcp-operator");
    Running { child, log }
}

/// Waits (polling the log file the process writes) until `needle` is logged.
fn wait_logged(r: &mut Running, needle: &str, limit: Duration) {
    let start = Instant::now();
    while start.elapsed() < limit {
        if r.log().contains(needle) {
            return;
        }
        if let Ok(Some(st)) = r.child.try_wait() {
            panic!("operator exited early ({st}):\n{}", r.log());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("'{needle}' not logged within {limit:?}:\n{}", r.log());
}

/// Sends `sig` and waits for the exit; returns how long it took.
fn stop(r: &mut Running, sig: Signal) -> Duration {
    let pid = Pid::from_raw(i32::try_from(r.child.id()).expect("pid fits"));
    let sent = Instant::now();
    kill(pid, sig).expect("send signal");
    loop {
        match r.child.try_wait().expect("wait") {
            Some(st) => {
                assert!(st.success(), "exit status {st}:\n{}", r.log());
                return sent.elapsed();
            }
            None if sent.elapsed() > EXIT_WITHIN => {
                panic!("still running {EXIT_WITHIN:?} after {sig}:\n{}", r.log());
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn case(leader_elect: bool, sig: Signal, running: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut r = start(dir.path(), leader_elect);
    // The process is past start-up and retrying the API server when the signal comes.
    wait_logged(&mut r, running, Duration::from_secs(30));
    let took = stop(&mut r, sig);
    let log = r.log();
    let name = if sig == Signal::SIGTERM {
        "SIGTERM"
    } else {
        "SIGINT"
    };
    assert!(
        log.contains(&format!("{name} received; shutting down")),
        "{log}"
    );
    assert!(log.contains("stopped"), "{log}");
    assert!(took < EXIT_WITHIN, "took {took:?}");
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn sigterm_without_an_api_server_and_without_leader_election() {
    // Every watch fails to list: the controllers never sync.
    case(false, Signal::SIGTERM, "failed with error");
}

#[test]
fn sigint_without_an_api_server_and_without_leader_election() {
    case(false, Signal::SIGINT, "failed with error");
}

#[test]
fn sigterm_without_an_api_server_with_leader_election() {
    // The election cannot create or read its Lease: it retries instead of exiting.
    case(true, Signal::SIGTERM, "cannot start leader election");
}
