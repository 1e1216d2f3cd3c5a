//! Loopback fixtures: an HTTPS upstream that records what reaches it, the proxy in-process with
//! its inputs in a temporary directory, and raw clients for the hostile cases.

#![allow(dead_code)]

pub mod cluster;

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::channel::Channel;
use http_body_util::{BodyExt, Either, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rcgen::{CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch, Notify};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use cli_mcp_api::proxy::{Domain, Injector, Route, RouteTable};
use cli_mcp_proxy::upstream::Timeouts;
use cli_mcp_proxy::{Config, Limits, Proxy, SandboxCheck, Shared};

pub const DEADLINE: Duration = Duration::from_secs(20);

pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A CA and a way to sign server certificates with it.
pub struct TestCa {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCa {
    pub fn new(name: &str) -> Self {
        let (cert_pem, key_pem) = cli_mcp_proxy::ca::generate_ca(name).unwrap();
        Self { cert_pem, key_pem }
    }

    pub fn server_config(&self, sans: &[&str]) -> Arc<ServerConfig> {
        let ca_key = KeyPair::from_pem(&self.key_pem).unwrap();
        let issuer = Issuer::from_ca_cert_pem(&self.cert_pem, ca_key).unwrap();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, sans[0]);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let cert = params.signed_by(&key, &issuer).unwrap();
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).unwrap(),
            )
            .unwrap();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }

    pub fn client_config(&self) -> Arc<ClientConfig> {
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(self.cert_pem.as_bytes()).unwrap())
            .unwrap();
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub uri: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// An HTTPS server on loopback recording every request that reaches it.
///
/// `/stream` answers with a first chunk at once and the second only after
/// [`Upstream::release`]; `/slow` answers only after it. `/ws` accepts a WebSocket upgrade and
/// echoes every byte back until the client closes; `/ws-other` answers 101 with another
/// protocol. Anything else: a small JSON body.
pub struct Upstream {
    pub addr: SocketAddr,
    pub ca: TestCa,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub accepted: Arc<AtomicUsize>,
    release: Arc<Notify>,
    /// Requests recorded so far, for [`Upstream::wait_seen`].
    arrived: Arc<watch::Sender<usize>>,
}

impl Upstream {
    pub async fn start() -> Self {
        let ca = TestCa::new("upstream CA");
        let acceptor = TlsAcceptor::from(ca.server_config(&["127.0.0.1", "localhost"]));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let accepted = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(Notify::new());
        let arrived = Arc::new(watch::Sender::new(0));
        let (s, a, r, n) = (
            seen.clone(),
            accepted.clone(),
            release.clone(),
            arrived.clone(),
        );
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                let acceptor = acceptor.clone();
                let (s, r, n) = (s.clone(), r.clone(), n.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let svc = service_fn(move |req| answer(req, s.clone(), r.clone(), n.clone()));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), svc)
                        .with_upgrades()
                        .await;
                });
            }
        });
        Self {
            addr,
            ca,
            seen,
            accepted,
            release,
            arrived,
        }
    }

    pub fn domain(&self) -> Domain {
        Domain::parse(&self.addr.to_string()).unwrap()
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Waits until `n` requests have reached the upstream.
    pub async fn wait_seen(&self, n: usize) {
        let mut arrived = self.arrived.subscribe();
        tokio::time::timeout(DEADLINE, arrived.wait_for(|c| *c >= n))
            .await
            .unwrap_or_else(|_| panic!("{n} request(s) did not reach the upstream in time"))
            .unwrap();
    }

    /// Lets `/stream` send its second chunk and `/slow` answer.
    pub fn release(&self) {
        self.release.notify_one();
    }

    pub fn route(&self, injector: Injector) -> Route {
        Route {
            domain: self.domain(),
            injector,
            ca_cert: Some(self.ca.cert_pem.clone()),
            identity: Default::default(),
        }
    }
}

type UpBody = Either<Full<Bytes>, Channel<Bytes>>;

