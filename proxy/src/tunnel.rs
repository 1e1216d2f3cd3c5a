//! An accepted CONNECT: TLS terminated with a leaf for the CONNECT host, then HTTP/1.1
//! requests served one at a time by [`crate::forward`].

use std::sync::Arc;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::upgrade::Upgraded;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio_rustls::rustls::server::Acceptor;
use tokio_rustls::LazyConfigAcceptor;
use tokio_util::sync::CancellationToken;

use cli_mcp_api::proxy::{Domain, Injector};

use crate::forward::{self, Tunnel};
use crate::metrics::GaugeGuard;
use crate::Shared;

pub async fn run(
    upgraded: Upgraded,
    domain: Domain,
    injector: Injector,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
) {
    let _open = GaugeGuard::new(&shared.metrics.tunnels);
    let limits = shared.limits;
    let refuse = |reason: &'static str, detail: String| {
        tracing::info!(domain = %domain, reason, detail, "tunnel refused");
        shared.metrics.refused(reason);
    };
    let accept = LazyConfigAcceptor::new(Acceptor::default(), TokioIo::new(upgraded));
    let start = match tokio::time::timeout(limits.handshake_timeout, accept).await {
        Ok(Ok(start)) => start,
        Ok(Err(e)) => return refuse("tls_handshake", e.to_string()),
        Err(_) => {
            return refuse(
                "tls_handshake_timeout",
                format!("{:?}", limits.handshake_timeout),
            )
        }
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
    let tls = match tokio::time::timeout(limits.handshake_timeout, start.into_stream(config)).await
    {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => return refuse("tls_handshake", e.to_string()),
        Err(_) => {
            return refuse(
                "tls_handshake_timeout",
                format!("{:?}", limits.handshake_timeout),
            )
        }
    };
    let tunnel = Arc::new(Tunnel::new(domain.clone(), injector, shared.clone()));
    let service = service_fn(move |req| forward::handle(tunnel.clone(), req));
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        // Also the idle limit between requests: hyper starts it whenever it waits for a head.
        .header_read_timeout(limits.idle_timeout)
        .max_buf_size(limits.max_header_bytes)
        .max_headers(limits.max_headers)
        .keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(tls), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = shutdown.cancelled() => {
            // Finish the request in flight, take no new one.
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(domain = %domain, error = %e, "tunnel ended");
    }
}
