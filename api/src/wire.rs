//! JSON bodies of the agent's HTTP API. Field names are the contract with every
//! client, so the tests below pin the exact JSON.

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use crate::SessionId;

/// Default command timeout when the request does not set one.
pub const DEFAULT_TIMEOUT_MS: u64 = 60_000;
/// Upper bound on any command timeout.
pub const MAX_TIMEOUT_MS: u64 = 300_000;
/// Default per-stream output budget kept in a response.
pub const DEFAULT_OUTPUT_BUDGET: usize = 64 * 1024;
/// Port the agent listens on in a sandbox pod.
pub const AGENT_PORT: u16 = 8090;
/// Env var that carries the session-token commitment of an assigned pod.
pub const ENV_TOKEN_SHA256: &str = "TOKEN_SHA256";
/// Env var that carries the assign-token commitment of a warm pod.
pub const ENV_ASSIGN_SHA256: &str = "ASSIGN_SHA256";
/// The agent's proxy relay: where it listens, the instance proxy it forwards to
/// (`host:port`), and the file holding the token it proves the pod with. All three or none.
pub const ENV_RELAY_LISTEN: &str = "CLI_MCP_AGENT_PROXY_RELAY_LISTEN";
pub const ENV_RELAY_UPSTREAM: &str = "CLI_MCP_AGENT_PROXY_UPSTREAM";
pub const ENV_RELAY_TOKEN_FILE: &str = "CLI_MCP_AGENT_PROXY_TOKEN_FILE";
/// Where the downward API puts the pod's annotations, so a restarted agent finds its
/// assignment (`token-sha256`) again.
pub const PODINFO_DIR: &str = "/etc/cli-mcp/pod";
pub const PODINFO_ANNOTATIONS: &str = "/etc/cli-mcp/pod/annotations";

/// `POST /exec` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    pub command: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Idempotency key: a repeated id returns the previous response instead of running again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// How a stream's text is encoded in JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// The bytes were valid UTF-8 and are the JSON string itself.
    #[default]
    Utf8,
    /// The bytes were not valid UTF-8; the JSON string is their standard base64.
    Base64,
}

impl Encoding {
    fn is_utf8(&self) -> bool {
        *self == Encoding::Utf8
    }
}

/// `POST /exec` success body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecResponse {
    pub stdout: String,
    pub stderr: String,
    /// Present (as `"base64"`) only when stdout was not valid UTF-8.
    #[serde(default, skip_serializing_if = "Encoding::is_utf8")]
    pub stdout_encoding: Encoding,
    #[serde(default, skip_serializing_if = "Encoding::is_utf8")]
    pub stderr_encoding: Encoding,
    pub exit_code: i32,
    pub duration_ms: u64,
    pub timed_out: bool,
    /// True when either stream was cut to the output budget.
    pub truncated: bool,
    /// Bytes the command wrote to stdout and stderr together, before truncation.
    pub total_bytes: u64,
    /// Working directory of the shell after the command.
    pub cwd: String,
    /// True when the shell was replaced during or before this command (its state is gone).
    pub shell_restarted: bool,
}

/// Encodes raw stream bytes as (text, encoding) so any bytes survive JSON exactly.
pub fn encode_stream(bytes: Vec<u8>) -> (String, Encoding) {
    match String::from_utf8(bytes) {
        Ok(s) => (s, Encoding::Utf8),
        Err(e) => (
            base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
            Encoding::Base64,
        ),
    }
}

fn decode_stream(text: &str, enc: Encoding) -> Result<Vec<u8>, base64::DecodeError> {
    match enc {
        Encoding::Utf8 => Ok(text.as_bytes().to_vec()),
        Encoding::Base64 => base64::engine::general_purpose::STANDARD.decode(text),
    }
}

impl ExecResponse {
    /// The exact bytes of stdout.
    pub fn stdout_bytes(&self) -> Result<Vec<u8>, base64::DecodeError> {
        decode_stream(&self.stdout, self.stdout_encoding)
    }

    /// The exact bytes of stderr.
    pub fn stderr_bytes(&self) -> Result<Vec<u8>, base64::DecodeError> {
        decode_stream(&self.stderr, self.stderr_encoding)
    }
}

/// `GET /exec/progress?request_id=…` success body: how far the command of that request is.
/// The agent answers at once (it never waits for the shell).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecProgress {
    /// False when the agent is not running this request now (not started yet, finished, or
    /// never sent); the other fields are then zero and empty.
    pub running: bool,
    /// Bytes the command has written to stdout and stderr together so far (never falls
    /// while it runs).
    pub bytes: u64,
    /// The last complete, non-blank line of output (either stream), at most
    /// [`PROGRESS_LINE_MAX`] bytes, control characters removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_line: Option<String>,
}

