//! Starting a session's agent: its directories, its command line, its cgroup, and the wait
//! for its "ready" log line.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStderr, Command};
use tokio::sync::watch;

use cli_mcp_api::activity::stamp_now;
use cli_mcp_api::token::{SandboxNonce, Token};
use cli_mcp_api::wire::ENV_TOKEN_SHA256;
use cli_mcp_api::SessionId;

use super::agent::{LocalAgent, AGENT_DRAIN, AGENT_KILL_GRACE};
use super::cgroups::{join_cgroup, kill_cgroup};
use super::roots::private_dir;
use super::LocalBackend;
use crate::auth::Caller;
use crate::sessions::SessionError;

/// How long a new agent may take to report that it listens.
const AGENT_START_TIMEOUT: Duration = Duration::from_secs(15);
/// The agent's "listening" log line.
const READY_MESSAGE: &str = "cli-mcp-agent ready";
/// Lines of agent stderr kept to explain a failed start.
const START_LOG_LINES: usize = 20;

impl LocalBackend {
    /// Starts a new agent for `sid`, owned by `caller`, and waits until it listens.
    pub(super) async fn spawn(
        &self,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<LocalAgent, SessionError> {
        let uid = self.next_uid.fetch_add(1, Ordering::Relaxed);
        let dir = self.root.path().join(format!("{sid}-{uid}"));
        let (workspace, state) = session_dirs(&dir)?;
        let session_token = self
            .key
            .session_token(sid, &SandboxNonce::from_bytes(rand::random()));
        let mut cmd = self.agent_command(&dir, &workspace, &state, &session_token);
        let cgroup = self.new_cgroup(sid, uid);
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                if let Some(dir) = &cgroup {
                    let _ = std::fs::remove_dir(dir);
                }
                return Err(SessionError::Sandbox(format!(
                    "cannot start {}: {e}",
                    self.agent_binary.display()
                )));
            }
        };
        let pid = child.id().unwrap_or_default();
        // Moved in before it reports ready: it starts no process of its own before its first
        // command, and no command can reach it before the server has read that line.
        let cgroup = cgroup.and_then(|dir| enter_cgroup(sid, dir, pid));
        let Some(stderr) = child.stderr.take() else {
            return Err(SessionError::Sandbox("the agent has no stderr pipe".into()));
        };
        let exited = watch_exit(child, cgroup);
        let mut lines = BufReader::with_capacity(1024, stderr).lines();
        let listen = self.await_ready(&mut lines, pid).await?;
        tokio::spawn(forward_log(lines, sid.clone()));
        let now = stamp_now();
        Ok(LocalAgent {
            pid,
            token: session_token,
            uid: format!("local-{uid}"),
            endpoint: format!("http://{listen}"),
            owner: caller.owner.clone(),
            created_at: now.clone(),
            last_activity: Mutex::new(now),
            dir,
            exited,
            suspect: Mutex::new(None),
        })
    }

    /// The agent's command line and environment.
    fn agent_command(&self, dir: &Path, workspace: &Path, state: &Path, token: &Token) -> Command {
        let mut cmd = Command::new(&self.agent_binary);
        cmd.arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--workdir")
            .arg(workspace)
            .arg("--state-dir")
            .arg(state)
            .arg("--podinfo-annotations")
            .arg(dir.join("no-podinfo"))
            .arg("--output-budget")
            .arg(self.limits.output_budget.to_string())
            .arg("--default-timeout-ms")
            .arg(self.limits.default_timeout.as_millis().to_string())
            .arg("--max-timeout-ms")
            .arg(self.limits.max_timeout.as_millis().to_string())
            .arg("--drain-timeout-ms")
            .arg(AGENT_DRAIN.as_millis().to_string())
            .arg("--kill-grace-ms")
            .arg(AGENT_KILL_GRACE.as_millis().to_string())
            // SIGTERM when this process dies, however it dies (SIGKILL included): the agent
            // then stops its shell and everything the shell started, as on a `DELETE`.
            .arg("--parent-pid")
            .arg(std::process::id().to_string())
            .arg("--log-json");
        // The server's own settings must not leak into the agent's flags.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("CLI_MCP_") {
                cmd.env_remove(&k);
            }
        }
        cmd.env(ENV_TOKEN_SHA256, token.commitment().to_hex())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd
    }

    /// A new cgroup for agent `uid` of `sid`, when cgroups can be made here.
    fn new_cgroup(&self, sid: &SessionId, uid: u64) -> Option<PathBuf> {
        match self.cgroups.as_ref().map(|c| c.create(sid, uid)) {
            Some(Ok(dir)) => Some(dir),
            Some(Err(e)) => {
                tracing::warn!(session = %sid, "cannot create the session's cgroup, it runs without: {e}");
                None
            }
            None => None,
        }
    }

    /// The address the agent reports it listens on, within [`AGENT_START_TIMEOUT`]; an agent
    /// that does not report in time is killed.
    async fn await_ready(
        &self,
        lines: &mut Lines<BufReader<ChildStderr>>,
        pid: u32,
    ) -> Result<String, SessionError> {
        match tokio::time::timeout(AGENT_START_TIMEOUT, wait_ready(lines)).await {
            Ok(Ok(addr)) => Ok(addr),
            Ok(Err(log)) => Err(SessionError::Sandbox(format!(
                "{} exited before it was ready; its log:\n{log}",
                self.agent_binary.display()
            ))),
            Err(_) => {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
                Err(SessionError::Sandbox(format!(
                    "{} did not report ready within {AGENT_START_TIMEOUT:?}",
                    self.agent_binary.display()
                )))
            }
        }
    }
}

