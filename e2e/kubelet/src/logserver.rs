//! A minimal kubelet HTTPS endpoint (`:10250`) so `kubectl logs` works: only
//! `GET /containerLogs/{namespace}/{pod}/{container}` (with `previous`, `tailLines`,
//! `limitBytes`, `follow`) and `/healthz`. Exec, attach and port-forward are refused.
//!
//! The serving certificate is self-signed (the apiserver does not verify kubelet certificates
//! unless started with `--kubelet-certificate-authority`) and requests are not authenticated:
//! the listener is bound to the node's InternalIP, a host-local address, and the log files
//! themselves are readable by root on the host anyway.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio_rustls::rustls;
use tokio_util::sync::CancellationToken;

type Body = BoxBody<Bytes, Infallible>;

/// Query options of a log request.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct LogQuery {
    pub previous: bool,
    pub follow: bool,
    pub tail_lines: Option<usize>,
    pub limit_bytes: Option<usize>,
}

impl LogQuery {
    pub fn parse(query: Option<&str>) -> LogQuery {
        let mut q = LogQuery::default();
        for pair in query.unwrap_or_default().split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let yes = v.is_empty() || v == "true" || v == "1";
            match k {
                "previous" => q.previous = yes,
                "follow" => q.follow = yes,
                "tailLines" => q.tail_lines = v.parse().ok(),
                "limitBytes" => q.limit_bytes = v.parse().ok(),
                _ => {}
            }
        }
        q
    }
}

/// `/containerLogs/{ns}/{pod}/{container}` → its three parts.
pub fn parse_log_path(path: &str) -> Option<(&str, &str, &str)> {
    let rest = path.strip_prefix("/containerLogs/")?;
    let mut it = rest.split('/');
    let (ns, pod, c) = (it.next()?, it.next()?, it.next()?);
    // Namespace, pod and container names are DNS names: never empty, no `_`.
    let ok = |s: &str| !s.is_empty() && s != "." && s != ".." && !s.contains('_');
    (it.next().is_none() && ok(ns) && ok(pod) && ok(c)).then_some((ns, pod, c))
}

/// Keeps the last `n` lines of `data`.
pub fn tail(data: &[u8], n: usize) -> &[u8] {
    if n == 0 {
        return &data[data.len()..];
    }
    let body = data.strip_suffix(b"\n").unwrap_or(data);
    let mut seen = 0;
    for (i, b) in body.iter().enumerate().rev() {
        if *b == b'\n' {
            seen += 1;
            if seen == n {
                return &data[i + 1..];
            }
        }
    }
    data
}

/// The newest log file of `container` of pod `ns/pod` under `STATE/pods`.
fn find_log(
    state_dir: &Path,
    ns: &str,
    pod: &str,
    container: &str,
    previous: bool,
) -> Option<PathBuf> {
    let prefix = format!("{ns}_{pod}_");
    let file = if previous {
        format!("{container}.log.1")
    } else {
        format!("{container}.log")
    };
    std::fs::read_dir(state_dir.join("pods"))
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path().join(&file))
        .filter_map(|p| {
            let m = std::fs::metadata(&p).ok()?.modified().ok()?;
            Some((m, p))
        })
        .max()
        .map(|(_, p)| p)
}

fn text(status: StatusCode, msg: impl Into<String>) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(msg.into())).boxed());
    *r.status_mut() = status;
    r
}

async fn handle(
    state_dir: Arc<PathBuf>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    if path == "/healthz" {
        return Ok(text(StatusCode::OK, "ok"));
    }
    let parsed = parse_log_path(&path).filter(|_| req.method() == Method::GET);
    let Some((ns, pod, container)) = parsed else {
        return Ok(text(
            StatusCode::NOT_IMPLEMENTED,
            format!(
                "cli-mcp-kubelet serves only container logs (no exec, attach or port-forward): {} {path}",
                req.method()
            ),
        ));
    };
    let q = LogQuery::parse(req.uri().query());
    let Some(file) = find_log(&state_dir, ns, pod, container, q.previous) else {
        let what = if q.previous { "previous " } else { "" };
        // 400 like the kubelet's "container ... is waiting to start"; the apiserver relays it.
        return Ok(text(
            StatusCode::BAD_REQUEST,
            format!(
                "no {what}log of container {container:?} in pod {ns}/{pod} on this node (not started yet?)"
            ),
        ));
    };
    let data = match tokio::fs::read(&file).await {
        Ok(d) => d,
        Err(e) => {
            return Ok(text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("reading {}: {e}", file.display()),
            ))
        }
    };
    let mut start = match q.tail_lines {
        Some(n) => data.len() - tail(&data, n).len(),
        None => 0,
    };
    if let Some(limit) = q.limit_bytes {
        start = start.max(data.len().saturating_sub(limit));
    }
    let initial = Bytes::copy_from_slice(&data[start..]);
    if !q.follow || q.previous {
        return Ok(Response::new(Full::new(initial).boxed()));
    }
    let offset = data.len() as u64;
    let stream = futures::stream::once(async move { initial })
        .chain(follow(file, offset))
        .map(|b| Ok::<_, Infallible>(Frame::data(b)));
    Ok(Response::new(BodyExt::boxed(StreamBody::new(stream))))
}

