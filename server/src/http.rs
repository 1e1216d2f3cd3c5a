//! HTTP routes.
//!
//! The MCP listener: `POST /mcp` (rmcp Streamable HTTP, stateless, JSON responses),
//! `DELETE /sessions/{id}`, `GET /sessions`, all behind the auth middleware, and the public
//! `GET /.well-known/oauth-protected-resource[/mcp]` (with `--auth kubernetes`). The health
//! listener (plain HTTP, never authenticated): `/livez`, `/readyz`, `/metrics`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use http_body_util::BodyExt as _;
use rmcp::model::{ClientJsonRpcMessage, ErrorCode as RpcCode};
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use cli_mcp_api::SessionId;

use crate::audit;
use crate::auth::resource::{self, ProtectedResource};
use crate::auth::{bearer, AuthError, Authenticator, Caller, Verb};
use crate::cancel::CallKey;
use crate::mcp::{BashServer, McpState};
use crate::metrics::{ErrorKind, Format as MetricsFormat, Listener, Metrics};
use crate::origin::OriginPolicy;
use crate::sessions::SessionError;

/// Shared state of the routes.
pub struct AppState {
    pub mcp: Arc<McpState>,
    /// `None` with `--auth none`.
    pub auth: Option<Arc<Authenticator>>,
    pub metrics: Arc<Metrics>,
    /// Set on SIGTERM: /readyz fails and responses close their connections (lame duck).
    pub draining: AtomicBool,
    /// The OAuth Protected Resource Metadata and 401 challenge; `None` with `--auth none`.
    pub resource: Option<Arc<ProtectedResource>>,
}

impl AppState {
    pub fn new(
        mcp: Arc<McpState>,
        auth: Option<Arc<Authenticator>>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            mcp,
            auth,
            metrics,
            draining: AtomicBool::new(false),
            resource: None,
        }
    }

    pub fn with_protected_resource(mut self, resource: ProtectedResource) -> Self {
        self.resource = Some(Arc::new(resource));
        self
    }
}

/// How the rmcp service is configured.
#[derive(Debug, Clone)]
pub struct McpHttpOptions {
    /// Keep rmcp's loopback-only `Host` check (DNS-rebinding protection for a local server).
    pub loopback_hosts_only: bool,
    /// Which `Origin` headers the MCP listener accepts.
    pub origins: OriginPolicy,
    pub cancel: CancellationToken,
}

/// The MCP listener's router.
pub fn mcp_router(state: Arc<AppState>, opts: McpHttpOptions) -> Router {
    let limit = state.mcp.limits.max_body_bytes;
    let mut cfg = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        .with_max_request_body_bytes(limit)
        .with_cancellation_token(opts.cancel);
    if !opts.loopback_hosts_only {
        cfg = cfg.disable_allowed_hosts();
    }
    let mcp_state = state.mcp.clone();
    let service = StreamableHttpService::new(
        move || Ok(BashServer::new(mcp_state.clone())),
        Arc::new(NeverSessionManager::default()),
        cfg,
    );
    let protected = Router::new()
        .route_service("/mcp", service)
        .route("/sessions", get(list_sessions))
        .route("/sessions/{id}", delete(delete_session))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), jsonrpc_guard))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        // Before auth: a refused cross-site request costs no token review.
        .layer(middleware::from_fn_with_state(
            (state.clone(), Arc::new(opts.origins)),
            check_origin,
        ));
    // The metadata is public (no token, any origin: browser-based clients read it too).
    Router::new()
        .route(
            resource::WELL_KNOWN,
            get(resource_metadata).fallback(metadata_method),
        )
        .route(
            &format!("{}/{{*path}}", resource::WELL_KNOWN),
            get(resource_metadata).fallback(metadata_method),
        )
        .merge(protected)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            close_when_draining,
        ))
        .layer(middleware::from_fn_with_state(
            (state.metrics.clone(), Listener::Mcp),
            count_requests,
        ))
        .with_state(state)
}

