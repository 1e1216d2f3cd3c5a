//! HTTP routes.
//!
//! The MCP listener: `POST /mcp` (rmcp Streamable HTTP, stateless, JSON responses),
//! `DELETE /sessions/{id}`, `GET /sessions`, all behind the auth middleware, and the public
//! `GET /.well-known/oauth-protected-resource[/mcp]` (with `--auth kubernetes`). The health
//! listener (plain HTTP, never authenticated): `/livez`, `/readyz`, `/metrics`.
//!
//! - this module: the routers, and what every route shares (error responses, request
//!   counting, the lame-duck `Connection: close`);
//! - `browsers`: the `Origin` check and CORS; `auth`: authentication and the protected
//!   resource metadata; `jsonrpc`: the check of a `POST /mcp` body, cancellations and chat
//!   handles; `sessions`: `DELETE /sessions/{id}`, `GET /sessions`; `health`: the health
//!   listener.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::auth::resource::{self, ProtectedResource};
use crate::auth::{Authenticator, Caller};
use crate::mcp::{BashServer, McpState};
use crate::metrics::{Listener, Metrics};
use crate::origin::OriginPolicy;

mod auth;
mod browsers;
mod health;
mod jsonrpc;
mod sessions;

pub use self::health::health_router;

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
        .route("/sessions", get(sessions::list_sessions))
        .route("/sessions/{id}", delete(sessions::delete_session))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            jsonrpc::jsonrpc_guard,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::authenticate,
        ));
    // Before auth: a refused cross-site request costs no token review.
    let protected = browsers::guard_browsers(protected, state.metrics.clone(), opts.origins);
    // The metadata is public (no token, any origin: browser-based clients read it too).
    Router::new()
        .route(
            resource::WELL_KNOWN,
            get(auth::resource_metadata).fallback(auth::metadata_method),
        )
        .route(
            &format!("{}/{{*path}}", resource::WELL_KNOWN),
            get(auth::resource_metadata).fallback(auth::metadata_method),
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

/// Marks a response as the last on its connection.
fn close(mut res: Response) -> Response {
    res.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}

fn caller_of(req_caller: Option<&Caller>) -> Caller {
    req_caller.cloned().unwrap_or_else(Caller::anonymous)
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
}
