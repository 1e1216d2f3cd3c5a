//! Pod status: building it from the slots and patching it when it changed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, PodCondition};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::{json, Value};

use super::Worker;
use crate::status::{self, ContainerView, PodView};

impl Worker {
    pub(super) fn previous_conditions(&self) -> Vec<PodCondition> {
        let mut prev: Vec<PodCondition> = self
            .pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        for c in &self.published_conditions {
            match prev.iter_mut().find(|p| p.type_ == c.type_) {
                Some(p) => *p = c.clone(),
                None => prev.push(c.clone()),
            }
        }
        prev
    }

    pub(super) async fn publish_status(&mut self) {
        if self.status_retry_at.is_some_and(|t| t > Instant::now()) {
            return;
        }
        let init: Vec<ContainerView> = self.init.iter().map(|s| s.view.clone()).collect();
        let containers: Vec<ContainerView> =
            self.containers.iter().map(|s| s.view.clone()).collect();
        let mut pod = (*self.pod).clone();
        let prev = self.previous_conditions();
        pod.status.get_or_insert_with(Default::default).conditions = Some(prev);
        let finished = self.deleting()
            && self
                .slot_ids()
                .iter()
                .all(|i| self.slot(*i).running.is_none());
        let message = self
            .net
            .error
            .clone()
            .filter(|_| self.net.ip.is_none())
            .or_else(|| self.volume_error.clone());
        let view = PodView {
            pod: &pod,
            init: &init,
            containers: &containers,
            network_ready: self.net.ip.is_some() && !self.net.torn_down,
            pod_ip: self.net.ip.map(|i| i.to_string()),
            host_ip: self.ctx.node.internal_ip.to_string(),
            start_time: self.start_time,
            terminated: finished,
            message,
            now: Timestamp::now(),
        };
        let status = status::build(&view);
        let conditions = status.conditions.clone().unwrap_or_default();
        let mut status_json = match serde_json::to_value(&status) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(pod = %self.pod_key(), "encoding status: {e}");
                return;
            }
        };
        if let Some(obj) = status_json.as_object_mut() {
            // Merge patches keep absent keys; clear a stale message explicitly.
            obj.entry("message").or_insert(Value::Null);
        }
        if self.published.as_ref() == Some(&status_json) {
            return;
        }
        let patch = json!({ "metadata": { "uid": self.uid }, "status": status_json });
        let api: Api<Pod> = Api::namespaced(self.ctx.client.clone(), &self.ns);
        match api
            .patch_status(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(p) => {
                self.published = Some(status_json);
                self.published_conditions = conditions;
                self.status_retry_at = None;
                // Keep our view of the pod fresh (resourceVersion, status) without waiting for
                // the watch; metadata changes still arrive through the watch.
                let mut fresh = (*self.pod).clone();
                fresh.status = p.status;
                self.pod = Arc::new(fresh);
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {
                self.status_retry_at = Some(Instant::now() + Duration::from_secs(5));
            }
            Err(e) => {
                tracing::warn!(pod = %self.pod_key(), "status update failed (will retry): {e}");
                self.status_retry_at = Some(Instant::now() + Duration::from_secs(1));
            }
        }
    }
}
