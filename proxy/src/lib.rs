//! `cli-mcp-proxy`: the credential-injecting egress proxy of a cli-mcp instance.
//!
//! Sandboxes reach HTTPS upstreams only through `CONNECT` to a routed `host:port`
//! ([`server`]); inside the tunnel the proxy terminates TLS with a leaf from the instance's CA
//! ([`ca`], [`tunnel`]), checks and rewrites every request ([`forward`], [`headers`],
//! [`k8s_path`]), injects the route's credential ([`credentials`]) and forwards it over
//! verified TLS ([`upstream`]). The real credential never enters a sandbox.
//! docs/proxy.md describes the behaviour, the flags and the limits.

#![forbid(unsafe_code)]

pub mod audit;
pub mod ca;
pub mod cli;
pub mod credentials;
pub mod forward;
pub mod headers;
pub mod health;
pub mod identity;
pub mod k8s_path;
pub mod metrics;
pub mod peers;
pub mod refusal;
pub mod run;
pub mod server;
pub mod slow_head;
pub mod tunnel;
pub mod upstream;
pub mod websocket;

use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_rustls::rustls;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use cli_mcp_api::names::InstanceName;
use cli_mcp_api::proxy::{Injector, RouteError, RouteTable};
use cli_mcp_api::token::HmacKey;

use crate::audit::AuditLog;
use crate::ca::{CaError, CertAuthority};
use crate::credentials::Credentials;
use crate::identity::Identity;
use crate::metrics::Metrics;
use crate::peers::PeerSlots;
use crate::upstream::{Timeouts, UpstreamError, Upstreams};

/// Bounds on what one client can make the proxy hold.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Client connections at once (idle, CONNECT pending, or tunnels).
    pub max_connections: usize,
    /// Of those, from one client address (one sandbox pod) at once: one sandbox flooding the
    /// proxy leaves room for the others.
    pub max_connections_per_client: usize,
    /// Largest request head (request line and headers); beyond it: 431.
    pub max_header_bytes: usize,
    /// Most header fields in one request.
    pub max_headers: usize,
    /// Time to send a complete CONNECT request head.
    pub header_read_timeout: Duration,
    /// Time for each TLS handshake step inside a tunnel.
    pub handshake_timeout: Duration,
    /// Time a tunnel may wait for the next request head (idle, or a slow client).
    pub idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_connections_per_client: 128,
            max_header_bytes: 32 * 1024,
            max_headers: 100,
            header_read_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(90),
        }
    }
}

impl Limits {
    /// An HTTP/1.1 server holding requests to the head limits, with `header_read_timeout` on
    /// every head: the CONNECT head on a client connection, the idle time between requests
    /// inside a tunnel.
    fn http1(&self, header_read_timeout: Duration) -> hyper::server::conn::http1::Builder {
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(header_read_timeout)
            // The read buffer alone is not an exact limit: a head that arrives in one read
            // bigger than the buffer's nominal size parses before it is checked. The head's
            // parsed size is.
            .max_buf_size(self.max_header_bytes)
            .max_header_size(self.max_header_bytes)
            .max_headers(self.max_headers);
        builder
    }
}

/// Everything the proxy needs to start.
#[derive(Debug, Clone)]
pub struct Config {
    pub routes: PathBuf,
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    pub kubeconfig: Option<PathBuf>,
    pub listen: SocketAddr,
    pub health_listen: SocketAddr,
    pub limits: Limits,
    pub upstream: Timeouts,
    /// After the stop signal, how long the proxy keeps accepting while `/readyz` fails: the
    /// Service's endpoints (every node's kube-proxy) learn that the pod is going only after
    /// it got the signal, and keep sending new connections here until then.
    pub shutdown_delay: Duration,
    /// How long in-flight requests may finish once the proxy stops accepting.
    pub grace: Duration,
    /// Leaf certificates kept.
    pub leaf_cache: NonZeroUsize,
    /// Who may use the proxy.
    pub sandboxes: SandboxCheck,
    /// Where audit lines go; `None`: standard output.
    pub audit_log: Option<PathBuf>,
}

