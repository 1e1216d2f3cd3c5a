//! The `local` backend: each session is a `cli-mcp-agent` child process on loopback, with the
//! same token scheme as in a cluster (a random HMAC key per server process).
//!
//! For development and the quick start only: the agents run as the server's user, on the
//! server's machine, with its environment and file system. **Nothing is isolated.**

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{ChildStderr, Command};
use tokio::sync::watch;

use cli_mcp_api::activity::stamp_now;
use cli_mcp_api::token::{HmacKey, SandboxNonce, Token};
use cli_mcp_api::wire::ENV_TOKEN_SHA256;
use cli_mcp_api::SessionId;

use super::locks::SessionLocks;
use super::{
    owner_allows, Activity, Backend, EndedSandboxes, Quota, Sandbox, SessionError, SessionSummary,
};
use crate::agent_client::{AgentClient, AgentError};
use crate::auth::Caller;
use crate::cli::Limits;
use crate::metrics::{Launch, Metrics};

pub const AGENT_BINARY_NAME: &str = "cli-mcp-agent";
/// Mode of every directory the backend makes.
const PRIVATE_DIR: u32 = 0o700;

/// The backend's root is `<temporary directory>/cli-mcp-local-<random>`.
const ROOT_PREFIX: &str = "cli-mcp-local-";
/// The file in a root that names the server process it belongs to: `<pid> <pid namespace>`.
const OWNER_FILE: &str = "server";

/// This process as a root's [`OWNER_FILE`] names it.
fn owner_line() -> String {
    format!("{} {}", std::process::id(), pid_namespace())
}

fn pid_namespace() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .map(|l| l.display().to_string())
        .unwrap_or_default()
}

