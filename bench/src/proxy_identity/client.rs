//! A sandbox's client as the proxy sees it, without a client library in between: a TCP
//! connection from the sandbox pod's address (`127.0.0.x` on loopback), `CONNECT` with
//! `Proxy-Authorization: Bearer <its token>` (what the agent's relay adds), TLS to the
//! proxy's leaf with no session resumption (each kubectl run is a new process), then HTTP/1.1
//! requests read to their end.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::client::Resumption;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use tokio_rustls::TlsConnector;

use super::sandboxes::Sandbox;
use super::upstream::provider;

/// Longest any one step may take before the figure is an error instead.
const DEADLINE: Duration = Duration::from_secs(20);

pub(crate) type Tunnel = TlsStream<TcpStream>;

/// How to reach one upstream through one proxy.
#[derive(Clone)]
pub(crate) struct Client {
    pub(crate) proxy: SocketAddr,
    /// `host:port` of the upstream.
    target: String,
    tls: TlsConnector,
}

impl Client {
    /// Through `proxy` to `target`, trusting `proxy_ca_pem` (the proxy's CA) only.
    pub(crate) fn new(proxy: SocketAddr, target: &str, proxy_ca_pem: &str) -> anyhow::Result<Self> {
        let mut roots = RootCertStore::empty();
        roots.add(CertificateDer::from_pem_slice(proxy_ca_pem.as_bytes())?)?;
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        config.resumption = Resumption::disabled();
        Ok(Self {
            proxy,
            target: target.to_owned(),
            tls: TlsConnector::from(Arc::new(config)),
        })
    }

    /// The proxy's answer head to a CONNECT from `from` with `token` (`None`: no
    /// `Proxy-Authorization`), and the connection when it is a 200.
    pub(crate) async fn connect(
        &self,
        from: IpAddr,
        token: Option<&str>,
    ) -> anyhow::Result<(String, TcpStream)> {
        let socket = TcpSocket::new_v4()?;
        socket
            .bind(SocketAddr::new(from, 0))
            .with_context(|| format!("binding {from}"))?;
        let mut tcp = socket.connect(self.proxy).await?;
        tcp.set_nodelay(true)?;
        let auth = token
            .map(|t| format!("Proxy-Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let target = &self.target;
        tcp.write_all(
            format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n").as_bytes(),
        )
        .await?;
        let (head, rest) = read_head(&mut tcp).await?;
        if !rest.is_empty() {
            bail!("the proxy sent bytes after its CONNECT answer: {head}");
        }
        Ok((head, tcp))
    }

    /// A tunnel from `from`, TLS up.
    pub(crate) async fn tunnel(&self, from: IpAddr, token: Option<&str>) -> anyhow::Result<Tunnel> {
        let (head, tcp) = self.connect(from, token).await?;
        if !head.starts_with("HTTP/1.1 200") {
            bail!("CONNECT {}: {}", self.target, first_line(&head));
        }
        let host = self.target.rsplit_once(':').map_or("", |(h, _)| h);
        let name = ServerName::try_from(host.to_owned())?;
        Ok(tokio::time::timeout(DEADLINE, self.tls.connect(name, tcp)).await??)
    }

    /// A tunnel for sandbox `s`, retried for up to 30 s while the proxy refuses it (its pod
    /// watch has not shown the pod yet).
    pub(crate) async fn tunnel_when_admitted(&self, s: &Sandbox) -> anyhow::Result<Tunnel> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.tunnel(s.ip, Some(&s.token)).await {
                Ok(t) => return Ok(t),
                Err(e) if Instant::now() > deadline => {
                    return Err(e.context(format!("sandbox {} was never admitted", s.ip)))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// A new tunnel and one GET `/` in it, timed from the TCP connect to the body's end.
    pub(crate) async fn fresh_get(
        &self,
        from: IpAddr,
        token: Option<&str>,
    ) -> anyhow::Result<Duration> {
        let start = Instant::now();
        let mut t = self.tunnel(from, token).await?;
        self.get(&mut t, "/").await?;
        Ok(start.elapsed())
    }

    /// GET `path` in tunnel `t`, read to the end of the body; errors unless 200.
    pub(crate) async fn get(&self, t: &mut Tunnel, path: &str) -> anyhow::Result<()> {
        let host = &self.target;
        t.write_all(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
            .await?;
        let (head, mut body) = read_head(t).await?;
        if !head.starts_with("HTTP/1.1 200") {
            bail!("GET {path}: {}", first_line(&head));
        }
        let lower = head.to_ascii_lowercase();
        if let Some(len) = lower
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
        {
            let len: usize = len.trim().parse()?;
            while body.len() < len {
                read_some(t, &mut body).await?;
            }
        } else if lower.contains("transfer-encoding: chunked") {
            while !body.ends_with(b"0\r\n\r\n") {
                read_some(t, &mut body).await?;
            }
        } else {
            bail!("GET {path}: neither a length nor chunks: {head}");
        }
        Ok(())
    }

    /// GET `path` in tunnel `t` and its answer head only (for a response that streams on).
    pub(crate) async fn open_stream(&self, t: &mut Tunnel, path: &str) -> anyhow::Result<()> {
        let host = &self.target;
        t.write_all(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
            .await?;
        let (head, _) = read_head(t).await?;
        if !head.starts_with("HTTP/1.1 200") {
            bail!("GET {path}: {}", first_line(&head));
        }
        Ok(())
    }
}

pub(crate) fn first_line(head: &str) -> &str {
    head.lines().next().unwrap_or("")
}

async fn read_some<R: AsyncRead + Unpin>(r: &mut R, into: &mut Vec<u8>) -> anyhow::Result<()> {
    let mut buf = [0u8; 4096];
    let n = tokio::time::timeout(DEADLINE, r.read(&mut buf))
        .await
        .context("no answer in time")??;
    if n == 0 {
        bail!(
            "closed after {:?}",
            String::from_utf8_lossy(&into[..into.len().min(300)])
        );
    }
    into.extend_from_slice(&buf[..n]);
    Ok(())
}

/// One answer head, and what came after it.
pub(crate) async fn read_head<R: AsyncRead + Unpin>(
    r: &mut R,
) -> anyhow::Result<(String, Vec<u8>)> {
    let mut got = Vec::new();
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = got.split_off(end + 4);
            return Ok((String::from_utf8_lossy(&got).into_owned(), rest));
        }
        read_some(r, &mut got).await?;
    }
}