async fn answer(
    mut req: Request<Incoming>,
    seen: Arc<Mutex<Vec<Seen>>>,
    release: Arc<Notify>,
    arrived: Arc<watch::Sender<usize>>,
) -> Result<Response<UpBody>, hyper::Error> {
    let upgrade = req
        .headers()
        .contains_key("upgrade")
        .then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_owned();
    let body = body.collect().await?.to_bytes();
    seen.lock().unwrap().push(Seen {
        method: parts.method.to_string(),
        uri: parts.uri.to_string(),
        headers: parts.headers,
        body,
    });
    arrived.send_modify(|n| *n += 1);
    match path.as_str() {
        "/stream" => {
            let (mut tx, rx) = Channel::new(1);
            tokio::spawn(async move {
                let _ = tx.send_data(Bytes::from_static(b"first\n")).await;
                release.notified().await;
                let _ = tx.send_data(Bytes::from_static(b"second\n")).await;
            });
            Ok(Response::new(Either::Right(rx)))
        }
        "/ws" | "/ws-other" if upgrade.is_some() => {
            let protocol = if path == "/ws" { "websocket" } else { "h2c" };
            if let Some(upgrade) = upgrade {
                tokio::spawn(async move {
                    let Ok(upgraded) = upgrade.await else { return };
                    let (mut r, mut w) = tokio::io::split(TokioIo::new(upgraded));
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
            Ok(Response::builder()
                .status(101)
                .header("connection", "upgrade")
                .header("upgrade", protocol)
                .body(Either::Left(Full::new(Bytes::new())))
                .unwrap())
        }
        "/slow" => {
            release.notified().await;
            Ok(Response::new(Either::Left(Full::new(Bytes::from_static(
                b"done\n",
            )))))
        }
        _ => Ok(Response::builder()
            .header("content-type", "application/json")
            .body(Either::Left(Full::new(Bytes::from_static(
                b"{\"kind\":\"PodList\",\"apiVersion\":\"v1\",\"metadata\":{},\"items\":[]}",
            ))))
            .unwrap()),
    }
}

/// A kubeconfig with one cluster at `server` (CA `ca_pem`) and one token user.
pub fn kubeconfig(server: &str, ca_pem: &str, token: &str) -> String {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: u\n  user:\n    token: {token}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u, namespace: default}}\ncurrent-context: x\n"
    )
}

/// The proxy's inputs in a directory, the kubeconfig published the way the kubelet does it.
pub struct Inputs {
    pub dir: tempfile::TempDir,
    pub ca: TestCa,
    generation: AtomicUsize,
}

impl Inputs {
    pub fn new(routes: Vec<Route>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new("proxy CA");
        std::fs::write(dir.path().join("ca.crt"), &ca.cert_pem).unwrap();
        std::fs::write(dir.path().join("ca.key"), &ca.key_pem).unwrap();
        std::fs::create_dir(dir.path().join("kubeconfig.d")).unwrap();
        let s = Self {
            dir,
            ca,
            generation: AtomicUsize::new(0),
        };
        s.write_routes(routes);
        s
    }

    pub fn write_routes(&self, routes: Vec<Route>) {
        let table = RouteTable::new(routes).unwrap();
        std::fs::write(self.dir.path().join("routes.json"), table.to_json()).unwrap();
    }

    pub fn kubeconfig_path(&self) -> PathBuf {
        self.dir.path().join("kubeconfig.d").join("kubeconfig")
    }

    /// Writes a new timestamped directory and swaps `..data` to it atomically.
    pub fn publish_kubeconfig(&self, content: &str) {
        let base = self.dir.path().join("kubeconfig.d");
        let g = self.generation.fetch_add(1, Ordering::SeqCst);
        let data = format!("..gen{g}");
        std::fs::create_dir(base.join(&data)).unwrap();
        std::fs::write(base.join(&data).join("kubeconfig"), content).unwrap();
        let tmp = base.join("..data_tmp");
        std::os::unix::fs::symlink(&data, &tmp).unwrap();
        std::fs::rename(&tmp, base.join("..data")).unwrap();
        let link = base.join("kubeconfig");
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink("..data/kubeconfig", &link).unwrap();
        }
    }

    pub fn config(&self) -> Config {
        let p = |n: &str| self.dir.path().join(n);
        Config {
            routes: p("routes.json"),
            ca_cert: p("ca.crt"),
            ca_key: p("ca.key"),
            kubeconfig: Some(self.kubeconfig_path()),
            listen: "127.0.0.1:0".parse().unwrap(),
            health_listen: "127.0.0.1:0".parse().unwrap(),
            limits: Limits::default(),
            upstream: Timeouts {
                connect: Duration::from_secs(5),
                handshake: Duration::from_secs(5),
                response_headers: Duration::from_secs(30),
            },
            shutdown_delay: Duration::ZERO,
            grace: Duration::from_secs(10),
            leaf_cache: NonZeroUsize::new(16).unwrap(),
            // The tests of everything after admission; tests/identity.rs verifies sandboxes.
            sandboxes: SandboxCheck::Unverified,
            audit_log: Some(p("audit.log")),
        }
    }

    /// The audit lines written so far, parsed.
    pub fn audit_lines(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.path().join("audit.log"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("an audit line is JSON"))
            .collect()
    }
}

/// A proxy serving in this process until dropped or [`Running::stop`]ped.
pub struct Running {
    pub addr: SocketAddr,
    pub health: SocketAddr,
    pub shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    pub done: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    pub async fn start(config: Config) -> Self {
        Self::start_with(config, None).await
    }