/// The session's workspace and state directories under `dir`, made private.
fn session_dirs(dir: &Path) -> Result<(PathBuf, PathBuf), SessionError> {
    let workspace = dir.join("workspace");
    let state = dir.join("state");
    for d in [&workspace, &state] {
        private_dir(d)
            .map_err(|e| SessionError::Sandbox(format!("cannot create {}: {e}", d.display())))?;
    }
    Ok((workspace, state))
}

/// Moves the agent `pid` into its cgroup `dir`; the cgroup it is in, if any.
fn enter_cgroup(sid: &SessionId, dir: PathBuf, pid: u32) -> Option<PathBuf> {
    match join_cgroup(&dir, pid) {
        Ok(()) => Some(dir),
        Err(e) => {
            tracing::warn!(session = %sid, "cannot move the agent into its cgroup, it runs without: {e}");
            let _ = std::fs::remove_dir(&dir);
            None
        }
    }
}

/// Waits for the agent's exit in a task of its own; the receiver learns its status.
fn watch_exit(mut child: Child, cgroup: Option<PathBuf>) -> watch::Receiver<Option<ExitStatus>> {
    let (tx, exited) = watch::channel(None);
    tokio::spawn(async move {
        let status = child.wait().await.ok();
        // Before the exit is announced: a stopped session has no process left.
        if let Some(dir) = cgroup {
            kill_cgroup(&dir).await;
        }
        let _ = tx.send(Some(status.unwrap_or_else(|| {
            use std::os::unix::process::ExitStatusExt;
            ExitStatus::from_raw(0)
        })));
    });
    exited
}

/// Reads the agent's JSON log until its ready line; returns the bound address, or the log so
/// far when it exits first.
async fn wait_ready(
    lines: &mut tokio::io::Lines<BufReader<ChildStderr>>,
) -> Result<String, String> {
    let mut seen: Vec<String> = Vec::new();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
            if v["message"] == READY_MESSAGE {
                if let Some(addr) = v["listen"].as_str() {
                    return Ok(addr.to_owned());
                }
            }
        }
        if seen.len() == START_LOG_LINES {
            seen.remove(0);
        }
        seen.push(line);
    }
    Err(seen.join("\n"))
}

/// Keeps draining the agent's log (a full pipe would block it) into ours at debug level.
async fn forward_log(mut lines: tokio::io::Lines<BufReader<ChildStderr>>, sid: SessionId) {
    while let Ok(Some(line)) = lines.next_line().await {
        tracing::debug!(target: "cli_mcp_server::agent", session = %sid, "{line}");
    }
}
