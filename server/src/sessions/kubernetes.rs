//! The `kubernetes` backend: a session is a sandbox pod of the instance, found by its
//! `session-id` label.
//!
//! Finding a session's pod (SPEC §4): the route cache → a label lookup → claiming a warm
//! pool pod → creating a pod on demand with the shared builder, then waiting for Ready with
//! a watch. Every step is safe against other replicas doing the same at the same time:
//! - a claim is a JSON merge patch guarded by the listed `resourceVersion`, so exactly one
//!   claimer wins a pod (409 → next pod); a claimed pod whose `/assign` fails is deleted, so
//!   no pod is ever left half-assigned;
//! - an on-demand pod has a deterministic name, so two creators meet in `AlreadyExists` and
//!   adopt the one pod;
//! - when a claim and a create race, both replicas see two pods for the session and pick the
//!   same winner (oldest `creationTimestamp`, then name); the loser is deleted.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use rand::seq::SliceRandom;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use cli_mcp_api::names::{annotation, label, InstanceName};
use cli_mcp_api::sandbox::{build_sandbox_pod, made_for_key, SandboxConfig, SandboxRole};
use cli_mcp_api::token::HmacKey;
use cli_mcp_api::wire::{AssignRequest, AGENT_PORT};
use cli_mcp_api::SessionId;

use super::activity::ActivityStamper;
use super::admission::{Admission, LimitReached, PodView, Refusal, Reservation};
use super::cache::{Route, RouteCache, SessionLocks};
use super::{now_rfc3339, owner_allows, Activity, Backend, Sandbox, SessionError, SessionSummary};
use crate::agent_client::AgentClient;
use crate::auth::Caller;
use crate::cli::Limits;
use crate::metrics::{Launch, Metrics};

/// How often the `sessions_active` gauge is refreshed from the API.
const GAUGE_REFRESH: Duration = Duration::from_secs(15);
/// A warm pod is retried after a 409 at most this many times (the 409 may come from a
/// status update, not from another claimer).
const CLAIM_ATTEMPTS_PER_POD: usize = 2;

/// How long a call waits for the agent of an existing session pod to accept connections
/// again after its container died (the kubelet restarts it, after a back-off from the second
/// crash on).
const AGENT_RESTART_WAIT: Duration = Duration::from_secs(30);

/// Container waiting reasons that mean the sandbox will not start on its own soon.
const FATAL_WAITING: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "CrashLoopBackOff",
];

pub struct KubeBackend {
    pods: Api<Pod>,
    client: kube::Client,
    cfg: SandboxConfig,
    cfg_hash: String,
    instance: InstanceName,
    key: HmacKey,
    agent: AgentClient,
    cache: RouteCache,
    locks: SessionLocks,
    stamper: Arc<ActivityStamper>,
    /// Admission of new sessions under `--max-sessions`, fed by the pod watch.
    admission: Admission,
    limits: Limits,
    metrics: Arc<Metrics>,
    /// What readiness knows of the API (see [`ApiHealth`]).
    api_health: std::sync::Mutex<ApiHealth>,
}

/// Longest a new session waits for the LIST that admission counts from while its pod watch
/// cannot be trusted (see [`Admission`]).
const ADMISSION_LIST_TIMEOUT: Duration = Duration::from_secs(10);

impl std::fmt::Debug for KubeBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeBackend")
            .field("instance", &self.instance)
            .field("namespace", &self.cfg.namespace)
            .finish()
    }
}

/// What the label lookup found.
enum Found {
    Pod(Box<Pod>),
    /// A pod made with another HMAC key (the instance key was rotated): deleted.
    Stale,
    Nothing,
}

impl KubeBackend {
    pub fn new(
        client: kube::Client,
        cfg: SandboxConfig,
        key: HmacKey,
        agent: AgentClient,
        limits: Limits,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        let pods = Api::<Pod>::namespaced(client.clone(), &cfg.namespace);
        Arc::new(Self {
            pods,
            client,
            cfg_hash: cfg.hash(),
            instance: cfg.instance.clone(),
            cfg,
            key,
            agent,
            cache: RouteCache::new((limits.max_sessions * 4).max(1024)),
            locks: SessionLocks::default(),
            stamper: ActivityStamper::new(),
            admission: Admission::new(limits.max_sessions),
            api_health: std::sync::Mutex::new(ApiHealth::default()),
            limits,
            metrics,
        })
    }

