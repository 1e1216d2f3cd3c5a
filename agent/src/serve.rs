//! The accept loop: HTTP/1.1 connections with a bounded idle time, at most N held at once,
//! and always room for a new one while any held connection is idle.
//!
//! Anyone who can reach the port can open connections, without a token: the shell itself
//! can. So no peer may hold a connection for free:
//! - a connection must send a complete request head within the header-read timeout, also
//!   between two requests on a kept-alive connection, or it is closed. One sweep over all
//!   connections enforces it (every quarter of the timeout), not a timer per connection:
//!   hyper's header-read timer arms a timer for every request, and each new timer that is
//!   due before the runtime's next wake-up costs a wake-up of the thread that waits for I/O;
//!   that made the agent spend about a tenth more CPU on a `true`;
//! - when all slots are taken, a new connection closes the oldest *idle* one: no request in
//!   flight, no unread bytes in its socket, and either done with a request already or given
//!   `SETTLE` to send one. Connections that only sit there make room for the next one, so a
//!   health probe (or the server's next call) is served within about `SETTLE` instead of
//!   waiting behind them in the kernel's accept queue, while a burst of honest callers whose
//!   requests are not read yet is never cut off. Only when no held connection is idle does a
//!   new one wait; `/exec` callers beyond a short queue are refused at once (see `http`), so
//!   that takes more than a flood of anonymous peers;
//! - a connection whose answer cannot be written is *stalled*, and counts as idle: a peer
//!   that sends requests (pipelined `/healthz`, say) and never reads the answers fills the
//!   socket buffers, and hyper then stops taking the answer's body and stops reading the
//!   requests behind it. The answer is in flight and bytes wait unread, which protected such
//!   a connection from eviction for good: 32 of them kept every probe out. An answer that
//!   made no progress for [`STALL`] (or an idle connection whose waiting bytes were not read
//!   for as long) is given up, and the connection closed at once, not gracefully.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, HttpBody};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

/// Largest request head (request line + headers) accepted; the agent's requests carry one
/// bearer token and a few short headers.
const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Most header fields per request.
const MAX_HEADERS: usize = 32;
/// How long a new connection is safe from eviction while it has sent nothing: a client's
/// request may trail its connect by a moment. Short, because it also bounds how fast held
/// connections can make room: peers that reconnect as soon as they are closed keep every
/// slot young, and a probe then waits for one of them to reach this age.
const SETTLE: Duration = Duration::from_millis(100);
/// How long an answer may wait to be written (or waiting bytes to be read, on an idle
/// connection) before the connection counts as stalled when room is needed. A client that
/// reads its answers takes them in microseconds; the sweep gives a stalled connection the
/// whole header-read timeout.
const STALL: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// Connections held at once (at least 1).
    pub max_connections: usize,
    /// How long a connection may take to send a request head, from when it is accepted or
    /// from the end of its previous response.
    pub header_read_timeout: Duration,
}

/// Serves `app` until `stop` turns true; then stops accepting, closes idle connections at
/// once and lets requests in flight finish (the caller bounds that wait).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    opts: ServeOptions,
    mut stop: watch::Receiver<bool>,
) {
    let conns = Arc::new(Connections::default());
    let max = opts.max_connections.max(1);
    // No timer for hyper, so no header-read timer of its own: `sweep` enforces the timeout.
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .max_buf_size(MAX_HEAD_BYTES.max(8192))
        .max_headers(MAX_HEADERS);
    let sweeper = {
        let conns = conns.clone();
        let timeout = opts.header_read_timeout;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval((timeout / 4).max(Duration::from_millis(10)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                conns.sweep(timeout);
            }
        })
    };
    loop {
        let stream = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        // Room first: the new connection is served only once it fits.
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            _ = conns.make_room(max) => {}
        }
        let conn = conns.add(stream.as_raw_fd());
        tokio::spawn(serve_connection(
            stream,
            app.clone(),
            builder.clone(),
            conn,
            conns.clone(),
            stop.clone(),
        ));
    }
    drop(listener);
    sweeper.abort();
    conns.wait_empty().await;
}

