//! The proxy relay: the sandbox's `HTTPS_PROXY` (`127.0.0.1:3128`), forwarding each proxy
//! connection to the instance's credential proxy with the pod's proof of identity added.
//!
//! The proxy wants every CONNECT to say which sandbox pod sent it
//! (`Proxy-Authorization: Bearer <the pod's projected ServiceAccount token>`), and the tools
//! in the sandbox (kubectl, curl, pip, client-go) cannot be taught to send it. So they talk
//! to the relay, which reads the request head, replaces any `Proxy-Authorization` with the
//! pod's, connects to the proxy, writes the new head and whatever followed the old one, and
//! from then on only copies bytes both ways. The proxy answers the CONNECT itself; the relay
//! answers only what it refuses before the proxy is reached ([`reply`]).
//!
//! The token is not a secret from the shell (it runs in the same container and can read the
//! file too): the relay is a convenience, not a boundary. It is read from the file for every
//! connection, so the kubelet's rotation (a new file behind the `..data` link every few
//! minutes) takes effect at once, and it is never logged.

mod head;
mod reply;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use head::ReadError;
use reply::Status;

pub use head::BadHead;

/// Largest token file read: a projected ServiceAccount token is about a kilobyte.
const MAX_TOKEN_BYTES: u64 = 16 * 1024;

/// How much the relay takes on. The defaults are the production ones; tests shorten them.
#[derive(Debug, Clone, Copy)]
pub struct RelayLimits {
    /// Connections relayed at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Largest request head (request line and headers); a larger one is answered 431.
    pub max_head_bytes: usize,
    /// How long a client may take to send its whole head, from the accept; then 408.
    pub head_timeout: Duration,
    /// How long the proxy may take to accept the connection (name lookup included); then 502.
    pub connect_timeout: Duration,
}

impl Default for RelayLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_head_bytes: 32 * 1024,
            head_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Where the relay forwards to and what it proves the pod with.
#[derive(Debug, Clone)]
pub struct Relay {
    /// The instance proxy, `host:port`; the host is looked up again for every connection
    /// (a Service name, whose address may change).
    pub upstream: String,
    /// The pod's projected ServiceAccount token, which the kubelet rotates.
    pub token_file: PathBuf,
    pub limits: RelayLimits,
}

/// Checks that `upstream` has the form `host:port` (nothing is looked up).
pub fn check_upstream(upstream: &str) -> Result<(), String> {
    let (host, port) = upstream
        .rsplit_once(':')
        .ok_or_else(|| format!("{upstream:?} is not host:port"))?;
    if host.is_empty() || host.contains(['/', ' ']) {
        return Err(format!("{upstream:?} is not host:port (bad host)"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(format!("{upstream:?} is not host:port (bad port)")),
    }
}

/// Relays every connection `listener` accepts until `stop` turns true (or its sender is
/// dropped); then stops accepting and closes every relayed connection.
pub async fn serve(listener: TcpListener, relay: Relay, mut stop: watch::Receiver<bool>) {
    let relay = Arc::new(relay);
    let max = relay.limits.max_connections.max(1);
    let slots = Arc::new(Semaphore::new(max));
    // Refusing takes a moment too (the answer is given time to arrive): as many refusals
    // as connections at most; beyond that the answer is written once and the socket closed.
    let refusals = Arc::new(Semaphore::new(max));
    let mut conns = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let (client, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "proxy relay: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if let Ok(slot) = slots.clone().try_acquire_owned() {
            let relay = relay.clone();
            conns.spawn(async move {
                relay_one(client, peer, &relay).await;
                drop(slot);
            });
            continue;
        }
        let message = format!(
            "{max} relayed connections are open already (--proxy-relay-max-connections); \
             try again once one has closed"
        );
        log_refusal(peer, Status::ServiceUnavailable, &message);
        match refusals.clone().try_acquire_owned() {
            Ok(permit) => {
                conns.spawn(async move {
                    reply::refuse(client, Status::ServiceUnavailable, &message).await;
                    drop(permit);
                });
            }
            Err(_) => reply::refuse_now(client, Status::ServiceUnavailable, &message),
        }
    }
    drop(listener);
    conns.shutdown().await;
}

/// One client connection: its head, the token, the proxy, then bytes both ways.
async fn relay_one(mut client: TcpStream, peer: SocketAddr, relay: &Relay) {
    let _ = client.set_nodelay(true);
    let limits = &relay.limits;
    let received = match head::read(&mut client, limits.max_head_bytes, limits.head_timeout).await {
        Ok(received) => received,
        Err(ReadError::Closed) => {
            tracing::debug!(%peer, "proxy relay: the client left before its request head");
            return;
        }
        Err(ReadError::TooLarge) => {
            let message = format!(
                "the request head is larger than {} bytes",
                limits.max_head_bytes
            );
            return refused(client, peer, Status::HeaderFieldsTooLarge, &message).await;
        }
        Err(ReadError::TimedOut) => {
            let message = format!(
                "the request head did not arrive within {:?}",
                limits.head_timeout
            );
            return refused(client, peer, Status::RequestTimeout, &message).await;
        }
    };
    let checked = match head::check(&received.head) {
        Ok(checked) => checked,
        Err(bad) => {
            let message = format!("not an HTTP/1.x proxy request: {bad}");
            return refused(client, peer, Status::BadRequest, &message).await;
        }
    };
    // Before any connection to the proxy: without a token it would only refuse us.
    let token = match read_token(&relay.token_file).await {
        Ok(token) => token,
        Err(message) => return refused(client, peer, Status::BadGateway, &message).await,
    };
    let mut upstream = match connect(&relay.upstream, limits.connect_timeout).await {
        Ok(upstream) => upstream,
        Err(message) => return refused(client, peer, Status::BadGateway, &message).await,
    };
    let mut out = checked.with_token(&token);
    out.extend_from_slice(&received.rest);
    let sent = tokio::time::timeout(limits.connect_timeout, upstream.write_all(&out)).await;
    if !matches!(sent, Ok(Ok(()))) {
        let message = format!(
            "the proxy at {} did not take the request within {:?}",
            relay.upstream, limits.connect_timeout
        );
        return refused(client, peer, Status::BadGateway, &message).await;
    }
    match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        Ok((up, down)) => tracing::debug!(%peer, up, down, "proxy relay: connection closed"),
        Err(e) => tracing::debug!(%peer, error = %e, "proxy relay: connection ended"),
    }
}

