//! The MCP tool handler: one tool, `bash`.
//!
//! Each HTTP request gets its own handler value (stateless Streamable HTTP); all state is in
//! [`McpState`]. The session comes from the `X-Session-ID` header (or `--session-id` on
//! stdio), the caller from the auth middleware (request extensions).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    JsonObject, ListResourceTemplatesResult, ListResourcesResult, ListToolsResult,
    PaginatedRequestParams, ReadResourceRequestParams, ReadResourceResponse, Resource,
    ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{json, Value};

use cli_mcp_api::wire::ExecResponse;
use cli_mcp_api::SessionId;

use crate::audit;
use crate::auth::Caller;
use crate::cancel::{CallKey, RunningCalls};
use crate::cli::Limits;
use crate::metrics::{ErrorKind, Outcome};
use crate::progress::{self, Reporter};
use crate::render::{render, BashOutput};
use crate::resources;
use crate::sessions::SessionManager;

pub const TOOL_NAME: &str = "bash";
pub const SESSION_HEADER: &str = "x-session-id";
/// The MCP session header of the handshake-era Streamable HTTP transport.
pub const MCP_SESSION_HEADER: &str = "mcp-session-id";
/// The tool argument that carries a chat's session handle (2026-07-28 clients).
pub const SESSION_ARG: &str = "session";
/// Hex characters of the owner hash at the start of a handle.
const HANDLE_OWNER_HEX: usize = 16;
/// Random hex characters of a handle (128 bits).
const HANDLE_RANDOM_HEX: usize = 32;

/// What the model needs to know about the shell, whatever the transport.
const SHELL_INSTRUCTIONS: &str = "`cd`, `export` and functions carry over between calls. stdin \
is /dev/null, so use non-interactive commands. Output is stdout, then stderr, then a one-line \
summary with the exit code. `exit` ends the shell itself: the next call starts a new one and \
the session's state (directory, variables, functions) is lost. To end a command with a \
status, use `(exit N)`, or `return N` inside a function.";

/// How a call finds its shell over HTTP, for the model.
const SESSIONS: &str = "The session is the HTTP header X-Session-ID when the client sets one \
(calls with the same id share one shell); otherwise each MCP session (chat) gets its own \
shell. If a result says `new session <handle>`, pass that handle as the `session` argument of \
your later calls to keep the same shell; without it, each call starts a new one.";

/// Largest `--instructions` text (bytes).
pub const MAX_INSTRUCTIONS_BYTES: usize = 16 * 1024;

/// The `instructions` of the `initialize` (and `server/discover`) result: the tool's own,
/// then the admin's (`--instructions`, which the operator renders from
/// `spec.server.instructions`) as written. Over stdio there is one session and no HTTP, so
/// neither the session header nor `DELETE /sessions` is mentioned: such a client cannot use
/// them.
pub fn instructions(stdio: bool, admin: Option<&str>) -> String {
    let mut text = if stdio {
        format!("One tool, `bash`, runs a command in a persistent bash shell. {SHELL_INSTRUCTIONS}")
    } else {
        format!(
            "One tool, `bash`, runs a command in a persistent bash shell of your session. \
             {SESSIONS} {SHELL_INSTRUCTIONS} End a session with DELETE /sessions/{{id}}."
        )
    };
    if let Some(admin) = admin.map(str::trim).filter(|a| !a.is_empty()) {
        text.push_str("\n\n");
        text.push_str(admin);
    }
    text
}

/// Everything a tool call needs.
pub struct McpState {
    pub sessions: SessionManager,
    pub limits: Limits,
    /// The session of the stdio transport.
    pub stdio_session: Option<SessionId>,
    /// The `instructions` of the initialize result (see [`instructions`]).
    pub instructions: String,
    /// Running calls, for `notifications/cancelled` (see [`crate::cancel`]).
    pub calls: RunningCalls,
}

#[derive(Clone)]
pub struct BashServer {
    state: Arc<McpState>,
}

impl BashServer {
    pub fn new(state: Arc<McpState>) -> Self {
        Self { state }
    }

