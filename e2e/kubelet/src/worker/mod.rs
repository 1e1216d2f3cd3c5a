//! One task per pod: network, volumes, container lifecycle, probes, status, deletion.
//!
//! The worker is a single event loop: it reacts to pod updates (from the watch), container
//! exits and probe results (from its own tasks), and timers (restart back-off, retries,
//! volume refresh). After each event it reconciles and patches the pod status if it changed.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, PodCondition};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::cni::Cni;
use crate::downward::PodFacts;
use crate::env::ServiceEnv;
use crate::netns;
use crate::node::NodeInfo;
use crate::probes::Kind;
use crate::state::{PodDir, PodRecord};
use crate::status::{self, State};
use crate::volumes::Volumes;

mod container;
mod publish;
mod setup;
mod teardown;

use container::{restart_wanted, terminated_from_api, Slot};

/// Tunables shared by all workers.
#[derive(Debug, Clone)]
pub struct Timing {
    pub crash_initial: Duration,
    pub crash_max: Duration,
    pub retry_initial: Duration,
    pub retry_max: Duration,
    pub volume_resync: Duration,
}

/// Shared, read-only context.
pub struct Ctx {
    pub client: Client,
    pub node: NodeInfo,
    pub state_dir: PathBuf,
    pub image_map: PathBuf,
    pub cni: Cni,
    pub service_env: ServiceEnv,
    pub dns: crate::launch::PodDns,
    pub services: Arc<crate::services::Services>,
    pub http: reqwest::Client,
    pub timing: Timing,
}

/// What the pod watch tells a worker.
#[derive(Debug, Clone)]
pub enum PodUpdate {
    Present(Arc<Pod>),
    /// The pod object is gone from the API (the last known object).
    Gone(Arc<Pod>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct SlotId {
    init: bool,
    idx: usize,
}

enum Event {
    Exited {
        slot: SlotId,
        run: u64,
        status: ExitStatus,
    },
    Probe {
        slot: SlotId,
        run: u64,
        kind: Kind,
        ok: bool,
        message: String,
    },
}

#[derive(Default)]
struct Net {
    ip: Option<Ipv4Addr>,
    error: Option<String>,
    retry_at: Option<Instant>,
    torn_down: bool,
}

struct Worker {
    ctx: Arc<Ctx>,
    pod: Arc<Pod>,
    uid: String,
    ns: String,
    name: String,
    dir: PodDir,
    record: PodRecord,
    net: Net,
    net_backoff: Backoff,
    volumes: Volumes,
    volumes_ready: bool,
    volume_error: Option<String>,
    next_volume_sync: Instant,
    volume_backoff: Backoff,
    init: Vec<Slot>,
    containers: Vec<Slot>,
    tx: mpsc::UnboundedSender<Event>,
    rx: mpsc::UnboundedReceiver<Event>,
    run_seq: u64,
    start_time: Timestamp,
    published: Option<Value>,
    published_conditions: Vec<PodCondition>,
    status_retry_at: Option<Instant>,
}

/// Runs the worker for one pod until it is deleted, gone, or the kubelet shuts down.
pub async fn run(
    ctx: Arc<Ctx>,
    mut updates: watch::Receiver<PodUpdate>,
    cancel: CancellationToken,
) {
    let pod = match &*updates.borrow_and_update() {
        PodUpdate::Present(p) | PodUpdate::Gone(p) => p.clone(),
    };
    let Some(mut w) = Worker::new(ctx, pod) else {
        return;
    };
    w.main_loop(updates, cancel).await;
}

impl Worker {
    fn new(ctx: Arc<Ctx>, pod: Arc<Pod>) -> Option<Worker> {
        let uid = pod.metadata.uid.clone()?;
        let ns = pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = pod.metadata.name.clone()?;
        let spec = pod.spec.as_ref()?;
        let dir = PodDir::new(&ctx.state_dir, &ns, &name, &uid);
        let prev = |init: bool, n: &str| {
            pod.status.as_ref().and_then(|s| {
                let list = if init {
                    s.init_container_statuses.as_ref()
                } else {
                    s.container_statuses.as_ref()
                };
                list.and_then(|l| l.iter().find(|c| c.name == n))
            })
        };
        let t = &ctx.timing;
        let init: Vec<Slot> = spec
            .init_containers
            .iter()
            .flatten()
            .map(|c| {
                let sidecar = c.restart_policy.as_deref() == Some("Always");
                Slot::new(c, sidecar, t, prev(true, &c.name))
            })
            .collect();
        let containers: Vec<Slot> = spec
            .containers
            .iter()
            .map(|c| Slot::new(c, false, t, prev(false, &c.name)))
            .collect();
        let start_time = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.as_ref())
            .map(|t| t.0)
            .unwrap_or_else(Timestamp::now);
        let (tx, rx) = mpsc::unbounded_channel();
        let record = PodRecord {
            uid: uid.clone(),
            namespace: ns.clone(),
            name: name.clone(),
            netns: netns::name_for(&uid),
            ..Default::default()
        };
        let mut w = Worker {
            net_backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(30)),
            volume_backoff: Backoff::new(t.retry_initial, t.retry_max),
            ctx,
            pod,
            uid,
            ns,
            name,
            dir,
            record,
            net: Net::default(),
            volumes: Volumes::default(),
            volumes_ready: false,
            volume_error: None,
            next_volume_sync: Instant::now(),
            init,
            containers,
            tx,
            rx,
            run_seq: 0,
            start_time,
            published: None,
            published_conditions: Vec::new(),
            status_retry_at: None,
        };
        w.adopt_finished_containers();
        Some(w)
    }

