//! One request inside a tunnel: checked, rewritten, forwarded upstream, its response streamed
//! back.
//!
//! A tunnel was opened for one `host:port`, and every request in it must be for that authority
//! (a `Host` naming another host would be smuggled past the route check). On kubernetes routes
//! the path is read with [`crate::k8s_path`] and protocol upgrades are refused, since exec,
//! attach and port-forward stream over SPDY or WebSocket; allow-list routes carry WebSocket
//! upgrades ([`crate::websocket`]). Bodies are never buffered: the
//! request body is handed to the upstream connection and the response body back to the client
//! as they arrive, so `logs -f` and watches stream and memory per request stays bounded by the
//! HTTP library's buffers.

use std::convert::Infallible;
use std::sync::{Arc, PoisonError};

use bytes::Bytes;
use http::header;
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;

use cli_mcp_api::proxy::{Domain, Injector, Route, RouteIdentity};

use crate::audit::{Audited, Record};
use crate::credentials::CredentialError;
use crate::headers::{impersonate, is_upgrade, strip_credentials, strip_hop_by_hop};
use crate::identity::Sandbox;
use crate::k8s_path;
use crate::refusal::Refusal;
use crate::upstream::UpstreamError;
use crate::websocket;
use crate::Shared;

pub type Body = Either<Audited<Incoming>, Full<Bytes>>;

/// The state of one tunnel: its route and its one upstream connection, opened on the first
/// request and reused for the next ones (HTTP/1.1 requests on a tunnel come one at a time).
pub struct Tunnel {
    domain: Domain,
    injector: Injector,
    identity: RouteIdentity,
    /// The sandbox that opened the tunnel (`None` from an unverifying proxy).
    sandbox: Option<Arc<Sandbox>>,
    shared: Arc<Shared>,
    upstream: tokio::sync::Mutex<Option<SendRequest<Incoming>>>,
    /// A WebSocket accepted on this tunnel, for [`crate::tunnel`] to run once hyper has
    /// written the 101 and let go of the connection.
    upgrade: std::sync::Mutex<Option<websocket::Pending>>,
}

impl Tunnel {
    pub fn new(route: Route, sandbox: Option<Arc<Sandbox>>, shared: Arc<Shared>) -> Self {
        Self {
            domain: route.domain,
            injector: route.injector,
            identity: route.identity,
            sandbox,
            shared,
            upstream: tokio::sync::Mutex::new(None),
            upgrade: std::sync::Mutex::new(None),
        }
    }