/// Counts every answered request (`cli_mcp_http_requests_total`), refusals included.
async fn count_requests(
    State((metrics, listener)): State<(Arc<Metrics>, Listener)>,
    req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path().to_owned();
    let res = next.run(req).await;
    metrics.http_request(listener, &path, res.status().as_u16());
    res
}

/// 403 for a request whose `Origin` is not allowed (see [`crate::origin`]). A page of an
/// allowed origin gets CORS: its preflight is answered here, before authentication (a
/// browser sends no `Authorization` on it), and the answers it may read carry
/// `Access-Control-Allow-Origin`; without them a browser hides every answer from the page,
/// so "allowed" meant nothing across origins.
async fn check_origin(
    State((s, policy)): State<(Arc<AppState>, Arc<OriginPolicy>)>,
    req: Request,
    next: Next,
) -> Response {
    let mut origins = req.headers().get_all(header::ORIGIN).iter();
    let (origin, verdict) = match (origins.next(), origins.next()) {
        (None, _) => (None, Ok(())),
        (Some(origin), None) => (Some(origin.clone()), policy.check(origin)),
        (Some(_), Some(_)) => (
            None,
            Err("the Origin header is sent more than once".to_owned()),
        ),
    };
    match verdict {
        Ok(()) => match origin {
            None => next.run(req).await,
            Some(origin) if is_preflight(&req) => cors_preflight(&origin),
            Some(origin) => {
                let mut res = next.run(req).await;
                allow_origin(res.headers_mut(), origin);
                res
            }
        },
        Err(why) => {
            s.metrics.error(ErrorKind::Forbidden);
            tracing::warn!(reason = %why, "refused a request by its Origin");
            error_response(StatusCode::FORBIDDEN, "forbidden_origin", why)
        }
    }
}

/// The request headers a page may send: the ones MCP clients use.
const CORS_ALLOW_HEADERS: &str = "authorization, content-type, accept, last-event-id, \
     mcp-protocol-version, mcp-session-id, x-session-id";
/// The answer headers a page may read: the chat's handle, the protocol version, and where
/// to get a token.
const CORS_EXPOSE_HEADERS: &str = "mcp-session-id, mcp-protocol-version, www-authenticate";
/// How long a browser may reuse a preflight's answer.
const CORS_MAX_AGE_SECONDS: &str = "600";

fn is_preflight(req: &Request) -> bool {
    req.method() == axum::http::Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
}

fn allow_origin(headers: &mut axum::http::HeaderMap, origin: HeaderValue) {
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    headers.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static(CORS_EXPOSE_HEADERS),
    );
    headers.append(header::VARY, HeaderValue::from_static("origin"));
}

fn cors_preflight(origin: &HeaderValue) -> Response {
    let mut res = StatusCode::NO_CONTENT.into_response();
    let h = res.headers_mut();
    allow_origin(h, origin.clone());
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, DELETE, OPTIONS"),
    );
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static(CORS_ALLOW_HEADERS),
    );
    h.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static(CORS_MAX_AGE_SECONDS),
    );
    res
}

/// The health listener's router.
pub fn health_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(
            (state.metrics.clone(), Listener::Health),
            count_requests,
        ))
        .with_state(state)
}