    fn tool(&self) -> Tool {
        bash_tool(&self.state.limits)
    }
}

/// The `bash` tool definition.
pub fn bash_tool(limits: &Limits) -> Tool {
    let max = limits.max_timeout.as_secs();
    let default = limits.default_timeout.as_secs();
    let schema = json!({
        "type": "object",
        "properties": {
            "command": {
                "type": "string",
                "description": "Bash command line to run in the session's persistent shell \
                    (state such as cwd and exported variables carries over). stdin is /dev/null."
            },
            "session": {
                "type": "string",
                "description": "The session handle a previous result named (`new session \
                    <handle>`), to keep using that shell. Omit it on the first call, and \
                    whenever the client keeps the session itself."
            },
            "timeout": {
                "type": "integer",
                "minimum": 1,
                "maximum": max,
                "description": format!("Seconds before the command is killed (the shell \
                    survives). Default {default}, maximum {max}.")
            }
        },
        "required": ["command"],
        "additionalProperties": false
    });
    let input: JsonObject = match schema {
        Value::Object(m) => m,
        _ => JsonObject::new(),
    };
    Tool::new(
        TOOL_NAME,
        "Run a bash command in your session's sandbox: a persistent shell per X-Session-ID, \
         or else per chat. When a result says `new session <handle>`, pass that handle as \
         `session` in later calls to keep the shell. Returns stdout, then stderr, then a \
         summary line with the exit code; the result is an error when the exit code is not 0 \
         or the command timed out.",
        Arc::new(input),
    )
    .with_title("Bash in a sandbox")
    .with_output_schema::<BashOutput>()
    .with_annotations(
        ToolAnnotations::new()
            .read_only(false)
            .destructive(true)
            .idempotent(false)
            .open_world(true),
    )
}

/// A tool error the model sees (`isError: true`).
fn tool_error(msg: impl Into<String>) -> CallToolResponse {
    CallToolResult::error(vec![ContentBlock::text(msg.into())]).into()
}

/// A new chat session handle for `caller`: `c`, 16 hex of the caller's owner hash, 32 random
/// hex (a valid session id, 49 characters). The owner part lets a handle of another identity
/// be refused with a clear message before anything is looked up; the sandbox's owner check
/// is what actually protects a session (a forged prefix only reaches that check).
pub fn new_handle(caller: &Caller) -> SessionId {
    let random: [u8; HANDLE_RANDOM_HEX / 2] = rand::random();
    let text = format!("c{}{}", owner_prefix(caller), hex::encode(random));
    SessionId::parse(&text)
        .unwrap_or_else(|e| unreachable!("`c` and lowercase hex is a valid session id: {e}"))
}

/// The start of the caller's owner hash (with auth off, where there is no owner, of its name).
fn owner_prefix(caller: &Caller) -> String {
    let mut owner = match &caller.owner {
        Some(owner) => owner.clone(),
        None => crate::auth::owner_hash(&caller.name),
    };
    owner.truncate(HANDLE_OWNER_HEX);
    owner
}

/// Checks a handle a client sent back (`what` names where it came from).
pub fn check_handle(text: &str, caller: &Caller, what: &str) -> Result<SessionId, String> {
    let well_formed = text.len() == 1 + HANDLE_OWNER_HEX + HANDLE_RANDOM_HEX
        && text.starts_with('c')
        && text[1..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !well_formed {
        return Err(format!(
            "{what} {:?} is not a session handle of this server; omit it to start a new \
             session (the result then names its handle)",
            text.chars().take(80).collect::<String>()
        ));
    }
    if text[1..1 + HANDLE_OWNER_HEX] != owner_prefix(caller) {
        return Err(format!(
            "{what} {text:?} belongs to another identity; use a handle this server gave you, \
             or omit it to start a new session"
        ));
    }
    SessionId::parse(text).map_err(|e| format!("{what} {text:?}: {e}"))
}

/// Where a call's session came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionSource {
    /// `X-Session-ID`, set by the caller's configuration (an orchestrator): as before.
    Header,
    /// The `session` argument: a handle from an earlier result.
    Argument,
    /// The MCP session (`Mcp-Session-Id`, issued at initialize): one shell per chat.
    McpSession,
    /// None of them: a new handle, which the result names.
    New,
}

