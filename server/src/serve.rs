//! Accept loop for a router, with optional TLS, bounded request heads, bounded connections,
//! and graceful shutdown (stop accepting, let in-flight requests finish within a drain
//! period).
//!
//! A connection costs a task, buffers and a descriptor before it has sent a byte, and the
//! port is reachable before any authentication. So a connection must send its first request
//! within [`ConnLimits::first_request_within`] (hyper's own header timeout starts only once
//! it has told HTTP/1 from HTTP/2, which waits for the client's first bytes; HTTP/2 has no
//! header timeout at all), HTTP/2 peers must answer keep-alive pings, and at most
//! [`ConnLimits::max_connections`] are open at once: past that, new ones wait in the listen
//! backlog until one closes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// Largest request head (request line + headers) accepted.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most header fields per request.
pub const MAX_HEADERS: usize = 64;
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2: a ping this often on a quiet connection, which must be answered within
/// [`H2_PING_TIMEOUT`], so a vanished peer's connection is closed.
const H2_PING_INTERVAL: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// What one listener allows its connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// A connection that has not sent a complete request head by then is closed.
    pub first_request_within: Duration,
    /// Connections open at once; more wait in the listen backlog.
    pub max_connections: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            first_request_within: HEADER_READ_TIMEOUT,
            // Far above what the replicas' clients need (one or a few connections each,
            // kept alive), far below the descriptor limit the server raises itself to.
            max_connections: 8192,
        }
    }
}

fn builder() -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS);
    b.http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(H2_PING_INTERVAL)
        .keep_alive_timeout(H2_PING_TIMEOUT)
        .max_header_list_size(MAX_HEAD_BYTES as u32);
    b
}

/// Serves `app` on `listener` until `stop`, then waits up to `drain` for open requests.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<ServerConfig>>,
    stop: CancellationToken,
    drain: Duration,
    limits: ConnLimits,
) {
    let graceful = GracefulShutdown::new();
    let acceptor = tls.map(TlsAcceptor::from);
    let builder = builder();
    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        let permit = tokio::select! {
            _ = stop.cancelled() => break,
            permit = open.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let requested = Arc::new(AtomicBool::new(false));
        let mark = requested.clone();
        let service = TowerToHyperService::new(tower::ServiceExt::map_request(
            app.clone(),
            move |req: hyper::Request<hyper::body::Incoming>| {
                mark.store(true, Ordering::Relaxed);
                req
            },
        ));
        let watcher = graceful.watcher();
        let builder = builder.clone();
        let acceptor = acceptor.clone();
        let first_request_within = limits.first_request_within;
        tokio::spawn(async move {
            let _permit = permit;
            let connection = async move {
                match acceptor {
                    None => {
                        let conn = builder.serve_connection(TokioIo::new(stream), service);
                        watcher.watch(conn.into_owned()).await
                    }
                    Some(acceptor) => {
                        let tls = match tokio::time::timeout(
                            TLS_HANDSHAKE_TIMEOUT,
                            acceptor.accept(stream),
                        )
                        .await
                        {
                            Ok(Ok(s)) => s,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                return Ok(());
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake timed out");
                                return Ok(());
                            }
                        };
                        let conn = builder.serve_connection(TokioIo::new(tls), service);
                        watcher.watch(conn.into_owned()).await
                    }
                }
            };
            tokio::pin!(connection);
            let result = match tokio::time::timeout(first_request_within, &mut connection).await {
                Ok(result) => result,
                Err(_) if requested.load(Ordering::Relaxed) => connection.await,
                Err(_) => {
                    tracing::debug!(%peer, "no request within {first_request_within:?}; closed");
                    return;
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(drain) => {
            tracing::warn!(?drain, "requests still open after the drain period; closing them");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// Longer than any step of these tests takes, so only a failure waits for it.
    const GUARD: Duration = Duration::from_secs(20);

    async fn start(limits: ConnLimits) -> (std::net::SocketAddr, CancellationToken) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = Router::new().route("/", get(|| async { "hello" })).route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(600)).await;
                "slow hello"
            }),
        );
        let stop = CancellationToken::new();
        tokio::spawn(serve(
            listener,
            app,
            None,
            stop.clone(),
            Duration::from_secs(1),
            limits,
        ));
        (addr, stop)
    }

    fn limits(first_request_within_ms: u64, max_connections: usize) -> ConnLimits {
        ConnLimits {
            first_request_within: Duration::from_millis(first_request_within_ms),
            max_connections,
        }
    }

    /// Reads until the peer closes; what it sent.
    async fn read_to_close(conn: &mut TcpStream) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout(GUARD, conn.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return got,
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Err(_) => panic!("the server kept the connection open: {got:?}"),
            }
        }
    }

    async fn get_once(addr: std::net::SocketAddr, path: &str) -> String {
        let mut conn = TcpStream::connect(addr).await.expect("connect");
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        conn.write_all(req.as_bytes()).await.expect("write");
        String::from_utf8_lossy(&read_to_close(&mut conn).await).into_owned()
    }

    #[tokio::test]
    async fn a_connection_that_never_sends_a_byte_is_closed() {
        let (addr, stop) = start(limits(200, 16)).await;
        let mut silent = TcpStream::connect(addr).await.expect("connect");
        assert!(read_to_close(&mut silent).await.is_empty());
        stop.cancel();
    }

    #[tokio::test]
    async fn an_http2_preface_without_a_request_is_closed() {
        let (addr, stop) = start(limits(200, 16)).await;
        let mut conn = TcpStream::connect(addr).await.expect("connect");
        conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .expect("preface");
        // The server's SETTINGS frame, then the close.
        read_to_close(&mut conn).await;
        stop.cancel();
    }

    #[tokio::test]
    async fn a_request_slower_than_the_first_request_limit_is_answered_whole() {
        let (addr, stop) = start(limits(200, 16)).await;
        let answer = get_once(addr, "/slow").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("slow hello"), "{answer}");
        stop.cancel();
    }

    #[tokio::test]
    async fn past_the_connection_limit_a_new_connection_waits_for_a_free_place() {
        let (addr, stop) = start(limits(10_000, 1)).await;
        let holder = TcpStream::connect(addr).await.expect("connect");
        // The one place is the holder's once the server has accepted it: a request on a
        // second connection is not answered while the holder stays open.
        let mut waiting = TcpStream::connect(addr).await.expect("connect");
        waiting
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut byte = [0u8; 1];
        assert!(
            tokio::time::timeout(Duration::from_millis(300), waiting.read(&mut byte))
                .await
                .is_err(),
            "answered past the limit"
        );
        drop(holder);
        let answer = read_to_close(&mut waiting).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.ends_with("ello"), "{answer}");
        stop.cancel();
    }
}
