//! One running agent process of a session: where it listens, whose it is, whether a failed
//! call left it suspect, and how it is stopped; and where the agent binary is found.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::sync::watch;

use cli_mcp_api::token::Token;

use crate::agent_client::AgentError;

pub const AGENT_BINARY_NAME: &str = "cli-mcp-agent";
/// How long an agent lets a running command go on after SIGTERM (its `--drain-timeout-ms`;
/// the agent's own default, 20 s, is for pods and would make `DELETE` wait that long).
pub(super) const AGENT_DRAIN: Duration = Duration::from_secs(2);
/// The agent's `--kill-grace-ms`: SIGTERM → SIGKILL of a command it stops, and the shell's
/// time to report back.
pub(super) const AGENT_KILL_GRACE: Duration = Duration::from_secs(1);
/// SIGTERM → SIGKILL grace when a session ends: longer than the agent's own bounded
/// shutdown, so an agent is SIGKILLed only when it is wedged. The agent exits within drain +
/// 8 kill graces + 2 s of SIGTERM (serving ends by drain + 3 kill graces + 2 s, then up to 3
/// kill graces for the running command to return, one for the shell to die and one for the
/// sweep of what escaped it); one more second for the exit itself.
/// A SIGKILLed agent cannot stop what its shell started: the session's cgroup does.
const STOP_GRACE: Duration = Duration::from_millis(
    AGENT_DRAIN.as_millis() as u64 + 8 * AGENT_KILL_GRACE.as_millis() as u64 + 2_000 + 1_000,
);

/// Finds the agent: the flag, else beside this binary, else `PATH`.
pub fn find_agent_binary(flag: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = flag {
        return if is_executable(p) {
            Ok(p.to_path_buf())
        } else {
            Err(format!(
                "--agent-binary {} is not an executable file",
                p.display()
            ))
        };
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join(AGENT_BINARY_NAME)));
    if let Some(p) = beside.filter(|p| is_executable(p)) {
        return Ok(p);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join(AGENT_BINARY_NAME);
            if is_executable(&p) {
                return Ok(p);
            }
        }
    }
    Err(format!(
        "cannot find {AGENT_BINARY_NAME} beside this binary or in PATH; build it \
         (`cargo build -p cli-mcp-agent`) or pass --agent-binary"
    ))
}

pub(super) fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// One running agent.
#[derive(Debug)]
pub(super) struct LocalAgent {
    pub(super) pid: u32,
    pub(super) uid: String,
    pub(super) endpoint: String,
    /// Bound to this agent's own nonce: a token of an earlier agent of the session never
    /// opens this one.
    pub(super) token: Token,
    pub(super) owner: Option<String>,
    pub(super) created_at: String,
    pub(super) last_activity: Mutex<String>,
    pub(super) dir: PathBuf,
    pub(super) exited: watch::Receiver<Option<ExitStatus>>,
    /// Set when a call to it failed: the next acquire checks or replaces it.
    pub(super) suspect: Mutex<Option<Suspicion>>,
}

/// Why a call to an agent failed, as far as it says whether the agent is still good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Suspicion {
    /// The connection failed (refused, or broken before the answer): the agent may be fine
    /// and the failure passing, so it is kept if it still answers `/healthz`.
    Unreached,
    /// The agent answered that it cannot take the session's commands (401, 503: shutting
    /// down), which its `/healthz` would not tell: it is replaced.
    Refused,
}

impl Suspicion {
    pub(super) fn of(e: &AgentError) -> Self {
        match e {
            AgentError::Connect { .. } | AgentError::Transport { .. } => Self::Unreached,
            _ => Self::Refused,
        }
    }
}

impl LocalAgent {
    pub(super) fn alive(&self) -> bool {
        self.exited.borrow().is_none()
    }

    pub(super) fn usable(&self) -> bool {
        self.alive() && self.suspicion().is_none()
    }

    pub(super) fn suspicion(&self) -> Option<Suspicion> {
        *self.suspect.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a failed call; a refusal is not taken back by a later connection failure.
    pub(super) fn suspect(&self, why: Suspicion) {
        let mut s = self.suspect.lock().unwrap_or_else(|p| p.into_inner());
        *s = (*s).max(Some(why));
    }

    /// Clears the suspicion if it is still only `Unreached` (no call met a refusal while
    /// `/healthz` was asked); whether it did.
    pub(super) fn clear_unreached(&self) -> bool {
        let mut s = self.suspect.lock().unwrap_or_else(|p| p.into_inner());
        let clear = *s == Some(Suspicion::Unreached);
        if clear {
            *s = None;
        }
        clear
    }

    /// SIGTERM, then SIGKILL after the grace period.
    pub(super) async fn stop(&self) {
        let mut exited = self.exited.clone();
        if !self.alive() {
            return;
        }
        let pid = Pid::from_raw(self.pid as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let done = tokio::time::timeout(STOP_GRACE, exited.wait_for(|s| s.is_some()))
            .await
            .is_ok();
        if !done && self.alive() {
            let _ = kill(pid, Signal::SIGKILL);
            let _ = exited.wait_for(|s| s.is_some()).await;
        }
    }
}