/// One connection until it ends, is evicted, or the agent stops.
async fn serve_connection(
    stream: TcpStream,
    app: Router,
    builder: hyper::server::conn::http1::Builder,
    conn: Arc<Conn>,
    conns: Arc<Connections>,
    mut stop: watch::Receiver<bool>,
) {
    let tracked = conn.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let in_flight = InFlight::enter(tracked.clone());
        let app = app.clone();
        async move {
            let res = tower::ServiceExt::oneshot(app, req).await?;
            // The request counts as in flight until its response body is written.
            in_flight.0.answer_moved(Some(Instant::now()));
            Ok::<_, Infallible>(res.map(|body| {
                Body::new(Tracked {
                    body,
                    _in_flight: in_flight,
                })
            }))
        }
    });
    let served = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(served);
    let mut closing = false;
    loop {
        tokio::select! {
            result = served.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                break;
            }
            _ = conn.evict.notified(), if !closing => {}
            _ = stop.wait_for(|s| *s), if !closing => {}
        }
        // Evicted or stopping: an idle connection goes now; one with a request in flight
        // finishes it (its caller gets the answer) and then closes, unless its answer cannot
        // be written (the peer does not read): that one would never finish.
        if conn.idle() || conn.stalled(Instant::now(), STALL) {
            break;
        }
        served.as_mut().graceful_shutdown();
        closing = true;
    }
    conns.remove(conn.id);
}

/// The connections held, oldest first.
#[derive(Default)]
struct Connections {
    held: Mutex<BTreeMap<u64, Arc<Conn>>>,
    next_id: AtomicUsize,
    /// A connection went idle or closed: room may have appeared.
    changed: Arc<Notify>,
}

struct Conn {
    id: u64,
    /// The socket, open for as long as the connection is held (it is removed from
    /// `Connections` before its stream is dropped).
    fd: RawFd,
    accepted: Instant,
    /// Since when no request has been in flight (the accept, or the end of the last one).
    idle_since: Mutex<Instant>,
    in_flight: AtomicUsize,
    /// A request was answered on it: its client has had its turn.
    served: AtomicBool,
    /// When the answer in flight last made progress: set when the handler returned it and
    /// each time hyper takes a part of its body; `None` while no answer waits to be written.
    answer_progress: Mutex<Option<Instant>>,
    /// Since when bytes have been seen waiting unread on this connection while it was idle.
    unread_since: Mutex<Option<Instant>>,
    evict: Notify,
    /// `Connections::changed`, told when this connection goes idle.
    changed: Arc<Notify>,
}

