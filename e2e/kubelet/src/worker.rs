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

use k8s_openapi::api::core::v1::{
    ConfigMap, Container, ContainerStateTerminated, Pod, PodCondition, Secret,
};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::{Api, Client};
use nix::sys::signal::Signal;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::cni::Cni;
use crate::downward::PodFacts;
use crate::env::{self, Objects, ServiceEnv};
use crate::node::NodeInfo;
use crate::probes::{self, Kind};
use crate::state::{PodDir, PodRecord, ProcRecord};
use crate::status::{self, ContainerView, PodView, State, Terminated};
use crate::volumes::{self, SyncCtx, Volumes};
use crate::{identity, imagemap, launch, netns, process};

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

struct Running {
    pid: i32,
    run: u64,
    since: Instant,
    probes: Vec<JoinHandle<()>>,
    killer: Option<JoinHandle<()>>,
    kill_message: Option<String>,
}

impl Running {
    fn stop_tasks(&mut self) {
        for p in self.probes.drain(..) {
            p.abort();
        }
        if let Some(k) = self.killer.take() {
            k.abort();
        }
    }
}

struct Slot {
    spec: Container,
    sidecar: bool,
    view: ContainerView,
    running: Option<Running>,
    next_attempt: Instant,
    done: bool,
    pulled_once: bool,
    crash: Backoff,
    pull: Backoff,
    config: Backoff,
}

impl Slot {
    fn new(
        spec: &Container,
        sidecar: bool,
        t: &Timing,
        prev: Option<&k8s_openapi::api::core::v1::ContainerStatus>,
    ) -> Slot {
        let mut view = ContainerView {
            name: spec.name.clone(),
            image: spec.image.clone().unwrap_or_default(),
            image_id: String::new(),
            container_id: None,
            state: State::waiting("ContainerCreating", None),
            last_terminated: None,
            restart_count: 0,
            ready: false,
            started: false,
            sidecar,
        };
        if let Some(p) = prev {
            view.restart_count = p.restart_count;
            view.last_terminated = p
                .last_state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .map(terminated_from_api);
            if p.state.as_ref().and_then(|s| s.running.as_ref()).is_some() {
                // It was running under a previous kubelet run and was stopped at startup.
                view.restart_count += 1;
            }
        }
        Slot {
            spec: spec.clone(),
            sidecar,
            view,
            running: None,
            next_attempt: Instant::now(),
            done: false,
            pulled_once: false,
            crash: Backoff::new(t.crash_initial, t.crash_max),
            pull: Backoff::new(t.retry_initial, t.retry_max),
            config: Backoff::new(t.retry_initial, t.retry_max),
        }
    }
}

