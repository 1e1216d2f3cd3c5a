//! Sessions: which sandbox serves a session id, and running a command there.
//!
//! A [`Backend`] finds or starts the sandbox of a session ([`kubernetes`]: pods of the
//! instance; [`local`]: agent processes on loopback). [`SessionManager`] is the backend-neutral
//! part of a call: send the command to the agent, rediscover once when a cached sandbox
//! stopped answering, and work out whether the session's state was reset.
//! It also reads a session's files beside its commands (`files`).

mod files;
pub mod kubernetes;
pub mod local;
pub mod locks;

pub use files::FileError;

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use cli_mcp_api::token::Token;
use cli_mcp_api::wire::{ExecRequest, ExecResponse};
use cli_mcp_api::SessionId;

use crate::agent_client::{AgentClient, AgentError};
use crate::auth::Caller;
use crate::metrics::{ErrorKind, Launch, Metrics};

/// Where one session's agent is, as found by a backend.
#[derive(Debug, Clone)]
pub struct Sandbox {
    /// `http://ip:port` of the agent.
    pub endpoint: String,
    /// The session token the agent expects.
    pub token: Token,
    /// Pod name, or `local/<pid>`.
    pub name: String,
    /// Identity of this incarnation (pod UID; a per-process id locally).
    pub uid: String,
    /// Set when this call started the sandbox.
    pub started: Option<Launch>,
    /// Set when the session had another sandbox before that is gone now (known to this
    /// server), so the shell state was reset.
    pub replaced: bool,
}

/// The moment of a command, for the idle clock (`last-activity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activity {
    Start,
    End,
}

/// One session as listed by `GET /sessions`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SessionSummary {
    pub session_id: String,
    /// Pod name (kubernetes) or `local/<pid>`.
    pub sandbox: String,
    /// `warm`, `cold` or `local`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub launch: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_activity: Option<String>,
    pub ready: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("session {0} belongs to another identity; use your own session id")]
    Forbidden(SessionId),
    /// A new session refused by a quota (which one, its value, when to retry).
    #[error("{0}")]
    SessionLimit(Quota),
    #[error("the sandbox of this session could not be started: {0}")]
    Sandbox(String),
    #[error("the sandbox's agent is restarting (its container crashed or was killed, so the session's shell state is reset): {0}; retry the call")]
    Restarting(String),
    /// The API did not answer, or answered that it cannot now (429, 5xx): passing.
    #[error("the Kubernetes API failed: {0}")]
    Kubernetes(String),
    /// The API answered no (authentication, RBAC, an invalid request), or this server
    /// cannot talk to it at all (its credentials): a retry gets the same.
    #[error("the Kubernetes API refused: {0}; the same call gets the same answer until the server's setup (its Role, the instance) is fixed")]
    KubernetesRefused(String),
    #[error("the session's sandbox went away while this command was running ({0}); the session now has a fresh sandbox (working directory, variables and functions were reset). The command was not run again: whether it finished, partly ran or never started is unknown, so check its effects before running it again")]
    Interrupted(String),
    #[error("{0}")]
    Agent(AgentError),
    #[error("another command of this session is still running; wait for it to finish, or use a separate session id for parallel work")]
    Busy,
    #[error("the session was deleted (DELETE /sessions/{{id}}) while this command ran, so the command was stopped with its sandbox and the session was not started again. Whether the command finished, partly ran or never started is unknown; a new call with this session id starts a fresh session")]
    Deleted,
    /// The client cancelled the call (`notifications/cancelled`, or it abandoned the HTTP
    /// request): the agent request was dropped, so the agent interrupts the command.
    #[error("the call was cancelled by the client; the command was interrupted as with Ctrl-C and the shell kept its state")]
    Cancelled,
}

/// The quota that refused a new session; its text names the limit, its value and when to
/// retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Quota {
    /// `--max-sessions`: the instance's sessions, across every server replica.
    Instance { max: usize },
    /// `--max-sessions-per-client`: one identity's sessions, across every server replica.
    Client { max: usize },
    /// `--new-sessions-per-minute-per-client`: one identity's new sessions on this replica.
    Rate {
        per_minute: u32,
        retry_after: Duration,
    },
}