impl Conn {
    /// No request in flight: closing it now loses nobody's answer.
    fn idle(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) == 0
    }

    fn idle_since(&self) -> Instant {
        *self.idle_since.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stalled; or idle, and not a caller whose request is still on its way to being read.
    fn evictable(&self, now: Instant) -> bool {
        self.stalled(now, STALL)
            || (self.idle()
                && !self.waiting_unread()
                && (self.served.load(Ordering::SeqCst)
                    || now.duration_since(self.accepted) >= SETTLE))
    }

    /// Whether [`Self::stalled`], just called, saw bytes waiting unread on this idle
    /// connection (one socket peek per check, not two).
    fn waiting_unread(&self) -> bool {
        self.unread_since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Its answer has not moved for `limit`, or (idle) bytes have waited unread for as long:
    /// hyper cannot write to the peer, which does not read. Notes whether an idle connection
    /// has bytes waiting ([`Self::waiting_unread`]).
    fn stalled(&self, now: Instant, limit: Duration) -> bool {
        let progress = *self
            .answer_progress
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(at) = progress {
            return now.duration_since(at) >= limit;
        }
        let mut since = self.unread_since.lock().unwrap_or_else(|p| p.into_inner());
        if self.idle() && self.unread_bytes() {
            return now.duration_since(*since.get_or_insert(now)) >= limit;
        }
        *since = None;
        false
    }

    fn answer_moved(&self, at: Option<Instant>) {
        *self
            .answer_progress
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = at;
    }

    /// Bytes wait in the socket that hyper has not read yet: a request about to be served.
    fn unread_bytes(&self) -> bool {
        use nix::sys::socket::MsgFlags;
        let mut byte = [0u8; 1];
        matches!(
            nix::sys::socket::recv(
                self.fd,
                &mut byte,
                MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT
            ),
            Ok(1)
        )
    }
}

impl Connections {
    fn held(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Conn>>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, fd: RawFd) -> Arc<Conn> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst) as u64;
        let now = Instant::now();
        let conn = Arc::new(Conn {
            id,
            fd,
            accepted: now,
            idle_since: Mutex::new(now),
            in_flight: AtomicUsize::new(0),
            served: AtomicBool::new(false),
            answer_progress: Mutex::new(None),
            unread_since: Mutex::new(None),
            evict: Notify::new(),
            changed: self.changed.clone(),
        });
        self.held().insert(id, conn.clone());
        conn
    }

    fn remove(&self, id: u64) {
        self.held().remove(&id);
        self.changed.notify_one();
    }

    /// Returns once fewer than `max` connections are held, evicting the oldest evictable
    /// one if need be. Waits only while no held connection is evictable: until one goes idle
    /// or closes (`changed`), or a young one has had `SETTLE` (rechecked on a short tick).
    async fn make_room(&self, max: usize) {
        loop {
            {
                let mut held = self.held();
                if held.len() < max {
                    return;
                }
                let now = Instant::now();
                let oldest = held.values().find(|c| c.evictable(now)).map(|c| c.id);
                if let Some(victim) = oldest.and_then(|id| held.remove(&id)) {
                    // notify_one keeps the wake-up if the task is not waiting yet.
                    victim.evict.notify_one();
                    return;
                }
            }
            // A wake-up stored by notify_one in the meantime is not lost.
            let _ = tokio::time::timeout(SETTLE / 10, self.changed.notified()).await;
        }
    }

    /// Closes the connections that have had no request in flight for `timeout` and have
    /// none on its way in: they did not send a whole request head in time.
    fn sweep(&self, timeout: Duration) {
        let now = Instant::now();
        let mut held = self.held();
        let expired: Vec<u64> = held
            .values()
            .filter(|c| {
                c.stalled(now, timeout)
                    || (c.idle()
                        && now.duration_since(c.idle_since()) >= timeout
                        && !c.waiting_unread())
            })
            .map(|c| c.id)
            .collect();
        for id in expired {
            if let Some(conn) = held.remove(&id) {
                conn.evict.notify_one();
            }
        }
    }

    async fn wait_empty(&self) {
        loop {
            let changed = self.changed.notified();
            if self.held().is_empty() {
                return;
            }
            changed.await;
        }
    }
}

/// Marks a connection busy for as long as it lives.
struct InFlight(Arc<Conn>);

impl InFlight {
    fn enter(conn: Arc<Conn>) -> Self {
        conn.in_flight.fetch_add(1, Ordering::SeqCst);
        Self(conn)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.answer_moved(None);
        self.0.served.store(true, Ordering::SeqCst);
        *self.0.idle_since.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            // An accept loop waiting for room may now evict this connection.
            self.0.changed.notify_one();
        }
    }
}

/// A response body that keeps its connection marked busy until hyper has taken all of it.
struct Tracked {
    body: Body,
    _in_flight: InFlight,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let frame = Pin::new(&mut self.body).poll_frame(cx);
        if frame.is_ready() {
            self._in_flight.0.answer_moved(Some(Instant::now()));
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
