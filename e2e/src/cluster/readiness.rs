//! The waits of `Cluster::up`: the apiserver's `/readyz`, the Node's Ready condition, the
//! `default` namespace's ServiceAccount and root CA; each fails at once when one of the
//! cluster's processes exits meanwhile.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Node, ServiceAccount};
use kube::runtime::wait::await_condition;
use kube::{Api, Client};

use super::Cluster;
use crate::error::{Error, Result};
use crate::node::RealNode;
use crate::process::Component;

impl Cluster {
    pub(super) async fn wait_readyz(&mut self, client: &Client, deadline: Instant) -> Result<()> {
        let mut last: String;
        loop {
            if let Some(e) = self.first_exit() {
                return Err(e);
            }
            let req = http::Request::get("/readyz")
                .body(Vec::new())
                .map_err(|e| Error::Other(format!("building /readyz request: {e}")))?;
            match tokio::time::timeout(Duration::from_secs(3), client.request_text(req)).await {
                Ok(Ok(body)) if body.trim() == "ok" => return Ok(()),
                Ok(Ok(body)) => last = body,
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "request timed out".into(),
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!(
                        "kube-apiserver /readyz (last answer: {last}); see {}",
                        self.info.log_dir.join("kube-apiserver.log").display()
                    ),
                    elapsed: self.started.elapsed(),
                });
            }
            // No watch exists for /readyz: poll it.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Wait until the cluster's Node is Ready.
    pub(super) async fn wait_node_ready(
        &mut self,
        client: &Client,
        deadline: Instant,
    ) -> Result<()> {
        let node_name = self.info.node_name.clone();
        self.wait_watched(
            &format!("node {node_name} to be Ready"),
            deadline,
            await_condition(Api::<Node>::all(client.clone()), &node_name, node_ready),
        )
        .await
    }

    /// Wait until the `default` namespace has its ServiceAccount and `kube-root-ca.crt`
    /// (what every pod of a test's or a user's needs).
    pub(super) async fn wait_default_namespace(
        &mut self,
        client: &Client,
        deadline: Instant,
    ) -> Result<()> {
        self.wait_watched(
            "ServiceAccount default/default",
            deadline,
            await_condition(
                Api::<ServiceAccount>::namespaced(client.clone(), "default"),
                "default",
                |o: Option<&ServiceAccount>| o.is_some(),
            ),
        )
        .await?;
        self.wait_watched(
            "ConfigMap default/kube-root-ca.crt",
            deadline,
            await_condition(
                Api::<ConfigMap>::namespaced(client.clone(), "default"),
                "kube-root-ca.crt",
                |o: Option<&ConfigMap>| o.is_some(),
            ),
        )
        .await
    }

    /// Wait for a watch-based condition while making sure no component died meanwhile.
    async fn wait_watched<K, F>(&mut self, what: &str, deadline: Instant, fut: F) -> Result<()>
    where
        F: std::future::Future<Output = std::result::Result<Option<K>, kube::runtime::wait::Error>>,
    {
        let mut fut = std::pin::pin!(tokio::time::timeout_at(deadline.into(), fut));
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                r = &mut fut => {
                    return match r {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err(source)) => Err(Error::Watch { what: what.to_string(), source }),
                        Err(_) => Err(Error::Timeout {
                            what: format!("{what}; logs are in {}", self.info.log_dir.display()),
                            elapsed: self.started.elapsed(),
                        }),
                    };
                }
                _ = tick.tick() => {
                    if let Some(e) = self.first_exit() {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// The first component that has exited, as an error.
    pub fn first_exit(&mut self) -> Option<Error> {
        if let Some(e) = self.real_node.as_mut().and_then(RealNode::first_exit) {
            return Some(e);
        }
        if let Some(e) = self.dns.as_mut().and_then(|d| d.exited_error()) {
            return Some(e);
        }
        self.control_plane
            .iter_mut()
            .chain(self.kubelet.iter_mut())
            .find_map(Component::exited_error)
    }
}

fn node_ready(node: Option<&Node>) -> bool {
    node.and_then(|n| n.status.as_ref())
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}
