//! Forward a loopback TCP port to a Service, the way `kubectl port-forward svc/NAME` gives a
//! user a local port.
//!
//! There is no kube-proxy, so ClusterIPs do not route. Instead, for every accepted
//! connection the forwarder picks a ready endpoint of the Service (`podIP:targetPort`,
//! honouring named target ports through the slice's port names) and splices the connection
//! to it. Endpoints are picked round-robin from a watch of the Service's EndpointSlices, as
//! kube-proxy does, so the forward follows pods as they come and go without an API call per
//! connection (a burst of a hundred new connections would otherwise be two hundred API
//! requests of the forward's own, timed as the product's). Where the watch has nothing yet,
//! or its pick refuses the connection (a pod gone within the watch's lag), the forward lists
//! the slices afresh.
//!
//! With [`TlsUpstream`] the forward also terminates TLS for the client: it listens for plain
//! HTTP on loopback and speaks TLS to the endpoint, trusting only the given CA and checking the
//! certificate against the given name. An MCP client can then use `http://127.0.0.1:PORT`
//! as printed, with no private CA to trust and no `/etc/hosts` entry, while the hop to the pod
//! stays encrypted and verified (never skipped).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::ListParams;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use tokio_rustls::TlsConnector;

use crate::error::{Error, Result};

/// A running forward; stops when dropped.
#[derive(Debug)]
pub struct ServiceForward {
    local: SocketAddr,
    task: JoinHandle<()>,
    watch: JoinHandle<()>,
}

struct Target {
    client: Client,
    namespace: String,
    service: String,
    port: u16,
    /// The Service port's name, which the slices' ports carry (empty when unnamed).
    port_name: String,
    /// The Service's EndpointSlices, kept by a watch.
    slices: Store<EndpointSlice>,
    next: AtomicUsize,
    tls: Option<TlsUpstream>,
}

/// TLS to the endpoint: only `ca` is trusted, and the certificate must be valid for `name`
/// (also sent as SNI).
#[derive(Clone)]
pub struct TlsUpstream {
    connector: TlsConnector,
    name: ServerName<'static>,
}