/// Removes the roots that servers which are gone left in `tmp`: a server that stops removes
/// its own, one that was killed (SIGKILL, a crash) cannot, and its sessions' workspaces and
/// agent state would stay for good. Only a real directory of this user is touched, and only
/// when it names a server of this pid namespace that no longer runs: a root that names none
/// (another server is making it right now) is left alone. Returns how many were removed.
fn remove_abandoned_roots(tmp: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return 0;
    };
    let (uid, ns) = (nix::unistd::geteuid().as_raw(), pid_namespace());
    let mut removed = 0;
    for e in entries.flatten() {
        if !e.file_name().to_string_lossy().starts_with(ROOT_PREFIX) {
            continue;
        }
        // `symlink_metadata`: a link named like a root is not followed (nor removed).
        let ours = std::fs::symlink_metadata(e.path())
            .is_ok_and(|m| m.file_type().is_dir() && m.uid() == uid);
        let Some(owner) = ours
            .then(|| std::fs::read_to_string(e.path().join(OWNER_FILE)).ok())
            .flatten()
        else {
            continue;
        };
        let gone = match owner.trim().split_once(' ') {
            Some((pid, owner_ns)) if owner_ns == ns => {
                pid.parse::<i32>().is_ok_and(|pid| pid > 0 && exited(pid))
            }
            _ => false,
        };
        if gone && std::fs::remove_dir_all(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Whether process `pid` has ended: it no longer exists, or it is a zombie (killed, not yet
/// reaped by its parent).
fn exited(pid: i32) -> bool {
    if kill(Pid::from_raw(pid), None) == Err(nix::errno::Errno::ESRCH) {
        return true;
    }
    // `/proc/<pid>/stat`: the state follows the command name, which ends with the last ')'.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

/// Creates `dir` and its missing parents with [`PRIVATE_DIR`].
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(PRIVATE_DIR)
        .create(dir)
}
/// How long a new agent may take to report that it listens.
const AGENT_START_TIMEOUT: Duration = Duration::from_secs(15);
/// How long an agent lets a running command go on after SIGTERM (its `--drain-timeout-ms`;
/// the agent's own default, 20 s, is for pods and would make `DELETE` wait that long).
const AGENT_DRAIN: Duration = Duration::from_secs(2);
/// The agent's `--kill-grace-ms`: SIGTERM → SIGKILL of a command it stops, and the shell's
/// time to report back.
const AGENT_KILL_GRACE: Duration = Duration::from_secs(1);
/// SIGTERM → SIGKILL grace when a session ends: longer than the agent's own bounded
/// shutdown, so an agent is SIGKILLed only when it is wedged. The agent exits within drain +
/// 8 kill graces + 2 s of SIGTERM (serving ends by drain + 3 kill graces + 2 s, then up to 3
/// kill graces for the running command to return, one for the shell to die and one for the
/// sweep of what escaped it); one more second for the exit itself.
/// A SIGKILLed agent cannot stop what its shell started: the session's cgroup does.
const STOP_GRACE: Duration = Duration::from_millis(
    AGENT_DRAIN.as_millis() as u64 + 8 * AGENT_KILL_GRACE.as_millis() as u64 + 2_000 + 1_000,
);
/// How long killing a session's cgroup may take before the server gives up on it (the
/// kernel delivers SIGKILL at once; exiting takes a process a few milliseconds).
const CGROUP_KILL_WAIT: Duration = Duration::from_secs(5);
/// The agent's "listening" log line.
const READY_MESSAGE: &str = "cli-mcp-agent ready";
/// Lines of agent stderr kept to explain a failed start.
const START_LOG_LINES: usize = 20;

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

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// One running agent.
#[derive(Debug)]
struct LocalAgent {
    pid: u32,
    uid: String,
    endpoint: String,
    /// Bound to this agent's own nonce: a token of an earlier agent of the session never
    /// opens this one.
    token: Token,
    owner: Option<String>,
    created_at: String,
    last_activity: Mutex<String>,
    dir: PathBuf,
    exited: watch::Receiver<Option<ExitStatus>>,
    /// Set when a call to it failed: the next acquire checks or replaces it.
    suspect: Mutex<Option<Suspicion>>,
}

/// Why a call to an agent failed, as far as it says whether the agent is still good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Suspicion {
    /// The connection failed (refused, or broken before the answer): the agent may be fine
    /// and the failure passing, so it is kept if it still answers `/healthz`.
    Unreached,
    /// The agent answered that it cannot take the session's commands (401, 503: shutting
    /// down), which its `/healthz` would not tell: it is replaced.
    Refused,
}

impl Suspicion {
    fn of(e: &AgentError) -> Self {
        match e {
            AgentError::Connect { .. } | AgentError::Transport { .. } => Self::Unreached,
            _ => Self::Refused,
        }
    }
}

impl LocalAgent {
    fn alive(&self) -> bool {
        self.exited.borrow().is_none()
    }

    fn usable(&self) -> bool {
        self.alive() && self.suspicion().is_none()
    }

    fn suspicion(&self) -> Option<Suspicion> {
        *self.suspect.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a failed call; a refusal is not taken back by a later connection failure.
    fn suspect(&self, why: Suspicion) {
        let mut s = self.suspect.lock().unwrap_or_else(|p| p.into_inner());
        *s = (*s).max(Some(why));
    }

    /// Clears the suspicion if it is still only `Unreached` (no call met a refusal while
    /// `/healthz` was asked); whether it did.
    fn clear_unreached(&self) -> bool {
        let mut s = self.suspect.lock().unwrap_or_else(|p| p.into_inner());
        let clear = *s == Some(Suspicion::Unreached);
        if clear {
            *s = None;
        }
        clear
    }

    /// SIGTERM, then SIGKILL after the grace period.
    async fn stop(&self) {
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

pub struct LocalBackend {
    agent_binary: PathBuf,
    key: HmacKey,
    root: tempfile::TempDir,
    limits: Limits,
    /// Asks a suspect agent's `/healthz` before it is replaced.
    agent: AgentClient,
    sessions: Mutex<HashMap<SessionId, Arc<LocalAgent>>>,
    locks: SessionLocks,
    metrics: Arc<Metrics>,
    next_uid: AtomicU64,
    /// Sessions admitted under `--max-sessions` whose agent is still starting (not yet in
    /// `sessions`). Read and changed only while `sessions` is locked, so the limit check
    /// and the admission are one step.
    starting: AtomicUsize,
    /// Agents stopped by `DELETE`: a call that was running in one must not start the
    /// session again.
    ended: EndedSandboxes,
    /// Where each agent gets a cgroup of its own; `None`: none can be made here.
    cgroups: Option<Cgroups>,
}

impl std::fmt::Debug for LocalBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBackend")
            .field("agent_binary", &self.agent_binary)
            .field("root", &self.root.path())
            .field("cgroups", &self.cgroups)
            .finish()
    }
}

impl LocalBackend {
    pub fn new(
        agent_binary: PathBuf,
        limits: Limits,
        agent: AgentClient,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Self>, std::io::Error> {
        // Sessions' workspaces and agent state (commands, output, journals) are private to
        // the server's user: the root is 0700 (tempfile's default would be 0755 here) and so
        // is every directory created in it.
        let abandoned = remove_abandoned_roots(&std::env::temp_dir());
        if abandoned > 0 {
            tracing::info!(
                removed = abandoned,
                "removed the local sessions' roots of servers that were killed"
            );
        }
        let root = tempfile::Builder::new()
            .prefix(ROOT_PREFIX)
            .permissions(std::fs::Permissions::from_mode(PRIVATE_DIR))
            .tempdir()?;
        std::fs::write(root.path().join(OWNER_FILE), owner_line())?;
        let cgroups = match Cgroups::detect() {
            Ok(c) => {
                tracing::info!(parent = %c.parent.display(),
                    "each local session's processes are kept in a cgroup of their own");
                Some(c)
            }
            Err(why) => {
                tracing::warn!(
                    "local sessions run without a cgroup ({why}): a session's processes that \
                     escaped its shell (setsid, double fork) survive an agent that is SIGKILLed"
                );
                None
            }
        };
        Ok(Arc::new(Self {
            agent_binary,
            key: HmacKey::from_bytes(rand::random()),
            root,
            limits,
            agent,
            sessions: Mutex::new(HashMap::new()),
            locks: SessionLocks::default(),
            metrics,
            next_uid: AtomicU64::new(1),
            starting: AtomicUsize::new(0),
            ended: EndedSandboxes::default(),
            cgroups,
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, Arc<LocalAgent>>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update_gauge(&self) {
        let n = self.lock().len();
        self.metrics.sessions_active.set(n as i64);
    }

    fn sandbox(&self, a: &LocalAgent, started: Option<Launch>, replaced: bool) -> Sandbox {
        Sandbox {
            endpoint: a.endpoint.clone(),
            token: a.token.clone(),
            name: format!("local/{}", a.pid),
            uid: a.uid.clone(),
            started,
            replaced,
        }
    }

    /// The live agent of `sid`, after the ownership check.
    fn live(&self, sid: &SessionId, caller: &Caller) -> Option<Result<Sandbox, SessionError>> {
        let agent = self.lock().get(sid).cloned()?;
        if !agent.usable() {
            return None;
        }
        Some(if owner_allows(agent.owner.as_deref(), caller) {
            Ok(self.sandbox(&agent, None, false))
        } else {
            Err(SessionError::Forbidden(sid.clone()))
        })
    }

    async fn spawn(&self, sid: &SessionId, caller: &Caller) -> Result<LocalAgent, SessionError> {
        let uid = self.next_uid.fetch_add(1, Ordering::Relaxed);
        let dir = self.root.path().join(format!("{sid}-{uid}"));
        let workspace = dir.join("workspace");
        let state = dir.join("state");
        for d in [&workspace, &state] {
            private_dir(d).map_err(|e| {
                SessionError::Sandbox(format!("cannot create {}: {e}", d.display()))
            })?;
        }
        let session_token = self
            .key
            .session_token(sid, &SandboxNonce::from_bytes(rand::random()));
        let token = session_token.commitment().to_hex();
        let mut cmd = Command::new(&self.agent_binary);
        cmd.arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--workdir")
            .arg(&workspace)
            .arg("--state-dir")
            .arg(&state)
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
        cmd.env(ENV_TOKEN_SHA256, token)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let cgroup = match self.cgroups.as_ref().map(|c| c.create(sid, uid)) {
            Some(Ok(dir)) => Some(dir),
            Some(Err(e)) => {
                tracing::warn!(session = %sid, "cannot create the session's cgroup, it runs without: {e}");
                None
            }
            None => None,
        };
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
        let cgroup = cgroup.and_then(|dir| match join_cgroup(&dir, pid) {
            Ok(()) => Some(dir),
            Err(e) => {
                tracing::warn!(session = %sid, "cannot move the agent into its cgroup, it runs without: {e}");
                let _ = std::fs::remove_dir(&dir);
                None
            }
        });
        let Some(stderr) = child.stderr.take() else {
            return Err(SessionError::Sandbox("the agent has no stderr pipe".into()));
        };
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
        let mut lines = BufReader::with_capacity(1024, stderr).lines();
        let listen = match tokio::time::timeout(AGENT_START_TIMEOUT, wait_ready(&mut lines)).await {
            Ok(Ok(addr)) => addr,
            Ok(Err(log)) => {
                return Err(SessionError::Sandbox(format!(
                    "{} exited before it was ready; its log:\n{log}",
                    self.agent_binary.display()
                )))
            }
            Err(_) => {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
                return Err(SessionError::Sandbox(format!(
                    "{} did not report ready within {AGENT_START_TIMEOUT:?}",
                    self.agent_binary.display()
                )));
            }
        };
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

    async fn discard(&self, agent: Arc<LocalAgent>) {
        agent.stop().await;
        let dir = agent.dir.clone();
        let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir)).await;
    }
}

/// An admission in `LocalBackend::starting`, given back when the start failed or the call
/// was dropped.
struct Starting<'a> {
    backend: &'a LocalBackend,
    done: bool,
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _sessions = self.backend.lock();
            self.backend.starting.fetch_sub(1, Ordering::SeqCst);
        }
    }
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

#[async_trait]
impl Backend for LocalBackend {
    async fn acquire(
        &self,
        sid: &SessionId,
        caller: &Caller,
        after: Option<&Sandbox>,
    ) -> Result<Sandbox, SessionError> {
        let deleted = || after.is_some_and(|a| self.ended.contains(&a.uid));
        if deleted() {
            return Err(SessionError::Deleted);
        }
        if let Some(hit) = self.live(sid, caller) {
            return hit;
        }
        let _guard = self.locks.lock(sid).await;
        // A DELETE that held the lock until now has marked its agent first.
        if deleted() {
            return Err(SessionError::Deleted);
        }
        if let Some(hit) = self.live(sid, caller) {
            return hit;
        }
        let t0 = Instant::now();
        // A dead (or unreachable, hence stopped) agent of this session: its state is gone;
        // say so on the next answer.
        let dead = self.lock().get(sid).cloned();
        if let Some(old) = &dead {
            if !owner_allows(old.owner.as_deref(), caller) {
                return Err(SessionError::Forbidden(sid.clone()));
            }
            // A connection that failed once (an agent busy accepting, a pooled connection
            // closed as a request crossed it) is no reason to lose the session's shell: an
            // agent that still answers is kept, as a pod is in a cluster, and the call's
            // retry then goes to the agent that journals its request id.
            if old.suspicion() == Some(Suspicion::Unreached)
                && old.alive()
                && self.agent.healthy(&old.endpoint).await
                && old.clear_unreached()
            {
                tracing::info!(session = %sid, pid = old.pid,
                    "kept a local session agent that answers /healthz after a failed call");
                return Ok(self.sandbox(old, None, false));
            }
        }
        if let Some(old) = dead.clone() {
            self.lock().remove(sid);
            self.discard(old).await;
        }
        {
            let sessions = self.lock();
            if sessions.len() + self.starting.load(Ordering::SeqCst) >= self.limits.max_sessions {
                return Err(SessionError::SessionLimit(Quota::Instance {
                    max: self.limits.max_sessions,
                }));
            }
            self.starting.fetch_add(1, Ordering::SeqCst);
        }
        let mut admitted = Starting {
            backend: self,
            done: false,
        };
        let agent = Arc::new(self.spawn(sid, caller).await?);
        {
            let mut sessions = self.lock();
            sessions.insert(sid.clone(), agent.clone());
            self.starting.fetch_sub(1, Ordering::SeqCst);
            admitted.done = true;
        }
        self.update_gauge();
        self.metrics.started(Launch::Local, t0.elapsed());
        tracing::info!(session = %sid, pid = agent.pid, took_ms = t0.elapsed().as_millis() as u64,
            "local session agent started");
        Ok(self.sandbox(&agent, Some(Launch::Local), dead.is_some()))
    }

    async fn existing(
        &self,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<Option<Sandbox>, SessionError> {
        self.live(sid, caller).transpose()
    }

    fn invalidate(&self, sid: &SessionId, sandbox: &Sandbox, why: &AgentError) {
        // The next acquire keeps it if it was only unreached and answers now, else stops it
        // (if it still runs) and starts a new one.
        if let Some(a) = self.lock().get(sid).filter(|a| a.uid == sandbox.uid) {
            a.suspect(Suspicion::of(why));
        }
    }

    fn ended(&self, _sid: &SessionId, sandbox: &Sandbox) -> bool {
        self.ended.contains(&sandbox.uid)
    }

    fn activity(&self, sid: &SessionId, sandbox: &Sandbox, _event: Activity) {
        let sessions = self.lock();
        if let Some(a) = sessions.get(sid).filter(|a| a.uid == sandbox.uid) {
            *a.last_activity.lock().unwrap_or_else(|p| p.into_inner()) = stamp_now();
        }
    }

    async fn delete(&self, sid: &SessionId, caller: &Caller) -> Result<(), SessionError> {
        let _guard = self.locks.lock(sid).await;
        let agent = self.lock().get(sid).cloned();
        let Some(agent) = agent else {
            return Ok(());
        };
        if !owner_allows(agent.owner.as_deref(), caller) {
            return Err(SessionError::Forbidden(sid.clone()));
        }
        // Marked before it stops, so the call running in it fails instead of starting the
        // session again.
        self.ended.end(&agent.uid);
        self.lock().remove(sid);
        self.update_gauge();
        tracing::info!(session = %sid, pid = agent.pid, "ending local session");
        self.discard(agent).await;
        Ok(())
    }

    async fn list(&self, caller: &Caller) -> Result<Vec<SessionSummary>, SessionError> {
        let sessions = self.lock();
        let mut out: Vec<SessionSummary> = sessions
            .iter()
            .filter(|(_, a)| owner_allows(a.owner.as_deref(), caller))
            .map(|(sid, a)| SessionSummary {
                session_id: sid.to_string(),
                sandbox: format!("local/{}", a.pid),
                launch: Some(Launch::Local.as_str().into()),
                created_at: Some(a.created_at.clone()),
                last_activity: Some(
                    a.last_activity
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .clone(),
                ),
                ready: a.alive(),
            })
            .collect();
        out.sort_by(|a, b| a.session_id.cmp(&b.session_id));
        Ok(out)
    }

    async fn ready(&self) -> Result<(), String> {
        if is_executable(&self.agent_binary) {
            Ok(())
        } else {
            Err(format!(
                "the agent binary {} is gone",
                self.agent_binary.display()
            ))
        }
    }

    async fn shutdown(&self) {
        let all: Vec<Arc<LocalAgent>> = self.lock().drain().map(|(_, a)| a).collect();
        futures::future::join_all(all.into_iter().map(|a| self.discard(a))).await;
        self.update_gauge();
    }
}

/// Each agent in a cgroup (v2) of its own, below the server's: whatever its processes do
/// (`setsid`, double forks, `disown`), they stay in that cgroup, and once the agent has
/// exited — also by SIGKILL, which leaves it no chance to stop its shell — the server kills
/// everything still in it. Without a writable cgroup v2 (an unprivileged user without a
/// delegated subtree, cgroup v1 only), agents run without one, and only the agent's own
/// stop (the shell, then repeated sweeps of the processes below it) ends the session's
/// processes.
#[derive(Debug)]
struct Cgroups {
    /// The server's own cgroup, where the agents' cgroups are made.
    parent: PathBuf,
}

impl Cgroups {
    /// The server's cgroup v2 directory, if there is one it can make cgroups in; else why
    /// not.
    fn detect() -> Result<Self, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
        let own = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .ok_or("this process is in no cgroup v2 hierarchy")?
            .trim()
            .to_owned();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
        let (root, mount) = mounts
            .lines()
            .find_map(cgroup2_mount)
            .ok_or("no cgroup2 file system is mounted")?;
        // The mount shows the hierarchy from `root` down (a container's namespace).
        let rel = Path::new(&own)
            .strip_prefix(&root)
            .map_err(|_| format!("this process's cgroup {own} is outside the mount of {root}"))?;
        let parent = Path::new(&mount).join(rel);
        // Probe: making one is the only test of whether we may.
        let probe = parent.join(format!("cli-mcp-probe-{}", std::process::id()));
        std::fs::create_dir(&probe)
            .map_err(|e| format!("cannot create a cgroup in {}: {e}", parent.display()))?;
        let _ = std::fs::remove_dir(&probe);
        remove_stale_cgroups(&parent);
        Ok(Self { parent })
    }

    /// A new cgroup for agent `uid` of `sid`.
    fn create(&self, sid: &SessionId, uid: u64) -> std::io::Result<PathBuf> {
        let dir = self
            .parent
            .join(format!("cli-mcp-{}-{sid}-{uid}", std::process::id()));
        std::fs::create_dir(&dir)?;
        Ok(dir)
    }
}

/// Removes the empty cgroups that servers which no longer run left in `parent` (a SIGKILLed
/// server empties none; its agents stop by themselves). `rmdir` removes only an empty
/// cgroup, so one still in use, or a live server's, is never touched.
fn remove_stale_cgroups(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("cli-mcp-"))
            .and_then(|n| n.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(e.path());
        }
    }
}

/// `(root, mount point)` of a cgroup2 line of `/proc/self/mountinfo`.
fn cgroup2_mount(line: &str) -> Option<(String, String)> {
    let (fields, fs) = line.split_once(" - ")?;
    if fs.split_whitespace().next()? != "cgroup2" {
        return None;
    }
    let mut f = fields.split_whitespace().skip(3);
    Some((f.next()?.to_owned(), f.next()?.to_owned()))
}

/// Moves `pid` into the cgroup `dir`.
fn join_cgroup(dir: &Path, pid: u32) -> std::io::Result<()> {
    std::fs::write(dir.join("cgroup.procs"), pid.to_string())
}

/// Whether any process is left in the cgroup `dir` (an unreadable one counts as populated).
fn populated(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.events"))
        .map(|e| !e.lines().any(|l| l == "populated 0"))
        .unwrap_or(true)
}

/// SIGKILLs everything in the cgroup `dir`, waits (bounded) until it is empty and removes
/// it. `cgroup.kill` (Linux 5.14) kills the whole cgroup at once, forks racing it included;
/// on older kernels each listed process is killed, again until none is left.
async fn kill_cgroup(dir: &Path) {
    let deadline = Instant::now() + CGROUP_KILL_WAIT;
    let has_kill = std::fs::write(dir.join("cgroup.kill"), "1").is_ok();
    while populated(dir) {
        if Instant::now() >= deadline {
            let left = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            tracing::warn!(cgroup = %dir.display(), left = %left.split_whitespace().collect::<Vec<_>>().join(" "),
                "processes of a stopped session's cgroup are still alive");
            return;
        }
        if !has_kill {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.split_whitespace().filter_map(|p| p.parse().ok()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if let Err(e) = std::fs::remove_dir(dir) {
        tracing::warn!(cgroup = %dir.display(), "cannot remove a stopped session's cgroup: {e}");
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).expect("stat").mode() & 0o7777
    }

    #[test]
    fn only_roots_of_servers_that_ended_here_are_removed() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let dead = child.id();
        child.wait().expect("reap true");
        let ns = pid_namespace();
        let root = |name: &str, owner: Option<String>| {
            let dir = tmp.path().join(name);
            std::fs::create_dir(&dir).expect("mkdir");
            std::fs::write(dir.join("workspace-file"), "x").expect("write");
            if let Some(owner) = owner {
                std::fs::write(dir.join(OWNER_FILE), owner).expect("write owner");
            }
            dir
        };
        let abandoned = root("cli-mcp-local-dead", Some(format!("{dead} {ns}")));
        let running = root("cli-mcp-local-live", Some(owner_line()));
        let elsewhere = root("cli-mcp-local-ns", Some(format!("{dead} pid:[1]")));
        let unnamed = root("cli-mcp-local-none", None);
        let junk = root("cli-mcp-local-junk", Some("not a pid".into()));
        let other = root("not-ours", Some(format!("{dead} {ns}")));
        // A link named like a root, to a directory a dead server owns: neither is touched.
        let target = root("target", Some(format!("{dead} {ns}")));
        std::os::unix::fs::symlink(&target, tmp.path().join("cli-mcp-local-link"))
            .expect("symlink");

        assert_eq!(remove_abandoned_roots(tmp.path()), 1);
        assert!(!abandoned.exists());
        for kept in [&running, &elsewhere, &unnamed, &junk, &other, &target] {
            assert!(kept.join("workspace-file").exists(), "{kept:?} was removed");
        }
        assert!(tmp.path().join("cli-mcp-local-link").is_symlink());
    }

    #[test]
    fn the_cgroup2_mount_is_found_in_mountinfo() {
        let v1 = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu";
        let v2 = "41 31 0:38 /kubepods/pod1 /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw";
        assert_eq!(cgroup2_mount(v1), None);
        assert_eq!(
            cgroup2_mount(v2),
            Some(("/kubepods/pod1".into(), "/sys/fs/cgroup".into()))
        );
        assert_eq!(cgroup2_mount("garbage"), None);
    }

    #[test]
    fn session_directories_are_private() {
        let backend = LocalBackend::new(
            PathBuf::from("/nonexistent/cli-mcp-agent"),
            Limits::default(),
            AgentClient::new(0).expect("client"),
            Arc::new(Metrics::new()),
        )
        .expect("backend");
        let root = backend.root.path();
        let session = root.join("s-1");
        private_dir(&session.join("workspace")).expect("create");
        assert_eq!(
            [mode(root), mode(&session), mode(&session.join("workspace"))],
            [0o700; 3],
            "{}",
            root.display()
        );
    }
}