/// Who may use the proxy.
#[derive(Debug, Clone)]
pub enum SandboxCheck {
    /// Every CONNECT must prove a serving sandbox pod of this instance ([`identity`]), with
    /// the proxy's own in-cluster identity for the TokenReviews and the pod watch.
    Verified {
        namespace: String,
        instance: InstanceName,
        hmac_key_file: PathBuf,
    },
    /// Whoever reaches the listener is served, and requests are audited without a session.
    /// For the library's tests of what comes after admission; the binary always verifies.
    Unverified,
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("route table {path}: {source}")]
    Routes { path: String, source: RouteError },
    #[error("route table {0}: it has kubernetes routes but no --kubeconfig was given to take their tokens from")]
    NoKubeconfig(String),
    #[error("proxy CA: {0}")]
    Ca(#[from] CaError),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("listening on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("health server: {0}")]
    Health(std::io::Error),
    #[error("the instance HMAC key {path}: {why}")]
    HmacKey { path: String, why: String },
    #[error("the proxy's own Kubernetes client (for TokenReviews and the sandbox pod watch): {0}")]
    Client(String),
    #[error("the audit log {path}: {source}")]
    Audit {
        path: String,
        source: std::io::Error,
    },
}

/// State shared by every connection.
pub struct Shared {
    pub routes: RouteTable,
    pub ca: CertAuthority,
    pub upstreams: Upstreams,
    pub credentials: Credentials,
    pub metrics: Metrics,
    pub limits: Limits,
    /// Set once the stop signal came: `/readyz` fails from then on.
    pub shutting_down: AtomicBool,
    /// The sandbox identity check; `None`: unverified (tests).
    pub identity: Option<Identity>,
    /// `(namespace, instance)` of a verifying proxy, for the audit lines.
    pub scope: Option<(String, String)>,
    pub audit: AuditLog,
    pub peers: Arc<PeerSlots>,
}

fn read(path: &std::path::Path) -> Result<String, ProxyError> {
    std::fs::read_to_string(path).map_err(|source| ProxyError::Read {
        path: path.display().to_string(),
        source,
    })
}

impl Shared {
    /// Loads and checks the route table, the CA and the upstream TLS settings; with
    /// [`SandboxCheck::Verified`], starts the pod watch with `client`.
    pub fn load(config: &Config, client: Option<kube::Client>) -> Result<Self, ProxyError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let routes_path = config.routes.display().to_string();
        let routes =
            RouteTable::from_json(&read(&config.routes)?).map_err(|source| ProxyError::Routes {
                path: routes_path.clone(),
                source,
            })?;
        let has_kubernetes = routes
            .routes()
            .iter()
            .any(|r| r.injector == Injector::Kubernetes);
        if has_kubernetes && config.kubeconfig.is_none() {
            return Err(ProxyError::NoKubeconfig(routes_path));
        }
        let ca = CertAuthority::from_pem(
            &read(&config.ca_cert)?,
            &read(&config.ca_key)?,
            config.leaf_cache,
            provider.clone(),
        )?;
        let upstreams = Upstreams::new(&routes, provider, config.upstream)?;
        let (identity, scope) = match (&config.sandboxes, client) {
            (SandboxCheck::Unverified, _) => (None, None),
            (SandboxCheck::Verified { .. }, None) => {
                return Err(ProxyError::Client("no client was given".into()))
            }
            (
                SandboxCheck::Verified {
                    namespace,
                    instance,
                    hmac_key_file,
                },
                Some(client),
            ) => {
                let key =
                    HmacKey::from_hex(&read(hmac_key_file)?).map_err(|e| ProxyError::HmacKey {
                        path: hmac_key_file.display().to_string(),
                        why: e.to_string(),
                    })?;
                let identity = Identity::start(client, namespace, instance.clone(), key);
                (
                    Some(identity),
                    Some((namespace.clone(), instance.to_string())),
                )
            }
        };
        let audit = match &config.audit_log {
            None => AuditLog::stdout(),
            Some(path) => AuditLog::file(path).map_err(|source| ProxyError::Audit {
                path: path.display().to_string(),
                source,
            })?,
        };
        Ok(Self {
            routes,
            ca,
            upstreams,
            credentials: Credentials::new(config.kubeconfig.clone()),
            metrics: Metrics::default(),
            limits: config.limits,
            shutting_down: AtomicBool::new(false),
            identity,
            scope,
            audit,
            peers: Arc::new(PeerSlots::new(config.limits.max_connections_per_client)),
        })
    }
}

