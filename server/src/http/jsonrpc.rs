//! The check of a `POST /mcp` body before rmcp sees it, and what the server does there
//! itself: cancelling the call a `notifications/cancelled` names, and giving a chat its
//! session handle at `initialize`.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http_body_util::BodyExt as _;
use rmcp::model::{ClientJsonRpcMessage, ErrorCode as RpcCode};
use serde_json::{json, Value};

use cli_mcp_api::SessionId;

use super::{caller_of, close, error_response, AppState};
use crate::cancel::CallKey;
use crate::mcp::session::{new_handle, MCP_SESSION_HEADER, SESSION_HEADER};
use crate::metrics::ErrorKind;

/// How much of an oversized body is read and discarded before answering 413.
const DRAIN_FACTOR: u64 = 4;
/// Deadline for a whole request body.
const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The notification a client sends to cancel one of its requests.
const CANCELLED: &str = "notifications/cancelled";

/// What the server itself needs of a well-formed MCP message.
struct Message {
    initialize: bool,
    /// The request id a `notifications/cancelled` names.
    cancelled: Option<Value>,
}

/// Checks a `POST /mcp` body before rmcp: size (413), JSON (-32700) and JSON-RPC shape
/// (-32600), each with a message that says what is wrong. rmcp would answer a bad body
/// with a plain-text 415.
pub(super) async fn jsonrpc_guard(
    State(s): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    if req.method() != http::Method::POST || req.uri().path() != "/mcp" {
        return next.run(req).await;
    }
    let (parts, bytes) = match read_body(&s, req).await {
        Ok(body) => body,
        Err(res) => return res,
    };
    let message = match check_message(&bytes) {
        Ok(m) => m,
        Err(Refusal { id, code, msg }) => {
            s.metrics.error(ErrorKind::BadRequest);
            return jsonrpc_error(StatusCode::BAD_REQUEST, id, code, msg);
        }
    };
    if let Some(request_id) = message.cancelled {
        cancel_call(&s, &parts, &request_id);
    }
    let handle = chat_handle(message.initialize, &parts);
    let mut res = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    if let Some(handle) = handle.filter(|_| res.status() == StatusCode::OK) {
        if let Ok(v) = HeaderValue::from_str(handle.as_str()) {
            res.headers_mut().insert(MCP_SESSION_HEADER, v);
        }
    }
    res
}

/// A JSON-RPC error response (for malformed MCP requests, before rmcp sees them).
fn jsonrpc_error(status: StatusCode, id: Value, code: RpcCode, msg: String) -> Response {
    (
        status,
        Json(json!({"jsonrpc": "2.0", "id": id, "error": {"code": code.0, "message": msg}})),
    )
        .into_response()
}

/// The 413 of a body over `--max-body-bytes` (`n`: its size, when known).
fn too_large(s: &AppState, n: Option<u64>) -> Response {
    let limit = s.mcp.limits.max_body_bytes;
    s.metrics.error(ErrorKind::BadRequest);
    let size = n.map(|n| format!(" ({n} bytes)")).unwrap_or_default();
    jsonrpc_error(
        StatusCode::PAYLOAD_TOO_LARGE,
        Value::Null,
        RpcCode::INVALID_REQUEST,
        format!(
            "request body{size} is over the limit of {limit} bytes (--max-body-bytes); \
             send a shorter command"
        ),
    )
}