/// `{"error": ..., "code": ...}` with a status.
pub fn error_response(status: StatusCode, code: &str, msg: impl Into<String>) -> Response {
    let mut res = (status, Json(json!({"error": msg.into(), "code": code}))).into_response();
    if status == StatusCode::UNAUTHORIZED {
        res.headers_mut()
            .insert(header::WWW_AUTHENTICATE, resource::challenge(None, None));
    }
    // Every 503 here is passing (authentication busy, the Kubernetes API slow or away):
    // clients and proxies that honour Retry-After come back soon instead of giving up.
    if status == StatusCode::SERVICE_UNAVAILABLE {
        res.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
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

/// How much of an oversized body is read and discarded before answering 413.
const DRAIN_FACTOR: u64 = 4;
/// Deadline for a whole request body.
const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Marks a response as the last on its connection.
fn close(mut res: Response) -> Response {
    res.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}

async fn authenticate(State(s): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    let caller = match &s.auth {
        None => Caller::anonymous(),
        Some(auth) => {
            let verb = Verb::of_method(req.method());
            let token = bearer::token(req.headers());
            let sent = matches!(token, Ok(Some(_)));
            let decision = match token {
                Ok(token) => auth.authorize(token, verb).await,
                Err(e) => Err(e),
            };
            match decision {
                Ok(c) => c,
                Err(e) => {
                    let (kind, code, challenge) = match e {
                        AuthError::BadRequest(_) => (
                            ErrorKind::BadRequest,
                            "bad_request",
                            Some("invalid_request"),
                        ),
                        // RFC 6750 §3.1: no error code when no bearer token was sent.
                        AuthError::Unauthenticated(_) => (
                            ErrorKind::Unauthenticated,
                            "unauthorized",
                            sent.then_some("invalid_token"),
                        ),
                        // No challenge on 403: access is an RBAC decision, and a new token
                        // (what MCP clients fetch on `insufficient_scope`) would not change it.
                        AuthError::Forbidden(_) => (ErrorKind::Forbidden, "forbidden", None),
                        AuthError::Unavailable(_) => {
                            (ErrorKind::KubernetesApi, "unavailable", None)
                        }
                    };
                    s.metrics.error(kind);
                    let mut res = error_response(e.status(), code, e.to_string());
                    if matches!(e, AuthError::BadRequest(_) | AuthError::Unauthenticated(_)) {
                        let value = match &s.resource {
                            Some(r) => r.challenge(req.uri(), req.headers(), challenge),
                            None => resource::challenge(None, challenge),
                        };
                        res.headers_mut().insert(header::WWW_AUTHENTICATE, value);
                    }
                    return res;
                }
            }
        }
    };
    // The bearer token has done its job; nothing downstream (rmcp, handlers) needs to see it.
    req.headers_mut().remove(header::AUTHORIZATION);
    req.extensions_mut().insert(caller);
    next.run(req).await
}

/// `GET /.well-known/oauth-protected-resource[/<resource path>]`: the metadata (RFC 9728).
async fn resource_metadata(State(s): State<Arc<AppState>>, req: Request) -> Response {
    let Some(r) = s.resource.as_ref().filter(|r| r.serves(req.uri().path())) else {
        return not_found(req).await;
    };
    let mut res = Json(r.document(req.uri(), req.headers())).into_response();
    for (name, value) in r.document_headers() {
        res.headers_mut().insert(name, value);
    }
    res
}

async fn metadata_method(req: Request) -> Response {
    let mut res = error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!(
            "{} is not allowed on {}; the protected resource metadata is read with GET",
            req.method(),
            req.uri().path()
        ),
    );
    res.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
    res
}

/// Checks a `POST /mcp` body before rmcp: size (413), JSON (-32700) and JSON-RPC shape
/// (-32600), each with a message that says what is wrong. rmcp would answer a bad body
/// with a plain-text 415.
async fn jsonrpc_guard(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if req.method() != http::Method::POST || req.uri().path() != "/mcp" {
        return next.run(req).await;
    }
    let limit = s.mcp.limits.max_body_bytes;
    let too_large = |n: Option<u64>| {
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
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // An oversized body is still read (and discarded) up to DRAIN_FACTOR × the limit, so the
    // client, which is usually still sending, reliably gets the 413 instead of a broken pipe.
    let drain_cap = (limit as u64).saturating_mul(DRAIN_FACTOR);
    if declared.is_some_and(|n| n > drain_cap) {
        return close(too_large(declared));
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
            return close(error_response(
                StatusCode::REQUEST_TIMEOUT,
                "timeout",
                format!("the request body did not arrive within {BODY_READ_TIMEOUT:?}"),
            ));
        }
        Ok(Err(e)) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("cannot read the request body: {e}"),
            )
        }
        Ok(Ok(())) => {}
    }
    if total > limit as u64 {
        return close(too_large(declared.or(Some(total))));
    }
    let bytes = Bytes::from(buf);
    let bad = |id: Value, code: RpcCode, msg: String| {
        s.metrics.error(ErrorKind::BadRequest);
        jsonrpc_error(StatusCode::BAD_REQUEST, id, code, msg)
    };
    let value: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => {
            return bad(
                Value::Null,
                RpcCode::PARSE_ERROR,
                format!("parse error: the body is not valid JSON ({e})"),
            )
        }
    };
    let id = value.get("id").cloned().unwrap_or(Value::Null);
    if !value.is_object() {
        return bad(
            id,
            RpcCode::INVALID_REQUEST,
            "invalid request: send one JSON-RPC 2.0 object per POST (batches are not supported)"
                .into(),
        );
    }
    if value.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return bad(
            id,
            RpcCode::INVALID_REQUEST,
            "invalid request: the object must have \"jsonrpc\": \"2.0\"".into(),
        );
    }
    let method = value.get("method").and_then(Value::as_str);
    let initialize = method == Some("initialize");
    let cancelled = (method == Some(CANCELLED) && value.get("id").is_none())
        .then(|| value.pointer("/params/requestId").cloned())
        .flatten();
    if let Err(e) = serde_json::from_value::<ClientJsonRpcMessage>(value) {
        return bad(
            id,
            RpcCode::INVALID_REQUEST,
            format!("invalid request: not an MCP client message ({e})"),
        );
    }
    if let Some(request_id) = cancelled {
        cancel_call(&s, &parts, &request_id);
    }
    // One shell per chat: a handshake-era client without X-Session-ID gets an MCP session
    // id at initialize, which it sends with every later request; the tool call takes it
    // as its sandbox session. It is a handle, not server state (rmcp stays stateless), so
    // any replica serves the chat. Only an initialize looks at the caller (no clone of it
    // for every other request).
    let handle = (initialize && !parts.headers.contains_key(crate::mcp::SESSION_HEADER))
        .then(|| crate::mcp::new_handle(&caller_of(parts.extensions.get())));
    let mut res = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    if let Some(handle) = handle.filter(|_| res.status() == StatusCode::OK) {
        if let Ok(v) = HeaderValue::from_str(handle.as_str()) {
            res.headers_mut().insert(crate::mcp::MCP_SESSION_HEADER, v);
        }
    }
    res
}

