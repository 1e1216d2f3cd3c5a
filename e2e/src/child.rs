//! The project's binaries run on the host by tests and benches: a child whose stderr carries
//! JSON log lines, started once it logs its ready line, with its log kept to read and wait
//! on; `cli-mcp-server` on loopback; the memory of a process.

use std::collections::VecDeque;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::error::{Error, Result};

/// How many log lines a [`JsonLog`] keeps (the oldest go first).
pub const LOG_LINES: usize = 2000;

/// The stderr lines of a child, the last [`LOG_LINES`] of them; every new line wakes the
/// waiters of [`JsonLog::wait_for`].
#[derive(Clone, Default)]
pub struct JsonLog {
    lines: Arc<Mutex<VecDeque<String>>>,
    event: Arc<tokio::sync::Notify>,
}

impl JsonLog {
    fn push(&self, line: String) {
        let mut l = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        if l.len() > LOG_LINES {
            l.pop_front();
        }
        l.push_back(line);
        drop(l);
        self.event.notify_waiters();
    }

    /// The kept lines, one a line.
    pub fn text(&self) -> String {
        self.lines
            .lock()
            .map(|l| l.iter().cloned().collect::<Vec<_>>().join("\n"))
            .unwrap_or_default()
    }

    /// Waits (woken by each new line, no polling) at most `within` for a line matching
    /// `pred`, kept or to come; `None` when none came.
    pub async fn wait_for(&self, within: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let wait = async {
            loop {
                let notified = self.event.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let found = self
                    .lines
                    .lock()
                    .ok()
                    .and_then(|l| l.iter().find(|l| pred(l)).cloned());
                if let Some(line) = found {
                    return line;
                }
                notified.await;
            }
        };
        tokio::time::timeout(within, wait).await.ok()
    }
}

/// A child started by [`start_logged`].
pub struct Started {
    pub child: Child,
    /// The ready line.
    pub ready: Value,
    pub log: JsonLog,
}

/// Spawns `cmd` with its stderr piped into a [`JsonLog`], and waits at most `within` for
/// the JSON line whose `message` is `ready`. Fails, with the log so far, when the child
/// ends or the time is up before that line.
pub async fn start_logged(mut cmd: Command, ready: &str, within: Duration) -> Result<Started> {
    let program = cmd.as_std().get_program().to_string_lossy().into_owned();
    let mut child = cmd
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::Command {
            command: program.clone(),
            detail: e.to_string(),
        })?;
    let stderr = child.stderr.take().expect("stderr is piped");
    let log = JsonLog::default();
    let (tx, rx) = tokio::sync::oneshot::channel::<Value>();
    let (reader_log, want) = (log.clone(), ready.to_owned());
    tokio::spawn(async move {
        let mut tx = Some(tx);
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if v["message"] == want.as_str() {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(v);
                    }
                }
            }
            reader_log.push(line);
        }
    });
    match tokio::time::timeout(within, rx).await {
        Ok(Ok(ready)) => Ok(Started { child, ready, log }),
        _ => Err(Error::Other(format!(
            "{program} did not log {ready:?} within {within:?}; its log:\n{}",
            log.text()
        ))),
    }
}

/// SIGTERM to a child that has not been waited for yet.
pub fn terminate(child: &Child) {
    if let Some(pid) = child.id() {
        let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
    }
}

/// `cli-mcp-server` on the host, on loopback ports it picks itself. SIGKILL on drop (`stop`
/// lets it stop gracefully first), then its temporary directory is removed.
pub struct LocalServer {
    pub child: Child,
    /// `listen` of its ready line: the MCP address.
    pub addr: String,
    /// `health_listen` of its ready line: `/livez`, `/readyz`, `/metrics`.
    pub health: String,
    pub log: JsonLog,
    /// `https` when started with `--tls-cert`.
    pub scheme: &'static str,
    /// The server's `TMPDIR`, where the local backend makes its sessions' root. A test
    /// rarely waits out the graceful stop that removes that root (its drop kills the
    /// server), so the harness removes it on drop.
    tmp: std::path::PathBuf,
}

impl LocalServer {
    /// Starts `bin` with `--listen 127.0.0.1:0 --health-listen 127.0.0.1:0 --log-json`, then
    /// `args`, `RUST_LOG=rust_log` and `env`, outside any cluster (no
    /// `KUBERNETES_SERVICE_HOST`) and with a `TMPDIR` of its own; waits at most 30 s for its
    /// ready line.
    pub async fn start(
        bin: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        rust_log: &str,
    ) -> Result<LocalServer> {
        let tmp = tempfile::Builder::new()
            .prefix("cli-mcp-test-server-")
            .tempdir()
            .map_err(|e| Error::Other(format!("a temporary directory for {bin:?}: {e}")))?;
        let mut cmd = Command::new(bin);
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--health-listen",
            "127.0.0.1:0",
            "--log-json",
        ])
        .args(args)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("RUST_LOG", rust_log)
        .env("TMPDIR", tmp.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let s = start_logged(cmd, "cli-mcp-server ready", Duration::from_secs(30)).await?;
        let field = |k: &str| s.ready[k].as_str().unwrap_or_default().to_owned();
        Ok(LocalServer {
            addr: field("listen"),
            health: field("health_listen"),
            child: s.child,
            log: s.log,
            scheme: if args.contains(&"--tls-cert") {
                "https"
            } else {
                "http"
            },
            tmp: tmp.keep(),
        })
    }

    /// The flags of the `local` backend with `agent` as the agent binary and no auth
    /// (each session an agent process on loopback), for [`LocalServer::start`].
    pub fn local_backend(agent: &str) -> Vec<&str> {
        vec![
            "--backend",
            "local",
            "--auth",
            "none",
            "--agent-binary",
            agent,
        ]
    }

    /// `<scheme>://<addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("{}://{}{path}", self.scheme, self.addr)
    }

    /// `http://<health><path>`.
    pub fn health_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.health)
    }

    pub fn log_text(&self) -> String {
        self.log.text()
    }

    /// Resident and peak resident memory in KiB.
    pub fn rss_kib(&self) -> Option<(u64, u64)> {
        rss_kib(self.child.id()?)
    }

    /// SIGTERM, then waits at most `within` for the exit; `None` when it did not exit.
    pub async fn stop(mut self, within: Duration) -> Option<std::io::Result<ExitStatus>> {
        terminate(&self.child);
        tokio::time::timeout(within, self.child.wait()).await.ok()
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
        }
        // The server's agents, told of its death, stop within a few seconds and may still
        // write below the root meanwhile: a removal that meets a file made after its
        // listing fails (ENOTEMPTY), so it is tried again, briefly.
        for _ in 0..50 {
            match std::fs::remove_dir_all(&self.tmp) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => break,
            }
        }
    }
}

/// Resident and peak resident memory of process `pid` in KiB (`VmRSS`, `VmHWM`).
pub fn rss_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}