    /// The WebSocket accepted on this tunnel, if any.
    pub fn take_upgrade(&self) -> Option<websocket::Pending> {
        self.upgrade
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    fn is_kubernetes(&self) -> bool {
        self.injector == Injector::Kubernetes
    }

    fn refuse(&self, record: &Record, method: &Method, path: &str, r: Refusal) -> Response<Body> {
        let outcome = if r.reason == "upstream_error" {
            "upstream_error"
        } else {
            "refused"
        };
        record.finish(r.status.as_u16(), outcome, Some(r.reason), 0);
        tracing::info!(
            domain = %self.domain,
            %method,
            path,
            reason = r.reason,
            status = r.status.as_u16(),
            detail = %r.message,
            "request refused"
        );
        self.shared.metrics.refused(r.reason);
        let resp = if self.is_kubernetes() {
            r.kubernetes_status()
        } else {
            r.text()
        };
        resp.map(Either::Right)
    }

    /// The checks and rewrites; `Err` is what the client gets instead.
    fn prepare(&self, req: Request<Incoming>) -> Result<Request<Incoming>, Refusal> {
        if self.sandbox.as_ref().is_some_and(|s| s.is_revoked()) {
            return Err(Refusal::new(
                StatusCode::FORBIDDEN,
                "session_ended",
                "the sandbox's session has ended; the proxy serves it no more",
            ));
        }
        if req.method() == Method::CONNECT {
            return Err(Refusal::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "nested_connect",
                "CONNECT inside a tunnel is refused",
            ));
        }
        self.check_authority(&req)?;
        if self.is_kubernetes() {
            k8s_path::classify(req.uri().path()).map_err(|p| Refusal::path(&p))?;
        }
        let websocket = if is_upgrade(req.headers()) {
            if self.is_kubernetes() {
                return Err(Refusal::new(
                    StatusCode::FORBIDDEN,
                    "upgrade_refused",
                    "exec, attach and port-forward stream through a protocol upgrade (SPDY or \
                     WebSocket); the proxy never allows an upgrade on a Kubernetes API route, \
                     whatever the kubeconfig's RBAC says",
                ));
            }
            Some(websocket::requested(req.headers()).ok_or_else(|| {
                Refusal::new(
                    StatusCode::NOT_IMPLEMENTED,
                    "upgrade_unsupported",
                    "the proxy forwards only WebSocket upgrades (Connection: upgrade and \
                     Upgrade: websocket)",
                )
            })?)
        } else {
            None
        };
        let (mut parts, body) = req.into_parts();
        // Origin form upstream, whatever form the client used (an absolute-form target was
        // checked against the CONNECT authority above).
        if parts.uri.authority().is_some() {
            parts.uri = parts
                .uri
                .path_and_query()
                .cloned()
                .map_or_else(|| Uri::from_static("/"), Uri::from);
        }
        strip_hop_by_hop(&mut parts.headers);
        strip_credentials(&mut parts.headers);
        if let Some(protocol) = websocket {
            websocket::mark(&mut parts.headers, protocol);
        }
        if self.is_kubernetes() {
            let value = self
                .shared
                .credentials
                .authorization(&self.domain)
                .map_err(credential_refusal)?;
            parts.headers.insert(header::AUTHORIZATION, value);
            if self.identity == RouteIdentity::ImpersonateCaller {
                self.impersonate(&mut parts.headers)?;
            }
        }
        Ok(Request::from_parts(parts, body))
    }

    /// The session's caller as the identity of the request, or a refusal: never the shared
    /// identity in its place.
    fn impersonate(&self, headers: &mut http::HeaderMap) -> Result<(), Refusal> {
        let refuse = |why: &str| {
            Refusal::new(
                StatusCode::FORBIDDEN,
                "no_caller",
                format!(
                    "this target acts as each session's MCP caller (identity \
                     impersonateCaller), and {why}; the proxy never falls back to its shared \
                     identity"
                ),
            )
        };
        let sandbox = self
            .sandbox
            .as_ref()
            .ok_or_else(|| refuse("this proxy does not verify sandboxes"))?;
        let caller = sandbox.caller.as_ref().ok_or_else(|| {
            refuse("this session has no caller (its server runs without --auth kubernetes)")
        })?;
        // Never the cluster's superuser group, whatever the pod says: a caller recorded as
        // system:masters would bypass RBAC wherever the proxy may impersonate groups freely.
        if caller.groups.iter().any(|g| g == "system:masters") {
            return Err(refuse("its caller claims the group system:masters"));
        }
        impersonate(headers, caller, &sandbox.session)
            .map_err(|e| refuse(&format!("its caller cannot be named in a header: {e}")))
    }

    fn check_authority(&self, req: &Request<Incoming>) -> Result<(), Refusal> {
        let mismatch = |what: &str, got: &str| {
            Refusal::new(
                StatusCode::MISDIRECTED_REQUEST,
                "authority_mismatch",
                format!(
                    "{what} {got:?} does not match the CONNECT authority {}; a tunnel reaches \
                     only the host it was opened for",
                    self.domain
                ),
            )
        };
        let same = |s: &str| Domain::with_default_port(s, 443).is_ok_and(|d| d == self.domain);
        if let Some(auth) = req.uri().authority() {
            if req.uri().scheme_str() != Some("https") || !same(auth.as_str()) {
                return Err(mismatch("the request target", &req.uri().to_string()));
            }
        }
        let mut hosts = req.headers().get_all(header::HOST).iter();
        let (Some(host), None) = (hosts.next(), hosts.next()) else {
            return Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                "bad_host",
                "a request needs exactly one Host header",
            ));
        };
        let host = host.to_str().unwrap_or("");
        if !same(host) {
            return Err(mismatch("Host", host));
        }
        Ok(())
    }

    async fn send(&self, req: Request<Incoming>) -> Result<Response<Incoming>, UpstreamError> {
        let upstreams = &self.shared.upstreams;
        let mut slot = self.upstream.lock().await;
        let reusable = match slot.take() {
            Some(mut s) => s.ready().await.is_ok().then_some(s),
            None => None,
        };
        let mut sender = match reusable {
            Some(s) => s,
            None => {
                let mut s = upstreams.connect(&self.domain).await?;
                s.ready()
                    .await
                    .map_err(|e| UpstreamError::Http(self.domain.clone(), e))?;
                s
            }
        };
        let pending = sender.send_request(req);
        *slot = Some(sender);
        drop(slot);
        let limit = upstreams.timeouts.response_headers;
        match tokio::time::timeout(limit, pending).await {
            Err(_) => Err(UpstreamError::ResponseTimeout(self.domain.clone(), limit)),
            Ok(r) => r.map_err(|e| UpstreamError::Http(self.domain.clone(), e)),
        }
    }
}