impl std::fmt::Display for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const WHEN: &str = "retry when a session ends: end one with DELETE /sessions/{id}, or \
                            wait for idle sessions to be collected";
        match self {
            Quota::Instance { max } => write!(
                f,
                "this instance already has {max} sessions (its limit: maxSessions, the \
                 server's --max-sessions); {WHEN}"
            ),
            Quota::Client { max } => write!(
                f,
                "you already have {max} sessions on this instance (the per-client limit: \
                 maxSessionsPerClient, the server's --max-sessions-per-client); retry when \
                 one of yours ends: end one with DELETE /sessions/{{id}}, or wait for your idle \
                 sessions to be collected"
            ),
            Quota::Rate {
                per_minute,
                retry_after,
            } => write!(
                f,
                "you started {per_minute} new sessions within the last minute (the per-client \
                 rate: newSessionsPerMinutePerClient, the server's \
                 --new-sessions-per-minute-per-client, counted per server replica); retry \
                 after ~{}s, or keep using a session you have",
                retry_after.as_secs_f64().ceil().max(1.0) as u64
            ),
        }
    }
}

impl SessionError {
    /// What `cli_mcp_errors_total` counts this as; `None` for a cancelled call, which is an
    /// outcome of the call (`cancelled`), not a failure.
    pub fn kind(&self) -> Option<ErrorKind> {
        Some(match self {
            SessionError::Forbidden(_) => ErrorKind::Forbidden,
            SessionError::SessionLimit { .. } => ErrorKind::SessionLimit,
            SessionError::Sandbox(_)
            | SessionError::Restarting(_)
            | SessionError::Interrupted(_)
            | SessionError::Deleted => ErrorKind::Sandbox,
            SessionError::Kubernetes(_) | SessionError::KubernetesRefused(_) => {
                ErrorKind::KubernetesApi
            }
            SessionError::Agent(_) => ErrorKind::Agent,
            SessionError::Busy => ErrorKind::Busy,
            SessionError::Cancelled => return None,
        })
    }
}

impl From<kube::Error> for SessionError {
    fn from(e: kube::Error) -> Self {
        match e {
            // It did not answer (restart, network): transient; sessions that already have a
            // sandbox keep working meanwhile.
            kube::Error::Service(_) | kube::Error::HyperError(_) => {
                SessionError::Kubernetes(format!(
                    "it is unreachable right now ({e}); existing sessions keep working, new \
                     ones need it: retry shortly"
                ))
            }
            // Overloaded or failing for now, or an object that changed or went in between
            // (a race with another replica, a pod deleted meanwhile): the next try differs.
            kube::Error::Api(ref s) if matches!(s.code, 404 | 409 | 410 | 429) || s.code >= 500 => {
                SessionError::Kubernetes(format!("{e}; retry shortly"))
            }
            // An answer that will not change by itself (RBAC, an invalid object, ...), or a
            // problem of this server's own (a body it cannot parse, its credentials): shown
            // as it is, and not worth a retry.
            other => SessionError::KubernetesRefused(other.to_string()),
        }
    }
}

/// Finds, starts, lists and deletes sandboxes.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The sandbox of `sid`, started if there is none. Fails with `Forbidden` when the
    /// session belongs to another identity.
    ///
    /// `after` is set on a call's retry: the sandbox the call just failed to reach. When that
    /// sandbox was ended on purpose (`DELETE /sessions/{id}`, here or on another replica),
    /// the call fails with [`SessionError::Deleted`] and nothing is looked up or started:
    /// a deleted session stays deleted until a call made after the deletion.
    async fn acquire(
        &self,
        sid: &SessionId,
        caller: &Caller,
        after: Option<&Sandbox>,
    ) -> Result<Sandbox, SessionError>;
    /// The sandbox `sid` has now, if any; never starts, adopts or repairs one (reading a
    /// session's files must not bring a deleted session back). Fails with `Forbidden` when
    /// the session belongs to another identity.
    async fn existing(
        &self,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<Option<Sandbox>, SessionError> {
        let _ = (sid, caller);
        Err(SessionError::Sandbox(
            "this backend cannot look a session up without starting it".into(),
        ))
    }
    /// Forgets `sandbox` as the route of `sid` (a call to it failed with `why`, an error
    /// [`AgentError::is_rediscoverable`] accepts); the next `acquire` looks again and reports
    /// a replacement when it finds another one.
    fn invalidate(&self, sid: &SessionId, sandbox: &Sandbox, why: &AgentError);
    /// Resolves with why `sandbox`'s container stopped, once the backend sees it stop after
    /// this call (never, for a backend that cannot tell): a call in flight to it is then
    /// answered at once instead of when its timeout runs out.
    fn stopped(&self, sandbox: &Sandbox) -> futures::future::BoxFuture<'static, String> {
        let _ = sandbox;
        Box::pin(std::future::pending())
    }
    /// A command starts or ends in `sandbox` (never blocks; stamping happens elsewhere).
    fn activity(&self, sid: &SessionId, sandbox: &Sandbox, event: Activity);
    /// Whether `sandbox` was ended on purpose (`DELETE /sessions/{id}`), as far as this
    /// replica knows.
    fn ended(&self, sid: &SessionId, sandbox: &Sandbox) -> bool;
    /// Ends the session (idempotent: an unknown session is fine).
    async fn delete(&self, sid: &SessionId, caller: &Caller) -> Result<(), SessionError>;
    /// The caller's sessions (all sessions when auth is off).
    async fn list(&self, caller: &Caller) -> Result<Vec<SessionSummary>, SessionError>;
    /// `Err(reason)` while the backend cannot serve (readiness probe).
    async fn ready(&self) -> Result<(), String>;
    /// Stops what the backend started (local agent processes).
    async fn shutdown(&self);
}

