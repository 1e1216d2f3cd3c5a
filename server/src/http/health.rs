//! The health listener: `/livez`, `/readyz` and `/metrics` (plain HTTP, never
//! authenticated).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use super::{count_requests, AppState};
use crate::metrics::{Format as MetricsFormat, Listener};

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