/// Reads the whole body within its deadline and size limit; the response that refuses it
/// otherwise.
async fn read_body(s: &AppState, req: Request) -> Result<(http::request::Parts, Bytes), Response> {
    let limit = s.mcp.limits.max_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // An oversized body is still read (and discarded) up to DRAIN_FACTOR × the limit, so the
    // client, which is usually still sending, reliably gets the 413 instead of a broken pipe.
    let drain_cap = (limit as u64).saturating_mul(DRAIN_FACTOR);
    if declared.is_some_and(|n| n > drain_cap) {
        return Err(close(too_large(s, declared)));
    }
    let (parts, mut body) = req.into_parts();
    let mut buf: Vec<u8> = Vec::new();
    let mut total: u64 = 0;
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| e.to_string())?;
            if let Ok(data) = frame.into_data() {
                total += data.len() as u64;
                if total <= limit as u64 {
                    buf.extend_from_slice(&data);
                } else if total > drain_cap {
                    break;
                } else if !buf.is_empty() {
                    buf = Vec::new();
                }
            }
        }
        Ok::<(), String>(())
    };
    match tokio::time::timeout(BODY_READ_TIMEOUT, read).await {
        Err(_) => {
            s.metrics.error(ErrorKind::BadRequest);
            return Err(close(error_response(
                StatusCode::REQUEST_TIMEOUT,
                "timeout",
                format!("the request body did not arrive within {BODY_READ_TIMEOUT:?}"),
            )));
        }
        Ok(Err(e)) => {
            return Err(error_response(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("cannot read the request body: {e}"),
            ))
        }
        Ok(Ok(())) => {}
    }
    if total > limit as u64 {
        return Err(close(too_large(s, declared.or(Some(total)))));
    }
    Ok((parts, Bytes::from(buf)))
}

/// Why a body is not a message rmcp should see: the JSON-RPC error it is answered with.
struct Refusal {
    id: Value,
    code: RpcCode,
    msg: String,
}

/// Checks that `bytes` is one JSON-RPC 2.0 object and an MCP client message.
fn check_message(bytes: &Bytes) -> Result<Message, Refusal> {
    let bad = |id: Value, code: RpcCode, msg: String| Refusal { id, code, msg };
    let value: Value = match serde_json::from_slice(bytes) {
        Ok(v) => v,
        Err(e) => {
            return Err(bad(
                Value::Null,
                RpcCode::PARSE_ERROR,
                format!("parse error: the body is not valid JSON ({e})"),
            ))
        }
    };
    let id = value.get("id").cloned().unwrap_or(Value::Null);
    if !value.is_object() {
        return Err(bad(
            id,
            RpcCode::INVALID_REQUEST,
            "invalid request: send one JSON-RPC 2.0 object per POST (batches are not supported)"
                .into(),
        ));
    }
    if value.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(bad(
            id,
            RpcCode::INVALID_REQUEST,
            "invalid request: the object must have \"jsonrpc\": \"2.0\"".into(),
        ));
    }
    let method = value.get("method").and_then(Value::as_str);
    let initialize = method == Some("initialize");
    let cancelled = (method == Some(CANCELLED) && value.get("id").is_none())
        .then(|| value.pointer("/params/requestId").cloned())
        .flatten();
    if let Err(e) = serde_json::from_value::<ClientJsonRpcMessage>(value) {
        return Err(bad(
            id,
            RpcCode::INVALID_REQUEST,
            format!("invalid request: not an MCP client message ({e})"),
        ));
    }
    Ok(Message {
        initialize,
        cancelled,
    })
}

/// One shell per chat: a handshake-era client without X-Session-ID gets an MCP session
/// id at initialize, which it sends with every later request; the tool call takes it
/// as its sandbox session. It is a handle, not server state (rmcp stays stateless), so
/// any replica serves the chat. Only an initialize looks at the caller (no clone of it
/// for every other request).
fn chat_handle(initialize: bool, parts: &http::request::Parts) -> Option<SessionId> {
    (initialize && !parts.headers.contains_key(SESSION_HEADER))
        .then(|| new_handle(&caller_of(parts.extensions.get())))
}

/// Cancels the running tool call a `notifications/cancelled` names, which rmcp's stateless
/// service would drop (see [`crate::cancel`]). rmcp still answers the notification (202).
fn cancel_call(s: &AppState, parts: &http::request::Parts, request_id: &Value) {
    let caller = caller_of(parts.extensions.get());
    let Some(key) = CallKey::new(&caller, &parts.headers, request_id) else {
        tracing::debug!(%request_id, "a cancellation without a session header names no call");
        return;
    };
    let n = s.mcp.calls.cancel(&key);
    tracing::info!(%request_id, caller = %caller.name, calls = n, "cancel requested");
}