/// The session of a call: `X-Session-ID`, else the `session` argument, else
/// `Mcp-Session-Id`, else a new handle.
pub fn resolve_session(
    headers: &http::HeaderMap,
    argument: Option<&str>,
    caller: &Caller,
) -> Result<(SessionId, SessionSource), String> {
    if headers.contains_key(SESSION_HEADER) {
        let sid = session_from_headers(headers)?;
        if let Some(arg) = argument.filter(|a| *a != sid.as_str()) {
            return Err(format!(
                "argument `session` {arg:?} differs from this connection's X-Session-ID \
                 {sid:?}, which decides the session here; omit `session`"
            ));
        }
        return Ok((sid, SessionSource::Header));
    }
    if let Some(arg) = argument {
        return Ok((
            check_handle(arg, caller, "argument `session`")?,
            SessionSource::Argument,
        ));
    }
    let mut values = headers.get_all(MCP_SESSION_HEADER).iter();
    if let Some(value) = values.next() {
        if values.next().is_some() {
            return Err("Mcp-Session-Id is sent more than once; send exactly one".into());
        }
        let text = value
            .to_str()
            .map_err(|_| "Mcp-Session-Id is not plain ASCII text".to_owned())?;
        return Ok((
            check_handle(text, caller, "Mcp-Session-Id")?,
            SessionSource::McpSession,
        ));
    }
    Ok((new_handle(caller), SessionSource::New))
}

/// The session id of a request, or a message that says exactly what is wrong.
pub fn session_from_headers(headers: &http::HeaderMap) -> Result<SessionId, String> {
    let mut values = headers.get_all(SESSION_HEADER).iter();
    let Some(value) = values.next() else {
        return Err(
            "missing X-Session-ID header: every call needs a session id, a DNS-1123 \
             label such as `my-session-1` (lowercase letters, digits and '-', at most 63 \
             characters), sent as the HTTP header X-Session-ID; calls with the same id share \
             one shell"
                .into(),
        );
    };
    if values.next().is_some() {
        return Err("X-Session-ID is sent more than once; send exactly one".into());
    }
    let text = value.to_str().map_err(|_| {
        "X-Session-ID is not plain ASCII text; use a DNS-1123 label such as `my-session-1`"
    })?;
    SessionId::parse(text).map_err(|e| format!("invalid X-Session-ID {text:?}: {e}"))
}

/// Validated tool arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BashArgs {
    pub command: String,
    pub timeout: Duration,
    /// A session handle from an earlier result.
    pub session: Option<String>,
}