fn terminated_from_api(t: &ContainerStateTerminated) -> Terminated {
    Terminated {
        exit_code: t.exit_code,
        signal: t.signal,
        reason: t.reason.clone().unwrap_or_else(|| "Error".into()),
        message: t.message.clone(),
        started_at: t.started_at.as_ref().map(|t| t.0),
        finished_at: t
            .finished_at
            .as_ref()
            .map(|t| t.0)
            .unwrap_or_else(Timestamp::now),
        container_id: t.container_id.clone(),
    }
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
        let s = self.slot(slot);
        if s.sidecar {
            return true;
        }
        if slot.init {
            return exit_code != 0 && self.restart_policy() != "Never";
        }
        match self.restart_policy() {
            "Never" => false,
            "OnFailure" => exit_code != 0,
            _ => true,
        }
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

    fn on_exit(&mut self, id: SlotId, run: u64, exit: ExitStatus) {
        let deleting = self.deleting();
        let pod_key = self.pod_key();
        let s = self.slot_mut(id);
        let Some(mut r) = s.running.take().filter(|r| r.run == run) else {
            return;
        };
        r.stop_tasks();
        // The container is over: nothing of its process group may outlive it.
        process::signal_group(r.pid, Signal::SIGKILL);
        let (exit_code, signal, reason) = process::describe_exit(&exit);
        let started_at = match &s.view.state {
            State::Running { started_at } => Some(*started_at),
            _ => None,
        };
        let t = Terminated {
            exit_code,
            signal,
            reason: reason.to_string(),
            message: r.kill_message.clone(),
            started_at,
            finished_at: Timestamp::now(),
            container_id: s.view.container_id.clone(),
        };
        s.view.ready = false;
        s.view.started = false;
        let name = s.spec.name.clone();
        tracing::info!(pod = %pod_key, container = %name, exit_code, "container exited");
        self.record.processes.remove(&name);
        let _ = self.record.save(&self.dir);
        // `done` was set before the signal when the kubelet itself is stopping the container.
        let stopping = self.slot(id).done;
        if deleting || stopping || !self.should_restart(id, exit_code) {
            let s = self.slot_mut(id);
            s.view.state = State::Terminated(t);
            s.done = true;
            return;
        }
        let (ns, pod_name, uid) = (self.ns.clone(), self.name.clone(), self.uid.clone());
        let s = self.slot_mut(id);
        let delay = s.crash.after_exit(r.since.elapsed());
        s.view.last_terminated = Some(t);
        s.view.restart_count += 1;
        s.next_attempt = Instant::now() + delay;
        s.view.state = if delay.is_zero() {
            State::waiting("ContainerCreating", None)
        } else {
            State::waiting(
                "CrashLoopBackOff",
                Some(format!(
                    "back-off {}s restarting failed container={} pod={}_{}({})",
                    delay.as_secs(),
                    name,
                    pod_name,
                    ns,
                    uid
                )),
            )
        };
    }

    fn on_probe(&mut self, id: SlotId, run: u64, kind: Kind, ok: bool, message: String) {
        let current = self.slot(id).running.as_ref().is_some_and(|r| r.run == run);
        if !current {
            return;
        }
        let name = self.slot(id).spec.name.clone();
        match (kind, ok) {
            (Kind::Readiness, ok) => {
                tracing::info!(pod = %self.pod_key(), container = %name, ready = ok, "readiness changed");
                self.slot_mut(id).view.ready = ok;
            }
            (Kind::Startup, true) => {
                tracing::info!(pod = %self.pod_key(), container = %name, "startup probe succeeded");
                self.slot_mut(id).view.started = true;
                self.start_probes(id, false);
            }
            (Kind::Liveness, true) => {}
            (Kind::Startup | Kind::Liveness, false) => {
                tracing::info!(pod = %self.pod_key(), container = %name, "{message}; killing container");
                let probe = if kind == Kind::Startup {
                    self.slot(id).spec.startup_probe.clone()
                } else {
                    self.slot(id).spec.liveness_probe.clone()
                };
                let grace = probe
                    .and_then(|p| p.termination_grace_period_seconds)
                    .map(|s| Duration::from_secs(s.max(0) as u64))
                    .unwrap_or_else(|| self.grace_period());
                self.kill(id, grace, Some(message));
            }
        }
    }

    /// SIGTERM now, SIGKILL after `grace`, unless the container exits first.
    fn kill(&mut self, id: SlotId, grace: Duration, message: Option<String>) {
        let Some(r) = self.slot_mut(id).running.as_mut() else {
            return;
        };
        if r.killer.is_some() {
            return;
        }
        r.kill_message = message;
        let pid = r.pid;
        process::signal_group(pid, Signal::SIGTERM);
        r.killer = Some(tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            process::signal_group(pid, Signal::SIGKILL);
        }));
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

    /// Terminal pods (nothing will run again) release their network right away.
    async fn teardown_if_finished(&mut self) {
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

    async fn stop_sidecars(&mut self) {
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

    /// Returns whether the pod network is up.
    async fn setup_network(&mut self) -> bool {
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

    async fn try_setup_network(&mut self) -> Result<Ipv4Addr, String> {
        // Record first, so a crash in between still gets cleaned up on restart.
        self.record.save(&self.dir)?;
        let ns_name = self.record.netns.clone();
        let path = netns::create(&ns_name).await?;
        match self.ctx.cni.add(&self.uid, &path).await {
            Ok(ip) => Ok(ip),
            Err(e) => {
                let _ = self.ctx.cni.del(&self.uid, Some(&path)).await;
                let _ = netns::delete(&ns_name).await;
                Err(e)
            }
        }
    }

    async fn sync_volumes(&mut self) {
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

    async fn fetch_objects(&self, c: &Container) -> Result<Objects, String> {
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

    fn set_waiting_retry(&mut self, id: SlotId, reason: &str, message: String, pull: bool) {
        let s = self.slot_mut(id);
        let delay = if pull {
            s.pull.after_failure()
        } else {
            s.config.after_failure()
        };
        s.next_attempt = Instant::now() + delay;
        s.view.state = State::waiting(reason, Some(message));
    }

    async fn try_start(&mut self, id: SlotId) {
        let Some(ip) = self.net.ip else { return };
        let spec = self.slot(id).spec.clone();
        let image = spec.image.clone().unwrap_or_default();
        let map = self.ctx.image_map.clone();
        let binary = match imagemap::resolve(&map, &image) {
            Ok(b) => b,
            Err(e) => {
                let first = !self.slot(id).pulled_once;
                let msg = e.to_string();
                tracing::warn!(pod = %self.pod_key(), container = %spec.name, "{msg}");
                let (reason, message) = if first {
                    ("ErrImagePull", msg)
                } else {
                    (
                        "ImagePullBackOff",
                        format!("Back-off pulling image {image:?}: {msg}"),
                    )
                };
                self.slot_mut(id).pulled_once = true;
                self.set_waiting_retry(id, reason, message, true);
                return;
            }
        };
        {
            let s = self.slot_mut(id);
            s.pull.reset();
            s.pulled_once = false;
            s.view.image_id = format!("cli-mcp://{}", binary.display());
        }
        let objects = match self.fetch_objects(&spec).await {
            Ok(o) => o,
            Err(e) => {
                self.set_waiting_retry(id, "CreateContainerConfigError", e, false);
                return;
            }
        };
        let Some(pod_spec) = self.pod.spec.clone() else {
            return;
        };
        let ident = identity::for_container(&pod_spec, &spec);
        let ip_s = ip.to_string();
        let host_ip = self.ctx.node.internal_ip.to_string();
        let facts = PodFacts {
            pod_ip: Some(&ip_s),
            host_ip: &host_ip,
            ..self.facts()
        };
        let env = match env::resolve(&facts, &spec, &objects, &self.ctx.service_env, ident.uid) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(pod = %self.pod_key(), container = %spec.name, "{e}");
                self.set_waiting_retry(id, "CreateContainerConfigError", e, false);
                return;
            }
        };
        let etc = launch::write_etc_files(&self.dir.root.join("etc"), &self.pod, &ip_s);
        let mounts = match etc.and_then(|mut etc| {
            let volumes = self
                .volumes
                .mounts_for(spec.volume_mounts.as_deref().unwrap_or_default(), &env)?;
            etc.extend(volumes);
            Ok(etc)
        }) {
            Ok(m) => m,
            Err(e) => {
                self.set_waiting_retry(id, "CreateContainerConfigError", e, false);
                return;
            }
        };
        let argv = launch::command_line(&binary, &spec, &env, |p| p.exists());
        let exec = launch::exec_spec(
            &self.pod,
            &spec,
            netns::path(&self.record.netns),
            argv,
            &env,
            &ident,
            mounts,
        );
        let spec_path = self.dir.exec_spec(&spec.name);
        if let Err(e) = process::write_spec(&spec_path, &exec) {
            self.set_waiting_retry(id, "CreateContainerConfigError", e, false);
            return;
        }
        self.slot_mut(id).config.reset();
        self.dir.rotate_log(&spec.name);
        let started = process::start_container(&spec_path, &self.dir.log(&spec.name)).await;
        self.run_seq += 1;
        let run = self.run_seq;
        match started {
            Ok(p) => self.on_started(id, run, p),
            Err(e) => {
                tracing::warn!(pod = %self.pod_key(), container = %spec.name, "start failed: {e}");
                // Treat like a process that exited at once, so restart policy and back-off apply.
                let now = Timestamp::now();
                let s = self.slot_mut(id);
                s.view.state = State::Running { started_at: now };
                s.running = Some(Running {
                    pid: 0,
                    run,
                    since: Instant::now(),
                    probes: Vec::new(),
                    killer: None,
                    kill_message: Some(e),
                });
                use std::os::unix::process::ExitStatusExt;
                self.on_exit(id, run, ExitStatus::from_raw(128 << 8));
                if let State::Waiting { .. } | State::Terminated(_) = &self.slot(id).view.state {
                    if let Some(t) = self.slot_mut(id).view.last_terminated.as_mut() {
                        t.reason = "StartError".into();
                    }
                    if let State::Terminated(t) = &mut self.slot_mut(id).view.state {
                        t.reason = "StartError".into();
                    }
                }
            }
        }
    }

    fn on_started(&mut self, id: SlotId, run: u64, started: process::Started) {
        let process::Started { pid, mut child } = started;
        let name = self.slot(id).spec.name.clone();
        tracing::info!(pod = %self.pod_key(), container = %name, pid, "container started");
        self.record.processes.insert(
            name,
            ProcRecord {
                pid,
                start_ticks: process::start_ticks(pid),
            },
        );
        if let Err(e) = self.record.save(&self.dir) {
            tracing::warn!(pod = %self.pod_key(), "{e}");
        }
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let status = match child.wait().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("waiting for container pid {pid}: {e}");
                    use std::os::unix::process::ExitStatusExt;
                    ExitStatus::from_raw(255 << 8)
                }
            };
            let _ = tx.send(Event::Exited {
                slot: id,
                run,
                status,
            });
        });
        let s = self.slot_mut(id);
        s.view.state = State::Running {
            started_at: Timestamp::now(),
        };
        s.view.container_id = Some(format!("cli-mcp://{pid}"));
        s.view.ready = false;
        s.view.started = false;
        s.running = Some(Running {
            pid,
            run,
            since: Instant::now(),
            probes: Vec::new(),
            killer: None,
            kill_message: None,
        });
        let has_startup = s.spec.startup_probe.is_some();
        if has_startup {
            self.start_probes(id, true);
        } else {
            self.slot_mut(id).view.started = true;
            self.start_probes(id, false);
        }
    }

    /// Starts the startup probe (`startup`), or the liveness and readiness probes.
    fn start_probes(&mut self, id: SlotId, startup: bool) {
        let Some(ip) = self.net.ip else { return };
        let spec_path = self.dir.exec_spec(&self.slot(id).spec.name);
        let s = self.slot(id);
        let Some(r) = s.running.as_ref() else { return };
        let target = probes::Target {
            pod_ip: ip,
            pod_cidr: self.ctx.cni.cidr,
            pid: r.pid,
            spec_path,
            ports: s.spec.ports.clone().unwrap_or_default(),
        };
        let run = r.run;
        let list: Vec<(Kind, Option<k8s_openapi::api::core::v1::Probe>)> = if startup {
            vec![(Kind::Startup, s.spec.startup_probe.clone())]
        } else {
            vec![
                (Kind::Liveness, s.spec.liveness_probe.clone()),
                (Kind::Readiness, s.spec.readiness_probe.clone()),
            ]
        };
        let no_readiness = !startup && s.spec.readiness_probe.is_none();
        let mut handles = Vec::new();
        for (kind, probe) in list {
            let Some(probe) = probe else { continue };
            let tx = self.tx.clone();
            let http = self.ctx.http.clone();
            let target = target.clone();
            handles.push(tokio::spawn(probes::run(
                kind,
                probe,
                target,
                http,
                move |ok, message| {
                    let _ = tx.send(Event::Probe {
                        slot: id,
                        run,
                        kind,
                        ok,
                        message,
                    });
                },
            )));
        }
        let s = self.slot_mut(id);
        if no_readiness {
            s.view.ready = true;
        }
        if let Some(r) = s.running.as_mut() {
            r.probes.extend(handles);
        }
    }

    /// Signals the given containers, waits up to `grace` for them to exit, then SIGKILLs.
    async fn signal_and_wait(&mut self, ids: &[SlotId], grace: Duration) {
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
    async fn run_pre_stop_hooks(&mut self, budget: Duration) {
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
    async fn stop_everything(&mut self, grace: Duration) {
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
    async fn teardown_runtime(&mut self) {
        if self.net.torn_down {
            return;
        }
        let ns_name = self.record.netns.clone();
        let leftovers = netns::processes_in(&ns_name);
        if !leftovers.is_empty() {
            tracing::info!(pod = %self.pod_key(), "killing {} leftover process(es) in {ns_name}", leftovers.len());
            process::kill_pids(&leftovers);
        }
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

    async fn terminate_and_delete(
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

    fn previous_conditions(&self) -> Vec<PodCondition> {
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

    async fn publish_status(&mut self) {
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