    fn restart_policy(&self) -> &str {
        self.pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.as_deref())
            .unwrap_or("Always")
    }

    fn should_restart(&self, slot: SlotId, exit_code: i32) -> bool {
        let sidecar = self.slot(slot).sidecar;
        restart_wanted(self.restart_policy(), slot.init, sidecar, exit_code)
    }

    /// Containers that finished for good before a kubelet restart stay finished.
    fn adopt_finished_containers(&mut self) {
        let statuses = self.pod.status.clone();
        for (init, list) in [
            (
                true,
                statuses
                    .as_ref()
                    .and_then(|s| s.init_container_statuses.clone()),
            ),
            (
                false,
                statuses.as_ref().and_then(|s| s.container_statuses.clone()),
            ),
        ] {
            for cs in list.into_iter().flatten() {
                let Some(t) = cs.state.as_ref().and_then(|s| s.terminated.as_ref()) else {
                    continue;
                };
                let slots = if init { &self.init } else { &self.containers };
                let Some(idx) = slots.iter().position(|s| s.spec.name == cs.name) else {
                    continue;
                };
                let id = SlotId { init, idx };
                if !self.should_restart(id, t.exit_code) {
                    let s = self.slot_mut(id);
                    s.view.state = State::Terminated(terminated_from_api(t));
                    s.view.container_id = cs.container_id.clone();
                    s.done = true;
                }
            }
        }
    }

    fn slot(&self, id: SlotId) -> &Slot {
        if id.init {
            &self.init[id.idx]
        } else {
            &self.containers[id.idx]
        }
    }

    fn slot_mut(&mut self, id: SlotId) -> &mut Slot {
        if id.init {
            &mut self.init[id.idx]
        } else {
            &mut self.containers[id.idx]
        }
    }

    fn slot_ids(&self) -> Vec<SlotId> {
        (0..self.init.len())
            .map(|idx| SlotId { init: true, idx })
            .chain((0..self.containers.len()).map(|idx| SlotId { init: false, idx }))
            .collect()
    }

    fn pod_key(&self) -> String {
        format!("{}/{}", self.ns, self.name)
    }

    fn deleting(&self) -> bool {
        self.pod.metadata.deletion_timestamp.is_some()
    }

    fn grace_period(&self) -> Duration {
        let secs = self
            .pod
            .metadata
            .deletion_grace_period_seconds
            .or_else(|| {
                self.pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.termination_grace_period_seconds)
            })
            .unwrap_or(30)
            .max(0);
        Duration::from_secs(secs as u64)
    }

    async fn main_loop(
        &mut self,
        mut updates: watch::Receiver<PodUpdate>,
        cancel: CancellationToken,
    ) {
        tracing::info!(pod = %self.pod_key(), uid = %self.uid, "pod worker started");
        loop {
            if self.deleting() {
                self.terminate_and_delete(&mut updates, &cancel).await;
                return;
            }
            self.reconcile().await;
            self.publish_status().await;
            let wake = self.next_wake();
            tokio::select! {
                biased;
                _ = cancel.cancelled() => {
                    self.stop_everything(Duration::from_secs(10).min(self.grace_period())).await;
                    tracing::info!(pod = %self.pod_key(), "stopped for kubelet shutdown");
                    return;
                }
                changed = updates.changed() => {
                    let update = if changed.is_ok() {
                        updates.borrow_and_update().clone()
                    } else {
                        PodUpdate::Gone(self.pod.clone())
                    };
                    match update {
                        PodUpdate::Present(p) => self.on_pod_update(p),
                        PodUpdate::Gone(p) => {
                            self.pod = p;
                            let grace = if self.deleting() { Duration::ZERO } else { self.grace_period().min(Duration::from_secs(2)) };
                            tracing::info!(pod = %self.pod_key(), "pod is gone from the API; stopping it");
                            self.stop_everything(grace).await;
                            return;
                        }
                    }
                }
                Some(ev) = self.rx.recv() => self.on_event(ev),
                _ = tokio::time::sleep_until(wake.into()) => {}
            }
        }
    }

    fn next_wake(&self) -> Instant {
        let far = Instant::now() + Duration::from_secs(3600);
        let mut t = far;
        let mut consider = |i: Option<Instant>| {
            if let Some(i) = i {
                t = t.min(i);
            }
        };
        consider(self.status_retry_at);
        if self.net.ip.is_none() {
            consider(self.net.retry_at);
        }
        if self.net.ip.is_some() && !self.net.torn_down {
            consider(Some(self.next_volume_sync));
        }
        for id in self.slot_ids() {
            let s = self.slot(id);
            if s.running.is_none() && !s.done {
                consider(Some(s.next_attempt));
            }
        }
        t
    }

    fn on_pod_update(&mut self, p: Arc<Pod>) {
        let meta_changed = p.metadata.labels != self.pod.metadata.labels
            || p.metadata.annotations != self.pod.metadata.annotations;
        let images: BTreeMap<String, Option<String>> = p
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .map(|c| (c.name.clone(), c.image.clone()))
            .collect();
        self.pod = p;
        if meta_changed {
            // Downward API files must follow labels/annotations promptly.
            self.next_volume_sync = Instant::now();
        }
        let grace = self.grace_period();
        for idx in 0..self.containers.len() {
            let id = SlotId { init: false, idx };
            let Some(Some(new_image)) = images.get(&self.slot(id).spec.name).cloned() else {
                continue;
            };
            if self.slot(id).spec.image.as_deref() != Some(new_image.as_str()) {
                tracing::info!(pod = %self.pod_key(), container = %self.slot(id).spec.name, image = %new_image, "image changed; restarting container");
                let s = self.slot_mut(id);
                s.spec.image = Some(new_image.clone());
                s.view.image = new_image;
                s.crash.reset();
                self.kill(id, grace, Some("Container image changed".into()));
            }
        }
    }

    fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Exited { slot, run, status } => self.on_exit(slot, run, status),
            Event::Probe {
                slot,
                run,
                kind,
                ok,
                message,
            } => self.on_probe(slot, run, kind, ok, message),
        }
    }

    fn facts(&self) -> PodFacts<'_> {
        PodFacts {
            pod: &self.pod,
            pod_ip: None,
            host_ip: "",
            node_name: &self.ctx.node.name,
            node_cpu: self.ctx.node.cpu_cores as f64,
            node_memory: self.ctx.node.memory_bytes as f64,
        }
    }

    async fn reconcile(&mut self) {
        let nothing_to_run = self
            .containers
            .iter()
            .all(|s| s.done && s.running.is_none());
        if nothing_to_run && self.net.ip.is_none() {
            // Finished before a kubelet restart: no network needed any more.
            self.net.torn_down = true;
            return;
        }
        if !self.setup_network().await {
            return;
        }
        if self.net.torn_down {
            return;
        }
        self.sync_volumes().await;
        if !self.volumes_ready {
            return;
        }
        // Init containers, in order; a sidecar counts as done once started.
        for idx in 0..self.init.len() {
            let id = SlotId { init: true, idx };
            if status::init_done(&self.slot(id).view) {
                continue;
            }
            let s = self.slot(id);
            if s.running.is_none() && !s.done && s.next_attempt <= Instant::now() {
                self.try_start(id).await;
            }
            if !status::init_done(&self.slot(id).view) {
                return;
            }
        }
        for idx in 0..self.containers.len() {
            let id = SlotId { init: false, idx };
            let s = self.slot(id);
            if s.running.is_none() && !s.done && s.next_attempt <= Instant::now() {
                self.try_start(id).await;
            }
        }
        self.teardown_if_finished().await;
    }
}
