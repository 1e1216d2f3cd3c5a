//! The `kubernetes` backend: a session is a sandbox pod of the instance, found by its
//! `session-id` label.
//!
//! Finding a session's pod: the route cache → a label lookup → claiming a warm
//! pool pod → creating a pod on demand with the shared builder, then waiting for Ready with
//! a watch. Every step is safe against other replicas doing the same at the same time:
//! - a claim is a JSON merge patch guarded by the listed `resourceVersion`, so exactly one
//!   claimer wins a pod (409 → next pod); a claimed pod whose `/assign` fails is deleted, so
//!   no pod is ever left half-assigned;
//! - an on-demand pod has a deterministic name, so two creators meet in `AlreadyExists` and
//!   adopt the one pod;
//! - when a claim and a create race, both replicas see two pods for the session and pick the
//!   same winner (oldest `creationTimestamp`, then name); the loser is deleted.
//!
//! A pod is trusted by its seal ([`seal`]), never by its name or labels: a pod that is not
//! sealed for its uid under the instance key is never routed to.
//!
//! The modules follow those steps: [`lookup`] (by label, and adopting a pod that exists),
//! [`admission`] (`--max-sessions`, from the pod [`watch`]), [`start`] (warm claim, cold
//! create, wait for Ready), [`agent_wait`] (an existing pod whose agent restarts),
//! [`api_health`] (readiness through API outages), [`routes`] (the route cache) and
//! [`activity`] (the idle clock's stamps).

mod activity;
mod admission;
mod agent_wait;
mod api_health;
mod feed;
mod lookup;
mod pods;
mod routes;
mod start;
mod steps;
#[cfg(test)]
mod testing;
mod watch;

pub use api_health::{ApiHealth, API_OUTAGE_GRACE};

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;

use cli_mcp_api::names::{annotation, label, InstanceName};
use cli_mcp_api::sandbox::SandboxConfig;
use cli_mcp_api::token::HmacKey;
use cli_mcp_api::SessionId;

use super::locks::SessionLocks;
use super::{
    owner_allows, Activity, Backend, EndedSandboxes, Sandbox, SessionError, SessionSummary,
};
use crate::agent_client::{AgentClient, AgentError};
use crate::auth::Caller;
use crate::cli::Limits;
use crate::metrics::{Launch, Metrics};
use activity::ActivityStamper;
use admission::Admission;
use agent_wait::AgentWait;
use cli_mcp_api::pod_state::{is_deleting, is_ready, session_of};
use lookup::{Found, Lookup};
use pods::{annotation_of, has_launch, SandboxPods};
use routes::RouteCache;
use start::{Shared, Starter};
use steps::timed;

/// The `retired` reason of the pods `DELETE /sessions/{id}` removes.
const RETIRED_SESSION_ENDED: &str = "session-ended";

/// Whether `pod` was ended by `DELETE /sessions/{id}` (on any replica).
fn ended_on_purpose(pod: &Pod) -> bool {
    annotation_of(pod, annotation::RETIRED) == Some(RETIRED_SESSION_ENDED)
}

/// How often the `sessions_active` gauge is refreshed (from the pod watch's view, or a LIST
/// while that view cannot be trusted).
const GAUGE_REFRESH: Duration = Duration::from_secs(15);

pub struct KubeBackend {
    pods: SandboxPods,
    /// Finding and adopting a session's pods.
    lookup: Arc<Lookup>,
    /// Claiming or creating a new session's pod.
    starter: Starter,
    client: kube::Client,
    namespace: String,
    instance: InstanceName,
    cache: RouteCache,
    locks: SessionLocks,
    stamper: Arc<ActivityStamper>,
    /// Admission of new sessions: the rate, `--max-sessions` (fed by the pod watch) and the
    /// session slots.
    admission: Admission,
    metrics: Arc<Metrics>,
    /// What readiness knows of the API (see [`ApiHealth`]).
    api_health: std::sync::Mutex<ApiHealth>,
    /// Pods ended by `DELETE /sessions/{id}`, by this replica or (seen by the pod watch)
    /// another: a call that was running in one must not start the session again.
    ended: EndedSandboxes,
}

