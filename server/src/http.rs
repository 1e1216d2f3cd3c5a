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
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

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
        .layer(middleware::from_fn_with_state(state.clone(), authenticate));
    // Before auth: a refused cross-site request costs no token review.
    let protected = guard_browsers(protected, state.metrics.clone(), opts.origins);
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

/// The guard of the MCP listener's routes against browsers: [`check_origin`] refuses a
/// foreign `Origin` before anything else runs, then tower-http's CORS layer serves the pages
/// of allowed origins. Both sit outside `router`'s own layers (authentication), so a
/// preflight, which a browser sends without `Authorization`, is answered without a token.
fn guard_browsers<S>(router: Router<S>, metrics: Arc<Metrics>, policy: OriginPolicy) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    let policy = Arc::new(policy);
    router
        .layer(cors(policy.clone()))
        .layer(middleware::from_fn_with_state(
            (metrics, policy),
            check_origin,
        ))
}

/// 403 for a request whose `Origin` is not allowed (see [`crate::origin`]), or that sends
/// `Origin` twice. This, not CORS, is the DNS-rebinding and cross-site defence: CORS only
/// decides what a browser lets a page read, after the request has run.
async fn check_origin(
    State((metrics, policy)): State<(Arc<Metrics>, Arc<OriginPolicy>)>,
    req: Request,
    next: Next,
) -> Response {
    let mut origins = req.headers().get_all(header::ORIGIN).iter();
    let verdict = match (origins.next(), origins.next()) {
        (None, _) => Ok(()),
        (Some(origin), None) => policy.check(origin),
        (Some(_), Some(_)) => Err("the Origin header is sent more than once".to_owned()),
    };
    match verdict {
        Ok(()) => next.run(req).await,
        Err(why) => {
            metrics.error(ErrorKind::Forbidden);
            tracing::warn!(reason = %why, "refused a request by its Origin");
            error_response(StatusCode::FORBIDDEN, "forbidden_origin", why)
        }
    }
}

/// CORS for the pages of allowed origins: without `Access-Control-Allow-Origin` a browser
/// hides every answer from the page, so "allowed" would mean nothing across origins. The
/// origin is echoed (never `*`) only when `policy` allows it, so the layer stays safe even
/// without [`check_origin`] in front of it. No `Allow-Credentials`: the token is a header,
/// not a cookie.
fn cors(policy: Arc<OriginPolicy>) -> CorsLayer {
    use axum::http::{HeaderName, Method};
    CorsLayer::new()
        .allow_origin(AllowOrigin::predicate(move |origin, _| {
            policy.check(origin).is_ok()
        }))
        .allow_methods([Method::GET, Method::POST, Method::DELETE, Method::OPTIONS])
        // The request headers MCP clients send.
        // Whatever request headers the page asks for: the origin is one allowed already, the
        // token is a header of its own, and MCP keeps adding headers (`Mcp-Method`,
        // `Mcp-Param-*`) that a fixed list would make every preflight refuse.
        .allow_headers(AllowHeaders::mirror_request())
        // The answer headers a page needs: the chat's handle, the protocol version, and where
        // to get a token.
        .expose_headers([
            HeaderName::from_static(crate::mcp::MCP_SESSION_HEADER),
            HeaderName::from_static("mcp-protocol-version"),
            header::WWW_AUTHENTICATE,
        ])
        .max_age(CORS_MAX_AGE)
}

