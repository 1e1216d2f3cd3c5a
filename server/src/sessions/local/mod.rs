//! The `local` backend: each session is a `cli-mcp-agent` child process on loopback, with the
//! same token scheme as in a cluster (a random HMAC key per server process).
//!
//! For development and the quick start only: the agents run as the server's user, on the
//! server's machine, with its environment and file system. **Nothing is isolated.**
//!
//! - this module: the backend (sessions, admission under `--max-sessions`, `DELETE`);
//! - `agent`: one running agent and how it is stopped; `spawn`: starting one;
//! - `roots`: the backend's private root directory; `cgroups`: a cgroup per agent.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;

use cli_mcp_api::activity::stamp_now;
use cli_mcp_api::token::HmacKey;
use cli_mcp_api::SessionId;

use super::locks::SessionLocks;
use super::{
    owner_allows, Activity, Backend, EndedSandboxes, Quota, Sandbox, SessionError, SessionSummary,
};
use crate::agent_client::{AgentClient, AgentError};
use crate::auth::Caller;
use crate::limits::Limits;
use crate::metrics::{Launch, Metrics};

mod agent;
mod cgroups;
mod roots;
mod spawn;

pub use self::agent::{find_agent_binary, AGENT_BINARY_NAME};
use self::agent::{is_executable, LocalAgent, Suspicion};
use self::cgroups::Cgroups;
use self::roots::{owner_line, remove_abandoned_roots, OWNER_FILE, PRIVATE_DIR, ROOT_PREFIX};

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

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;

    use super::roots::private_dir;
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).expect("stat").mode() & 0o7777
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