impl std::fmt::Debug for KubeBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeBackend")
            .field("instance", &self.instance)
            .field("namespace", &self.namespace)
            .finish()
    }
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
        let stamper = ActivityStamper::new(limits.activity_stamp_gap);
        let pods = SandboxPods::new(
            Api::namespaced(client.clone(), &cfg.namespace),
            stamper.clone(),
        );
        let agent_wait = AgentWait::new(pods.clone(), agent, key.clone(), limits.start_timeout);
        let lookup = Lookup::new(
            pods.clone(),
            key.clone(),
            cfg.instance.clone(),
            limits.start_timeout,
            agent_wait.clone(),
        );
        let lookup = Arc::new(lookup);
        let admission = Admission::new(
            client.clone(),
            &cfg.namespace,
            cfg.instance.clone(),
            &limits,
            metrics.clone(),
        );
        let shared = Shared {
            pods: pods.clone(),
            lookup: lookup.clone(),
            agent_wait,
            view: admission.view().clone(),
            metrics: metrics.clone(),
        };
        let (instance, namespace) = (cfg.instance.clone(), cfg.namespace.clone());
        let starter = Starter::new(client.clone(), cfg, key, limits.start_timeout, shared);
        Arc::new(Self {
            pods,
            lookup,
            starter,
            admission,
            client,
            instance,
            namespace,
            cache: RouteCache::new((limits.max_sessions * 4).max(1024)),
            locks: SessionLocks::default(),
            stamper,
            api_health: std::sync::Mutex::new(ApiHealth::default()),
            ended: EndedSandboxes::default(),
            metrics,
        })
    }

    /// Background work: `last-activity` stamping and the `sessions_active` gauge.
    pub fn spawn_background(
        self: &Arc<Self>,
        stop: CancellationToken,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let stamper = self
            .stamper
            .clone()
            .run(self.pods.api().clone(), stop.clone());
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
                if let Err(e) = me.admission.refresh_gauge().await {
                    tracing::debug!(error = %e, "cannot refresh sessions_active");
                }
            }
        };
        let routes = self.clone().watch_routes(stop.clone());
        let slots = self.admission.slots().clone().watch(stop.clone());
        let pool = self.starter.watch_pool(stop.clone());
        vec![
            tokio::spawn(stamper),
            tokio::spawn(gauge),
            tokio::spawn(routes),
            tokio::spawn(slots),
            tokio::spawn(pool),
        ]
    }

    /// The session's route in the cache, as the sandbox of a call by `caller` (refused when
    /// the caller may not use it).
    fn cached(&self, sid: &SessionId, caller: &Caller) -> Option<Result<Sandbox, SessionError>> {
        let route = self.cache.get(sid)?;
        Some(if owner_allows(route.owner.as_deref(), caller) {
            Ok(route.sandbox(None, false))
        } else {
            Err(SessionError::Forbidden(sid.clone()))
        })
    }

    /// Whether the pod behind `used` was ended by `DELETE /sessions/{id}`: known from this
    /// replica's own deletions and the pod watch, else read from the pod itself (another
    /// replica's deletion the watch has not delivered yet). A pod that is gone altogether
    /// without the watch having seen why counts as not ended (its session starts again, and
    /// the call says the sandbox was replaced).
    async fn was_ended(&self, used: &Sandbox) -> bool {
        if self.ended.contains(&used.uid) {
            return true;
        }
        match self.pods.api().get_opt(&used.name).await {
            Ok(Some(pod)) if pod.uid().as_deref() == Some(used.uid.as_str()) => {
                let ended = ended_on_purpose(&pod);
                if ended {
                    self.ended.end(&used.uid);
                }
                ended
            }
            _ => self.ended.contains(&used.uid),
        }
    }

    /// The session's pod, found, adopted or started; what the route cache did not know.
    async fn acquire_slow(
        &self,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<Sandbox, SessionError> {
        let t0 = Instant::now();
        // At the limit, a session the watch knows no pod of is refused before any API call:
        // callers over the limit cost nothing. (A pod another replica created within the
        // watch's lag is missed: that caller is refused once, and its next call finds it.)
        self.admission.refuse_at_once(sid, caller, t0)?;
        let previous = self.cache.previous_uid(sid);
        // A session that neither the pod watch (synced) nor the route cache has ever seen is
        // new, but for a pod another replica wrote within the watch's lag: no label lookup
        // (a LIST) then. Should such a pod exist after all, the converge check after this
        // replica's own write sees both and every replica keeps the same one.
        let found = if previous.is_none() && self.admission.view().unseen(sid) {
            Found::Nothing
        } else {
            timed("lookup", self.lookup.find(sid)).await?
        };
        let stale = match found {
            Found::Pod(pod) => {
                let pod = self.lookup.adopt(*pod, sid, caller).await?;
                let route = self.lookup.route(sid, &pod)?;
                let replaced = previous.is_some_and(|p| p != route.uid);
                self.cache.insert(sid.clone(), route.clone());
                return Ok(route.sandbox(None, replaced));
            }
            Found::Stale => true,
            Found::Nothing => false,
        };
        let mut reservation = Box::pin(self.admission.admit(sid, caller, t0)).await?;
        let started = Box::pin(self.starter.start(sid, caller, &mut reservation)).await;
        // Slots still held here were not bound to a pod of this session: freed.
        reservation.free_unbound_slots();
        let (pod, launch) = match started {
            Ok(started) => started,
            // Another replica may have given the session its pod meanwhile (and deleted ours
            // as the loser): use that one.
            Err(e) => match self.lookup.find(sid).await? {
                Found::Pod(p) => {
                    tracing::info!(session = %sid, pod = %p.name_any(), error = %e,
                        "another replica started this session; using its pod");
                    let launch = if has_launch(&p, label::LAUNCH_WARM) {
                        Launch::Warm
                    } else {
                        Launch::Cold
                    };
                    (self.lookup.adopt(*p, sid, caller).await?, launch)
                }
                _ => return Err(e),
            },
        };
        let route = self.lookup.route(sid, &pod)?;
        // The start's paths (claim, create, converge) each check the owner; checked once more
        // where they meet, so that no later path can hand a caller someone else's pod.
        if !owner_allows(route.owner.as_deref(), caller) {
            return Err(SessionError::Forbidden(sid.clone()));
        }
        reservation.keep_charge();
        self.metrics.started(launch, t0.elapsed());
        tracing::info!(session = %sid, pod = %route.pod, launch = launch.as_str(),
            took_ms = t0.elapsed().as_millis() as u64, steps = %steps::summary(),
            "session sandbox started");
        self.cache.insert(sid.clone(), route.clone());
        Ok(route.sandbox(Some(launch), previous.is_some() || stale))
    }
}

