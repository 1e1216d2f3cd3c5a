//! The MCP listener's guard against browsers: a foreign `Origin` is refused before anything
//! else runs, and the pages of allowed origins get CORS.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use super::error_response;
use crate::metrics::{ErrorKind, Metrics};
use crate::origin::OriginPolicy;

/// The guard of the MCP listener's routes against browsers: [`check_origin`] refuses a
/// foreign `Origin` before anything else runs, then tower-http's CORS layer serves the pages
/// of allowed origins. Both sit outside `router`'s own layers (authentication), so a
/// preflight, which a browser sends without `Authorization`, is answered without a token.
pub(super) fn guard_browsers<S>(
    router: Router<S>,
    metrics: Arc<Metrics>,
    policy: OriginPolicy,
) -> Router<S>
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
            HeaderName::from_static(crate::mcp::session::MCP_SESSION_HEADER),
            HeaderName::from_static("mcp-protocol-version"),
            header::WWW_AUTHENTICATE,
        ])
        .max_age(CORS_MAX_AGE)
}

/// How long a browser may reuse a preflight's answer.
const CORS_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(600);

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use axum::body::Body;
    use axum::http::HeaderValue;
    use tower::ServiceExt as _;

    use super::*;

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
}