/// A proxy bound to its ports, not yet serving.
pub struct Proxy {
    shared: Arc<Shared>,
    listener: TcpListener,
    health: TcpListener,
    shutdown_delay: Duration,
    grace: Duration,
}

impl Proxy {
    /// Binds with the in-cluster client (or `KUBECONFIG`'s) when sandboxes are verified.
    pub async fn bind(config: &Config) -> Result<Self, ProxyError> {
        let client = match config.sandboxes {
            SandboxCheck::Unverified => None,
            SandboxCheck::Verified { .. } => Some(
                kube::Client::try_default()
                    .await
                    .map_err(|e| ProxyError::Client(e.to_string()))?,
            ),
        };
        Self::bind_with(config, client).await
    }

    /// Binds; `client` is the proxy's own identity for a verifying proxy.
    pub async fn bind_with(
        config: &Config,
        client: Option<kube::Client>,
    ) -> Result<Self, ProxyError> {
        let shared = Arc::new(Shared::load(config, client)?);
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ProxyError::Listen { addr, source })
        };
        let listener = bind(config.listen).await?;
        let health = bind(config.health_listen).await?;
        if let Some(why) = health::not_ready(&shared) {
            tracing::warn!(why, "starting, but not ready");
        }
        Ok(Self {
            shared,
            listener,
            health,
            shutdown_delay: config.shutdown_delay,
            grace: config.grace,
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn health_addr(&self) -> std::io::Result<SocketAddr> {
        self.health.local_addr()
    }

    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// Serves until `stop` completes; then, lame duck for the shutdown delay (`/readyz`
    /// fails, new connections are still served, so none is refused while the Service still
    /// sends them here); then stops accepting, lets in-flight requests finish for up to the
    /// grace period, and returns.
    pub async fn serve(self, stop: impl Future<Output = ()>) -> Result<(), ProxyError> {
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let health_stop = shutdown.clone();
        let health_addr = self
            .health
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let health = axum::serve(self.health, health::router(self.shared.clone()))
            .with_graceful_shutdown(async move { health_stop.cancelled().await });
        let health = tokio::spawn(async move { health.await });
        tracing::info!(
            listen = %self.listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            health = %health_addr,
            routes = self.shared.routes.routes().len(),
            "proxy serving"
        );
        let accept = server::serve(
            self.listener,
            self.shared.clone(),
            shutdown.clone(),
            tracker.clone(),
        );
        tokio::pin!(accept);
        let stopped = tokio::select! {
            () = &mut accept => false,
            () = stop => true,
        };
        if stopped && !self.shutdown_delay.is_zero() {
            self.shared.shutting_down.store(true, Ordering::Relaxed);
            tracing::info!(delay = ?self.shutdown_delay, "stopping: /readyz fails; still accepting for the shutdown delay");
            tokio::select! {
                () = &mut accept => {}
                () = tokio::time::sleep(self.shutdown_delay) => {}
            }
        }
        self.shared.shutting_down.store(true, Ordering::Relaxed);
        tracing::info!(grace = ?self.grace, open = tracker.len(), "stopping: no new connections; open ones get the grace period");
        shutdown.cancel();
        tracker.close();
        if tokio::time::timeout(self.grace, tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(grace = ?self.grace, open = tracker.len(), "grace period over; closing the rest");
        }
        match health.await {
            Ok(Ok(())) | Err(_) => Ok(()),
            Ok(Err(e)) => Err(ProxyError::Health(e)),
        }
    }
}
