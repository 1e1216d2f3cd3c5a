//! The envelope of one tool call, the same for every tool: who calls, in which session, the
//! cancellation a client can ask for, progress when the call asked for it, and exactly one
//! audit record and one metrics record per call. A tool's handler parses its arguments,
//! then runs its body inside the envelope ([`ToolCall::run`]), so a second tool adds only
//! its own body.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use rmcp::model::{CallToolResponse, CallToolResult, ContentBlock};
use rmcp::service::RequestContext;
use rmcp::RoleServer;
use tokio_util::sync::CancellationToken;

use cli_mcp_api::SessionId;

use super::session::{resolve_session, SessionSource};
use super::McpState;
use crate::audit;
use crate::auth::Caller;
use crate::cancel::{CallKey, Registration};
use crate::metrics::{ErrorKind, Metrics, Outcome};
use crate::progress::{self, Reporter};
use crate::sessions::SessionError;

/// The caller of a request, as the auth middleware put it in the request's extensions.
pub fn caller_of(context: &RequestContext<RoleServer>) -> Caller {
    context
        .extensions
        .get::<http::request::Parts>()
        .and_then(|p| p.extensions.get::<Caller>())
        .cloned()
        .unwrap_or_else(Caller::anonymous)
}

/// A tool error the model sees (`isError: true`).
pub fn tool_error(msg: impl Into<String>) -> CallToolResponse {
    CallToolResult::error(vec![ContentBlock::text(msg.into())]).into()
}

/// One running tool call, from its arguments to its result.
pub struct ToolCall<'a> {
    state: &'a McpState,
    context: &'a RequestContext<RoleServer>,
    /// The tool's name, for the log.
    tool: &'static str,
    caller: Caller,
    metrics: Arc<Metrics>,
    t0: Instant,
}

/// What a tool's body runs with: the call's session, its caller, and the token that a
/// cancellation (the client's, or the request's end) cancels.
pub struct Scope {
    pub sid: SessionId,
    pub caller: Caller,
    pub cancel: CancellationToken,
}

/// What a tool's body produced: its result, and what the call's metrics and audit record
/// say of it.
pub struct Done {
    pub result: CallToolResult,
    pub outcome: Outcome,
    pub sandbox: String,
    pub exit_code: Option<i32>,
    pub timed_out: bool,
    pub bytes: u64,
}

impl<'a> ToolCall<'a> {
    /// Starts the clock of a call of `tool` and finds its caller.
    pub fn open(
        state: &'a McpState,
        context: &'a RequestContext<RoleServer>,
        tool: &'static str,
    ) -> Self {
        Self {
            state,
            context,
            tool,
            caller: caller_of(context),
            metrics: state.sessions.metrics().clone(),
            t0: Instant::now(),
        }
    }

    /// Refuses the call before it reached a session (bad arguments, no session).
    pub fn refuse(&self, kind: ErrorKind, msg: String) -> CallToolResponse {
        self.metrics.error(kind);
        self.metrics.exec(Outcome::Error, self.t0.elapsed());
        audit::log(&audit::Record {
            action: "tools/call",
            session: None,
            caller: &self.caller.name,
            duration_ms: self.duration_ms(),
            outcome: kind.as_str(),
            ..Default::default()
        });
        tool_error(msg)
    }

    /// Runs `body` in the call's session (`session_arg`: the tool's `session` argument),
    /// cancellable and with progress, and records the call once, whatever its end.
    /// `command_sha256` is the audit record's hash of what the call runs.
    pub async fn run<F, Fut>(
        self,
        session_arg: Option<&str>,
        command_sha256: Option<&str>,
        body: F,
    ) -> CallToolResponse
    where
        F: FnOnce(Scope) -> Fut,
        Fut: Future<Output = Result<Done, SessionError>>,
    {
        let (sid, source) = match self.session(session_arg) {
            Ok(r) => r,
            Err(msg) => return self.refuse(ErrorKind::BadRequest, msg),
        };
        // rmcp cancels `context.ct` when the client abandons the HTTP request (and, on stdio,
        // on `notifications/cancelled`), but it runs the handler in a task of its own that
        // it never drops: the call must stop by itself. Over HTTP a notification reaches it
        // only through `state.calls`.
        let cancel = self.context.ct.child_token();
        let _running = self.register(&cancel);
        let scope = Scope {
            sid: sid.clone(),
            caller: self.caller.clone(),
            cancel,
        };
        // A body that panics (or a future dropped at shutdown) never reaches `finished` or
        // `failed`; the audit log must still hold the call.
        let unfinished = Unfinished::arm(|| self.abandoned(&sid, command_sha256));
        let end = progress::with_reporter(self.reporter(), body(scope)).await;
        unfinished.disarm();
        match end {
            Ok(done) => self.finished(&sid, source, command_sha256, done),
            Err(e) => self.failed(&sid, command_sha256, e),
        }
    }