/// New data appended to `file` after `offset`, until the file is rotated or removed (the
/// container restarted or the pod is gone). Ends when the client goes away.
fn follow(file: PathBuf, offset: u64) -> impl futures::Stream<Item = Bytes> {
    futures::stream::unfold((file, offset), |(file, mut offset)| async move {
        loop {
            let meta = tokio::fs::metadata(&file).await.ok()?;
            if meta.len() < offset {
                return None;
            }
            if meta.len() > offset {
                let mut f = tokio::fs::File::open(&file).await.ok()?;
                f.seek(std::io::SeekFrom::Start(offset)).await.ok()?;
                let mut buf = Vec::new();
                f.read_to_end(&mut buf).await.ok()?;
                offset += buf.len() as u64;
                return Some((Bytes::from(buf), (file, offset)));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
}

fn tls_config(node: &str, addr: &SocketAddr) -> Result<Arc<rustls::ServerConfig>, String> {
    let key = rcgen::generate_simple_self_signed(vec![node.to_string(), addr.ip().to_string()])
        .map_err(|e| format!("generating the kubelet serving certificate: {e}"))?;
    let cert = key.cert.der().clone();
    let pk = rustls::pki_types::PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_no_client_auth()
        .with_single_cert(vec![cert], pk)
        .map_err(|e| format!("TLS setup: {e}"))?;
    Ok(Arc::new(cfg))
}

/// Binds `addr` and serves until `cancel`. Returns an error only if it cannot start.
pub async fn serve(
    addr: SocketAddr,
    node: &str,
    state_dir: PathBuf,
    cancel: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let tls = tokio_rustls::TlsAcceptor::from(tls_config(node, &addr)?);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("binding the kubelet endpoint {addr}: {e}"))?;
    let state_dir = Arc::new(state_dir);
    Ok(tokio::spawn(async move {
        loop {
            let (tcp, _) = tokio::select! {
                _ = cancel.cancelled() => return,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!("kubelet endpoint accept: {e}");
                        continue;
                    }
                },
            };
            let tls = tls.clone();
            let state_dir = state_dir.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move {
                let Ok(Ok(stream)) =
                    tokio::time::timeout(Duration::from_secs(10), tls.accept(tcp)).await
                else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req| handle(state_dir.clone(), req));
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc);
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    r = conn => if let Err(e) = r {
                        tracing::debug!("kubelet endpoint connection: {e}");
                    },
                }
            });
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_paths_and_queries() {
        assert_eq!(
            parse_log_path("/containerLogs/default/web-0/app"),
            Some(("default", "web-0", "app"))
        );
        assert_eq!(parse_log_path("/containerLogs/default/web-0"), None);
        assert_eq!(parse_log_path("/containerLogs/a/b/c/d"), None);
        assert_eq!(parse_log_path("/containerLogs/../b/c"), None);
        assert_eq!(parse_log_path("/exec/a/b/c"), None);
        let q = LogQuery::parse(Some(
            "follow=true&tailLines=5&previous=false&limitBytes=100",
        ));
        assert_eq!(
            q,
            LogQuery {
                previous: false,
                follow: true,
                tail_lines: Some(5),
                limit_bytes: Some(100)
            }
        );
    }

    #[test]
    fn tails_lines() {
        assert_eq!(tail(b"a\nb\nc\n", 2), b"b\nc\n");
        assert_eq!(tail(b"a\nb\nc", 1), b"c");
        assert_eq!(tail(b"a\nb\n", 5), b"a\nb\n");
        assert_eq!(tail(b"a\nb\n", 0), b"");
    }

    #[test]
    fn finds_the_newest_log() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("pods").join("ns_web_u1");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("app.log"), "hello\n").expect("write");
        assert_eq!(
            find_log(tmp.path(), "ns", "web", "app", false),
            Some(dir.join("app.log"))
        );
        assert_eq!(find_log(tmp.path(), "ns", "web", "app", true), None);
        assert_eq!(find_log(tmp.path(), "ns", "we", "app", false), None);
    }
}
