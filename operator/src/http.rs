//! `/metrics`, `/livez`, `/readyz` on the health address.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::metrics::Metrics;

/// Readiness: a leader is ready once its caches synced; a standby (waiting for the lease)
/// is ready too — it is healthy and able to take over.
pub fn router(metrics: Arc<Metrics>, leader: tokio::sync::watch::Receiver<bool>) -> Router {
    Router::new()
        .route("/livez", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move |State(m): State<Arc<Metrics>>| {
                let leader = *leader.borrow();
                async move {
                    match (leader, m.is_ready()) {
                        (false, _) => (StatusCode::OK, "standby"),
                        (true, true) => (StatusCode::OK, "ok"),
                        (true, false) => (StatusCode::SERVICE_UNAVAILABLE, "caches not synced"),
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    m.encode(),
                )
                    .into_response()
            }),
        )
        .with_state(metrics)
}

pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    leader: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics /livez /readyz");
    axum::serve(listener, router(metrics, leader)).await
}
