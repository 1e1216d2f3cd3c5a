//! `408 Request Timeout` for a client that began a request head and did not finish it in time.
//!
//! hyper enforces the head-read timeout but only closes the connection, and it owns the stream
//! while it serves, so the stream is shared: hyper serves one handle, the proxy keeps the
//! other and writes the 408 through it once hyper has given up. Only one task ever uses the
//! stream at a time (hyper's, then the proxy's after hyper returned), so the lock is never
//! contended.
//!
//! A connection idle between requests (nothing read since the last response) is closed
//! without a 408: a keep-alive client may be sending its next request at that moment, and
//! would read the 408 as that request's answer.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

struct Inner<T> {
    io: T,
    /// Bytes arrived since the last write: a request head has begun.
    head_begun: bool,
}

/// A stream handle; clones share the stream.
pub struct Watched<T>(Arc<Mutex<Inner<T>>>);

impl<T> Clone for Watched<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T> Watched<T> {
    pub fn new(io: T) -> Self {
        Self(Arc::new(Mutex::new(Inner {
            io,
            head_begun: false,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        // A panic while polling leaves the stream as it was; nothing to repair.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the client has sent part of a request head that has not been answered.
    pub fn head_begun(&self) -> bool {
        self.lock().head_begun
    }
}

impl<T: AsyncWrite + Unpin> Watched<T> {
    /// Writes the 408 and closes the stream, within `limit` (a client that does not read
    /// cannot hold the connection open).
    pub async fn request_timeout(mut self, waited: Duration, flag: &str, limit: Duration) {
        let body = format!(
            "the request head did not arrive within {waited:?} ({flag}); the proxy closed the \
             connection\n"
        );
        let reply = format!(
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let send = async {
            self.write_all(reply.as_bytes()).await?;
            self.shutdown().await
        };
        if let Err(e) = tokio::time::timeout(limit, send)
            .await
            .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
        {
            tracing::debug!(error = %e, "the 408 was not delivered");
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut inner = self.lock();
        let before = buf.filled().len();
        let polled = Pin::new(&mut inner.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            inner.head_begun = true;
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut inner = self.lock();
        let polled = Pin::new(&mut inner.io).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            inner.head_begun = false;
        }
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut inner = self.lock();
        let polled = Pin::new(&mut inner.io).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            inner.head_begun = false;
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.lock().io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.lock().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.lock().io).poll_shutdown(cx)
    }
}
