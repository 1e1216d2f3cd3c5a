//! WebSocket on allow-list routes: the upgrade request is checked and scrubbed like any other
//! request; once the upstream answers `101`, both connections are handed over by hyper and
//! the bytes are copied both ways until either side closes or the pair is idle for the
//! tunnel's idle timeout. Kubernetes routes never get here: exec, attach and port-forward
//! ride on upgrades, so [`crate::forward`] refuses them first.

use std::time::Duration;

use http::header::{self, HeaderMap, HeaderValue};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use cli_mcp_api::proxy::Domain;

/// Bytes read at once from each side: the memory a WebSocket costs beyond hyper's buffers.
const CHUNK: usize = 16 * 1024;

/// The protocol of a well-formed WebSocket upgrade request (`Connection: upgrade` and exactly
/// one `Upgrade: websocket`), to be sent on upstream once hop-by-hop headers are gone.
pub fn requested(headers: &HeaderMap) -> Option<HeaderValue> {
    let connection_upgrade = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|o| o.trim().eq_ignore_ascii_case("upgrade"));
    let mut upgrades = headers.get_all(header::UPGRADE).iter();
    match (upgrades.next(), upgrades.next()) {
        (Some(v), None) if connection_upgrade && is_websocket(v) => Some(v.clone()),
        _ => None,
    }
}

pub fn is_websocket(v: &HeaderValue) -> bool {
    v.to_str()
        .is_ok_and(|s| s.trim().eq_ignore_ascii_case("websocket"))
}

/// Marks `headers` as a WebSocket upgrade (after hop-by-hop headers were stripped).
pub fn mark(headers: &mut HeaderMap, protocol: HeaderValue) {
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, protocol);
}

/// Both halves of an accepted upgrade, waiting for hyper to hand the connections over.
pub struct Pending {
    pub client: OnUpgrade,
    pub upstream: OnUpgrade,
}

impl Pending {
    /// Copies both ways until a side closes, `idle` passes without a byte either way, or
    /// `shutdown`. The hand-over itself is bounded by `handover`.
    pub async fn run(
        self,
        domain: &Domain,
        handover: Duration,
        idle: Duration,
        shutdown: &CancellationToken,
    ) {
        let both = async { tokio::try_join!(self.client, self.upstream) };
        let (client, upstream) = match tokio::time::timeout(handover, both).await {
            Ok(Ok(pair)) => pair,
            Ok(Err(e)) => {
                return tracing::debug!(domain = %domain, error = %e, "WebSocket hand-over failed")
            }
            Err(_) => return tracing::debug!(domain = %domain, "WebSocket hand-over timed out"),
        };
        tracing::debug!(domain = %domain, "WebSocket open");
        let end = tokio::select! {
            end = splice(TokioIo::new(client), TokioIo::new(upstream), idle) => end,
            () = shutdown.cancelled() => "proxy stopping",
        };
        tracing::debug!(domain = %domain, end, "WebSocket closed");
    }
}

/// Copies `a` to `b` and `b` to `a`; returns why it stopped. One side's end of stream is
/// passed on as a write shutdown and the other direction goes on until it ends too.
async fn splice<A, B>(a: A, b: B, idle: Duration) -> &'static str
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (mut a_read, mut a_write) = tokio::io::split(a);
    let (mut b_read, mut b_write) = tokio::io::split(b);
    let mut a_buf = vec![0u8; CHUNK];
    let mut b_buf = vec![0u8; CHUNK];
    let (mut a_open, mut b_open) = (true, true);
    while a_open || b_open {
        // Reads are cancel-safe: the branch not taken loses nothing.
        let step = tokio::time::timeout(idle, async {
            tokio::select! {
                r = a_read.read(&mut a_buf), if a_open => {
                    pass(r, &a_buf, &mut b_write, &mut a_open).await
                }
                r = b_read.read(&mut b_buf), if b_open => {
                    pass(r, &b_buf, &mut a_write, &mut b_open).await
                }
            }
        })
        .await;
        match step {
            Err(_) => return "idle",
            Ok(Err(_)) => return "connection error",
            Ok(Ok(())) => {}
        }
    }
    "closed by both sides"
}

/// Writes what one read gave to the other side; an end of stream closes that direction.
async fn pass<W: AsyncWrite + Unpin>(
    read: std::io::Result<usize>,
    buf: &[u8],
    to: &mut W,
    open: &mut bool,
) -> std::io::Result<()> {
    match read? {
        0 => {
            *open = false;
            to.shutdown().await
        }
        n => {
            to.write_all(&buf[..n]).await?;
            to.flush().await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headers::test_map as map;

    #[test]
    fn only_a_well_formed_websocket_upgrade_is_one() {
        let ok = map(&[
            ("Connection", "keep-alive, Upgrade"),
            ("Upgrade", "WebSocket"),
        ]);
        assert_eq!(requested(&ok).unwrap(), "WebSocket");
        for bad in [
            map(&[("Upgrade", "websocket")]),
            map(&[("Connection", "upgrade")]),
            map(&[("Connection", "upgrade"), ("Upgrade", "h2c")]),
            map(&[("Connection", "upgrade"), ("Upgrade", "SPDY/3.1")]),
            map(&[("Connection", "upgrade"), ("Upgrade", "websocket, h2c")]),
            map(&[
                ("Connection", "upgrade"),
                ("Upgrade", "websocket"),
                ("Upgrade", "websocket"),
            ]),
        ] {
            assert!(requested(&bad).is_none(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn splice_copies_both_ways_and_passes_each_close_on() {
        let (mut client, proxy_client) = tokio::io::duplex(64);
        let (proxy_upstream, mut upstream) = tokio::io::duplex(64);
        let copy = tokio::spawn(splice(
            proxy_client,
            proxy_upstream,
            Duration::from_secs(20),
        ));
        // More than the duplex buffers hold: backpressure, not loss.
        let big = vec![7u8; 100_000];
        let sent = big.clone();
        let writer = tokio::spawn(async move {
            client.write_all(&sent).await.unwrap();
            client.shutdown().await.unwrap();
            let mut back = Vec::new();
            client.read_to_end(&mut back).await.unwrap();
            back
        });
        let mut got = Vec::new();
        upstream.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, big, "client to upstream, ending in the client's close");
        upstream.write_all(b"bye").await.unwrap();
        upstream.shutdown().await.unwrap();
        assert_eq!(writer.await.unwrap(), b"bye");
        assert_eq!(copy.await.unwrap(), "closed by both sides");
    }

    #[tokio::test]
    async fn splice_ends_when_idle() {
        let (_client, proxy_client) = tokio::io::duplex(64);
        let (proxy_upstream, _upstream) = tokio::io::duplex(64);
        let end = tokio::time::timeout(
            Duration::from_secs(20),
            splice(proxy_client, proxy_upstream, Duration::from_millis(100)),
        )
        .await
        .expect("the idle limit ended it");
        assert_eq!(end, "idle");
    }
}
