//! The loopback HTTPS upstream the identity figures tunnel to: a CA of its own (the route
//! pins it), `/stream` answers with a first chunk and never ends (an open watch), anything
//! else a small JSON body with a `content-length`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
    PKCS_ECDSA_P256_SHA256,
};
use tokio::net::TcpListener;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::TlsAcceptor;

use cli_mcp_api::proxy::{Domain, Injector, Route};

/// What a plain GET gets: what a small Kubernetes list looks like.
const SMALL: &[u8] = b"{\"kind\":\"PodList\",\"apiVersion\":\"v1\",\"metadata\":{},\"items\":[]}";

pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The upstream, serving until dropped.
pub(crate) struct Upstream {
    pub(crate) addr: SocketAddr,
    ca_pem: String,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Upstream {
    pub(crate) async fn start() -> anyhow::Result<Self> {
        let (ca_pem, config) = server_config().context("the upstream's certificates")?;
        let acceptor = TlsAcceptor::from(config);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let accept = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let _ = tcp.set_nodelay(true);
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service_fn(answer))
                        .await;
                });
            }
        });
        Ok(Self {
            addr,
            ca_pem,
            accept,
        })
    }

    /// `127.0.0.1:<port>`, what the clients CONNECT to.
    pub(crate) fn target(&self) -> String {
        self.addr.to_string()
    }

    /// The allow-list route to it, its CA pinned.
    pub(crate) fn route(&self) -> anyhow::Result<Route> {
        Ok(Route {
            domain: Domain::parse(&self.target())?,
            injector: Injector::None,
            ca_cert: Some(self.ca_pem.clone()),
            identity: Default::default(),
        })
    }
}

/// A CA (its PEM) and a server config with a leaf for 127.0.0.1 it signed.
fn server_config() -> anyhow::Result<(String, Arc<ServerConfig>)> {
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "bench upstream CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca =
        CertifiedIssuer::self_signed(ca_params, KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?)?;
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_owned()])?;
    params
        .distinguished_name
        .push(DnType::CommonName, "127.0.0.1");
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let leaf = params.signed_by(&key, &ca)?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(leaf.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((ca.pem(), Arc::new(config)))
}

type Body = BoxBody<Bytes, Infallible>;

async fn answer(req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    if req.uri().path() == "/stream" {
        // A first chunk at once, then nothing until the client goes: a watch with no events.
        let first = futures::stream::once(async {
            Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"first\n")))
        });
        let body = StreamBody::new(first.chain(futures::stream::pending()));
        return Ok(Response::new(BodyExt::boxed(body)));
    }
    let body = Full::new(Bytes::from_static(SMALL)).boxed();
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}
