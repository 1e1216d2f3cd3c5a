//! Stopping containers (grace periods, preStop hooks), releasing the pod's network and
//! files, and finishing a deletion in the API.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Preconditions};
use kube::Api;
use nix::sys::signal::Signal;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{Event, PodUpdate, SlotId, Worker};
use crate::backoff::Backoff;
use crate::probes;
use crate::status::{State, Terminated};
use crate::{netns, process};

impl Worker {
    /// Terminal pods (nothing will run again) release their network right away.
    pub(super) async fn teardown_if_finished(&mut self) {
        let all_done = self
            .containers
            .iter()
            .all(|s| s.done && s.running.is_none());
        let init_failed = self.restart_policy() == "Never"
            && self.init.iter().any(|s| {
                s.done && matches!(&s.view.state, State::Terminated(t) if t.exit_code != 0)
            });
        if (all_done || init_failed) && !self.net.torn_down {
            self.stop_sidecars().await;
            tracing::info!(pod = %self.pod_key(), "pod finished; releasing its network");
            self.teardown_runtime().await;
        }
    }

    pub(super) async fn stop_sidecars(&mut self) {
        let ids: Vec<SlotId> = self
            .slot_ids()
            .into_iter()
            .filter(|id| self.slot(*id).running.is_some())
            .collect();
        if ids.is_empty() {
            return;
        }
        for id in &ids {
            self.slot_mut(*id).done = true;
        }
        self.signal_and_wait(&ids, self.grace_period()).await;
    }

    /// Signals the given containers, waits up to `grace` for them to exit, then SIGKILLs.
    pub(super) async fn signal_and_wait(&mut self, ids: &[SlotId], grace: Duration) {
        for id in ids {
            if let Some(r) = self.slot_mut(*id).running.as_mut() {
                r.stop_tasks();
                process::signal_group(r.pid, Signal::SIGTERM);
            }
        }
        let any_running = |w: &Worker| ids.iter().any(|id| w.slot(*id).running.is_some());
        let deadline = Instant::now() + grace;
        while any_running(self) {
            match tokio::time::timeout_at(deadline.into(), self.rx.recv()).await {
                Ok(Some(ev @ Event::Exited { .. })) => self.on_event(ev),
                Ok(Some(Event::Probe { .. })) => {}
                Ok(None) | Err(_) => break,
            }
        }
        if any_running(self) {
            for id in ids {
                if let Some(r) = self.slot(*id).running.as_ref() {
                    tracing::info!(pod = %self.pod_key(), container = %self.slot(*id).spec.name, "grace period over; SIGKILL");
                    process::signal_group(r.pid, Signal::SIGKILL);
                }
            }
            let hard = Instant::now() + Duration::from_secs(10);
            while any_running(self) {
                match tokio::time::timeout_at(hard.into(), self.rx.recv()).await {
                    Ok(Some(ev @ Event::Exited { .. })) => self.on_event(ev),
                    Ok(Some(Event::Probe { .. })) => {}
                    Ok(None) | Err(_) => break,
                }
            }
        }
    }

    /// Runs the preStop hooks of running containers (exec, httpGet, sleep), within `budget`.
    pub(super) async fn run_pre_stop_hooks(&mut self, budget: Duration) {
        let Some(ip) = self.net.ip else { return };
        let mut hooks = Vec::new();
        for id in self.slot_ids() {
            let s = self.slot(id);
            let (Some(r), Some(h)) = (
                s.running.as_ref(),
                s.spec.lifecycle.as_ref().and_then(|l| l.pre_stop.clone()),
            ) else {
                continue;
            };
            let target = probes::Target {
                pod_ip: ip,
                pod_cidr: self.ctx.cni.cidr,
                pid: r.pid,
                spec_path: self.dir.exec_spec(&s.spec.name),
                ports: s.spec.ports.clone().unwrap_or_default(),
            };
            let http = self.ctx.http.clone();
            let name = s.spec.name.clone();
            let pod = self.pod_key();
            hooks.push(async move {
                let result = if let Some(sl) = &h.sleep {
                    tokio::time::sleep(Duration::from_secs(sl.seconds.max(0) as u64)).await;
                    Ok(())
                } else {
                    let p = k8s_openapi::api::core::v1::Probe {
                        exec: h.exec.clone(),
                        http_get: h.http_get.clone(),
                        tcp_socket: h.tcp_socket.clone(),
                        ..Default::default()
                    };
                    probes::probe_once(&p, &target, budget, &http).await
                };
                if let Err(e) = result {
                    tracing::warn!(pod = %pod, container = %name, "preStop hook failed: {e}");
                }
            });
        }
        if hooks.is_empty() {
            return;
        }
        let _ = tokio::time::timeout(budget, futures::future::join_all(hooks)).await;
    }

