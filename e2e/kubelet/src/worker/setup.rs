//! Pod-level setup: the network namespace with its CNI address, and the volumes.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Instant;

use k8s_openapi::api::core::v1::{ConfigMap, Container, Secret};
use kube::Api;

use super::Worker;
use crate::downward::PodFacts;
use crate::env::{self, Objects};
use crate::status::State;
use crate::volumes::{self, SyncCtx};
use crate::{identity, netns};

impl Worker {
    /// Returns whether the pod network is up.
    pub(super) async fn setup_network(&mut self) -> bool {
        if self.net.ip.is_some() {
            return true;
        }
        if self.net.retry_at.is_some_and(|t| t > Instant::now()) {
            return false;
        }
        match self.try_setup_network().await {
            Ok(ip) => {
                tracing::info!(pod = %self.pod_key(), ip = %ip, netns = %self.record.netns, "pod network ready");
                self.net.ip = Some(ip);
                self.net.error = None;
                self.net.retry_at = None;
                true
            }
            Err(e) => {
                let delay = self.net_backoff.after_failure();
                tracing::warn!(pod = %self.pod_key(), "network setup failed (retry in {delay:?}): {e}");
                self.net.error = Some(format!("pod network setup failed: {e}"));
                self.net.retry_at = Some(Instant::now() + delay);
                false
            }
        }
    }

    pub(super) async fn try_setup_network(&mut self) -> Result<Ipv4Addr, String> {
        // Record first, so a crash in between still gets cleaned up on restart.
        self.record.save(&self.dir)?;
        let ns_name = self.record.netns.clone();
        let path = netns::create(&ns_name).await?;
        let added = self.ctx.cni.add(&self.uid, &path).await;
        // The Service rules are in place before any container can open a connection.
        let added = match added {
            Ok(ip) => self.ctx.services.attach(&ns_name).await.map(|()| ip),
            Err(e) => Err(e),
        };
        match added {
            Ok(ip) => Ok(ip),
            Err(e) => {
                self.ctx.services.detach(&ns_name).await;
                let _ = self.ctx.cni.del(&self.uid, Some(&path)).await;
                let _ = netns::delete(&ns_name).await;
                Err(e)
            }
        }
    }

    pub(super) async fn sync_volumes(&mut self) {
        if Instant::now() < self.next_volume_sync {
            return;
        }
        let tmpfs: Vec<PathBuf> = volumes::tmpfs_volumes(&self.pod, &self.dir)
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        if tmpfs.iter().any(|p| !self.record.tmpfs.contains(p)) {
            self.record.tmpfs = tmpfs;
            if let Err(e) = self.record.save(&self.dir) {
                tracing::warn!(pod = %self.pod_key(), "{e}");
            }
        }
        let (uid, gid) = self
            .pod
            .spec
            .as_ref()
            .map(identity::volume_owner)
            .unwrap_or((0, 0));
        let ctx = self.ctx.clone();
        let pod = self.pod.clone();
        let dir = self.dir.clone();
        let sync = SyncCtx {
            client: &ctx.client,
            facts: PodFacts {
                pod: &pod,
                pod_ip: None,
                host_ip: "",
                node_name: &ctx.node.name,
                node_cpu: ctx.node.cpu_cores as f64,
                node_memory: ctx.node.memory_bytes as f64,
            },
            dir: &dir,
            owner: (uid, gid),
        };
        let result = self.volumes.sync(&sync).await;
        let resync = ctx.timing.volume_resync;
        match result {
            Ok(()) => {
                self.volumes_ready = true;
                self.volume_error = None;
                self.volume_backoff.reset();
                let mut next = Instant::now() + resync;
                if let Some(t) = self.volumes.next_token_refresh() {
                    next = next.min(t);
                }
                self.next_volume_sync = next;
            }
            Err(e) if self.volumes_ready => {
                tracing::warn!(pod = %self.pod_key(), "volume refresh failed (keeping old content): {e}");
                self.next_volume_sync = Instant::now() + resync;
            }
            Err(e) => {
                let delay = self.volume_backoff.after_failure();
                tracing::warn!(pod = %self.pod_key(), "volume setup failed (retry in {delay:?}): {e}");
                self.volume_error = Some(e.clone());
                self.next_volume_sync = Instant::now() + delay;
                for id in self.slot_ids() {
                    let s = self.slot_mut(id);
                    if s.running.is_none() && !s.done {
                        s.view.state =
                            State::waiting("CreateContainerConfigError", Some(e.clone()));
                    }
                }
            }
        }
    }

    pub(super) async fn fetch_objects(&self, c: &Container) -> Result<Objects, String> {
        let (cms, secrets) = env::referenced_objects(c);
        let mut out = Objects::default();
        let cm_api: Api<ConfigMap> = Api::namespaced(self.ctx.client.clone(), &self.ns);
        for n in cms {
            let v = cm_api
                .get_opt(&n)
                .await
                .map_err(|e| format!("reading configmap {}/{n}: {e}", self.ns))?;
            out.config_maps.insert(n, v);
        }
        let s_api: Api<Secret> = Api::namespaced(self.ctx.client.clone(), &self.ns);
        for n in secrets {
            let v = s_api
                .get_opt(&n)
                .await
                .map_err(|e| format!("reading secret {}/{n}: {e}", self.ns))?;
            out.secrets.insert(n, v);
        }
        Ok(out)
    }
}
