//! The operator binary stops on SIGTERM/SIGINT even when the API server cannot be reached:
//! its kubeconfig points at a loopback port nothing listens on (no cluster needed).

use std::io::{BufRead as _, BufReader};
use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Well inside the Deployment's 30 s termination grace period.
const EXIT_WITHIN: Duration = Duration::from_secs(5);

/// A loopback port that was free a moment ago and is closed now: connects are refused.
/// Picked outside the ephemeral range, so no outgoing connection takes it meanwhile.
fn closed_port() -> u16 {
    cli_mcp_e2e::net::free_port(Ipv4Addr::LOCALHOST).expect("a free port")
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

/// The operator process, its stdout and stderr on one pipe read line by line on a thread:
/// waits are blocking reads with deadlines, not polls.
struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Every line read so far.
    log: String,
}

impl Running {
    /// The next line, or `None` once the output ended (the process exited). Panics with
    /// `late` and the log if nothing comes before `deadline`.
    fn next_line(&mut self, deadline: Instant, late: &str) -> Option<String> {
        match self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(line) => {
                self.log.push_str(&line);
                Some(line)
            }
            Err(RecvTimeoutError::Disconnected) => None,
            Err(RecvTimeoutError::Timeout) => panic!("{late}:\n{}", self.log),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &std::path::Path, leader_elect: bool, platform: &str) -> Running {
    let (reader, writer) = std::io::pipe().expect("pipe");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cli-mcp-operator"));
    cmd.env("KUBECONFIG", kubeconfig(dir))
        .env("RELATED_IMAGE_SERVER", "cli-mcp-server:test")
        .env("CLI_MCP_HEALTH_LISTEN", "127.0.0.1:0")
        .env("CLI_MCP_LEADER_ELECT", leader_elect.to_string())
        .env("CLI_MCP_PLATFORM", platform)
        .env("POD_NAMESPACE", "default")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(writer.try_clone().expect("pipe"))
        .stderr(writer);
    let child = cmd.spawn().expect("spawn cli-mcp-operator");
    // Our copies of the write end must go, or the end of the output never comes.
    drop(cmd);
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { break };
            if tx.send(line + "\n").is_err() {
                break;
            }
        }
    });
    Running {
        child,
        lines,
        log: String::new(),
    }
}

/// Reads the output until `needle` is logged, at most `limit`.
fn wait_logged(r: &mut Running, needle: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    let late = format!("'{needle}' not logged within {limit:?}");
    while let Some(line) = r.next_line(deadline, &late) {
        if line.contains(needle) {
            return;
        }
    }
    let st = r.child.wait().expect("wait");
    panic!("operator exited early ({st}):\n{}", r.log);
}

/// Sends `sig` and waits, at most [`EXIT_WITHIN`], for the exit (the end of the output,
/// then the status).
fn stop(r: &mut Running, sig: Signal) {
    let pid = Pid::from_raw(i32::try_from(r.child.id()).expect("pid fits"));
    let sent = Instant::now();
    kill(pid, sig).expect("send signal");
    let late = format!("still running {EXIT_WITHIN:?} after {sig}");
    while r.next_line(sent + EXIT_WITHIN, &late).is_some() {}
    let st = r.child.wait().expect("wait");
    assert!(st.success(), "exit status {st}:\n{}", r.log);
}

/// `platform` `kubernetes` skips the start-up detection, so the signal finds the process in
/// the phase `running` names; `auto` stops it while it asks which platform this is.
fn case(leader_elect: bool, platform: &str, sig: Signal, running: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut r = start(dir.path(), leader_elect, platform);
    // The process is past start-up and retrying the API server when the signal comes.
    wait_logged(&mut r, running, Duration::from_secs(30));
    stop(&mut r, sig);
    let log = &r.log;
    assert!(
        log.contains(&format!("{} received; shutting down", sig.as_str())),
        "{log}"
    );
    assert!(log.contains("stopped"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn sigterm_without_an_api_server_and_without_leader_election() {
    // Every watch fails to list: the controllers never sync.
    case(false, "kubernetes", Signal::SIGTERM, "failed with error");
}

#[test]
fn sigint_without_an_api_server_and_without_leader_election() {
    case(false, "kubernetes", Signal::SIGINT, "failed with error");
}

#[test]
fn sigterm_without_an_api_server_with_leader_election() {
    // The election cannot create or read its Lease: it retries instead of exiting.
    case(
        true,
        "kubernetes",
        Signal::SIGTERM,
        "cannot start leader election",
    );
}

#[test]
fn sigterm_while_detecting_the_platform_without_an_api_server() {
    // Start-up retries the API group list until the API server answers.
    case(
        true,
        "auto",
        Signal::SIGTERM,
        "listing API groups to detect OpenShift",
    );
}

/// Without an API server, `auto` keeps asking which platform this is, past the 30 s after
/// which it used to assume plain Kubernetes (wrong for the process's life on OpenShift after
/// a passing outage).
#[test]
fn the_platform_is_never_guessed_while_the_api_server_is_away() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut r = start(dir.path(), false, "auto");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut waits_of_8s = 0;
    // Attempts at 0, 0.5, 1.5, 3.5, 7.5, 15.5, 23.5 and 31.5 s: the fourth 8 s wait is
    // announced past the old 30 s limit.
    while waits_of_8s < 4 {
        let line = r
            .next_line(deadline, "no fourth 8 s retry within 60 s")
            .unwrap_or_else(|| panic!("operator exited early:\n{}", r.log));
        assert!(
            !line.contains("platform detected") && !line.contains("assuming"),
            "{line}"
        );
        if line.contains("listing API groups to detect OpenShift")
            && line.contains("retrying in 8s")
        {
            waits_of_8s += 1;
        }
    }
    stop(&mut r, Signal::SIGTERM);
}
