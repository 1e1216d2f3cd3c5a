//! `DELETE /sessions/{id}` and `GET /sessions`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use cli_mcp_api::SessionId;

use super::{caller_of, error_response, AppState};
use crate::audit;
use crate::auth::Caller;
use crate::metrics::ErrorKind;
use crate::sessions::SessionError;

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

pub(super) async fn delete_session(
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

pub(super) async fn list_sessions(
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

#[cfg(test)]
mod tests {
    use axum::http::header;

    use super::*;

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
