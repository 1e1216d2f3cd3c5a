//! An accepted CONNECT: TLS terminated with a leaf for the CONNECT host, then HTTP/1.1
//! requests served one at a time by [`crate::forward`], or a WebSocket once one is accepted.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio_rustls::rustls::server::Acceptor;
use tokio_rustls::LazyConfigAcceptor;
use tokio_util::sync::{CancellationToken, DropGuard};

use cli_mcp_api::proxy::Route;

use crate::forward::{self, Tunnel};
use crate::identity::Sandbox;
use crate::metrics::GaugeGuard;
use crate::slow_head::Watched;
use crate::Shared;

pub async fn run(
    upgraded: Upgraded,
    route: Route,
    sandbox: Option<Arc<Sandbox>>,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
) {
    let _open = GaugeGuard::new(&shared.metrics.tunnels);
    let domain = route.domain.clone();
    let limits = shared.limits;
    let refuse = |reason: &'static str, detail: String| {
        tracing::info!(domain = %domain, reason, detail, "tunnel refused");
        shared.metrics.refused(reason);
    };
    let accept = LazyConfigAcceptor::new(Acceptor::default(), TokioIo::new(upgraded));
    let start = match step(limits.handshake_timeout, accept).await {
        Ok(start) => start,
        Err((reason, detail)) => return refuse(reason, detail),
    };
    // SNI names the host the client thinks it is talking to; it must be the CONNECT host (IP
    // literals carry no SNI), or the client is trying to reach one host through another's
    // tunnel.
    if let Some(sni) = start.client_hello().server_name() {
        if !sni
            .trim_end_matches('.')
            .eq_ignore_ascii_case(domain.host())
        {
            return refuse(
                "sni_mismatch",
                format!(
                    "SNI {sni:?} does not match the CONNECT host {}",
                    domain.host()
                ),
            );
        }
    }
    let config = match shared.ca.server_config(domain.host()) {
        Ok(c) => c,
        Err(e) => return refuse("leaf_certificate", e.to_string()),
    };
    let tls = match step(limits.handshake_timeout, start.into_stream(config)).await {
        Ok(tls) => tls,
        Err((reason, detail)) => return refuse(reason, detail),
    };
    let Revocation {
        revoked,
        stop,
        _done,
    } = Revocation::of(sandbox.as_ref(), &shutdown);
    let tunnel = Arc::new(Tunnel::new(route, sandbox.clone(), shared.clone()));
    let svc_tunnel = tunnel.clone();
    let service = service_fn(move |req| forward::handle(svc_tunnel.clone(), req));
    // The idle limit between requests: hyper starts the head timer whenever it waits for one.
    let tls = Watched::new(tls);
    let conn = limits
        .http1(limits.idle_timeout)
        .serve_connection(TokioIo::new(tls.clone()), service)
        .with_upgrades();
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = revoked.cancelled() => {
            return refuse("session_ended", "the sandbox's session ended; tunnel cut".into());
        }
        () = shutdown.cancelled() => {
            // Finish the request in flight, take no new one.
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    // After a 101 hyper lets go of the connection; the WebSocket keeps the tunnel's slot.
    if let Some(ws) = tunnel.take_upgrade() {
        ws.run(
            &domain,
            limits.handshake_timeout,
            limits.idle_timeout,
            &stop,
        )
        .await;
    }
    if let Err(e) = result {
        if e.is_timeout() && tls.head_begun() {
            refuse("header_read_timeout", e.to_string());
            tls.request_timeout(
                limits.idle_timeout,
                "--idle-timeout",
                limits.handshake_timeout,
            )
            .await;
        } else {
            tracing::debug!(domain = %domain, error = %e, "tunnel ended");
        }
    }
}

/// When the sandbox's session ends its tunnels are cut at once, an open watch or WebSocket
/// included, not merely refused their next request.
struct Revocation {
    /// Cancelled when the session ends.
    revoked: CancellationToken,
    /// Cancelled when the session ends or the proxy stops (what a WebSocket watches).
    stop: CancellationToken,
    /// Ends the task that watches the session, with the tunnel.
    _done: DropGuard,
}

impl Revocation {
    fn of(sandbox: Option<&Arc<Sandbox>>, shutdown: &CancellationToken) -> Self {
        let revoked = CancellationToken::new();
        let stop = shutdown.child_token();
        if let Some(sandbox) = sandbox.cloned() {
            let (revoked, stop) = (revoked.clone(), stop.clone());
            tokio::spawn(async move {
                tokio::select! {
                    () = sandbox.revoked() => {
                        revoked.cancel();
                        stop.cancel();
                    }
                    () = revoked.cancelled() => {}
                }
            });
        }
        Self {
            _done: revoked.clone().drop_guard(),
            revoked,
            stop,
        }
    }
}

/// One TLS handshake step within `limit`; `Err` is the refusal's reason and detail.
async fn step<T>(
    limit: Duration,
    fut: impl Future<Output = std::io::Result<T>>,
) -> Result<T, (&'static str, String)> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(done)) => Ok(done),
        Ok(Err(e)) => Err(("tls_handshake", e.to_string())),
        Err(_) => Err(("tls_handshake_timeout", format!("{limit:?}"))),
    }
}