fn credential_refusal(e: CredentialError) -> Refusal {
    let reason = match e {
        CredentialError::NoToken(_) => "no_token",
        _ => "kubeconfig_unusable",
    };
    Refusal::new(StatusCode::BAD_GATEWAY, reason, e.to_string())
}

/// The tunnel's service function.
pub async fn handle(
    tunnel: Arc<Tunnel>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    // For the log lines after `req` is consumed; both clones share the parsed head's bytes.
    let method = req.method().clone();
    let uri = req.uri().clone();
    let path = uri.path();
    let record = Record::new(
        tunnel.shared.clone(),
        tunnel.sandbox.clone(),
        tunnel.domain.as_str(),
        &method,
        &uri,
    );
    let mut req = match tunnel.prepare(req) {
        Ok(r) => r,
        Err(r) => {
            tunnel.shared.metrics.request("refused");
            return Ok(tunnel.refuse(&record, &method, path, r));
        }
    };
    // Taken before the request goes upstream: hyper hands the client's connection over
    // through it once the 101 is written.
    let client_upgrade = websocket::requested(req.headers()).map(|_| hyper::upgrade::on(&mut req));
    match tunnel.send(req).await {
        Ok(mut resp) if resp.status() == StatusCode::SWITCHING_PROTOCOLS => {
            let protocol = resp.headers().get(header::UPGRADE).cloned();
            let (Some(client), Some(protocol)) =
                (client_upgrade, protocol.filter(websocket::is_websocket))
            else {
                tunnel.shared.metrics.request("upstream_error");
                let r = Refusal::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "the upstream switched protocols without a WebSocket upgrade being asked \
                     for and answered",
                );
                return Ok(tunnel.refuse(&record, &method, path, r));
            };
            let upstream = hyper::upgrade::on(&mut resp);
            tunnel.shared.metrics.request("forwarded");
            tracing::debug!(domain = %tunnel.domain, %method, path, "WebSocket upgrade accepted");
            *tunnel
                .upgrade
                .lock()
                .unwrap_or_else(PoisonError::into_inner) =
                Some(websocket::Pending { client, upstream });
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            websocket::mark(&mut parts.headers, protocol);
            let body = Audited::new(body, record, parts.status.as_u16());
            Ok(Response::from_parts(parts, Either::Left(body)))
        }
        Ok(resp) => {
            tunnel.shared.metrics.request("forwarded");
            tracing::debug!(domain = %tunnel.domain, %method, path, status = resp.status().as_u16(), "forwarded");
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            let body = Audited::new(body, record, parts.status.as_u16());
            Ok(Response::from_parts(parts, Either::Left(body)))
        }
        Err(e) => {
            tunnel.shared.metrics.request("upstream_error");
            let status = match e {
                UpstreamError::ResponseTimeout(..)
                | UpstreamError::ConnectTimeout(..)
                | UpstreamError::HandshakeTimeout(..) => StatusCode::GATEWAY_TIMEOUT,
                _ => StatusCode::BAD_GATEWAY,
            };
            let r = Refusal::new(status, "upstream_error", format!("upstream {e}"));
            Ok(tunnel.refuse(&record, &method, path, r))
        }
    }
}
