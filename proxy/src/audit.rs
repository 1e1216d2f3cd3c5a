//! The audit log: one JSON line per request a sandbox sent through a tunnel, naming the
//! session and the MCP caller behind it.
//!
//! A line is written when the request is done: when its response body ended or was cut
//! (a watch, `logs -f`), or at once for a refusal. It never carries a header value, a token
//! or a body; the query only as the two flags that change what a request does (`watch`,
//! `dryRun`). The destination is `--audit-log` (standard output by default, apart from the
//! logs only when it is a file).

use std::io::Write;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{Method, Uri};
use hyper::body::{Body, Frame, SizeHint};
use serde::Serialize;

use cli_mcp_api::proxy::SessionCaller;

use crate::identity::Sandbox;
use crate::metrics::Metrics;
use crate::Shared;

/// Where audit lines go.
pub struct AuditLog {
    out: Mutex<Box<dyn Write + Send>>,
}

impl AuditLog {
    /// Standard output.
    pub fn stdout() -> Self {
        Self {
            out: Mutex::new(Box::new(std::io::stdout())),
        }
    }

    /// A file, appended to (created if missing).
    pub fn file(path: &Path) -> std::io::Result<Self> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Self {
            out: Mutex::new(Box::new(f)),
        })
    }

    /// Any writer (tests).
    pub fn to_writer(w: Box<dyn Write + Send>) -> Self {
        Self { out: Mutex::new(w) }
    }

    fn write(&self, line: &Line<'_>, metrics: &Metrics) {
        let Ok(mut text) = serde_json::to_vec(line) else {
            return;
        };
        text.push(b'\n');
        let mut out = self.out.lock().unwrap_or_else(PoisonError::into_inner);
        // One write per line, so lines from concurrent requests never interleave.
        match out.write_all(&text).and_then(|()| out.flush()) {
            Ok(()) => {
                metrics.audit_lines.inc();
            }
            Err(e) => {
                metrics.audit_failures.inc();
                tracing::error!(error = %e, "writing an audit line failed");
            }
        }
    }
}

#[derive(Serialize)]
struct Line<'a> {
    time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    namespace: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    instance: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    session: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pod: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    caller: Option<&'a SessionCaller>,
    host: &'a str,
    method: &'a str,
    path: &'a str,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    watch: bool,
    #[serde(rename = "dryRun", skip_serializing_if = "std::ops::Not::not")]
    dry_run: bool,
    status: u16,
    outcome: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a str>,
    bytes: u64,
    /// `false` when the response ended before its body did: the client went, or the
    /// tunnel was cut (the session ended, the proxy stopped).
    #[serde(skip_serializing_if = "std::clone::Clone::clone")]
    complete: bool,
    #[serde(rename = "durationMs")]
    duration_ms: f64,
}

/// One request, from its head until its response is done.
pub struct Record {
    shared: Arc<Shared>,
    sandbox: Option<Arc<Sandbox>>,
    host: String,
    method: Method,
    path: String,
    watch: bool,
    dry_run: bool,
    started: Instant,
}

impl Record {
    pub fn new(
        shared: Arc<Shared>,
        sandbox: Option<Arc<Sandbox>>,
        host: &str,
        method: &Method,
        uri: &Uri,
    ) -> Self {
        let (watch, dry_run) = flags(uri);
        Self {
            shared,
            sandbox,
            host: host.to_owned(),
            method: method.clone(),
            path: uri.path().to_owned(),
            watch,
            dry_run,
            started: Instant::now(),
        }
    }

    /// Writes the line: `status` and `outcome` (`forwarded`, `refused`, `upstream_error`),
    /// the refusal's reason, the response body's bytes.
    pub fn finish(&self, status: u16, outcome: &str, reason: Option<&str>, bytes: u64) {
        self.finish_body(status, outcome, reason, bytes, true);
    }