fn caller_of(req_caller: Option<&Caller>) -> Caller {
    req_caller.cloned().unwrap_or_else(Caller::anonymous)
}

/// The notification a client sends to cancel one of its requests.
const CANCELLED: &str = "notifications/cancelled";

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

fn session_error_response(e: &SessionError) -> Response {
    let (status, code) = match e {
        SessionError::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
        SessionError::SessionLimit { .. } => (StatusCode::TOO_MANY_REQUESTS, "session_limit"),
        SessionError::Busy => (StatusCode::CONFLICT, "busy"),
        // 503 comes with Retry-After: only for what passes.
        SessionError::Kubernetes(_) => (StatusCode::SERVICE_UNAVAILABLE, "kubernetes_api"),
        SessionError::KubernetesRefused(_) => (StatusCode::BAD_GATEWAY, "kubernetes_api"),
        SessionError::Sandbox(_)
        | SessionError::Restarting(_)
        | SessionError::Interrupted(_)
        | SessionError::Deleted
        | SessionError::Agent(_) => (StatusCode::BAD_GATEWAY, "sandbox"),
        // Only a tool call is cancelled, and its errors are tool results.
        SessionError::Cancelled => (StatusCode::BAD_REQUEST, "cancelled"),
    };
    error_response(status, code, e.to_string())
}

async fn delete_session(
    State(s): State<Arc<AppState>>,
    caller: Option<axum::Extension<Caller>>,
    Path(id): Path<String>,
) -> Response {
    let t0 = Instant::now();
    let caller = caller_of(caller.as_deref());
    let sid = match SessionId::parse(&id) {
        Ok(sid) => sid,
        Err(e) => {
            s.metrics.error(ErrorKind::BadRequest);
            return error_response(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("invalid session id {id:?}: {e}"),
            );
        }
    };
    let result = s.mcp.sessions.backend().delete(&sid, &caller).await;
    let outcome = match &result {
        Ok(()) => "ok",
        Err(e) => e.kind().map_or("cancelled", ErrorKind::as_str),
    };
    audit::log(&audit::Record {
        action: "delete",
        session: Some(sid.as_str()),
        caller: &caller.name,
        duration_ms: t0.elapsed().as_millis() as u64,
        outcome,
        ..Default::default()
    });
    match result {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => {
            if let Some(kind) = e.kind() {
                s.metrics.error(kind);
            }
            session_error_response(&e)
        }
    }
}