    /// Stops all containers and releases everything; used for deletion, disappearance and
    /// kubelet shutdown.
    pub(super) async fn stop_everything(&mut self, grace: Duration) {
        let start = Instant::now();
        self.run_pre_stop_hooks(grace).await;
        let left = grace.saturating_sub(start.elapsed());
        // Regular containers first, then sidecars (in reverse order), as the kubelet does.
        let regular: Vec<SlotId> = self.slot_ids().into_iter().filter(|i| !i.init).collect();
        for id in &regular {
            self.slot_mut(*id).done = true;
        }
        self.signal_and_wait(&regular, left).await;
        let mut init: Vec<SlotId> = self.slot_ids().into_iter().filter(|i| i.init).collect();
        init.reverse();
        for id in &init {
            self.slot_mut(*id).done = true;
        }
        let left = grace.saturating_sub(start.elapsed());
        self.signal_and_wait(&init, left).await;
        self.teardown_runtime().await;
        let _ = std::fs::remove_file(self.dir.record());
    }

    /// Kills leftovers in the netns, releases the IP, removes the netns, tmpfs and volumes.
    pub(super) async fn teardown_runtime(&mut self) {
        if self.net.torn_down {
            return;
        }
        let ns_name = self.record.netns.clone();
        let killed = netns::kill_everything_in(&ns_name, netns::KILL_WITHIN).await;
        if killed > 0 {
            tracing::info!(pod = %self.pod_key(), "killed {killed} leftover process(es) in {ns_name}");
        }
        self.ctx.services.detach(&ns_name).await;
        if self.net.ip.is_some() || netns::exists(&ns_name) {
            let path = netns::path(&ns_name);
            let ns_path = netns::exists(&ns_name).then_some(path.as_path());
            if let Err(e) = self.ctx.cni.del(&self.uid, ns_path).await {
                tracing::warn!(pod = %self.pod_key(), "{e}");
            }
            if let Err(e) = netns::delete(&ns_name).await {
                tracing::warn!(pod = %self.pod_key(), "{e}");
            }
        }
        for t in &self.record.tmpfs {
            crate::state::unmount(t);
        }
        let _ = std::fs::remove_dir_all(self.dir.volumes());
        let _ = std::fs::remove_dir_all(self.dir.root.join("exec"));
        let _ = std::fs::remove_dir_all(self.dir.root.join("etc"));
        self.record.processes.clear();
        self.record.tmpfs.clear();
        let _ = self.record.save(&self.dir);
        self.net.torn_down = true;
    }

    pub(super) async fn terminate_and_delete(
        &mut self,
        updates: &mut watch::Receiver<PodUpdate>,
        cancel: &CancellationToken,
    ) {
        let grace = self.grace_period();
        tracing::info!(pod = %self.pod_key(), ?grace, "pod is being deleted; stopping containers");
        self.stop_everything(grace).await;
        // Containers that never ran end up terminated too, so the final status is complete.
        for id in self.slot_ids() {
            let s = self.slot_mut(id);
            if let State::Waiting { .. } = s.view.state {
                s.view.state = State::Terminated(Terminated {
                    exit_code: 137,
                    signal: None,
                    reason: "ContainerStatusUnknown".into(),
                    message: Some(
                        "the container was never started before the pod was deleted".into(),
                    ),
                    started_at: None,
                    finished_at: Timestamp::now(),
                    container_id: None,
                });
            }
        }
        self.publish_status().await;
        let api: Api<Pod> = Api::namespaced(self.ctx.client.clone(), &self.ns);
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(self.uid.clone()),
                resource_version: None,
            }),
            ..Default::default()
        };
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        loop {
            match api.delete(&self.name, &dp).await {
                Ok(_) => {
                    tracing::info!(pod = %self.pod_key(), "pod deleted");
                    break;
                }
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => break,
                Err(e) => {
                    let delay = backoff.after_failure();
                    tracing::warn!(pod = %self.pod_key(), "deleting pod failed (retry in {delay:?}): {e}");
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(delay) => {}
                        changed = updates.changed() => {
                            if changed.is_err() || matches!(&*updates.borrow(), PodUpdate::Gone(_)) {
                                break;
                            }
                        }
                    }
                }
            }
        }
        let _ = std::fs::remove_file(self.dir.record());
    }
}