/// Most bytes of [`ExecProgress::last_line`].
pub const PROGRESS_LINE_MAX: usize = 200;

/// Most bytes one `GET /files/…` answers (its `length` is capped to this).
pub const FILE_READ_MAX: u64 = 4 * 1024 * 1024;
/// Response header of `GET /files/…`: the file's size when it was opened.
pub const HEADER_FILE_SIZE: &str = "x-file-size";

/// `POST /assign` body: binds a warm pod to a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssignRequest {
    pub session_id: SessionId,
    /// Commitment (`sha256_hex`) of the session token that `/exec` will require.
    pub token_sha256: String,
}

/// `POST /assign` success body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssignResponse {
    pub session_id: SessionId,
}

/// Machine-readable error codes; the HTTP status says the class, the code says which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: malformed body or invalid field.
    BadRequest,
    /// 401: missing or wrong bearer token.
    Unauthorized,
    /// 404: no such endpoint.
    NotFound,
    /// 409: `/assign` on an already assigned pod.
    AlreadyAssigned,
    /// 409: another command is running and did not finish within this call's timeout.
    Busy,
    /// 413: body over the limit.
    PayloadTooLarge,
    /// 503: pod waiting for `/assign`.
    NotAssigned,
    /// 503: the agent is shutting down.
    ShuttingDown,
    /// 404 on `GET /files/…`: no such file, or not one the agent serves (a link, a
    /// directory, outside the workspace).
    NoSuchFile,
    /// 500: the agent could not run the command (the shell could not be started, …).
    Internal,
}

/// Body of every error response: `{"error": "...", "code": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    pub code: ErrorCode,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn exec_request_json() {
        let r: ExecRequest =
            serde_json::from_value(json!({"command": "ls", "timeout_ms": 5, "request_id": "r1"}))
                .expect("parses");
        assert_eq!(
            r,
            ExecRequest {
                command: "ls".into(),
                timeout_ms: Some(5),
                request_id: Some("r1".into())
            }
        );
        let min: ExecRequest = serde_json::from_value(json!({"command": "ls"})).expect("parses");
        assert_eq!(
            serde_json::to_value(&min).expect("serializes"),
            json!({"command": "ls"})
        );
        let err = serde_json::from_value::<ExecRequest>(json!({"cmd": "ls"})).expect_err("typo");
        assert!(err.to_string().contains("unknown field `cmd`"), "{err}");
    }

    #[test]
    fn exec_response_json_is_exact() {
        let r = ExecResponse {
            stdout: "a".into(),
            stderr: String::new(),
            stdout_encoding: Encoding::Utf8,
            stderr_encoding: Encoding::Utf8,
            exit_code: 0,
            duration_ms: 3,
            timed_out: false,
            truncated: false,
            total_bytes: 1,
            cwd: "/w".into(),
            shell_restarted: false,
        };
        assert_eq!(
            serde_json::to_value(&r).expect("serializes"),
            json!({"stdout": "a", "stderr": "", "exit_code": 0, "duration_ms": 3,
                   "timed_out": false, "truncated": false, "total_bytes": 1, "cwd": "/w",
                   "shell_restarted": false})
        );
    }

    #[test]
    fn binary_output_roundtrips_exactly() {
        let raw = vec![0u8, 0xff, b'a', 0xc3];
        let (text, enc) = encode_stream(raw.clone());
        assert_eq!(enc, Encoding::Base64);
        let r = ExecResponse {
            stdout: text,
            stderr: "x\0y".into(),
            stdout_encoding: enc,
            stderr_encoding: Encoding::Utf8,
            exit_code: 1,
            duration_ms: 0,
            timed_out: false,
            truncated: false,
            total_bytes: 7,
            cwd: "/".into(),
            shell_restarted: false,
        };
        let v = serde_json::to_value(&r).expect("serializes");
        assert_eq!(v["stdout_encoding"], "base64");
        assert!(v.get("stderr_encoding").is_none());
        let back: ExecResponse = serde_json::from_value(v).expect("parses");
        assert_eq!(back.stdout_bytes().expect("decodes"), raw);
        assert_eq!(back.stderr_bytes().expect("decodes"), b"x\0y");
    }

    #[test]
    fn assign_and_error_json() {
        let a: AssignRequest =
            serde_json::from_value(json!({"session_id": "s1", "token_sha256": "ab"}))
                .expect("parses");
        assert_eq!(a.session_id.as_str(), "s1");
        assert!(serde_json::from_value::<AssignRequest>(
            json!({"session_id": "S 1", "token_sha256": "ab"})
        )
        .is_err());
        let e = ErrorBody {
            error: "busy".into(),
            code: ErrorCode::AlreadyAssigned,
        };
        assert_eq!(
            serde_json::to_value(&e).expect("serializes"),
            json!({"error": "busy", "code": "already_assigned"})
        );
    }
}