    /// With `client` as the proxy's own identity (a verifying proxy).
    pub async fn start_with(config: Config, client: Option<kube::Client>) -> Self {
        let proxy = Proxy::bind_with(&config, client)
            .await
            .expect("the proxy starts");
        let addr = proxy.local_addr().unwrap();
        let health = proxy.health_addr().unwrap();
        let shared = proxy.shared();
        let (tx, rx) = oneshot::channel::<()>();
        let done = tokio::spawn(async move {
            proxy
                .serve(async move {
                    let _ = rx.await;
                })
                .await
                .expect("the proxy serves");
        });
        Self {
            addr,
            health,
            shared,
            stop: Some(tx),
            done: Some(done),
        }
    }

    /// Signals shutdown (what SIGTERM does in the binary).
    pub fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }

    pub fn proxy_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `GET <path>` on the health listener.
    pub async fn health_get(&self, path: &str) -> reqwest::Response {
        reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .get(format!("http://{}{path}", self.health))
            .send()
            .await
            .unwrap()
    }

    pub async fn metrics(&self) -> String {
        self.health_get("/metrics").await.text().await.unwrap()
    }
}

/// Value of a metric line (`name{labels} value`), 0 when absent.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A reqwest client using the proxy and trusting only the proxy's CA.
pub fn client(proxy: &Running, proxy_ca: &TestCa) -> reqwest::Client {
    reqwest::Client::builder()
        .proxy(reqwest::Proxy::https(proxy.proxy_url()).unwrap())
        .add_root_certificate(reqwest::Certificate::from_pem(proxy_ca.cert_pem.as_bytes()).unwrap())
        .tls_built_in_root_certs(false)
        .timeout(DEADLINE)
        .build()
        .unwrap()
}

/// Sends a raw request head on a fresh connection to the proxy and reads until it closes.
pub async fn raw(proxy: SocketAddr, bytes: &[u8]) -> String {
    let mut tcp = TcpStream::connect(proxy).await.unwrap();
    tcp.write_all(bytes).await.unwrap();
    read_to_close(&mut tcp).await
}

pub async fn read_to_close<R: AsyncReadExt + Unpin>(r: &mut R) -> String {
    let mut out = Vec::new();
    match tokio::time::timeout(DEADLINE, r.read_to_end(&mut out)).await {
        Ok(_) => String::from_utf8_lossy(&out).into_owned(),
        Err(_) => panic!(
            "the proxy did not close the connection within {DEADLINE:?}; got {:?}",
            String::from_utf8_lossy(&out)
        ),
    }
}

/// Reads one response head (up to the blank line).
pub async fn read_head<R: AsyncReadExt + Unpin>(r: &mut R) -> String {
    let mut out = Vec::new();
    let mut byte = [0u8; 1];
    while !out.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(DEADLINE, r.read(&mut byte))
            .await
            .expect("a response head in time")
            .unwrap();
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&out));
        out.push(byte[0]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads one response with a `content-length` body: its head, and its body read whole so the
/// connection is ready for the next request.
pub async fn read_response<R: AsyncReadExt + Unpin>(r: &mut R) -> (String, Vec<u8>) {
    let head = read_head(r).await;
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no content-length in {head}"));
    let mut body = vec![0; length];
    tokio::time::timeout(DEADLINE, r.read_exact(&mut body))
        .await
        .expect("the body in time")
        .unwrap();
    (head, body)
}

/// CONNECT to `target` through the proxy, then TLS with `sni` (None: the target's host),
/// trusting the proxy CA.
pub async fn tunnel(
    proxy: SocketAddr,
    target: &str,
    sni: Option<&str>,
    proxy_ca: &TestCa,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    tunnel_as(proxy, target, sni, proxy_ca, "").await
}

/// [`tunnel`] with `extra` header lines (each ending in CRLF) on the CONNECT.
pub async fn tunnel_as(
    proxy: SocketAddr,
    target: &str,
    sni: Option<&str>,
    proxy_ca: &TestCa,
    extra: &str,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let mut tcp = TcpStream::connect(proxy).await?;
    tcp.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{extra}\r\n").as_bytes())
        .await?;
    let head = read_head(&mut tcp).await;
    assert!(head.starts_with("HTTP/1.1 200"), "CONNECT {target}: {head}");
    let host = sni
        .map(str::to_owned)
        .unwrap_or_else(|| Domain::parse(target).unwrap().host().to_owned());
    let name = ServerName::try_from(host).unwrap();
    TlsConnector::from(proxy_ca.client_config())
        .connect(name, tcp)
        .await
}

/// Sends `request` in a fresh tunnel to `host` and reads the response head.
pub async fn tunnel_request(
    proxy: SocketAddr,
    host: &str,
    proxy_ca: &TestCa,
    request: &str,
) -> String {
    let mut tls = tunnel(proxy, host, None, proxy_ca).await.unwrap();
    tls.write_all(request.as_bytes()).await.unwrap();
    read_head(&mut tls).await
}

pub fn path_of(p: &Path) -> String {
    p.display().to_string()
}
