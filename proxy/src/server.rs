//! The client-facing listener: connection admission, the CONNECT request and the route check.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response};
use http_body_util::{Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use cli_mcp_api::proxy::Domain;

use crate::identity::Sandbox;
use crate::metrics::GaugeGuard;
use crate::peers::PeerSlot;
use crate::refusal::Refusal;
use crate::slow_head::Watched;
use crate::{tunnel, Shared};

type Body = http_body_util::Either<Empty<Bytes>, Full<Bytes>>;

/// Accepts until `shutdown`; every connection task is tracked by `tracker`.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
) {
    let slots = Arc::new(Semaphore::new(shared.limits.max_connections));
    let full = too_many_connections(shared.limits.max_connections);
    let client_full = too_many_from_one_client(shared.limits.max_connections_per_client);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            () = shutdown.cancelled() => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: the condition is outside our
                // control and clears when connections close; yield so the loop does not spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::task::yield_now().await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            shared.metrics.refused("connection_limit");
            tracing::info!(%peer, reason = "connection_limit", "connection refused");
            // Best effort, never waits: the refusal must cost nothing.
            let _ = stream.try_write(&full);
            continue;
        };
        let Some(slot) = shared.peers.try_take(peer.ip()) else {
            shared.metrics.refused("client_connection_limit");
            tracing::info!(%peer, reason = "client_connection_limit", "connection refused");
            let _ = stream.try_write(&client_full);
            continue;
        };
        let _ = stream.set_nodelay(true);
        tracker.spawn(connection(
            stream,
            peer,
            (permit, slot),
            shared.clone(),
            shutdown.clone(),
            tracker.clone(),
        ));
    }
}

fn too_many_connections(limit: usize) -> Vec<u8> {
    close_with(
        "503 Service Unavailable",
        &format!(
            "the proxy is at its limit of {limit} connections (--max-connections); retry later\n"
        ),
    )
}

fn too_many_from_one_client(limit: usize) -> Vec<u8> {
    close_with(
        "429 Too Many Requests",
        &format!(
            "this sandbox holds {limit} connections to the proxy already, its share \
             (--max-connections-per-client); close some and retry\n"
        ),
    )
}

fn close_with(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// What a connection holds until it closes: its place under `--max-connections` and its
/// client's under `--max-connections-per-client`.
type Slots = (OwnedSemaphorePermit, PeerSlot);

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    permit: Slots,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
) {
    let _open = GaugeGuard::new(&shared.metrics.connections);
    // The tunnel task keeps the slot after this HTTP connection has been upgraded.
    let permit = Arc::new(permit);
    let limits = shared.limits;
    let svc_shared = shared.clone();
    let svc_shutdown = shutdown.clone();
    let service = service_fn(move |req| {
        connect(
            req,
            peer,
            svc_shared.clone(),
            permit.clone(),
            svc_shutdown.clone(),
            tracker.clone(),
        )
    });
    let stream = Watched::new(stream);
    let conn = limits
        .http1(limits.header_read_timeout)
        .serve_connection(TokioIo::new(stream.clone()), service)
        .with_upgrades();
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        let reason = if e.is_timeout() {
            "header_read_timeout"
        } else if e.is_parse_too_large() {
            "headers_too_large"
        } else if e.is_parse() {
            "bad_request"
        } else {
            ""
        };
        if reason.is_empty() {
            tracing::debug!(error = %e, "client connection ended");
        } else {
            shared.metrics.refused(reason);
            tracing::info!(error = %e, reason, "connection refused");
        }
        if e.is_timeout() && stream.head_begun() {
            stream
                .request_timeout(
                    limits.header_read_timeout,
                    "--header-read-timeout",
                    limits.handshake_timeout,
                )
                .await;
        }
    }
}

async fn connect(
    req: Request<Incoming>,
    peer: SocketAddr,
    shared: Arc<Shared>,
    permit: Arc<Slots>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
) -> Result<Response<Body>, Infallible> {
    if req.method() != Method::CONNECT {
        return Ok(refuse(
            &shared,
            Refusal::not_connect(),
            req.uri().to_string(),
            peer,
        ));
    }
    let target = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .unwrap_or_default();
    let domain = match Domain::parse(&target) {
        Ok(d) => d,
        Err(e) => {
            return Ok(refuse(
                &shared,
                Refusal::bad_target(&target, &e.to_string()),
                target.clone(),
                peer,
            ))
        }
    };
    // Who asks comes first: a client that proves no sandbox learns nothing of the routes.
    let sandbox = match admit(&shared, peer, &req).await {
        Ok(s) => s,
        Err(r) => return Ok(refuse(&shared, r, target, peer)),
    };
    let Some(route) = shared.routes.get(&domain).cloned() else {
        return Ok(refuse(
            &shared,
            Refusal::domain_not_allowed(&domain),
            target,
            peer,
        ));
    };
    tracing::debug!(domain = %domain, session = sandbox.as_ref().map(|s| s.session.as_str()), "tunnel opened");
    let upgrade = hyper::upgrade::on(req);
    tracker.spawn(async move {
        match upgrade.await {
            Ok(upgraded) => tunnel::run(upgraded, route, sandbox, shared, shutdown).await,
            Err(e) => tracing::debug!(error = %e, "CONNECT upgrade failed"),
        }
        drop(permit);
    });
    Ok(Response::new(Body::Left(Empty::new())))
}

/// The sandbox the CONNECT proves (`None` from an unverifying proxy).
async fn admit(
    shared: &Shared,
    peer: SocketAddr,
    req: &Request<Incoming>,
) -> Result<Option<Arc<Sandbox>>, Refusal> {
    let Some(identity) = &shared.identity else {
        return Ok(None);
    };
    let authorization = req.headers().get(header::PROXY_AUTHORIZATION);
    identity.admit(peer.ip(), authorization).await.map(Some)
}

fn refuse(shared: &Shared, r: Refusal, target: String, peer: SocketAddr) -> Response<Body> {
    // Field names other than tracing's own `target` and `message`: a JSON log line would
    // carry each key twice.
    tracing::info!(
        connect = %target,
        %peer,
        reason = r.reason,
        status = r.status.as_u16(),
        detail = %r.message,
        "CONNECT refused"
    );
    shared.metrics.refused(r.reason);
    let mut resp = r.text().map(Body::Right);
    if r.status == http::StatusCode::PROXY_AUTHENTICATION_REQUIRED {
        resp.headers_mut().insert(
            header::PROXY_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"cli-mcp-proxy\""),
        );
    }
    // A refused client gets no second try on this connection.
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}