    /// Background work: `last-activity` stamping and the `sessions_active` gauge.
    pub fn spawn_background(
        self: &Arc<Self>,
        stop: CancellationToken,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let stamper = self.stamper.clone().run(self.pods.clone(), stop.clone());
        let me = self.clone();
        let gauge_stop = stop.clone();
        let gauge = async move {
            let stop = gauge_stop;
            let mut tick = tokio::time::interval(GAUGE_REFRESH);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                if let Err(e) = me.refresh_gauge().await {
                    tracing::debug!(error = %e, "cannot refresh sessions_active");
                }
            }
        };
        let routes = self.clone().watch_routes(stop.clone());
        vec![
            tokio::spawn(stamper),
            tokio::spawn(gauge),
            tokio::spawn(routes),
        ]
    }

    /// Feeds admission's view of the instance's sessions (see [`Admission`]), and drops the
    /// route of a session as soon as its pod is being deleted (by the idle GC, an
    /// admin, another replica), so no call is sent to an address that is going away; and
    /// remembers the pod as gone also for sessions this replica never served, so the next
    /// call reports the reset whichever replica serves it.
    async fn watch_routes(self: Arc<Self>, stop: CancellationToken) {
        let cfg = watcher::Config::default().labels(&self.instance.assigned_selector());
        let stream = watcher::watcher(self.pods.clone(), cfg).default_backoff();
        let mut stream = std::pin::pin!(stream);
        loop {
            let event = tokio::select! {
                _ = stop.cancelled() => break,
                e = stream.next() => match e {
                    Some(e) => e,
                    None => break,
                },
            };
            match event {
                Ok(watcher::Event::Init) => self.admission.relist_started(Instant::now()),
                Ok(watcher::Event::InitApply(p)) => {
                    self.admission.relisted(pod_view(&p));
                    if deleting(&p) || is_terminal(&p) {
                        self.pod_going(&p)
                    }
                }
                Ok(watcher::Event::InitDone) => self.admission.relist_done(),
                Ok(watcher::Event::Apply(p)) => {
                    self.admission.applied(pod_view(&p));
                    if deleting(&p) || is_terminal(&p) {
                        self.pod_going(&p)
                    }
                }
                Ok(watcher::Event::Delete(p)) => {
                    self.admission.deleted(pod_view(&p));
                    self.pod_going(&p)
                }
                Err(e) => {
                    self.admission.watch_failed();
                    tracing::debug!(error = %e, "sandbox pod watch error (retrying)")
                }
            }
        }
    }

    fn pod_going(&self, pod: &Pod) {
        let (Some(sid), Some(uid)) = (
            pod.labels()
                .get(label::SESSION_ID)
                .and_then(|s| SessionId::parse(s).ok()),
            pod.uid(),
        ) else {
            return;
        };
        self.stamper.forget(&pod.name_any());
        let retired = pod.annotations().contains_key(annotation::RETIRED);
        if self.cache.tombstone(&sid, &uid, retired) {
            tracing::info!(session = %sid, pod = %pod.name_any(),
                "session pod is being deleted; route dropped");
        }
    }

    fn sandbox(
        &self,
        sid: &SessionId,
        route: &Route,
        started: Option<Launch>,
        replaced: bool,
    ) -> Sandbox {
        Sandbox {
            endpoint: route.endpoint.clone(),
            token: self.key.session_token(sid),
            name: route.pod.clone(),
            uid: route.uid.clone(),
            started,
            replaced,
        }
    }

    /// Session ids of the assigned, not-terminating pods, from a LIST; updates the gauge.
    async fn live_sessions(&self) -> Result<HashSet<SessionId>, SessionError> {
        let list = self
            .pods
            .list_metadata(&ListParams::default().labels(&self.instance.assigned_selector()))
            .await?;
        let live: HashSet<SessionId> = list
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| p.metadata.labels?.remove(label::SESSION_ID))
            .filter_map(|s| SessionId::parse(&s).ok())
            .collect();
        self.metrics.sessions_active.set(live.len() as i64);
        Ok(live)
    }

    /// Refreshes the `sessions_active` gauge: from the pod watch's view, or a LIST while that
    /// view cannot be trusted.
    async fn refresh_gauge(&self) -> Result<(), SessionError> {
        match self.admission.live_sessions() {
            Some(n) => {
                self.metrics.sessions_active.set(n as i64);
                Ok(())
            }
            None => self.live_sessions().await.map(drop),
        }
    }

    /// Session pods by label, duplicates resolved, pods of an old key removed.
    async fn find(&self, sid: &SessionId) -> Result<Found, SessionError> {
        let list = self
            .pods
            .list(&ListParams::default().labels(&self.instance.session_selector(sid)))
            .await?;
        let (dead, live): (Vec<Pod>, Vec<Pod>) = list
            .items
            .into_iter()
            .filter(|p| !deleting(p))
            .partition(is_terminal);
        // A Failed or Succeeded pod (a kubelet eviction leaves the pod object in phase
        // Failed) never runs again: remove it, and the session starts afresh.
        for pod in &dead {
            tracing::warn!(session = %sid, pod = %pod.name_any(),
                phase = pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or_default(),
                "session pod has terminated for good; deleting it and starting a new sandbox");
            self.delete_pod(pod).await;
        }
        let Some(winner) = self.resolve_duplicates(live).await else {
            return Ok(if dead.is_empty() {
                Found::Nothing
            } else {
                Found::Stale
            });
        };
        let expected = self.key.session_token(sid).commitment().to_hex();
        if annotation_of(&winner, annotation::TOKEN_SHA256) != Some(expected.as_str()) {
            tracing::warn!(session = %sid, pod = %winner.name_any(),
                "session pod was made with another HMAC key (the instance key changed); replacing it");
            self.delete_pod(&winner).await;
            return Ok(Found::Stale);
        }
        Ok(Found::Pod(Box::new(winner)))
    }

    /// Picks the winner among pods of one session and deletes the others.
    async fn resolve_duplicates(&self, mut pods: Vec<Pod>) -> Option<Pod> {
        if pods.len() > 1 {
            pods.sort_by(winner_order);
            for loser in &pods[1..] {
                tracing::info!(pod = %loser.name_any(), winner = %pods[0].name_any(),
                    "two sandboxes for one session; deleting the loser");
                self.retire_pod(loser, "duplicate").await;
            }
        }
        pods.into_iter().next()
    }

    /// Deletes a sandbox whose disappearance is not a reset of its session's state (see
    /// `annotation::RETIRED`): marked first, so every replica's pod watch sees why.
    async fn retire_pod(&self, pod: &Pod, why: &str) {
        let patch = json!({"metadata": {"annotations": {annotation::RETIRED: why}}});
        match self
            .pods
            .patch(
                &pod.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => return,
            // Deleting it anyway: at worst another replica reports a reset that was not one.
            Err(e) => {
                tracing::warn!(pod = %pod.name_any(), error = %e, "cannot mark sandbox pod retired")
            }
        }
        self.delete_pod(pod).await;
    }

    async fn delete_pod(&self, pod: &Pod) {
        let name = pod.name_any();
        self.stamper.forget(&name);
        let mut dp = DeleteParams::default();
        if let Some(uid) = pod.uid() {
            dp = dp.preconditions(kube::api::Preconditions {
                uid: Some(uid),
                resource_version: None,
            });
        }
        match self.pods.delete(&name, &dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() || s.is_conflict() => {}
            Err(e) => tracing::warn!(pod = %name, error = %e, "cannot delete sandbox pod"),
        }
    }

    /// Admits one new session under `--max-sessions` (see [`Admission`]): from the pod
    /// watch's view, or from a LIST while that view cannot be trusted. The reservation must be
    /// held until the session's pod is written ([`Reservation::written`]) or the start gave
    /// up.
    async fn admit(&self, sid: &SessionId) -> Result<Reservation, SessionError> {
        let limit = |LimitReached { max }| SessionError::SessionLimit { max };
        match self.admission.reserve(sid) {
            Ok(r) => return Ok(r),
            Err(Refusal::Limit(l)) => return Err(limit(l)),
            Err(Refusal::NotSynced) => {}
        }
        let listed = tokio::time::timeout(ADMISSION_LIST_TIMEOUT, self.live_sessions())
            .await
            .map_err(|_| {
                SessionError::Kubernetes(format!(
                    "counting the instance's sessions took over {}s; retry shortly",
                    ADMISSION_LIST_TIMEOUT.as_secs()
                ))
            })??;
        self.admission.reserve_listed(sid, &listed).map_err(limit)
    }

    /// Tries the warm pool; `None` when no pod could be claimed.
    async fn claim_warm(
        &self,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<Option<Pod>, SessionError> {
        let list = self
            .pods
            .list(&ListParams::default().labels(&self.instance.unassigned_selector()))
            .await?;
        let total = list.items.len();
        let mut candidates: Vec<Pod> = list
            .items
            .into_iter()
            .filter(|p| !deleting(p) && is_ready(p) && pod_ip(p).is_some())
            .collect();
        let ready = candidates.len();
        candidates
            .retain(|p| annotation_of(p, annotation::SANDBOX_HASH) == Some(self.cfg_hash.as_str()));
        if candidates.is_empty() && ready > 0 {
            tracing::warn!(ready, hash = %self.cfg_hash,
                "warm pods exist but none has this server's sandbox-hash; creating on demand (is the operator's sandbox config the same as --sandbox-config?)");
        }
        // A pod made for another HMAC key would refuse this replica's /assign: leave it to
        // the operator instead of claiming and then deleting it (while the key is rotated,
        // the replica being replaced would otherwise burn the new pool).
        let same_config = candidates.len();
        candidates.retain(|p| made_for_key(p, &self.key));
        if candidates.is_empty() && same_config > 0 {
            tracing::warn!(warm = same_config,
                "warm pods exist but none was made for this replica's HMAC key (the key was rotated: this replica or the pool is outdated); creating on demand");
        }
        tracing::debug!(total, ready, usable = candidates.len(), "warm pool");
        // Random order: concurrent claimers spread over the pool instead of all fighting
        // for the first pod.
        candidates.shuffle(&mut rand::rng());
        for pod in candidates {
            if let Some(claimed) = self.try_claim(pod, sid, caller).await? {
                return Ok(Some(claimed));
            }
        }
        Ok(None)
    }

    /// Claims one warm pod: guarded patch, then `/assign`. Deletes the pod on any failure
    /// after the patch, so it is never left half-assigned.
    async fn try_claim(
        &self,
        mut pod: Pod,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<Option<Pod>, SessionError> {
        let name = pod.name_any();
        let token = self.key.session_token(sid).commitment().to_hex();
        let mut claimed = None;
        for attempt in 0..CLAIM_ATTEMPTS_PER_POD {
            // Without a resourceVersion the patch would not be guarded.
            let Some(rv) = pod.resource_version() else {
                return Ok(None);
            };
            let mut annotations = serde_json::Map::new();
            annotations.insert(annotation::TOKEN_SHA256.into(), json!(token));
            annotations.insert(annotation::LAST_ACTIVITY.into(), json!(now_rfc3339()));
            if let Some(owner) = &caller.owner {
                annotations.insert(annotation::OWNER.into(), json!(owner));
            }
            let patch = json!({
                "metadata": {
                    "resourceVersion": rv,
                    "labels": { label::SESSION_ID: sid.as_str(), label::LAUNCH: label::LAUNCH_WARM },
                    "annotations": annotations,
                }
            });
            match self
                .pods
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(p) => {
                    claimed = Some(p);
                    break;
                }
                Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(None),
                Err(kube::Error::Api(s)) if s.is_conflict() => {
                    // Lost to another claimer, or the pod changed (status update): look again.
                    self.metrics.claim_conflicts.inc();
                    if attempt + 1 == CLAIM_ATTEMPTS_PER_POD {
                        return Ok(None);
                    }
                    match self.pods.get_opt(&name).await? {
                        Some(p) if !deleting(&p) && is_ready(&p) && !has_session(&p) => pod = p,
                        _ => return Ok(None),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        let Some(claimed) = claimed else {
            return Ok(None);
        };
        match self.assign(&claimed, sid).await {
            Ok(()) => Ok(Some(claimed)),
            Err(e) => {
                tracing::warn!(pod = %name, session = %sid, error = %e,
                    "claimed warm pod did not accept /assign; deleting it and trying the next");
                self.retire_pod(&claimed, "not-assigned").await;
                Ok(None)
            }
        }
    }

    /// `POST /assign` on a warm pod (idempotent in the agent: a repeat of the same
    /// assignment succeeds).
    async fn assign(&self, pod: &Pod, sid: &SessionId) -> Result<(), String> {
        let endpoint = endpoint_of(pod).ok_or("the pod has no IP")?;
        let req = AssignRequest {
            session_id: sid.clone(),
            token_sha256: self.key.session_token(sid).commitment().to_hex(),
        };
        self.agent
            .assign(&endpoint, &self.key.assign_token(&pod.name_any()), &req)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Creates the session's own pod, or adopts it when another replica created it first.
    async fn create_cold(&self, sid: &SessionId, caller: &Caller) -> Result<Pod, SessionError> {
        let pod = build_sandbox_pod(
            &self.cfg,
            &SandboxRole::Session {
                sid: sid.clone(),
                token: self.key.session_token(sid).commitment(),
                owner: caller.owner.clone(),
            },
            &now_rfc3339(),
        );
        let name = pod.name_any();
        for _ in 0..3 {
            match self.pods.create(&PostParams::default(), &pod).await {
                Ok(p) => return Ok(p),
                Err(kube::Error::Api(s)) if s.is_already_exists() => {
                    match self.pods.get_opt(&name).await? {
                        // Gone in between: create again.
                        None => continue,
                        // The previous pod of this session is still terminating: wait for it.
                        Some(old) if deleting(&old) => {
                            self.wait_gone(&old).await?;
                            continue;
                        }
                        // Another replica created it: adopt.
                        Some(existing) => return Ok(existing),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(SessionError::Sandbox(format!(
            "pod {name} kept being replaced while it was created; retry the call"
        )))
    }

    async fn wait_gone(&self, pod: &Pod) -> Result<(), SessionError> {
        let name = pod.name_any();
        let uid = pod.uid();
        let cond = move |p: Option<&Pod>| p.is_none_or(|p| p.uid() != uid);
        tokio::time::timeout(
            self.limits.start_timeout,
            await_condition(self.pods.clone(), &name, cond),
        )
        .await
        .map_err(|_| {
            SessionError::Sandbox(format!(
                "the previous pod {name} of this session is still terminating after {:?}",
                self.limits.start_timeout
            ))
        })?
        .map_err(|e| SessionError::Kubernetes(e.to_string()))?;
        Ok(())
    }

    /// Waits (watch, not polling) until `pod` is Ready with an IP. A pod that cannot start
    /// is deleted, so the next call starts a fresh one.
    async fn wait_ready(&self, pod: Pod) -> Result<Pod, SessionError> {
        if is_ready(&pod) && pod_ip(&pod).is_some() {
            return Ok(pod);
        }
        let name = pod.name_any();
        let uid = pod.uid();
        let want = uid.clone();
        let cond = move |p: Option<&Pod>| match p {
            None => true,
            Some(p) => {
                p.uid() != want
                    || deleting(p)
                    || (is_ready(p) && pod_ip(p).is_some())
                    || start_failure(p).is_some()
            }
        };
        let waited = tokio::time::timeout(
            self.limits.start_timeout,
            await_condition(self.pods.clone(), &name, cond),
        )
        .await;
        let outcome: Result<(), String> = match waited {
            Err(_) => {
                let why = self
                    .pods
                    .get_opt(&name)
                    .await
                    .ok()
                    .flatten()
                    .map(|p| pending_reason(&p))
                    .unwrap_or_default();
                Err(format!(
                    "pod {name} did not become ready within {:?}{why}",
                    self.limits.start_timeout
                ))
            }
            Ok(Err(e)) => return Err(SessionError::Kubernetes(e.to_string())),
            Ok(Ok(None)) => return Err(deleted_while_starting(&name)),
            Ok(Ok(Some(p))) if p.uid() != uid || deleting(&p) => {
                return Err(deleted_while_starting(&name))
            }
            Ok(Ok(Some(p))) => match start_failure(&p) {
                Some(reason) => Err(format!("pod {name} cannot start: {reason}")),
                None => return Ok(p),
            },
        };
        let msg = outcome.err().unwrap_or_default();
        self.retire_pod(&pod, "never-started").await;
        Err(SessionError::Sandbox(format!(
            "{msg}; it was deleted, and the next call starts a new sandbox (check the instance's sandbox image and resources)"
        )))
    }

    /// After a claim or create: if another replica gave the session a second pod at the same
    /// time, every replica keeps the same one.
    async fn converge(&self, sid: &SessionId, ours: Pod) -> Result<Pod, SessionError> {
        let list = self
            .pods
            .list(&ListParams::default().labels(&self.instance.session_selector(sid)))
            .await?;
        let live: Vec<Pod> = list.items.into_iter().filter(|p| !deleting(p)).collect();
        if live.len() <= 1 {
            return Ok(ours);
        }
        let Some(winner) = self.resolve_duplicates(live).await else {
            return Ok(ours);
        };
        if winner.uid() == ours.uid() {
            return Ok(ours);
        }
        self.ensure_assigned(&winner, sid).await?;
        self.wait_ready(winner).await
    }

    /// A claimed warm pod found by label may not have had its `/assign` yet (its claimer is
    /// still on the way): assign it ourselves; the agent accepts a repeat of the same
    /// assignment.
    async fn ensure_assigned(&self, pod: &Pod, sid: &SessionId) -> Result<(), SessionError> {
        if !has_launch(pod, label::LAUNCH_WARM) || !is_ready(pod) {
            return Ok(());
        }
        self.assign(pod, sid).await.map_err(|e| {
            SessionError::Sandbox(format!(
                "pod {} did not accept /assign: {e}",
                pod.name_any()
            ))
        })
    }

    /// The existing pod of a session, once its agent accepts connections (and, for a claimed
    /// warm pod, its assignment). Right after the agent's container died the pod still exists
    /// and may still say Ready, but nothing listens until the kubelet has restarted the
    /// container: wait for that, bounded, rather than fail as if the sandbox could not start.
    async fn await_agent(&self, mut pod: Pod, sid: &SessionId) -> Result<Pod, SessionError> {
        let name = pod.name_any();
        let deadline =
            tokio::time::Instant::now() + AGENT_RESTART_WAIT.min(self.limits.start_timeout);
        let mut pause = Duration::from_millis(100);
        loop {
            let reason = match self.agent_listens(&pod).await {
                Err(e) => e,
                Ok(()) => return self.ensure_assigned(&pod, sid).await.map(|()| pod),
            };
            if tokio::time::Instant::now() + pause > deadline {
                // Still crash-looping after the wait: the agent does not come back by itself
                // soon, so the pod is replaced as one that cannot start.
                if let Some(why) = start_failure(&pod) {
                    self.delete_pod(&pod).await;
                    return Err(SessionError::Sandbox(format!(
                        "the agent of pod {name} keeps crashing ({why}); the pod was deleted, and the next call starts a new sandbox"
                    )));
                }
                return Err(SessionError::Restarting(format!(
                    "pod {name} still does not answer after {:?} ({reason})",
                    AGENT_RESTART_WAIT.min(self.limits.start_timeout)
                )));
            }
            tracing::info!(session = %sid, pod = %name, reason = %reason,
                "the session's agent does not answer (restarting?); waiting for it");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
            // The pod may have been deleted or have failed meanwhile, or got a new IP.
            match self.pods.get_opt(&name).await? {
                Some(p) if p.uid() == pod.uid() && !deleting(&p) && !is_terminal(&p) => pod = p,
                _ => {
                    return Err(SessionError::Sandbox(format!(
                        "pod {name} went away while its agent was restarting; the next call starts a new sandbox"
                    )))
                }
            }
        }
    }

    /// Whether something accepts TCP connections on the pod's agent port.
    async fn agent_listens(&self, pod: &Pod) -> Result<(), String> {
        let ip = pod_ip(pod).ok_or("the pod has no IP")?;
        let addr = match ip.parse::<std::net::IpAddr>() {
            Ok(ip) => std::net::SocketAddr::new(ip, AGENT_PORT),
            Err(e) => return Err(format!("pod IP {ip}: {e}")),
        };
        match tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect(addr))
            .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("connecting to the agent at {addr}: {e}")),
            Err(_) => Err(format!(
                "connecting to the agent at {addr}: no answer within 3s"
            )),
        }
    }

    fn route_of(&self, pod: &Pod) -> Result<Route, SessionError> {
        let endpoint = endpoint_of(pod)
            .ok_or_else(|| SessionError::Sandbox(format!("pod {} has no IP", pod.name_any())))?;
        Ok(Route {
            pod: pod.name_any(),
            uid: pod.uid().unwrap_or_default(),
            endpoint,
            owner: annotation_of(pod, annotation::OWNER).map(str::to_owned),
            launch: match pod.labels().get(label::LAUNCH).map(String::as_str) {
                Some(label::LAUNCH_WARM) => Some(Launch::Warm),
                Some(label::LAUNCH_COLD) => Some(Launch::Cold),
                _ => None,
            },
        })
    }

    /// Claims a warm pod, else creates one; returns it Ready. The reservation is handed on
    /// as soon as the pod is written.
    async fn start_new(
        &self,
        sid: &SessionId,
        caller: &Caller,
        reservation: &Reservation,
    ) -> Result<(Pod, Launch), SessionError> {
        let written = |p: &Pod| reservation.written(&p.uid().unwrap_or_else(|| p.name_any()));
        match self.claim_warm(sid, caller).await? {
            Some(p) => {
                written(&p);
                Ok((p, Launch::Warm))
            }
            None => {
                let p = self.create_cold(sid, caller).await?;
                written(&p);
                Ok((self.wait_ready(p).await?, Launch::Cold))
            }
        }
    }

    async fn acquire_slow(
        &self,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<Sandbox, SessionError> {
        let t0 = Instant::now();
        let previous = self.cache.previous_uid(sid);
        let mut stale = false;
        match self.find(sid).await? {
            Found::Pod(pod) => {
                if !owner_allows(annotation_of(&pod, annotation::OWNER), caller) {
                    return Err(SessionError::Forbidden(sid.clone()));
                }
                // A pod that has run before and stopped answering is restarting its agent
                // (the kubelet may already report CrashLoopBackOff for the pause between
                // restarts, which for a new pod would mean it cannot start).
                let pod = if has_run(&pod) {
                    *pod
                } else {
                    self.wait_ready(*pod).await?
                };
                let pod = self.await_agent(pod, sid).await?;
                let route = self.route_of(&pod)?;
                let replaced = previous.is_some_and(|p| p != route.uid);
                self.cache.insert(sid.clone(), route.clone());
                return Ok(self.sandbox(sid, &route, None, replaced));
            }
            Found::Stale => stale = true,
            Found::Nothing => {}
        }

        let reservation = self.admit(sid).await?;
        let pod = match self.start_new(sid, caller, &reservation).await {
            Ok((pod, launch)) => (self.converge(sid, pod).await?, launch),
            Err(e) => {
                // Another replica may have given the session its pod meanwhile (and deleted
                // ours as the loser): use that one.
                match self.find(sid).await? {
                    Found::Pod(p) => {
                        tracing::info!(session = %sid, pod = %p.name_any(), error = %e,
                            "another replica started this session; using its pod");
                        if !owner_allows(annotation_of(&p, annotation::OWNER), caller) {
                            return Err(SessionError::Forbidden(sid.clone()));
                        }
                        self.ensure_assigned(&p, sid).await?;
                        let launch = if has_launch(&p, label::LAUNCH_WARM) {
                            Launch::Warm
                        } else {
                            Launch::Cold
                        };
                        (self.wait_ready(*p).await?, launch)
                    }
                    _ => return Err(e),
                }
            }
        };
        let (pod, launch) = pod;
        if !owner_allows(annotation_of(&pod, annotation::OWNER), caller) {
            return Err(SessionError::Forbidden(sid.clone()));
        }
        let route = self.route_of(&pod)?;
        self.metrics.started(launch, t0.elapsed());
        tracing::info!(session = %sid, pod = %route.pod, launch = launch.as_str(),
            took_ms = t0.elapsed().as_millis() as u64, "session sandbox started");
        self.cache.insert(sid.clone(), route.clone());
        Ok(self.sandbox(sid, &route, Some(launch), previous.is_some() || stale))
    }
}

#[async_trait]
impl Backend for KubeBackend {
    async fn acquire(&self, sid: &SessionId, caller: &Caller) -> Result<Sandbox, SessionError> {
        let cached = |this: &Self| -> Option<Result<Sandbox, SessionError>> {
            let route = this.cache.get(sid)?;
            Some(if owner_allows(route.owner.as_deref(), caller) {
                Ok(this.sandbox(sid, &route, None, false))
            } else {
                Err(SessionError::Forbidden(sid.clone()))
            })
        };
        if let Some(hit) = cached(self) {
            return hit;
        }
        let _guard = self.locks.lock(sid).await;
        if let Some(hit) = cached(self) {
            return hit;
        }
        self.acquire_slow(sid, caller).await
    }

    fn invalidate(&self, sid: &SessionId, sandbox: &Sandbox) {
        self.cache.invalidate(sid, &sandbox.uid);
    }

    fn activity(&self, _sid: &SessionId, sandbox: &Sandbox, event: Activity) {
        self.stamper.record(&sandbox.name, &sandbox.uid, event);
    }

    async fn delete(&self, sid: &SessionId, caller: &Caller) -> Result<(), SessionError> {
        let _guard = self.locks.lock(sid).await;
        let list = self
            .pods
            .list(&ListParams::default().labels(&self.instance.session_selector(sid)))
            .await?;
        if list
            .items
            .iter()
            .any(|p| !owner_allows(annotation_of(p, annotation::OWNER), caller))
        {
            return Err(SessionError::Forbidden(sid.clone()));
        }
        for pod in list.items.iter().filter(|p| !deleting(p)) {
            tracing::info!(session = %sid, pod = %pod.name_any(), "deleting session sandbox");
            self.retire_pod(pod, "session-ended").await;
        }
        self.cache.remove(sid);
        Ok(())
    }

    async fn list(&self, caller: &Caller) -> Result<Vec<SessionSummary>, SessionError> {
        let list = self
            .pods
            .list(&ListParams::default().labels(&self.instance.assigned_selector()))
            .await?;
        let mut out: Vec<SessionSummary> = list
            .items
            .iter()
            .filter(|p| !deleting(p))
            .filter(|p| owner_allows(annotation_of(p, annotation::OWNER), caller))
            .filter_map(|p| {
                Some(SessionSummary {
                    session_id: p.labels().get(label::SESSION_ID)?.clone(),
                    sandbox: p.name_any(),
                    launch: p.labels().get(label::LAUNCH).cloned(),
                    created_at: annotation_of(p, annotation::CREATED_AT).map(str::to_owned),
                    last_activity: annotation_of(p, annotation::LAST_ACTIVITY).map(str::to_owned),
                    ready: is_ready(p),
                })
            })
            .collect();
        out.sort_by(|a, b| {
            a.session_id
                .cmp(&b.session_id)
                .then(a.sandbox.cmp(&b.sandbox))
        });
        Ok(out)
    }

    /// See [`ApiHealth`]: an API blip must not take every replica out of the Service.
    async fn ready(&self) -> Result<(), String> {
        let probe =
            match tokio::time::timeout(Duration::from_secs(3), self.client.apiserver_version())
                .await
            {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("the Kubernetes API is not reachable: {e}")),
                Err(_) => Err("the Kubernetes API did not answer within 3s".to_owned()),
            };
        self.api_health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(probe, Instant::now())
    }

    async fn shutdown(&self) {}
}

/// Readiness as seen from the API's answers to readiness probes.
///
/// Not ready until the API has answered once (the replica can do nothing without it). After
/// that a replica serves existing sessions from its route cache and cached auth decisions,
/// so an outage shorter than [`API_OUTAGE_GRACE`] keeps it ready: otherwise an API blip takes
/// every replica out of the Service at once, for nothing. New sessions meanwhile get a clear
/// "retry shortly" error. A longer outage (this replica's own path to the API broken, say)
/// makes it unready, so callers go to replicas that can still start sessions.
#[derive(Debug, Default)]
pub struct ApiHealth {
    reached: bool,
    down_since: Option<Instant>,
}

/// How long readiness survives an API outage once the API has answered.
pub const API_OUTAGE_GRACE: Duration = Duration::from_secs(120);

impl ApiHealth {
    pub fn observe(&mut self, probe: Result<(), String>, now: Instant) -> Result<(), String> {
        match probe {
            Ok(()) => {
                self.reached = true;
                self.down_since = None;
                Ok(())
            }
            Err(e) if !self.reached => Err(e),
            Err(e) => {
                let since = *self.down_since.get_or_insert(now);
                let down = now.saturating_duration_since(since);
                if down < API_OUTAGE_GRACE {
                    Ok(())
                } else {
                    Err(format!("{e} (for {}s)", down.as_secs()))
                }
            }
        }
    }
}

/// Order of preference among pods of one session: oldest first, then by name. Every replica
/// computes the same order from the same objects.
fn winner_order(a: &Pod, b: &Pod) -> std::cmp::Ordering {
    let ts = |p: &Pod| p.metadata.creation_timestamp.as_ref().map(|t| t.0);
    match (ts(a), ts(b)) {
        (Some(x), Some(y)) => x.cmp(&y),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => std::cmp::Ordering::Equal,
    }
    .then_with(|| a.name_any().cmp(&b.name_any()))
}

/// What admission needs of an assigned pod.
fn pod_view(p: &Pod) -> PodView {
    PodView {
        key: p.uid().unwrap_or_else(|| p.name_any()),
        session: p
            .labels()
            .get(label::SESSION_ID)
            .and_then(|s| SessionId::parse(s).ok()),
        terminating: deleting(p),
    }
}

fn deleting(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_some()
}

/// A pod this call was waiting for was deleted by someone else: the operator (an instance
/// being deleted, or a sandbox made by a server replica whose HMAC key or config is outdated,
/// as happens while one is replaced) or an admin. Nothing is wrong with the sandbox image.
fn deleted_while_starting(name: &str) -> SessionError {
    SessionError::Sandbox(format!(
        "pod {name} was deleted while it was starting (by the operator or an admin: while the instance's HMAC key or configuration changes, the operator removes sandboxes made by server replicas that are being replaced); retry the call"
    ))
}

/// Whether the pod's agent has been up before: Ready now, or its container has restarted or
/// has exited at least once.
fn has_run(p: &Pod) -> bool {
    is_ready(p)
        || p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|cs| {
                cs.iter().any(|c| {
                    c.restart_count > 0
                        || c.last_state
                            .as_ref()
                            .is_some_and(|l| l.terminated.is_some())
                })
            })
}

/// Phase Failed or Succeeded: the pod's containers never run again.
fn is_terminal(p: &Pod) -> bool {
    matches!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Failed" | "Succeeded")
    )
}

fn has_session(p: &Pod) -> bool {
    p.labels().contains_key(label::SESSION_ID)
}

fn has_launch(p: &Pod, launch: &str) -> bool {
    p.labels().get(label::LAUNCH).map(String::as_str) == Some(launch)
}

fn annotation_of<'a>(p: &'a Pod, key: &str) -> Option<&'a str> {
    p.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

pub fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn pod_ip(p: &Pod) -> Option<&str> {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .filter(|ip| !ip.is_empty())
}

fn endpoint_of(p: &Pod) -> Option<String> {
    let ip = pod_ip(p)?;
    Some(match ip.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(v6)) => format!("http://[{v6}]:{AGENT_PORT}"),
        _ => format!("http://{ip}:{AGENT_PORT}"),
    })
}

/// Why a pod will not become ready by itself, if it will not.
fn start_failure(p: &Pod) -> Option<String> {
    let status = p.status.as_ref()?;
    if let Some(phase @ ("Failed" | "Succeeded")) = status.phase.as_deref() {
        return Some(format!("the pod is {phase}"));
    }
    status.container_statuses.iter().flatten().find_map(|cs| {
        let w = cs.state.as_ref()?.waiting.as_ref()?;
        let reason = w.reason.as_deref()?;
        FATAL_WAITING.contains(&reason).then(|| {
            format!(
                "container {} is {reason}: {}",
                cs.name,
                w.message.as_deref().unwrap_or("")
            )
        })
    })
}

/// Phase and conditions of a pod that is not ready, for a timeout message.
fn pending_reason(p: &Pod) -> String {
    let Some(status) = p.status.as_ref() else {
        return String::new();
    };
    let mut parts = vec![format!(
        "phase {}",
        status.phase.as_deref().unwrap_or("unknown")
    )];
    for c in status.conditions.iter().flatten() {
        if c.status != "True" {
            if let Some(m) = c.message.as_deref().filter(|m| !m.is_empty()) {
                parts.push(format!("{}: {m}", c.type_));
            }
        }
    }
    format!(" ({})", parts.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn pod(name: &str, created: Option<&str>) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.metadata.creation_timestamp = created.map(|t| Time(t.parse().expect("timestamp")));
        p
    }

    #[test]
    fn the_oldest_pod_wins_then_the_name() {
        let mut pods = [
            pod("b", Some("2026-01-01T00:00:02Z")),
            pod("c", Some("2026-01-01T00:00:01Z")),
            pod("a", Some("2026-01-01T00:00:02Z")),
        ];
        pods.sort_by(winner_order);
        let names: Vec<_> = pods.iter().map(|p| p.name_any()).collect();
        assert_eq!(names, ["c", "a", "b"]);
    }

    #[test]
    fn start_failures_are_recognised() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "x"},
            "status": {"phase": "Pending", "containerStatuses": [{
                "name": "agent", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": "ErrImagePull", "message": "no such image"}}
            }]}
        }))
        .expect("pod");
        let why = start_failure(&p).expect("fatal");
        assert!(
            why.contains("ErrImagePull") && why.contains("no such image"),
            "{why}"
        );
        let ok: Pod = serde_json::from_value(json!({
            "metadata": {"name": "x"},
            "status": {"phase": "Pending", "containerStatuses": [{
                "name": "agent", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": "ContainerCreating"}}
            }]}
        }))
        .expect("pod");
        assert_eq!(start_failure(&ok), None);
    }

    #[test]
    fn endpoints_bracket_ipv6() {
        let p: Pod = serde_json::from_value(json!({"status": {"podIP": "fd00::5"}})).expect("pod");
        assert_eq!(endpoint_of(&p).as_deref(), Some("http://[fd00::5]:8090"));
        let p: Pod =
            serde_json::from_value(json!({"status": {"podIP": "10.244.1.7"}})).expect("pod");
        assert_eq!(endpoint_of(&p).as_deref(), Some("http://10.244.1.7:8090"));
    }

    #[test]
    fn readiness_survives_a_short_api_outage_but_not_a_long_one() {
        let t0 = Instant::now();
        let down = || Err::<(), String>("the Kubernetes API is not reachable: refused".into());
        let mut h = ApiHealth::default();
        assert!(h.observe(down(), t0).is_err(), "never reached: not ready");
        assert!(h.observe(Ok(()), t0).is_ok());
        assert!(h.observe(down(), t0).is_ok(), "a blip keeps it ready");
        let later = t0 + API_OUTAGE_GRACE - Duration::from_secs(1);
        assert!(h.observe(down(), later).is_ok());
        let e = h
            .observe(down(), t0 + API_OUTAGE_GRACE)
            .expect_err("a long outage makes it unready");
        assert!(e.contains("not reachable") && e.contains("for 120s"), "{e}");
        assert!(
            h.observe(Ok(()), t0 + API_OUTAGE_GRACE).is_ok(),
            "recovers at once"
        );
        assert!(
            h.observe(down(), t0 + API_OUTAGE_GRACE * 2).is_ok(),
            "a new outage starts a new grace"
        );
    }
}
