//! The `bash` tool: its definition, its arguments, and its body, which runs the command in
//! the session's sandbox inside a [`ToolCall`].

use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, JsonObject, Resource,
    Tool, ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::RoleServer;
use serde_json::{json, Value};

use cli_mcp_api::wire::ExecResponse;
use cli_mcp_api::SessionId;

use super::call::{Done, ToolCall};
use super::session::SESSION_ARG;
use super::McpState;
use crate::audit;
use crate::limits::Limits;
use crate::metrics::{ErrorKind, Outcome};
use crate::render::{render, BashOutput};
use crate::resources;

pub const TOOL_NAME: &str = "bash";

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

/// Runs a `bash` call: its arguments, then the command in the session's sandbox.
pub(super) async fn call(
    state: &McpState,
    request: CallToolRequestParams,
    context: RequestContext<RoleServer>,
) -> CallToolResponse {
    let call = ToolCall::open(state, &context, TOOL_NAME);
    let args = match parse_args(request.arguments.as_ref(), &state.limits) {
        Ok(a) => a,
        Err(msg) => return call.refuse(ErrorKind::BadRequest, msg),
    };
    let command_hash = audit::command_hash(&args.command);
    let session = args.session.clone();
    call.run(
        session.as_deref(),
        Some(&command_hash),
        |scope| async move {
            let outcome = state
                .sessions
                .exec(
                    &scope.sid,
                    &scope.caller,
                    args.command,
                    args.timeout,
                    &scope.cancel,
                )
                .await?;
            Ok(result(state, &scope.sid, &outcome))
        },
    )
    .await
}

/// The tool result of a command that ran: its rendered output, links to the spills of a
/// truncated stream, and what the call's metrics and audit record say of it.
fn result(state: &McpState, sid: &SessionId, outcome: &crate::sessions::ExecOutcome) -> Done {
    let metrics = state.sessions.metrics();
    let rendered = render(sid.as_str(), outcome, state.limits.output_budget);
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
    let mut content = vec![ContentBlock::text(rendered.text)];
    content.extend(spill_links(sid, r, state.limits.max_resource_read));
    let mut result = CallToolResult::success(content);
    result.structured_content = serde_json::to_value(&rendered.structured).ok();
    result.is_error = Some(rendered.is_error);
    Done {
        result,
        outcome: result_kind,
        sandbox: outcome.sandbox.clone(),
        exit_code: Some(r.exit_code),
        timed_out: r.timed_out,
        bytes: r.total_bytes,
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