/// What one command produced, plus what the caller must know about the session.
#[derive(Debug, Clone)]
pub struct ExecOutcome {
    pub response: ExecResponse,
    /// Set when this call started the session's sandbox.
    pub started: Option<Launch>,
    /// Why the session's state was reset, when it was.
    pub reset: Option<String>,
    pub sandbox: String,
}

pub const RESET_REPLACED: &str = "the session's sandbox was replaced (the previous one was deleted, evicted, idle-collected or crashed), so its working directory, variables and functions were reset";
pub const RESET_SHELL: &str = "the session's shell restarted (see stderr), so its working directory, variables and functions were reset";

/// Backend-neutral command execution.
pub struct SessionManager {
    backend: Arc<dyn Backend>,
    agent: AgentClient,
    metrics: Arc<Metrics>,
}

impl SessionManager {
    pub fn new(backend: Arc<dyn Backend>, agent: AgentClient, metrics: Arc<Metrics>) -> Self {
        Self {
            backend,
            agent,
            metrics,
        }
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Runs `command` in the session's sandbox. On a transport error or a 401/503 from the
    /// sandbox, the route is invalidated and rediscovered once; a retry on the same sandbox
    /// reuses the request id, so the agent answers it from its journal instead of running
    /// the command twice. A command that may have run on a sandbox that was then replaced
    /// is not sent to the replacement: the caller is told its effects are unknown.
    ///
    /// `cancel` stops the call ([`SessionError::Cancelled`]): a running command's agent
    /// request is dropped, so the agent interrupts the command (Ctrl-C, the shell kept) and
    /// takes the session's next command at once. A sandbox being started is started all
    /// the same (dropping that halfway could leave a pod or process nobody tracks), and then
    /// nothing is sent to it.
    pub async fn exec(
        &self,
        sid: &SessionId,
        caller: &Caller,
        command: String,
        timeout: Duration,
        cancel: &CancellationToken,
    ) -> Result<ExecOutcome, SessionError> {
        let mut sandbox = self.backend.acquire(sid, caller, None).await?;
        if cancel.is_cancelled() {
            return Err(SessionError::Cancelled);
        }
        let req = ExecRequest {
            command,
            timeout_ms: Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)),
            request_id: Some(request_id()),
        };
        let mut replaced = sandbox.replaced;
        let mut result = self.run(sid, &sandbox, &req, timeout, cancel).await?;
        if let Err(e @ AgentError::Stopped { .. }) = &result {
            // Not tried again: the command may have run, and its sandbox is restarting. The
            // next call looks the session up afresh.
            self.backend.invalidate(sid, &sandbox, e);
        }
        if let Err(e) = &result {
            if e.is_rediscoverable() {
                tracing::warn!(session = %sid, sandbox = %sandbox.name, error = %e,
                    "sandbox did not answer; rediscovering the session once");
                self.backend.invalidate(sid, &sandbox, e);
                // Never starts the session again when the sandbox was deleted meanwhile.
                let again = self.backend.acquire(sid, caller, Some(&sandbox)).await?;
                if cancel.is_cancelled() {
                    return Err(SessionError::Cancelled);
                }
                // The same request id protects a retry only on the same sandbox (its agent
                // journals requests); a replacement pod has no record of it and would run
                // the command a second time.
                if again.uid != sandbox.uid && e.may_have_run() {
                    return Err(SessionError::Interrupted(format!(
                        "{} was replaced by {}",
                        sandbox.name, again.name
                    )));
                }
                replaced |= again.replaced || again.uid != sandbox.uid;
                let started = sandbox.started.or(again.started);
                sandbox = Sandbox { started, ..again };
                result = self.run(sid, &sandbox, &req, timeout, cancel).await?;
                if let Err(e) = &result {
                    if e.is_rediscoverable() {
                        self.backend.invalidate(sid, &sandbox, e);
                    }
                }
            }
        }
        if deleted_meanwhile(&result, self.backend.ended(sid, &sandbox)) {
            return Err(SessionError::Deleted);
        }
        let response = result.map_err(|e| {
            if e.is_busy() {
                SessionError::Busy
            } else {
                SessionError::Agent(e)
            }
        })?;
        let reset = if replaced {
            Some(RESET_REPLACED.to_owned())
        } else if response.shell_restarted {
            Some(RESET_SHELL.to_owned())
        } else {
            None
        };
        if reset.is_some() {
            self.metrics.state_resets.inc();
        }
        Ok(ExecOutcome {
            response,
            started: sandbox.started,
            reset,
            sandbox: sandbox.name,
        })
    }
}