async fn list_sessions(
    State(s): State<Arc<AppState>>,
    caller: Option<axum::Extension<Caller>>,
) -> Response {
    let caller = caller_of(caller.as_deref());
    match s.mcp.sessions.backend().list(&caller).await {
        Ok(list) => Json(json!({ "sessions": list })).into_response(),
        Err(e) => {
            if let Some(kind) = e.kind() {
                s.metrics.error(kind);
            }
            session_error_response(&e)
        }
    }
}

async fn not_found(req: Request) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        "not_found",
        format!(
            "no route for {} {}; this server serves POST /mcp, GET /sessions and DELETE /sessions/{{id}}",
            req.method(),
            req.uri().path()
        ),
    )
}

/// While draining, every HTTP/1 response closes its connection: a keep-alive client then
/// opens a new one, which the Service sends to a replica that is not going away. Without
/// this, idle keep-alive connections were closed under clients writing their next request
/// ("connection closed before message completed") during a rolling restart.
async fn close_when_draining(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let http1 = req.version() <= axum::http::Version::HTTP_11;
    let mut res = next.run(req).await;
    if http1 && s.draining.load(Ordering::Relaxed) {
        res.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    res
}

async fn readyz(State(s): State<Arc<AppState>>) -> Response {
    if s.draining.load(Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response();
    }
    match s.mcp.sessions.backend().ready().await {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response(),
    }
}

/// OpenMetrics, or the Prometheus text format for a scraper that prefers `text/plain`.
async fn metrics(State(s): State<Arc<AppState>>, headers: axum::http::HeaderMap) -> Response {
    let accept = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    let format = MetricsFormat::negotiate(Some(&accept));
    (
        [(header::CONTENT_TYPE, format.content_type())],
        s.metrics.encode_as(format),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_503_says_when_to_retry_and_a_401_how_to_authenticate() {
        let busy = error_response(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "busy");
        assert_eq!(
            busy.headers()
                .get(header::RETRY_AFTER)
                .map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
        let denied = error_response(StatusCode::UNAUTHORIZED, "unauthorized", "no token");
        assert!(denied.headers().get(header::WWW_AUTHENTICATE).is_some());
        assert!(denied.headers().get(header::RETRY_AFTER).is_none());
    }

    /// Only an API that cannot answer now is "retry in 1 s": a refusal (RBAC, a missing
    /// object) would be refused again on every retry a client makes.
    #[test]
    fn only_a_passing_api_failure_says_retry() {
        let api = |code: u16| {
            SessionError::from(kube::Error::Api(Box::new(kube::core::Status {
                code,
                message: format!("answer {code}"),
                ..Default::default()
            })))
        };
        for (code, status, retry) in [
            (401, StatusCode::BAD_GATEWAY, false),
            (403, StatusCode::BAD_GATEWAY, false),
            (422, StatusCode::BAD_GATEWAY, false),
            (404, StatusCode::SERVICE_UNAVAILABLE, true),
            (409, StatusCode::SERVICE_UNAVAILABLE, true),
            (429, StatusCode::SERVICE_UNAVAILABLE, true),
            (500, StatusCode::SERVICE_UNAVAILABLE, true),
            (503, StatusCode::SERVICE_UNAVAILABLE, true),
        ] {
            let e = api(code);
            let res = session_error_response(&e);
            assert_eq!(res.status(), status, "{code}: {e}");
            assert_eq!(
                res.headers().get(header::RETRY_AFTER).is_some(),
                retry,
                "{code}: {e}"
            );
            assert_eq!(e.to_string().contains("retry shortly"), retry, "{e}");
            assert_eq!(e.to_string().contains("is fixed"), !retry, "{e}");
        }
    }
}
