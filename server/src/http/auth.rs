//! Authentication of the MCP listener's requests, and the public OAuth protected resource
//! metadata that tells a client where to get a token.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::{error_response, not_found, AppState};
use crate::auth::resource;
use crate::auth::{bearer, AuthError, Caller, Verb};
use crate::metrics::ErrorKind;

pub(super) async fn authenticate(
    State(s): State<Arc<AppState>>,
    mut req: Request,
    next: Next,
) -> Response {
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
pub(super) async fn resource_metadata(State(s): State<Arc<AppState>>, req: Request) -> Response {
    let Some(r) = s.resource.as_ref().filter(|r| r.serves(req.uri().path())) else {
        return not_found(req).await;
    };
    let mut res = Json(r.document(req.uri(), req.headers())).into_response();
    for (name, value) in r.document_headers() {
        res.headers_mut().insert(name, value);
    }
    res
}

pub(super) async fn metadata_method(req: Request) -> Response {
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