/// Exit code of a command the agent interrupted (128 + SIGINT), as it does when it is
/// stopped before the command finished.
const EXIT_INTERRUPTED: i32 = 130;

/// Whether a call's result is the deletion of its sandbox rather than its command's own
/// result: the sandbox was ended by `DELETE`, and the call failed to reach it or the agent
/// interrupted the command as it stopped. A command that finished before the deletion keeps
/// its answer.
fn deleted_meanwhile(result: &Result<ExecResponse, AgentError>, ended: bool) -> bool {
    ended
        && match result {
            Ok(r) => r.exit_code == EXIT_INTERRUPTED,
            Err(e) => !e.is_busy(),
        }
}

/// Uids of sandboxes ended on purpose (`DELETE /sessions/{id}`), so that a call whose
/// sandbox went that way does not start the session again. Bounded: past `capacity` the
/// oldest are forgotten (a call would have to outlive that many deletions to miss its own).
#[derive(Debug)]
pub struct EndedSandboxes {
    inner: Mutex<(HashSet<String>, VecDeque<String>)>,
    capacity: usize,
}

impl Default for EndedSandboxes {
    fn default() -> Self {
        Self::new(4096)
    }
}

impl EndedSandboxes {
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Mutex::new((HashSet::new(), VecDeque::new())),
            capacity: capacity.max(1),
        }
    }

    /// Records that the sandbox `uid` was ended on purpose.
    pub fn end(&self, uid: &str) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (set, order) = &mut *inner;
        if !set.insert(uid.to_owned()) {
            return;
        }
        order.push_back(uid.to_owned());
        while order.len() > self.capacity {
            if let Some(old) = order.pop_front() {
                set.remove(&old);
            }
        }
    }

    pub fn contains(&self, uid: &str) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .contains(uid)
    }
}

impl SessionManager {
    /// One request to the agent, with the activity clock started before and stopped after,
    /// also when the call is cancelled halfway. Cancelling drops the request, which closes
    /// its connection: that is how the agent learns that its caller went away.
    async fn run(
        &self,
        sid: &SessionId,
        sandbox: &Sandbox,
        req: &ExecRequest,
        timeout: Duration,
        cancel: &CancellationToken,
    ) -> Result<Result<ExecResponse, AgentError>, SessionError> {
        let _clock = ActivityClock::start(self.backend.as_ref(), sid, sandbox);
        let request = self
            .agent
            .exec(&sandbox.endpoint, &sandbox.token, req, timeout);
        let stopped = self.backend.stopped(sandbox);
        tokio::select! {
            // An answer that is there already wins over a cancel that came with it.
            biased;
            answer = request => Ok(answer),
            _ = cancel.cancelled() => Err(SessionError::Cancelled),
            reason = stopped => Ok(Err(AgentError::Stopped { reason })),
        }
    }
}