    fn finish_body(
        &self,
        status: u16,
        outcome: &str,
        reason: Option<&str>,
        bytes: u64,
        complete: bool,
    ) {
        let sandbox = self.sandbox.as_deref();
        let scope = self.shared.scope.as_ref();
        let line = Line {
            time: k8s_openapi::jiff::Timestamp::now().to_string(),
            namespace: scope.map(|s| s.0.as_str()),
            instance: scope.map(|s| s.1.as_str()),
            session: sandbox.map(|s| s.session.as_str()),
            pod: sandbox.map(|s| s.pod.as_str()),
            caller: sandbox.and_then(|s| s.caller.as_ref()),
            host: &self.host,
            method: self.method.as_str(),
            path: &self.path,
            watch: self.watch,
            dry_run: self.dry_run,
            status,
            outcome,
            reason,
            bytes,
            complete,
            duration_ms: (self.started.elapsed().as_secs_f64() * 1000.0 * 1000.0).round() / 1000.0,
        };
        self.shared.audit.write(&line, &self.shared.metrics);
    }
}

/// Whether a request watches (`watch` in the query, or the legacy `/watch/` path) and
/// whether it is a dry run (`dryRun`), read as the API server reads them: keys and values
/// percent-decoded, and a flag true unless it says `0`, `f`, `false`, `n`, `no` or `off`.
fn flags(uri: &Uri) -> (bool, bool) {
    let segments: Vec<&str> = uri.path().split('/').collect();
    let mut watch = match segments.get(1) {
        Some(&"api") => segments.get(3) == Some(&"watch"),
        Some(&"apis") => segments.get(4) == Some(&"watch"),
        _ => false,
    };
    let mut dry_run = false;
    for pair in uri.query().unwrap_or("").split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (k, v) = (decode(k), decode(v).to_ascii_lowercase());
        match k.as_str() {
            "watch" => watch |= !matches!(v.as_str(), "0" | "f" | "false" | "n" | "no" | "off"),
            "dryRun" => dry_run |= !v.is_empty(),
            _ => {}
        }
    }
    (watch, dry_run)
}

/// `%XX` and `+` decoded; anything malformed kept as it is.
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A response body that counts its bytes and writes the request's audit line when it ends,
/// or when it is dropped unfinished (the client went, the tunnel was revoked).
pub struct Audited<B> {
    inner: B,
    record: Option<(Record, u16)>,
    bytes: u64,
}

impl<B> Audited<B> {
    pub fn new(inner: B, record: Record, status: u16) -> Self {
        Self {
            inner,
            record: Some((record, status)),
            bytes: 0,
        }
    }

    fn done(&mut self, complete: bool) {
        if let Some((record, status)) = self.record.take() {
            record.finish_body(status, "forwarded", None, self.bytes, complete);
        }
    }
}

impl<B> Drop for Audited<B> {
    fn drop(&mut self) {
        self.done(false);
    }
}

impl<B> Body for Audited<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.bytes += data.len() as u64;
                }
            }
            Poll::Ready(None) => self.done(true),
            Poll::Ready(Some(Err(_))) => self.done(false),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_and_dry_run_are_read_from_the_query_and_the_legacy_path() {
        let f = |s: &str| flags(&s.parse::<Uri>().unwrap());
        assert_eq!(f("/api/v1/pods"), (false, false));
        assert_eq!(f("/api/v1/pods?watch=true"), (true, false));
        assert_eq!(f("/api/v1/pods?watch=1&x=y"), (true, false));
        assert_eq!(f("/api/v1/pods?watch=false"), (false, false));
        assert_eq!(f("/api/v1/watch/namespaces/a/pods"), (true, false));
        assert_eq!(f("/apis/apps/v1/watch/deployments"), (true, false));
        assert_eq!(f("/api/v1/namespaces/a/pods?dryRun=All"), (false, true));
        // As the API server reads them: decoded keys, any value but the false ones.
        assert_eq!(f("/api/v1/pods?watch=TRUE"), (true, false));
        assert_eq!(f("/api/v1/pods?watch=yes"), (true, false));
        assert_eq!(f("/api/v1/pods?wat%63h=1"), (true, false));
        assert_eq!(f("/api/v1/pods?watch=F"), (false, false));
        assert_eq!(f("/api/v1/pods?dr%79Run=All"), (false, true));
        assert_eq!(f("/api/v1/pods?watch=%"), (true, false));
    }
}
