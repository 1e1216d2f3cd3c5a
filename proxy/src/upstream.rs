//! Connections from the proxy to the upstreams: direct (no proxy from the environment), over
//! TLS that is always verified — against the route's pinned CA when it has one (and only that
//! CA), else against the system roots — with SNI set to the route's host, and bounded in time
//! at every step before the response headers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};
use tokio_rustls::TlsConnector;

use cli_mcp_api::proxy::{Domain, RouteTable};

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("route {domain}: its caCert is not PEM of one or more certificates: {reason}")]
    BadCa { domain: Domain, reason: String },
    #[error("no system CA certificates could be loaded ({0}), so route(s) without a caCert cannot be verified")]
    NoSystemRoots(String),
    #[error("route {0}: {1}")]
    Tls(Domain, rustls::Error),
    #[error("connecting to {0}: {1}")]
    Connect(Domain, std::io::Error),
    #[error("connecting to {0}: no answer within {1:?}")]
    ConnectTimeout(Domain, Duration),
    #[error("TLS with {0} failed: {1}")]
    Handshake(Domain, std::io::Error),
    #[error("TLS with {0}: no handshake within {1:?}")]
    HandshakeTimeout(Domain, Duration),
    #[error("HTTP with {0}: {1}")]
    Http(Domain, hyper::Error),
    #[error("{0} sent no response headers within {1:?}")]
    ResponseTimeout(Domain, Duration),
}

#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub connect: Duration,
    pub handshake: Duration,
    pub response_headers: Duration,
}

/// One TLS client configuration per route, built once at start.
pub struct Upstreams {
    configs: HashMap<Domain, TlsConnector>,
    pub timeouts: Timeouts,
}

impl Upstreams {
    pub fn new(
        routes: &RouteTable,
        provider: Arc<rustls::crypto::CryptoProvider>,
        timeouts: Timeouts,
    ) -> Result<Self, UpstreamError> {
        let mut system: Option<Arc<RootCertStore>> = None;
        let mut configs = HashMap::new();
        for route in routes.routes() {
            let d = &route.domain;
            let roots = match &route.ca_cert {
                Some(pem) => Arc::new(pinned_roots(d, pem)?),
                None => match &system {
                    Some(s) => s.clone(),
                    None => system.insert(Arc::new(system_roots()?)).clone(),
                },
            };
            let mut config = ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| UpstreamError::Tls(d.clone(), e))?
                .with_root_certificates(roots)
                .with_no_client_auth();
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            configs.insert(d.clone(), TlsConnector::from(Arc::new(config)));
        }
        Ok(Self { configs, timeouts })
    }

    /// A verified HTTP/1.1 connection to `domain`'s upstream.
    pub async fn connect(&self, domain: &Domain) -> Result<SendRequest<Incoming>, UpstreamError> {
        let connector = self.configs.get(domain).ok_or_else(|| {
            UpstreamError::Tls(
                domain.clone(),
                rustls::Error::General("no TLS configuration for this route".into()),
            )
        })?;
        let t = self.timeouts;
        let tcp = tokio::time::timeout(
            t.connect,
            TcpStream::connect((domain.host(), domain.port())),
        )
        .await
        .map_err(|_| UpstreamError::ConnectTimeout(domain.clone(), t.connect))?
        .map_err(|e| UpstreamError::Connect(domain.clone(), e))?;
        // Small request/response exchanges: do not wait to coalesce.
        let _ = tcp.set_nodelay(true);
        let name = ServerName::try_from(domain.host().to_owned()).map_err(|e| {
            UpstreamError::Tls(domain.clone(), rustls::Error::General(e.to_string()))
        })?;
        let tls = tokio::time::timeout(t.handshake, connector.connect(name, tcp))
            .await
            .map_err(|_| UpstreamError::HandshakeTimeout(domain.clone(), t.handshake))?
            .map_err(|e| UpstreamError::Handshake(domain.clone(), e))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| UpstreamError::Http(domain.clone(), e))?;
        let d = domain.clone();
        tokio::spawn(async move {
            // Upgrades: a WebSocket's 101 hands the connection over instead of ending it.
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(domain = %d, error = %e, "upstream connection ended");
            }
        });
        Ok(sender)
    }
}

fn pinned_roots(d: &Domain, pem: &str) -> Result<RootCertStore, UpstreamError> {
    let bad = |reason: String| UpstreamError::BadCa {
        domain: d.clone(),
        reason,
    };
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let cert = cert.map_err(|e| bad(e.to_string()))?;
        roots.add(cert).map_err(|e| bad(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(bad("no certificate in it".into()));
    }
    Ok(roots)
}

fn system_roots() -> Result<RootCertStore, UpstreamError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map(|e| e.to_string())
            .unwrap_or_else(|| "none found; is the ca-certificates bundle installed?".into());
        return Err(UpstreamError::NoSystemRoots(why));
    }
    Ok(roots)
}