pub fn parse_args(args: Option<&JsonObject>, limits: &Limits) -> Result<BashArgs, String> {
    let empty = JsonObject::new();
    let args = args.unwrap_or(&empty);
    if let Some(k) = args
        .keys()
        .find(|k| !["command", "timeout", SESSION_ARG].contains(&k.as_str()))
    {
        return Err(format!(
            "unknown argument {k:?}; `bash` takes `command` (string), optional `timeout` \
             (integer seconds) and optional `session` (a handle from an earlier result)"
        ));
    }
    let session = match args.get(SESSION_ARG) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            return Err(format!(
                "argument `session` must be a string (a handle from an earlier result), not {}",
                json_type(other)
            ))
        }
    };
    let command = match args.get("command") {
        None => return Err("missing argument `command` (the bash command line to run)".into()),
        Some(Value::String(s)) => s,
        Some(other) => {
            return Err(format!(
                "argument `command` must be a string, not {}",
                json_type(other)
            ))
        }
    };
    if command.trim().is_empty() {
        return Err("argument `command` is empty; pass the command line to run".into());
    }
    if command.len() > limits.max_command_bytes {
        return Err(format!(
            "argument `command` is {} bytes; the limit is {} bytes. Put large content in a file \
             in smaller pieces (for example several `cat >> file <<'EOF'` calls)",
            command.len(),
            limits.max_command_bytes
        ));
    }
    if command.contains('\0') {
        return Err("argument `command` contains a NUL character, which bash cannot run".into());
    }
    let max = limits.max_timeout.as_secs();
    let timeout = match args.get("timeout") {
        None | Some(Value::Null) => limits.default_timeout,
        Some(Value::Number(n)) => match n.as_u64() {
            Some(s) if (1..=max).contains(&s) => Duration::from_secs(s),
            Some(s) if s > max => {
                return Err(format!(
                    "argument `timeout` is {s} seconds; the maximum is {max}"
                ))
            }
            _ => {
                return Err(format!(
                    "argument `timeout` must be a whole number of seconds from 1 to {max}, not {n}"
                ))
            }
        },
        Some(other) => {
            return Err(format!(
                "argument `timeout` must be an integer number of seconds, not {}",
                json_type(other)
            ))
        }
    };
    Ok(BashArgs {
        command: command.clone(),
        timeout,
        session,
    })
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl BashServer {
    async fn call_bash(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> CallToolResponse {
        let t0 = Instant::now();
        let state = &self.state;
        let metrics = state.sessions.metrics().clone();
        let parts = context.extensions.get::<http::request::Parts>();
        let caller = parts
            .and_then(|p| p.extensions.get::<Caller>())
            .cloned()
            .unwrap_or_else(Caller::anonymous);

        let audit_fail = |session: Option<&str>, kind: ErrorKind, msg: String| {
            metrics.error(kind);
            metrics.exec(Outcome::Error, t0.elapsed());
            audit::log(&audit::Record {
                action: "tools/call",
                session,
                caller: &caller.name,
                duration_ms: t0.elapsed().as_millis() as u64,
                outcome: kind.as_str(),
                ..Default::default()
            });
            tool_error(msg)
        };

        let args = match parse_args(request.arguments.as_ref(), &state.limits) {
            Ok(a) => a,
            Err(msg) => return audit_fail(None, ErrorKind::BadRequest, msg),
        };
        let resolved = match (&state.stdio_session, parts) {
            (Some(sid), _) => match args.session.as_deref() {
                Some(arg) if arg != sid.as_str() => Err(format!(
                    "argument `session` {arg:?} differs from this server's session {sid:?}; \
                     omit `session`"
                )),
                _ => Ok((sid.clone(), SessionSource::Header)),
            },
            (None, Some(parts)) => {
                resolve_session(&parts.headers, args.session.as_deref(), &caller)
            }
            (None, None) => Err("no session: this transport carries no HTTP headers".into()),
        };
        let (sid, source) = match resolved {
            Ok(r) => r,
            Err(msg) => return audit_fail(None, ErrorKind::BadRequest, msg),
        };
        let command_hash = audit::command_hash(&args.command);
        // rmcp cancels `context.ct` when the client abandons the HTTP request (and, on stdio,
        // on `notifications/cancelled`), but it runs the handler in a task of its own that
        // it never drops: the call must stop by itself. Over HTTP a notification reaches it
        // only through `state.calls`.
        let cancel = context.ct.child_token();
        let _running = parts
            .and_then(|p| {
                let id = serde_json::to_value(&context.id).ok()?;
                CallKey::new(&caller, &p.headers, &id)
            })
            .map(|key| state.calls.register(key, cancel.clone()));
        // Only a call that asked for progress (`_meta.progressToken`) follows it.
        let reporter = context
            .meta
            .get_progress_token()
            .map(|token| Reporter::new(context.peer.clone(), token));
        let exec = state
            .sessions
            .exec(&sid, &caller, args.command, args.timeout, &cancel);
        let outcome = match progress::with_reporter(reporter, exec).await {
            Ok(o) => o,
            Err(e) => {
                let kind = e.kind();
                let result = match kind {
                    Some(kind) => {
                        metrics.error(kind);
                        Outcome::Error
                    }
                    None => Outcome::Cancelled,
                };
                metrics.exec(result, t0.elapsed());
                audit::log(&audit::Record {
                    action: "tools/call",
                    session: Some(sid.as_str()),
                    caller: &caller.name,
                    command_sha256: Some(&command_hash),
                    duration_ms: t0.elapsed().as_millis() as u64,
                    outcome: kind.map_or(result.as_str(), ErrorKind::as_str),
                    ..Default::default()
                });
                tracing::info!(session = %sid, error = %e, "bash call failed");
                return tool_error(e.to_string());
            }
        };
        let rendered = render(sid.as_str(), &outcome, state.limits.output_budget);
        let r = &outcome.response;
        let result_kind = if r.timed_out {
            metrics.timeouts.inc();
            Outcome::TimedOut
        } else if r.exit_code != 0 {
            Outcome::Failed
        } else {
            Outcome::Ok
        };
        if rendered.structured.truncated {
            metrics.truncations.inc();
        }
        metrics.exec(result_kind, t0.elapsed());
        audit::log(&audit::Record {
            action: "tools/call",
            session: Some(sid.as_str()),
            caller: &caller.name,
            command_sha256: Some(&command_hash),
            sandbox: Some(&outcome.sandbox),
            exit_code: Some(r.exit_code),
            timed_out: r.timed_out,
            bytes: r.total_bytes,
            duration_ms: t0.elapsed().as_millis() as u64,
            outcome: result_kind.as_str(),
        });
        let mut content = vec![ContentBlock::text(rendered.text)];
        content.extend(spill_links(&sid, r, state.limits.max_resource_read));
        if source == SessionSource::New {
            content.push(ContentBlock::text(format!(
                "[new session {sid}: pass \"session\": \"{sid}\" in your next bash calls to \
                 keep this shell, its directory and variables]"
            )));
        }
        let mut result = CallToolResult::success(content);
        result.structured_content = serde_json::to_value(&rendered.structured).ok();
        result.is_error = Some(rendered.is_error);
        result.into()
    }
}

/// For each spill a truncated stream's marker names: a note with its resource URI, and a
/// `resource_link` to it, so a client can read the whole stream in chunks.
fn spill_links(sid: &SessionId, r: &ExecResponse, max_read: u64) -> Vec<ContentBlock> {
    if !r.truncated {
        return Vec::new();
    }
    let mut blocks = Vec::new();
    for bytes in [r.stdout_bytes(), r.stderr_bytes()].into_iter().flatten() {
        for name in resources::spills_named_in(&String::from_utf8_lossy(&bytes)) {
            let uri = resources::spill_uri(sid, &name);
            blocks.push(ContentBlock::text(format!(
                "[the truncated output is MCP resource {uri}: read it with resources/read, \
                 at most {max_read} bytes per read (add ?offset=N&length=M)]"
            )));
            blocks.push(ContentBlock::resource_link(
                Resource::new(uri, name)
                    .with_description("the start of the truncated stream, as the sandbox kept it")
                    .with_mime_type("application/octet-stream"),
            ));
        }
    }
    blocks
}

impl ServerHandler for BashServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .build(),
        )
        .with_server_info(
            Implementation::new("cli-mcp-server", env!("CARGO_PKG_VERSION"))
                .with_title("cli-mcp: bash in a sandbox per session"),
        )
        .with_instructions(self.state.instructions.clone())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(vec![self.tool()]))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        (name == TOOL_NAME).then(|| self.tool())
    }

    /// No fixed resources: a session's files are reached through the templates.
    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        Ok(ListResourcesResult::with_all_items(Vec::new()))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, McpError> {
        Ok(ListResourceTemplatesResult::with_all_items(
            resources::templates(self.state.limits.max_resource_read),
        ))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        let caller = context
            .extensions
            .get::<http::request::Parts>()
            .and_then(|p| p.extensions.get::<Caller>())
            .cloned()
            .unwrap_or_else(Caller::anonymous);
        let result = resources::read(
            &self.state.sessions,
            &caller,
            &request.uri,
            self.state.limits.max_resource_read,
        )
        .await;
        if let Err(e) = &result {
            tracing::info!(uri = %request.uri.chars().take(200).collect::<String>(),
                error = %e.message, "resources/read refused");
        }
        result.map(Into::into)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        if request.name != TOOL_NAME {
            self.state.sessions.metrics().error(ErrorKind::BadRequest);
            return Err(McpError::invalid_params(
                format!(
                    "unknown tool {:?}; this server has one tool: {TOOL_NAME}",
                    request.name
                ),
                None,
            ));
        }
        Ok(self.call_bash(request, context).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits::default()
    }

    fn args(v: Value) -> Result<BashArgs, String> {
        match v {
            Value::Object(m) => parse_args(Some(&m), &limits()),
            _ => parse_args(None, &limits()),
        }
    }

    #[test]
    fn session_header_errors_say_what_is_wrong() {
        let mut h = http::HeaderMap::new();
        assert!(session_from_headers(&h)
            .expect_err("missing")
            .contains("missing X-Session-ID"));
        h.insert(SESSION_HEADER, http::HeaderValue::from_static("Bad_ID"));
        let e = session_from_headers(&h).expect_err("invalid");
        assert!(
            e.contains("invalid X-Session-ID \"Bad_ID\"") && e.contains("'B'"),
            "{e}"
        );
        h.append(SESSION_HEADER, http::HeaderValue::from_static("ok"));
        assert!(session_from_headers(&h)
            .expect_err("twice")
            .contains("more than once"));
        let mut h = http::HeaderMap::new();
        h.insert(SESSION_HEADER, http::HeaderValue::from_static("s-1"));
        assert_eq!(
            session_from_headers(&h).map(|s| s.to_string()),
            Ok("s-1".into())
        );
    }

    #[test]
    fn sessions_come_from_the_header_the_argument_the_mcp_session_or_anew() {
        let alice = Caller::identified("alice");
        let bob = Caller::identified("bob");
        let none = http::HeaderMap::new();
        let (first, source) = resolve_session(&none, None, &alice).expect("new");
        assert_eq!(source, SessionSource::New);
        let (other, _) = resolve_session(&none, None, &alice).expect("new");
        assert_ne!(first, other, "every call without a session starts its own");
        assert_eq!(first.as_str().len(), 49);

        let (again, source) = resolve_session(&none, Some(first.as_str()), &alice).expect("handle");
        assert_eq!(
            (again.clone(), source),
            (first.clone(), SessionSource::Argument)
        );
        let e = resolve_session(&none, Some(first.as_str()), &bob).expect_err("not bob's");
        assert!(e.contains("belongs to another identity"), "{e}");
        // One sentence: a line continuation lost in the source shows as a run of spaces.
        assert!(!e.contains("  "), "{e:?}");
        for forged in [
            "my-session",
            "c1234",
            &format!("{}x", &first.as_str()[..48]),
        ] {
            let e = resolve_session(&none, Some(forged), &alice).expect_err("forged");
            assert!(
                e.contains("is not a session handle of this server") && !e.contains("  "),
                "{forged}: {e:?}"
            );
        }

        let mut mcp = http::HeaderMap::new();
        mcp.insert(
            MCP_SESSION_HEADER,
            http::HeaderValue::from_str(first.as_str()).expect("header"),
        );
        assert_eq!(
            resolve_session(&mcp, None, &alice),
            Ok((first.clone(), SessionSource::McpSession))
        );
        assert!(resolve_session(&mcp, None, &bob)
            .expect_err("not bob's")
            .contains("Mcp-Session-Id"));
        mcp.append(MCP_SESSION_HEADER, http::HeaderValue::from_static("c0"));
        assert!(resolve_session(&mcp, None, &alice)
            .expect_err("twice")
            .contains("more than once"));

        // The orchestrator's header decides, whatever else is sent.
        let mut h = mcp.clone();
        h.insert(SESSION_HEADER, http::HeaderValue::from_static("orch-1"));
        assert_eq!(
            resolve_session(&h, None, &bob).map(|(s, src)| (s.to_string(), src)),
            Ok(("orch-1".to_owned(), SessionSource::Header))
        );
        assert!(resolve_session(&h, Some("orch-1"), &bob).is_ok());
        let e = resolve_session(&h, Some(first.as_str()), &alice).expect_err("differs");
        assert!(
            e.contains("differs from this connection's X-Session-ID") && !e.contains("  "),
            "{e:?}"
        );
        // Auth off: handles are still checked, against the anonymous name.
        let anon = Caller::anonymous();
        let (h1, _) = resolve_session(&none, None, &anon).expect("new");
        assert!(resolve_session(&none, Some(h1.as_str()), &anon).is_ok());
    }

    #[test]
    fn arguments_are_validated() {
        let ok = args(json!({"command": "ls", "timeout": 5})).expect("valid");
        assert_eq!(ok.timeout, Duration::from_secs(5));
        assert_eq!(
            args(json!({"command": "ls"})).expect("valid").timeout,
            Duration::from_secs(60)
        );
        for (v, needle) in [
            (json!({}), "missing argument `command`"),
            (json!({"command": 1}), "must be a string"),
            (json!({"command": "  "}), "is empty"),
            (json!({"command": "ls", "timeout": 0}), "whole number"),
            (json!({"command": "ls", "timeout": 301}), "maximum is 300"),
            (json!({"command": "ls", "timeout": 1.5}), "whole number"),
            (json!({"command": "ls", "timeout": "5"}), "integer"),
            (
                json!({"command": "ls", "cwd": "/"}),
                "unknown argument \"cwd\"",
            ),
            (
                json!({"command": "ls", "session": 5}),
                "`session` must be a string",
            ),
            (json!({"command": "a\u{0}b"}), "NUL"),
        ] {
            let e = args(v.clone()).expect_err("invalid");
            assert!(e.contains(needle), "{v}: {e}");
        }
        let huge = "x".repeat(limits().max_command_bytes + 1);
        assert!(args(json!({ "command": huge }))
            .expect_err("huge")
            .contains("limit"));
    }

    #[test]
    fn the_tool_is_annotated_and_typed() {
        let t = bash_tool(&limits());
        let a = t.annotations.expect("annotations");
        assert_eq!(a.read_only_hint, Some(false));
        assert_eq!(a.destructive_hint, Some(true));
        assert_eq!(a.idempotent_hint, Some(false));
        assert_eq!(a.open_world_hint, Some(true));
        assert_eq!(t.input_schema["type"], "object");
        assert_eq!(t.input_schema["required"], json!(["command"]));
        assert_eq!(t.input_schema["properties"]["timeout"]["maximum"], 300);
        assert!(t.output_schema.is_some());
    }

    #[test]
    fn instructions_explain_exit_and_fit_the_transport() {
        let http = instructions(false, None);
        let stdio = instructions(true, None);
        for text in [&http, &stdio] {
            assert!(text.contains("`exit` ends the shell"), "{text}");
            assert!(
                text.contains("`(exit N)`") && text.contains("`return N`"),
                "{text}"
            );
        }
        assert!(http.contains("X-Session-ID") && http.contains("DELETE /sessions/{id}"));
        for http_only in ["X-Session-ID", "header", "DELETE", "/sessions"] {
            assert!(
                !stdio.contains(http_only),
                "stdio mentions {http_only}: {stdio}"
            );
        }
        let admin = "kubectl (context prod-ro) and jq.\nRead only.";
        let with = instructions(false, Some(admin));
        assert_eq!(with, format!("{http}\n\n{admin}"));
        assert_eq!(
            instructions(false, Some("  \n")),
            http,
            "blank text adds nothing"
        );
    }

    #[test]
    fn tool_schemas_use_only_standard_json_schema_formats() {
        let t = bash_tool(&limits());
        let output = t.output_schema.as_ref().expect("output schema");
        for schema in [
            Value::Object((*t.input_schema).clone()),
            Value::Object((**output).clone()),
        ] {
            let bad: Vec<_> = crate::schema::formats(&schema)
                .into_iter()
                .filter(|(_, f)| !crate::schema::STANDARD_FORMATS.contains(&f.as_str()))
                .collect();
            assert!(bad.is_empty(), "non-standard formats {bad:?} in {schema}");
        }
        assert_eq!(output["properties"]["duration_ms"]["type"], "integer");
        assert_eq!(output["properties"]["duration_ms"]["minimum"], 0);
    }
}
