//! `GET /healthz` (the process serves), `/readyz` (it can do its job: routes and CA loaded —
//! they are, or it would not have started —, the sandbox pods listed once, and the
//! kubeconfig readable with a token for every kubernetes route) and `/metrics`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use cli_mcp_api::proxy::Injector;

use crate::Shared;

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(shared)
}

/// Why the proxy is not ready, or `None`.
pub fn not_ready(shared: &Shared) -> Option<String> {
    if shared.shutting_down.load(Ordering::Relaxed) {
        return Some("shutting down".into());
    }
    if let Some(why) = shared.identity.as_ref().and_then(|i| i.not_ready()) {
        return Some(why.into());
    }
    for route in shared.routes.routes() {
        if route.injector == Injector::Kubernetes {
            if let Err(e) = shared.credentials.authorization(&route.domain) {
                return Some(e.to_string());
            }
        }
    }
    None
}

async fn readyz(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    match not_ready(&shared) {
        None => (StatusCode::OK, "ok\n".to_string()),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

async fn metrics(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        shared.metrics.encode(),
    )
}