    /// Records a call whose body never returned.
    fn abandoned(&self, sid: &SessionId, command_sha256: Option<&str>) {
        self.metrics.exec(Outcome::Error, self.t0.elapsed());
        audit::log(&audit::Record {
            action: "tools/call",
            session: Some(sid.as_str()),
            caller: &self.caller.name,
            command_sha256,
            duration_ms: self.duration_ms(),
            outcome: "abandoned",
            ..Default::default()
        });
    }

    /// The call's session: the stdio transport's own, else from the request's headers, the
    /// `session` argument, or a new handle.
    fn session(&self, argument: Option<&str>) -> Result<(SessionId, SessionSource), String> {
        let parts = self.context.extensions.get::<http::request::Parts>();
        match (&self.state.stdio_session, parts) {
            (Some(sid), _) => match argument {
                Some(arg) if arg != sid.as_str() => Err(format!(
                    "argument `session` {arg:?} differs from this server's session {sid:?}; \
                     omit `session`"
                )),
                _ => Ok((sid.clone(), SessionSource::Header)),
            },
            (None, Some(parts)) => resolve_session(&parts.headers, argument, &self.caller),
            (None, None) => Err("no session: this transport carries no HTTP headers".into()),
        }
    }

    /// Lists the call among the running calls a `notifications/cancelled` can name, until
    /// the returned registration is dropped.
    fn register(&self, cancel: &CancellationToken) -> Option<Registration> {
        let parts = self.context.extensions.get::<http::request::Parts>()?;
        let id = serde_json::to_value(&self.context.id).ok()?;
        let key = CallKey::new(&self.caller, &parts.headers, &id)?;
        Some(self.state.calls.register(key, cancel.clone()))
    }

    /// Only a call that asked for progress (`_meta.progressToken`) follows it.
    fn reporter(&self) -> Option<Reporter> {
        self.context
            .meta
            .get_progress_token()
            .map(|token| Reporter::new(self.context.peer.clone(), token))
    }

    /// Records a call whose body produced a result, and tells a new session's handle.
    fn finished(
        &self,
        sid: &SessionId,
        source: SessionSource,
        command_sha256: Option<&str>,
        done: Done,
    ) -> CallToolResponse {
        self.metrics.exec(done.outcome, self.t0.elapsed());
        audit::log(&audit::Record {
            action: "tools/call",
            session: Some(sid.as_str()),
            caller: &self.caller.name,
            command_sha256,
            sandbox: Some(&done.sandbox),
            exit_code: done.exit_code,
            timed_out: done.timed_out,
            bytes: done.bytes,
            duration_ms: self.duration_ms(),
            outcome: done.outcome.as_str(),
        });
        let mut result = done.result;
        if source == SessionSource::New {
            result.content.push(ContentBlock::text(format!(
                "[new session {sid}: pass \"session\": \"{sid}\" in your next bash calls to \
                 keep this shell, its directory and variables]"
            )));
        }
        result.into()
    }

    /// Records a call that did not reach a result (an error, or a cancellation).
    fn failed(
        &self,
        sid: &SessionId,
        command_sha256: Option<&str>,
        e: SessionError,
    ) -> CallToolResponse {
        let kind = e.kind();
        let result = match kind {
            Some(kind) => {
                self.metrics.error(kind);
                Outcome::Error
            }
            None => Outcome::Cancelled,
        };
        self.metrics.exec(result, self.t0.elapsed());
        audit::log(&audit::Record {
            action: "tools/call",
            session: Some(sid.as_str()),
            caller: &self.caller.name,
            command_sha256,
            duration_ms: self.duration_ms(),
            outcome: kind.map_or(result.as_str(), ErrorKind::as_str),
            ..Default::default()
        });
        tracing::info!(session = %sid, error = %e, "{} call failed", self.tool);
        tool_error(e.to_string())
    }

    fn duration_ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }
}

/// Runs its closure when dropped still armed: on a panic's unwinding, or when the future
/// holding it is dropped before it was disarmed.
struct Unfinished<F: FnOnce()> {
    on_drop: Option<F>,
}

impl<F: FnOnce()> Unfinished<F> {
    fn arm(on_drop: F) -> Self {
        Self {
            on_drop: Some(on_drop),
        }
    }

    fn disarm(mut self) {
        self.on_drop = None;
    }
}

impl<F: FnOnce()> Drop for Unfinished<F> {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unfinished_call_is_recorded_on_a_panic_and_a_finished_one_is_not() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let recorded = AtomicUsize::new(0);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _guard = Unfinished::arm(|| {
                recorded.fetch_add(1, Ordering::SeqCst);
            });
            panic!("the tool's body");
        }));
        assert!(panicked.is_err());
        assert_eq!(recorded.load(Ordering::SeqCst), 1, "recorded on the panic");
        Unfinished::arm(|| {
            recorded.fetch_add(1, Ordering::SeqCst);
        })
        .disarm();
        assert_eq!(
            recorded.load(Ordering::SeqCst),
            1,
            "not recorded once disarmed"
        );
    }
}