/// How long a browser may reuse a preflight's answer.
const CORS_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(600);

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
    use tower::ServiceExt as _;

    /// The routes behind the browser guard, with a stand-in for authentication that refuses
    /// every request without `Authorization` and counts the requests that reached it.
    fn guarded(reached: Arc<std::sync::atomic::AtomicUsize>) -> Router {
        let routes = Router::new()
            .route("/mcp", axum::routing::post(|| async { "ran" }))
            .layer(middleware::from_fn(move |req: Request, next: Next| {
                let reached = reached.clone();
                async move {
                    reached.fetch_add(1, Ordering::SeqCst);
                    if req.headers().contains_key(header::AUTHORIZATION) {
                        next.run(req).await
                    } else {
                        error_response(StatusCode::UNAUTHORIZED, "unauthorized", "no token")
                    }
                }
            }));
        let policy = OriginPolicy {
            allowed: vec![
                crate::origin::AllowedOrigin::parse("https://app.example.com").expect("origin"),
            ],
            loopback: false,
        };
        guard_browsers(routes, Arc::new(Metrics::new()), policy)
    }

    fn request(method: &str, origin: Option<&str>, extra: &[(&str, &str)]) -> Request {
        let mut b = Request::builder().method(method).uri("/mcp");
        if let Some(o) = origin {
            b = b.header(header::ORIGIN, o);
        }
        for (k, v) in extra {
            b = b.header(*k, *v);
        }
        b.body(Body::empty()).expect("request")
    }

    fn get<'a>(res: &'a Response, name: &str) -> Option<&'a str> {
        res.headers().get(name).and_then(|v| v.to_str().ok())
    }

    /// A preflight is answered before authentication (a browser sends it without a token);
    /// an answer from behind authentication, a 401 included, carries what a page of an
    /// allowed origin needs to read it; a foreign origin is refused before anything runs.
    #[tokio::test]
    async fn browsers_get_cors_before_authentication_and_foreign_origins_nothing() {
        let reached = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let app = guarded(reached.clone());
        let page = Some("https://app.example.com");

        let preflight = [
            ("access-control-request-method", "POST"),
            (
                "access-control-request-headers",
                "authorization, mcp-session-id, mcp-protocol-version, last-event-id, mcp-method",
            ),
        ];
        let res = app
            .clone()
            .oneshot(request("OPTIONS", page, &preflight))
            .await
            .expect("infallible");
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(get(&res, "access-control-allow-origin"), page);
        assert_eq!(get(&res, "access-control-max-age"), Some("600"));
        let headers = get(&res, "access-control-allow-headers").unwrap_or_default();
        for h in [
            "authorization",
            "mcp-session-id",
            "mcp-protocol-version",
            "last-event-id",
            "mcp-method",
        ] {
            assert!(headers.contains(h), "{h} in {headers}");
        }
        assert_eq!(
            reached.load(Ordering::SeqCst),
            0,
            "the preflight reached auth"
        );

        let res = app
            .clone()
            .oneshot(request("POST", page, &[]))
            .await
            .expect("infallible");
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(get(&res, "access-control-allow-origin"), page);
        let exposed = get(&res, "access-control-expose-headers").unwrap_or_default();
        for h in ["mcp-session-id", "mcp-protocol-version", "www-authenticate"] {
            assert!(exposed.contains(h), "{h} in {exposed}");
        }
        assert!(get(&res, "vary").is_some_and(|v| v.contains("origin")));
        let res = app
            .clone()
            .oneshot(request("POST", page, &[("authorization", "Bearer t")]))
            .await
            .expect("infallible");
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(get(&res, "access-control-allow-origin"), page);
        assert_eq!(reached.load(Ordering::SeqCst), 2);

        for (method, extra) in [("OPTIONS", &preflight[..]), ("POST", &[][..])] {
            let res = app
                .clone()
                .oneshot(request(method, Some("http://evil.example"), extra))
                .await
                .expect("infallible");
            assert_eq!(res.status(), StatusCode::FORBIDDEN, "{method}");
            assert_eq!(get(&res, "access-control-allow-origin"), None, "{method}");
        }
        let mut twice = request("POST", page, &[]);
        twice.headers_mut().append(
            header::ORIGIN,
            HeaderValue::from_static("https://app.example.com"),
        );
        let res = app.clone().oneshot(twice).await.expect("infallible");
        assert_eq!(res.status(), StatusCode::FORBIDDEN);
        assert_eq!(
            reached.load(Ordering::SeqCst),
            2,
            "a foreign origin reached auth"
        );
    }

    /// The CORS layer echoes only an origin the policy allows, so it cannot undo the origin
    /// check if it ever ends up outside it.
    #[tokio::test]
    async fn the_cors_layer_itself_never_echoes_a_foreign_origin() {
        let policy = Arc::new(OriginPolicy {
            allowed: vec![],
            loopback: true,
        });
        let app = Router::new()
            .route("/mcp", axum::routing::post(|| async { "ran" }))
            .layer(cors(policy));
        for (origin, echoed) in [
            ("http://localhost:3000", true),
            ("http://evil.example", false),
        ] {
            let res = app
                .clone()
                .oneshot(request("POST", Some(origin), &[]))
                .await
                .expect("infallible");
            assert_eq!(
                get(&res, "access-control-allow-origin"),
                echoed.then_some(origin),
                "{origin}"
            );
        }
    }

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

    /// Only an API that cannot answer now, or an object that changed or went in between (404,
    /// 409: a race with another replica), is "retry in 1 s": a refusal (RBAC, an invalid
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