#[async_trait]
impl Backend for KubeBackend {
    async fn acquire(
        &self,
        sid: &SessionId,
        caller: &Caller,
        after: Option<&Sandbox>,
    ) -> Result<Sandbox, SessionError> {
        if let Some(used) = after {
            if self.was_ended(used).await {
                return Err(SessionError::Deleted);
            }
        }
        if let Some(hit) = self.cached(sid, caller) {
            return hit;
        }
        let _guard = self.locks.lock(sid).await;
        // A DELETE on this replica that held the lock until now has marked its pods first.
        if after.is_some_and(|used| self.ended.contains(&used.uid)) {
            return Err(SessionError::Deleted);
        }
        if let Some(hit) = self.cached(sid, caller) {
            return hit;
        }
        // Boxed: a start's future nests the lookup, admission, claim and converge steps side
        // by side, too large for a worker thread's stack in debug builds when kept inline.
        steps::traced(Box::pin(self.acquire_slow(sid, caller))).await
    }

    async fn existing(
        &self,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<Option<Sandbox>, SessionError> {
        if let Some(hit) = self.cached(sid, caller) {
            return hit.map(Some);
        }
        self.lookup.existing(sid, caller).await
    }

    fn invalidate(&self, sid: &SessionId, sandbox: &Sandbox, _why: &AgentError) {
        self.cache.invalidate(sid, &sandbox.uid);
    }

    fn ended(&self, _sid: &SessionId, sandbox: &Sandbox) -> bool {
        self.ended.contains(&sandbox.uid)
    }

    fn activity(&self, _sid: &SessionId, sandbox: &Sandbox, event: Activity) {
        self.stamper.record(&sandbox.name, &sandbox.uid, event);
    }

    async fn delete(&self, sid: &SessionId, caller: &Caller) -> Result<(), SessionError> {
        let _guard = self.locks.lock(sid).await;
        let list = self
            .pods
            .api()
            .list(&ListParams::default().labels(&self.instance.session_selector(sid)))
            .await?;
        if list
            .items
            .iter()
            .any(|p| !owner_allows(annotation_of(p, annotation::OWNER), caller))
        {
            return Err(SessionError::Forbidden(sid.clone()));
        }
        for pod in list.items.iter().filter(|p| !is_deleting(p)) {
            // Marked before it goes, so the call running in it fails instead of starting the
            // session again.
            if let Some(uid) = pod.uid() {
                self.ended.end(&uid);
            }
            tracing::info!(session = %sid, pod = %pod.name_any(), "deleting session sandbox");
            self.pods.retire(pod, RETIRED_SESSION_ENDED).await;
            // Its places are free when DELETE answers.
            self.admission.session_ended(sid, pod).await;
        }
        self.cache.remove(sid);
        Ok(())
    }

    async fn list(&self, caller: &Caller) -> Result<Vec<SessionSummary>, SessionError> {
        let list = self
            .pods
            .api()
            .list(&ListParams::default().labels(&self.instance.assigned_selector()))
            .await?;
        let mut out: Vec<SessionSummary> = list
            .items
            .iter()
            .filter(|p| !is_deleting(p))
            .filter(|p| owner_allows(annotation_of(p, annotation::OWNER), caller))
            .filter_map(|p| {
                Some(SessionSummary {
                    session_id: session_of(p)?.to_owned(),
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
        let probe = api_health::probe(&self.client).await;
        self.api_health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(probe, Instant::now())
    }

    async fn shutdown(&self) {}
}