/// Records `Activity::Start` now and `Activity::End` when dropped.
struct ActivityClock<'a> {
    backend: &'a dyn Backend,
    sid: &'a SessionId,
    sandbox: &'a Sandbox,
}

impl<'a> ActivityClock<'a> {
    fn start(backend: &'a dyn Backend, sid: &'a SessionId, sandbox: &'a Sandbox) -> Self {
        backend.activity(sid, sandbox, Activity::Start);
        Self {
            backend,
            sid,
            sandbox,
        }
    }
}

impl Drop for ActivityClock<'_> {
    fn drop(&mut self) {
        self.backend.activity(self.sid, self.sandbox, Activity::End);
    }
}

/// 16 random hex characters: the agent's replay key for one tool call.
fn request_id() -> String {
    let bytes: [u8; 8] = rand::random();
    hex::encode(bytes)
}

/// Whether `caller` may use a sandbox whose owner annotation is `pod_owner`. With auth off
/// (no caller owner) every session is reachable; with auth on only an exact match is.
pub fn owner_allows(pod_owner: Option<&str>, caller: &Caller) -> bool {
    match &caller.owner {
        None => true,
        Some(mine) => pod_owner == Some(mine.as_str()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records activity events; never has a sandbox.
    #[derive(Default)]
    struct Recorder(Mutex<Vec<Activity>>);

    #[async_trait]
    impl Backend for Recorder {
        async fn acquire(
            &self,
            sid: &SessionId,
            _: &Caller,
            _: Option<&Sandbox>,
        ) -> Result<Sandbox, SessionError> {
            Err(SessionError::Forbidden(sid.clone()))
        }
        fn invalidate(&self, _: &SessionId, _: &Sandbox, _: &AgentError) {}
        fn ended(&self, _: &SessionId, _: &Sandbox) -> bool {
            false
        }
        fn activity(&self, _: &SessionId, _: &Sandbox, event: Activity) {
            self.0.lock().expect("lock").push(event);
        }
        async fn delete(&self, _: &SessionId, _: &Caller) -> Result<(), SessionError> {
            Ok(())
        }
        async fn list(&self, _: &Caller) -> Result<Vec<SessionSummary>, SessionError> {
            Ok(vec![])
        }
        async fn ready(&self) -> Result<(), String> {
            Ok(())
        }
        async fn shutdown(&self) {}
    }

    /// A cancelled call ends at once, closes its connection to the agent (which is how the
    /// agent learns to interrupt the command), and still stops the activity clock.
    #[tokio::test]
    async fn a_cancelled_call_ends_at_once_and_closes_its_agent_connection() {
        use tokio::io::AsyncReadExt;
        let backend = Arc::new(Recorder::default());
        let mgr = SessionManager::new(
            backend.clone(),
            AgentClient::new(1024).expect("client"),
            Arc::new(Metrics::new()),
        );
        let sid = SessionId::parse("s").expect("valid");
        // An agent that reads the request and never answers; it reports when its caller
        // closes the connection.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let endpoint = format!("http://{}", silent.local_addr().expect("addr"));
        let (got_request, request_seen) = tokio::sync::oneshot::channel();
        let (closed_tx, closed) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let Ok((mut conn, _)) = silent.accept().await else {
                return;
            };
            let mut buf = [0u8; 4096];
            let mut got_request = Some(got_request);
            loop {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        if let Some(tx) = got_request.take() {
                            let _ = tx.send(());
                        }
                    }
                }
            }
            let _ = closed_tx.send(());
        });
        let sandbox = Sandbox {
            endpoint,
            token: cli_mcp_api::token::HmacKey::from_bytes([1; 32])
                .session_token(&sid, &cli_mcp_api::token::SandboxNonce::from_bytes([2; 16])),
            name: "p".into(),
            uid: "u".into(),
            started: None,
            replaced: false,
        };
        let req = ExecRequest {
            command: "sleep 30".into(),
            timeout_ms: None,
            request_id: None,
        };
        let cancel = CancellationToken::new();
        let canceller = {
            let cancel = cancel.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(10), request_seen)
                    .await
                    .expect("the request reaches the agent within 10 s")
                    .expect("the agent reports the request");
                cancel.cancel();
                std::time::Instant::now()
            }
        };
        let (answer, cancelled_at) = tokio::time::timeout(Duration::from_secs(20), async {
            tokio::join!(
                mgr.run(&sid, &sandbox, &req, Duration::from_secs(60), &cancel),
                canceller
            )
        })
        .await
        .expect("the cancelled call ends");
        let took = cancelled_at.elapsed();
        assert!(matches!(answer, Err(SessionError::Cancelled)), "{answer:?}");
        assert!(
            took < Duration::from_secs(1),
            "the call ended {took:?} after its cancel"
        );
        tokio::time::timeout(Duration::from_secs(5), closed)
            .await
            .expect("the agent's connection is closed within 5 s of the cancel")
            .expect("the agent reports the close");
        assert_eq!(
            *backend.0.lock().expect("lock"),
            vec![Activity::Start, Activity::End]
        );
    }

    #[test]
    fn ownership() {
        let anon = Caller::anonymous();
        let alice = Caller::identified("alice");
        assert!(owner_allows(None, &anon));
        assert!(owner_allows(Some("x"), &anon));
        assert!(!owner_allows(None, &alice));
        assert!(!owner_allows(Some("x"), &alice));
        assert!(owner_allows(alice.owner.as_deref(), &alice));
    }

    #[test]
    fn request_ids_differ() {
        assert_ne!(request_id(), request_id());
        assert_eq!(request_id().len(), 16);
    }

    #[test]
    fn an_unreachable_api_says_retry_and_an_api_answer_does_not() {
        let down = SessionError::from(kube::Error::Service(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "connection refused",
        ))));
        let msg = down.to_string();
        assert!(
            msg.starts_with("the Kubernetes API failed: it is unreachable right now"),
            "{msg}"
        );
        assert!(msg.contains("retry shortly"), "{msg}");
        let status = kube::core::Status::failure("pods is forbidden", "Forbidden").with_code(403);
        let msg = SessionError::from(kube::Error::Api(Box::new(status))).to_string();
        assert!(msg.contains("forbidden") && !msg.contains("retry"), "{msg}");
    }

    /// First `acquire`: sandbox "a" at `a`; later ones: "b" at `b` (the pod was replaced).
    /// With `deleted`, sandbox "a" was ended by DELETE while the call ran.
    struct Swapper {
        calls: Mutex<usize>,
        a: String,
        b: String,
        deleted: EndedSandboxes,
    }

    impl Swapper {
        fn new(a: String, b: String) -> Self {
            Self {
                calls: Mutex::new(0),
                a,
                b,
                deleted: EndedSandboxes::new(8),
            }
        }
    }

    #[async_trait]
    impl Backend for Swapper {
        async fn acquire(
            &self,
            sid: &SessionId,
            _: &Caller,
            after: Option<&Sandbox>,
        ) -> Result<Sandbox, SessionError> {
            if after.is_some_and(|a| self.deleted.contains(&a.uid)) {
                return Err(SessionError::Deleted);
            }
            let mut n = self.calls.lock().expect("lock");
            *n += 1;
            let (name, endpoint) = if *n == 1 {
                ("a", &self.a)
            } else {
                ("b", &self.b)
            };
            Ok(Sandbox {
                endpoint: endpoint.clone(),
                token: cli_mcp_api::token::HmacKey::from_bytes([1; 32])
                    .session_token(sid, &cli_mcp_api::token::SandboxNonce::from_bytes([2; 16])),
                name: name.into(),
                uid: name.into(),
                started: None,
                replaced: false,
            })
        }
        fn invalidate(&self, _: &SessionId, _: &Sandbox, _: &AgentError) {}
        fn ended(&self, _: &SessionId, sandbox: &Sandbox) -> bool {
            self.deleted.contains(&sandbox.uid)
        }
        fn activity(&self, _: &SessionId, _: &Sandbox, _: Activity) {}
        async fn delete(&self, _: &SessionId, _: &Caller) -> Result<(), SessionError> {
            Ok(())
        }
        async fn list(&self, _: &Caller) -> Result<Vec<SessionSummary>, SessionError> {
            Ok(vec![])
        }
        async fn ready(&self) -> Result<(), String> {
            Ok(())
        }
        async fn shutdown(&self) {}
    }

    /// "a" takes requests and drops them unanswered (its sandbox went away mid-command);
    /// "b" counts the requests it receives and never answers.
    async fn dying_and_counting() -> (String, String, Arc<std::sync::atomic::AtomicUsize>) {
        use tokio::io::AsyncReadExt;
        let a = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let a_addr = a.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = a.accept().await {
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf).await;
                drop(conn);
            }
        });
        let b = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let b_addr = b.local_addr().expect("addr");
        let reached_b = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = reached_b.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = b.accept().await {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let _keep = conn;
                    std::future::pending::<()>().await;
                });
            }
        });
        (
            format!("http://{a_addr}"),
            format!("http://{b_addr}"),
            reached_b,
        )
    }

    #[tokio::test]
    async fn a_command_that_may_have_run_is_not_sent_to_a_replacement_sandbox() {
        let (a, b, reached_b) = dying_and_counting().await;
        let mgr = SessionManager::new(
            Arc::new(Swapper::new(a, b)),
            AgentClient::new(1024).expect("client"),
            Arc::new(Metrics::new()),
        );
        let sid = SessionId::parse("s").expect("valid");
        let r = mgr
            .exec(
                &sid,
                &Caller::anonymous(),
                "touch /x".into(),
                Duration::from_secs(1),
                &CancellationToken::new(),
            )
            .await;
        let e = r.expect_err("the call must fail");
        assert!(matches!(e, SessionError::Interrupted(_)), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("not run again") && msg.contains("reset"),
            "{msg}"
        );
        assert_eq!(
            reached_b.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "the command was sent to the replacement sandbox"
        );
    }

    #[tokio::test]
    async fn a_call_whose_sandbox_was_deleted_fails_and_starts_nothing() {
        let (a, b, reached_b) = dying_and_counting().await;
        let backend = Arc::new(Swapper::new(a, b));
        backend.deleted.end("a");
        let mgr = SessionManager::new(
            backend.clone(),
            AgentClient::new(1024).expect("client"),
            Arc::new(Metrics::new()),
        );
        let sid = SessionId::parse("s").expect("valid");
        let e = mgr
            .exec(
                &sid,
                &Caller::anonymous(),
                "sleep 30".into(),
                Duration::from_secs(1),
                &CancellationToken::new(),
            )
            .await
            .expect_err("the call must fail");
        assert!(matches!(e, SessionError::Deleted), "{e}");
        assert!(
            e.to_string().contains("deleted") && e.to_string().contains("not started again"),
            "{e}"
        );
        assert_eq!(
            *backend.calls.lock().expect("lock"),
            1,
            "the retry acquired (and could have started) a sandbox"
        );
        assert_eq!(reached_b.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    #[test]
    fn only_a_deleted_sandbox_turns_a_result_into_deleted() {
        let answer = |exit_code| {
            Ok(ExecResponse {
                stdout: String::new(),
                stderr: String::new(),
                stdout_encoding: Default::default(),
                stderr_encoding: Default::default(),
                exit_code,
                duration_ms: 0,
                timed_out: false,
                truncated: false,
                total_bytes: 0,
                cwd: "/".into(),
                shell_restarted: false,
            })
        };
        let broken: Result<ExecResponse, AgentError> = Err(AgentError::Transport {
            endpoint: "http://a".into(),
            detail: "connection reset".into(),
        });
        // The sandbox was ended by DELETE: a broken call or an interrupted command is the
        // deletion; a command that finished first keeps its answer.
        assert!(deleted_meanwhile(&broken, true));
        assert!(deleted_meanwhile(&answer(EXIT_INTERRUPTED), true));
        assert!(!deleted_meanwhile(&answer(0), true));
        assert!(!deleted_meanwhile(&answer(1), true));
        // Not deleted: results are what they are.
        assert!(!deleted_meanwhile(&broken, false));
        assert!(!deleted_meanwhile(&answer(EXIT_INTERRUPTED), false));
    }

    #[test]
    fn ended_sandboxes_are_bounded_and_forget_the_oldest_first() {
        let e = EndedSandboxes::new(3);
        for uid in ["u1", "u2", "u3"] {
            e.end(uid);
        }
        e.end("u2"); // again: no second entry
        assert!(["u1", "u2", "u3"].iter().all(|u| e.contains(u)));
        e.end("u4");
        assert!(!e.contains("u1"), "the oldest is forgotten first");
        assert!(["u2", "u3", "u4"].iter().all(|u| e.contains(u)));
        assert!(!e.contains("never"));
    }
}