impl std::fmt::Debug for TlsUpstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsUpstream")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl TlsUpstream {
    /// `ca_pem`: the CA certificate(s) in PEM, the only roots trusted; `name`: the DNS name
    /// the endpoint's certificate must carry (for an instance: `<service>.<namespace>.svc`).
    pub fn new(ca_pem: &[u8], name: &str) -> Result<TlsUpstream> {
        let mut roots = RootCertStore::empty();
        let mut found = 0;
        for cert in CertificateDer::pem_slice_iter(ca_pem) {
            let cert = cert.map_err(|e| Error::Other(format!("the CA is not valid PEM: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| Error::Other(format!("the CA certificate is not usable: {e}")))?;
            found += 1;
        }
        if found == 0 {
            return Err(Error::Other(
                "the CA file holds no PEM certificate; pass the instance's ca.crt".into(),
            ));
        }
        let name = ServerName::try_from(name.to_string())
            .map_err(|e| Error::Other(format!("{name:?} is not a valid server name: {e}")))?;
        let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Other(format!("TLS client setup: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(TlsUpstream {
            connector: TlsConnector::from(Arc::new(config)),
            name,
        })
    }

    /// Splices the plain `inbound` connection to `outbound` over TLS.
    pub async fn splice(&self, inbound: &mut TcpStream, outbound: TcpStream) -> Result<()> {
        let mut tls = self
            .connector
            .connect(self.name.clone(), outbound)
            .await
            .map_err(|e| Error::Other(format!("TLS to the endpoint as {:?}: {e}", self.name)))?;
        tokio::io::copy_bidirectional(inbound, &mut tls)
            .await
            .map_err(|e| Error::Other(format!("splicing over TLS: {e}")))?;
        Ok(())
    }
}

impl ServiceForward {
    /// Listen on `127.0.0.1:<ephemeral>` and forward to port `port` (the Service's `port`,
    /// not the target port) of Service `namespace/service`.
    pub async fn start(
        client: Client,
        namespace: &str,
        service: &str,
        port: u16,
    ) -> Result<ServiceForward> {
        Self::start_on(client, namespace, service, port, 0).await
    }

    /// Like [`ServiceForward::start`], on a chosen local port (0 = ephemeral).
    pub async fn start_on(
        client: Client,
        namespace: &str,
        service: &str,
        port: u16,
        local_port: u16,
    ) -> Result<ServiceForward> {
        Self::start_with(client, namespace, service, port, local_port, None).await
    }

    /// Like [`ServiceForward::start_on`]; with `tls`, clients speak plain TCP to the local
    /// port and the forward speaks TLS to the endpoint (see [`TlsUpstream`]).
    pub async fn start_with(
        client: Client,
        namespace: &str,
        service: &str,
        port: u16,
        local_port: u16,
        tls: Option<TlsUpstream>,
    ) -> Result<ServiceForward> {
        // Fail early with a clear message if the Service or its port does not exist.
        let port_name = resolve_port_name(&client, namespace, service, port).await?;
        let bind = SocketAddr::from((Ipv4Addr::LOCALHOST, local_port));
        let listener = TcpListener::bind(bind).await.map_err(|e| Error::Command {
            command: format!("listen on {bind}"),
            detail: e.to_string(),
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Other(format!("local address of the forward: {e}")))?;
        // Started once nothing can fail any more: the forward's drop is what stops it.
        let slices = Api::<EndpointSlice>::namespaced(client.clone(), namespace);
        let (store, writer) = reflector::store();
        let config =
            watcher::Config::default().labels(&format!("kubernetes.io/service-name={service}"));
        let watch = tokio::spawn(
            watcher(slices, config)
                .default_backoff()
                .reflect(writer)
                .for_each(|_| futures::future::ready(())),
        );
        let target = Arc::new(Target {
            client,
            namespace: namespace.to_string(),
            service: service.to_string(),
            port,
            port_name,
            slices: store,
            next: AtomicUsize::new(0),
            tls,
        });
        let task = tokio::spawn(async move {
            loop {
                let (inbound, peer) = match listener.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!("port-forward accept failed: {e}");
                        continue;
                    }
                };
                let target = target.clone();
                tokio::spawn(async move {
                    if let Err(e) = target.serve(inbound).await {
                        tracing::warn!(
                            "port-forward {peer} -> svc/{}/{}:{}: {e}",
                            target.namespace,
                            target.service,
                            target.port
                        );
                    }
                });
            }
        });
        Ok(ServiceForward { local, task, watch })
    }

    /// The local address to connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// `http://127.0.0.1:<port>`
    pub fn http_url(&self) -> String {
        format!("http://{}", self.local)
    }
}

impl Drop for ServiceForward {
    fn drop(&mut self) {
        self.task.abort();
        self.watch.abort();
    }
}

/// The name of port `port` of Service `namespace/service` (empty when it is unnamed).
async fn resolve_port_name(
    client: &Client,
    namespace: &str,
    service: &str,
    port: u16,
) -> Result<String> {
    let svc = Api::<Service>::namespaced(client.clone(), namespace)
        .get_opt(service)
        .await?
        .ok_or_else(|| Error::Other(format!("Service {namespace}/{service} does not exist")))?;
    let ports = svc.spec.and_then(|s| s.ports).unwrap_or_default();
    ports
        .iter()
        .find(|p| p.port == i32::from(port))
        .map(|p| p.name.clone().unwrap_or_default())
        .ok_or_else(|| {
            Error::Other(format!(
                "Service {namespace}/{service} has no port {port} (it has {:?})",
                ports.iter().map(|p| p.port).collect::<Vec<_>>()
            ))
        })
}

/// All ready `ip:port` endpoints of the port named `port_name` in `slices`, in a stable order.
fn ready_endpoints<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    port_name: &str,
) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    for slice in slices {
        let Some(port) = slice
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref().unwrap_or_default() == port_name)
            .and_then(|p| p.port)
            .and_then(|p| u16::try_from(p).ok())
        else {
            continue;
        };
        for ep in slice.endpoints.iter().flatten() {
            // A nil `ready` means "unknown", which consumers treat as ready.
            let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            if !ready {
                continue;
            }
            for addr in &ep.addresses {
                if let Ok(ip) = addr.parse::<IpAddr>() {
                    out.push(SocketAddr::new(ip, port));
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

impl Target {
    /// The ready endpoints as the watch last saw them (empty before its first list).
    fn watched_endpoints(&self) -> Vec<SocketAddr> {
        let slices = self.slices.state();
        ready_endpoints(slices.iter().map(|s| s.as_ref()), &self.port_name)
    }

    /// The ready endpoints as the API server has them now.
    async fn listed_endpoints(&self) -> Result<Vec<SocketAddr>> {
        let slices = Api::<EndpointSlice>::namespaced(self.client.clone(), &self.namespace)
            .list(
                &ListParams::default()
                    .labels(&format!("kubernetes.io/service-name={}", self.service)),
            )
            .await?;
        Ok(ready_endpoints(&slices.items, &self.port_name))
    }

    /// One of `endpoints`, round-robin.
    fn pick(&self, endpoints: &[SocketAddr]) -> Result<SocketAddr> {
        if endpoints.is_empty() {
            return Err(Error::Other(format!(
                "Service {}/{} has no ready endpoints for port {}",
                self.namespace, self.service, self.port
            )));
        }
        Ok(endpoints[self.next.fetch_add(1, Ordering::Relaxed) % endpoints.len()])
    }

    /// A connection to an endpoint: the watch's pick, else (nothing watched yet, or the pick
    /// refused) one from a fresh list.
    async fn connect(&self) -> Result<(SocketAddr, TcpStream)> {
        let watched = self.watched_endpoints();
        if !watched.is_empty() {
            let pick = self.pick(&watched)?;
            if let Ok(stream) = TcpStream::connect(pick).await {
                return Ok((pick, stream));
            }
        }
        let pick = self.pick(&self.listed_endpoints().await?)?;
        let stream = TcpStream::connect(pick).await.map_err(|e| Error::Command {
            command: format!("connect to endpoint {pick}"),
            detail: e.to_string(),
        })?;
        Ok((pick, stream))
    }

    async fn serve(&self, mut inbound: TcpStream) -> Result<()> {
        let (pick, mut outbound) = self.connect().await?;
        let _ = inbound.set_nodelay(true);
        let _ = outbound.set_nodelay(true);
        if let Some(tls) = &self.tls {
            return tls.splice(&mut inbound, outbound).await;
        }
        tokio::io::copy_bidirectional(&mut inbound, &mut outbound)
            .await
            .map_err(|e| Error::Other(format!("splicing to {pick}: {e}")))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::PrivateKeyDer;
    use tokio_rustls::rustls::ServerConfig;
    use tokio_rustls::TlsAcceptor;

    const NAME: &str = "cli-mcp-demo.cli-mcp-demo.svc";

    /// A CA (PEM) and a TLS echo server on loopback whose certificate, for `NAME`, it signed.
    async fn echo_server() -> (String, SocketAddr) {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::default();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_pem = ca.self_signed(&ca_key).expect("CA").pem();
        let issuer = Issuer::new(ca, &ca_key);
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec![NAME.to_string()])
            .expect("params")
            .signed_by(&key, &issuer)
            .expect("leaf");
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                PrivateKeyDer::try_from(key.serialize_der()).expect("key der"),
            )
            .expect("server config");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut buf = [0u8; 4];
                    if tls.read_exact(&mut buf).await.is_ok() {
                        let _ = tls.write_all(&buf).await;
                        let _ = tls.shutdown().await;
                    }
                });
            }
        });
        (ca_pem, addr)
    }

    /// A plain client connection whose accepted end is spliced to `server` by `tls`; returns
    /// the client end and the splice's result.
    async fn through(tls: TlsUpstream, server: SocketAddr) -> (TcpStream, JoinHandle<Result<()>>) {
        let local = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let client = TcpStream::connect(local.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (mut inbound, _) = local.accept().await.expect("accept");
        let splice = tokio::spawn(async move {
            let outbound = TcpStream::connect(server).await.expect("connect server");
            tls.splice(&mut inbound, outbound).await
        });
        (client, splice)
    }

    #[tokio::test]
    async fn plain_in_tls_out_with_the_pinned_ca() {
        let (ca, server) = echo_server().await;
        let tls = TlsUpstream::new(ca.as_bytes(), NAME).expect("upstream");
        let (mut client, splice) = through(tls, server).await;
        client.write_all(b"ping").await.expect("write");
        let mut back = Vec::new();
        client.read_to_end(&mut back).await.expect("read");
        assert_eq!(back, b"ping", "the bytes went through TLS and back");
        drop(client);
        splice.await.expect("join").expect("splice ends cleanly");
    }

    #[tokio::test]
    async fn another_ca_or_another_name_is_refused_and_nothing_reaches_the_client() {
        let (ca, server) = echo_server().await;
        let (other_ca, _) = echo_server().await;
        for (ca_pem, name, want) in [
            // Both CAs carry the same (default) name, so rustls finds the issuer and the
            // signature check is what fails.
            (&other_ca, NAME, "invalid peer certificate"),
            (&ca, "other.cli-mcp-demo.svc", "not valid for name"),
        ] {
            let tls = TlsUpstream::new(ca_pem.as_bytes(), name).expect("upstream");
            let (mut client, splice) = through(tls, server).await;
            let err = splice.await.expect("join").expect_err("must not connect");
            assert!(err.to_string().contains(want), "{want}: {err}");
            let mut back = Vec::new();
            let _ = client.read_to_end(&mut back).await;
            assert!(back.is_empty(), "nothing reached the client: {back:?}");
        }
    }

    #[tokio::test]
    async fn a_ca_file_without_a_certificate_or_a_bad_name_is_a_clear_error() {
        let e = TlsUpstream::new(b"not pem", NAME).expect_err("no cert");
        assert!(e.to_string().contains("holds no PEM certificate"), "{e}");
        let (ca, _) = echo_server().await;
        let e = TlsUpstream::new(ca.as_bytes(), "bad name!").expect_err("bad name");
        assert!(e.to_string().contains("not a valid server name"), "{e}");
    }
}