/// Logs the refusal (the reason, never a header's value) and answers it.
async fn refused(client: TcpStream, peer: SocketAddr, status: Status, message: &str) {
    log_refusal(peer, status, message);
    reply::refuse(client, status, message).await;
}

fn log_refusal(peer: SocketAddr, status: Status, message: &str) {
    tracing::info!(
        %peer,
        status = status.code(),
        reason = message,
        "proxy relay refused a connection"
    );
}

/// The token in `path`, trimmed; the error names the file and says what is wrong with it.
async fn read_token(path: &Path) -> Result<String, String> {
    let failed = |e: std::io::Error| {
        format!(
            "cannot read the proxy token file {}: {e} (the pod's projected ServiceAccount \
             token, --proxy-token-file)",
            path.display()
        )
    };
    let file = tokio::fs::File::open(path).await.map_err(failed)?;
    let mut raw = Vec::new();
    file.take(MAX_TOKEN_BYTES + 1)
        .read_to_end(&mut raw)
        .await
        .map_err(failed)?;
    if raw.len() as u64 > MAX_TOKEN_BYTES {
        return Err(format!(
            "the proxy token file {} is larger than {MAX_TOKEN_BYTES} bytes",
            path.display()
        ));
    }
    let token = raw.trim_ascii();
    if token.is_empty() {
        return Err(format!("the proxy token file {} is empty", path.display()));
    }
    // Into a header line as it is: a line end or a control byte would forge more headers.
    if !token.iter().all(u8::is_ascii_graphic) {
        return Err(format!(
            "the proxy token file {} holds characters a header cannot carry",
            path.display()
        ));
    }
    Ok(String::from_utf8_lossy(token).into_owned())
}

/// A connection to the proxy, its name looked up anew each attempt. A connection refused,
/// reset or unroutable is tried again after [`retry_pause`] while the time limit allows: a
/// Service whose endpoints were just replaced (a proxy rollout, or the moment after the
/// instance became Ready, before every node routes the Service to the new pods) refuses for
/// a moment, and the next attempt reaches a live replica.
async fn connect(upstream: &str, timeout: Duration) -> Result<TcpStream, String> {
    let started = tokio::time::Instant::now();
    let deadline = started + timeout;
    let mut attempt = 0;
    loop {
        attempt += 1;
        match tokio::time::timeout_at(deadline, TcpStream::connect(upstream)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Ok(Err(e)) => match retry_pause(attempt, started.elapsed(), timeout) {
                Some(pause) => {
                    tracing::debug!(upstream, attempt, error = %e, "the proxy refused; trying again");
                    tokio::time::sleep(pause).await;
                }
                None => {
                    return Err(format!(
                        "cannot connect to the proxy at {upstream}: {e} ({attempt} attempts in \
                         {:?})",
                        started.elapsed()
                    ))
                }
            },
            Err(_) => {
                return Err(format!(
                    "the proxy at {upstream} did not accept a connection within {timeout:?}"
                ))
            }
        }
    }
}

/// How long to wait before attempt `attempt + 1` after `elapsed` of a `limit`: 50 ms,
/// doubling up to 800 ms, for at most 5 s (and never past the limit); `None`: give up.
fn retry_pause(attempt: u32, elapsed: Duration, limit: Duration) -> Option<Duration> {
    const RETRY_FOR: Duration = Duration::from_secs(5);
    let pause = Duration::from_millis(50)
        .saturating_mul(1 << attempt.saturating_sub(1).min(4))
        .min(Duration::from_millis(800));
    (elapsed + pause < limit.min(RETRY_FOR)).then_some(pause)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_connection_is_retried_with_backoff_within_the_limits() {
        let ms = Duration::from_millis;
        let limit = Duration::from_secs(10);
        assert_eq!(retry_pause(1, ms(0), limit), Some(ms(50)));
        assert_eq!(retry_pause(2, ms(50), limit), Some(ms(100)));
        assert_eq!(retry_pause(5, ms(800), limit), Some(ms(800)));
        assert_eq!(retry_pause(9, ms(2000), limit), Some(ms(800)));
        // Never past five seconds, nor past the connect limit.
        assert_eq!(retry_pause(9, ms(4500), limit), None);
        assert_eq!(retry_pause(1, ms(0), ms(40)), None);
    }

    #[test]
    fn upstreams_must_be_host_and_port() {
        for good in ["p.ns.svc:8080", "127.0.0.1:1", "[::1]:8080"] {
            assert_eq!(check_upstream(good), Ok(()), "{good}");
        }
        for bad in [
            "p.ns.svc",
            ":8080",
            "p:0",
            "p:http",
            "http://p:8080",
            "p:99999",
        ] {
            assert!(check_upstream(bad).is_err(), "{bad}");
        }
    }
}
