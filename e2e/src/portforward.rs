//! Forward a loopback TCP port to a Service, the way `kubectl port-forward svc/NAME` gives a
//! user a local port.
//!
//! There is no kube-proxy, so ClusterIPs do not route. Instead, for every accepted
//! connection the forwarder resolves Service → EndpointSlices → a ready endpoint
//! (`podIP:targetPort`, honouring named target ports through the slice's port names) and
//! splices the connection to it. Endpoints are picked round-robin, and since resolution
//! happens per connection, the forward follows pods as they come and go.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::ListParams;
use kube::{Api, Client};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::error::{Error, Result};

/// A running forward; stops when dropped.
#[derive(Debug)]
pub struct ServiceForward {
    local: SocketAddr,
    task: JoinHandle<()>,
}

struct Target {
    client: Client,
    namespace: String,
    service: String,
    port: u16,
    next: AtomicUsize,
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
        let target = Arc::new(Target {
            client,
            namespace: namespace.to_string(),
            service: service.to_string(),
            port,
            next: AtomicUsize::new(0),
        });
        // Fail early with a clear message if the Service or its port does not exist.
        target.resolve_port_name().await?;
        let bind = SocketAddr::from((Ipv4Addr::LOCALHOST, local_port));
        let listener = TcpListener::bind(bind).await.map_err(|e| Error::Command {
            command: format!("listen on {bind}"),
            detail: e.to_string(),
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Other(format!("local address of the forward: {e}")))?;
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
        Ok(ServiceForward { local, task })
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
    }
}

impl Target {
    /// The name of the Service port (empty when it is unnamed).
    async fn resolve_port_name(&self) -> Result<String> {
        let svc = Api::<Service>::namespaced(self.client.clone(), &self.namespace)
            .get_opt(&self.service)
            .await?
            .ok_or_else(|| {
                Error::Other(format!(
                    "Service {}/{} does not exist",
                    self.namespace, self.service
                ))
            })?;
        let ports = svc.spec.and_then(|s| s.ports).unwrap_or_default();
        ports
            .iter()
            .find(|p| p.port == i32::from(self.port))
            .map(|p| p.name.clone().unwrap_or_default())
            .ok_or_else(|| {
                Error::Other(format!(
                    "Service {}/{} has no port {} (it has {:?})",
                    self.namespace,
                    self.service,
                    self.port,
                    ports.iter().map(|p| p.port).collect::<Vec<_>>()
                ))
            })
    }

    /// All ready `ip:port` endpoints of the Service port, in a stable order.
    async fn endpoints(&self) -> Result<Vec<SocketAddr>> {
        let port_name = self.resolve_port_name().await?;
        let slices = Api::<EndpointSlice>::namespaced(self.client.clone(), &self.namespace)
            .list(
                &ListParams::default()
                    .labels(&format!("kubernetes.io/service-name={}", self.service)),
            )
            .await?;
        let mut out = Vec::new();
        for slice in slices.items {
            let Some(port) = slice
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.clone().unwrap_or_default() == port_name)
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
        Ok(out)
    }

    async fn serve(&self, mut inbound: TcpStream) -> Result<()> {
        let endpoints = self.endpoints().await?;
        if endpoints.is_empty() {
            return Err(Error::Other(format!(
                "Service {}/{} has no ready endpoints for port {}",
                self.namespace, self.service, self.port
            )));
        }
        let pick = endpoints[self.next.fetch_add(1, Ordering::Relaxed) % endpoints.len()];
        let mut outbound = TcpStream::connect(pick).await.map_err(|e| Error::Command {
            command: format!("connect to endpoint {pick}"),
            detail: e.to_string(),
        })?;
        let _ = inbound.set_nodelay(true);
        let _ = outbound.set_nodelay(true);
        tokio::io::copy_bidirectional(&mut inbound, &mut outbound)
            .await
            .map_err(|e| Error::Other(format!("splicing to {pick}: {e}")))?;
        Ok(())
    }
}
