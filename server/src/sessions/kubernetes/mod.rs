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
//! A pod is trusted by its seal (see `lookup/seal.rs`), never by its name or labels: a pod
//! that is not sealed for its uid under the instance key is never routed to.
//!
//! [`KubeBackend`] composes parts that own their state, one per step: [`lookup`] (by label,
//! and adopting a pod that exists), [`admission`] (the rate, `--max-sessions` from the pod
//! [`watch`], the session slots: a [`admission::Reservation`]), [`start`] (warm claim, cold
//! create, converge) and [`ending`] (`DELETE /sessions/{id}`, and the sandboxes it ended).
//! They share [`pods`] (the pods API, retiring a pod) and [`agent_wait`] (waiting for an
//! agent, `/assign`). Around them: [`api_health`] (readiness through API outages),
//! [`routes`] (the route cache), [`activity`] (the idle clock's stamps) and [`steps`] (where
//! a start spends its time).

mod activity;
mod admission;
mod agent_wait;
mod api_health;
mod ending;
mod feed;
mod lookup;
mod pods;
mod routes;
mod start;
mod steps;
mod stops;
#[cfg(test)]
mod testing;
mod watch;

pub use api_health::{ApiHealth, API_OUTAGE_GRACE};

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use kube::Api;
use tokio_util::sync::CancellationToken;

use cli_mcp_api::names::InstanceName;
use cli_mcp_api::sandbox::SandboxConfig;
use cli_mcp_api::token::HmacKey;
use cli_mcp_api::SessionId;

use super::locks::SessionLocks;
use super::{owner_allows, Activity, Backend, Sandbox, SessionError, SessionSummary};
use crate::agent_client::{AgentClient, AgentError};
use crate::auth::Caller;
use crate::cli::Limits;
use crate::metrics::{Launch, Metrics};
use activity::ActivityStamper;
use admission::Admission;
use agent_wait::AgentWait;
use ending::Endings;
use lookup::{Found, Lookup};
use pods::SandboxPods;
use routes::{Route, RouteCache};
use start::{Shared, Starter};
use stops::ContainerStops;
use watch::PodWatch;

pub struct KubeBackend {
    pods: SandboxPods,
    instance: InstanceName,
    namespace: String,
    client: kube::Client,
    cache: RouteCache,
    locks: SessionLocks,
    lookup: Arc<Lookup>,
    admission: Admission,
    starter: Starter,
    endings: Endings,
    stamper: Arc<ActivityStamper>,
    metrics: Arc<Metrics>,
    stops: ContainerStops,
    /// What readiness knows of the API (see [`ApiHealth`]).
    api_health: std::sync::Mutex<ApiHealth>,
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
        let (instance, namespace) = (cfg.instance.clone(), cfg.namespace.clone());
        let stamper = ActivityStamper::new(limits.activity_stamp_gap);
        let pods = SandboxPods::new(Api::namespaced(client.clone(), &namespace), stamper.clone());
        let agent_wait = AgentWait::new(pods.clone(), agent, key.clone(), limits.start_timeout);
        let lookup = Arc::new(Lookup::new(
            pods.clone(),
            key.clone(),
            instance.clone(),
            limits.start_timeout,
            agent_wait.clone(),
        ));
        let admission = Admission::new(
            client.clone(),
            &namespace,
            instance.clone(),
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
        let starter = Starter::new(client.clone(), cfg, key, limits.start_timeout, shared);
        Arc::new(Self {
            endings: Endings::new(pods.clone(), instance.clone()),
            cache: RouteCache::new((limits.max_sessions * 4).max(1024)),
            locks: SessionLocks::default(),
            stops: ContainerStops::default(),
            api_health: std::sync::Mutex::new(ApiHealth::default()),
            pods,
            instance,
            namespace,
            client,
            lookup,
            admission,
            starter,
            stamper,
            metrics,
        })
    }

    /// Background work: `last-activity` stamping, the `sessions_active` gauge, and the
    /// watches of the session pods, the slots and the warm pool.
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
        let gauge = async move { me.admission.keep_gauge(gauge_stop).await };
        let routes = self.clone().watch_pods(stop.clone());
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

    /// Feeds admission's view and the route cache from the watch of the assigned pods.
    async fn watch_pods(self: Arc<Self>, stop: CancellationToken) {
        let watch = PodWatch {
            view: self.admission.view(),
            slots: self.admission.slots(),
            stamper: &self.stamper,
            cache: &self.cache,
            stops: &self.stops,
        };
        let selector = self.instance.assigned_selector();
        watch.run(self.pods.api().clone(), selector, &stop).await;
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
            steps::timed("lookup", self.lookup.find(sid)).await?
        };
        let stale = match found {
            Found::Pod(pod) => {
                let pod = self.lookup.adopt(*pod, sid, caller).await?;
                let route = self.lookup.route(sid, &pod)?;
                let replaced = previous.is_some_and(|p| p != route.uid);
                return Ok(self.bind(sid, route, None, replaced));
            }
            Found::Stale => true,
            Found::Nothing => false,
        };
        let replaced = previous.is_some() || stale;
        self.start_new(sid, caller, t0, replaced).await
    }

    /// A session with no pod: admitted, then started (or given the pod another replica
    /// started for it meanwhile).
    async fn start_new(
        &self,
        sid: &SessionId,
        caller: &Caller,
        t0: Instant,
        replaced: bool,
    ) -> Result<Sandbox, SessionError> {
        let mut reservation = Box::pin(self.admission.admit(sid, caller, t0)).await?;
        let started = Box::pin(self.starter.start(sid, caller, &mut reservation)).await;
        // Slots still held here were not bound to a pod of this session: freed.
        reservation.free_unbound_slots();
        let (pod, launch) = match started {
            Ok(started) => started,
            Err(e) => self.lookup.started_elsewhere(sid, caller, e).await?,
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
        Ok(self.bind(sid, route, Some(launch), replaced))
    }

    /// The session's calls go to `route` from now on: cached, and its sandbox returned.
    fn bind(
        &self,
        sid: &SessionId,
        route: Route,
        started: Option<Launch>,
        replaced: bool,
    ) -> Sandbox {
        let sandbox = route.sandbox(started, replaced);
        self.cache.insert(sid.clone(), route);
        sandbox
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
            if self.endings.was_ended(used).await {
                return Err(SessionError::Deleted);
            }
        }
        if let Some(hit) = self.cached(sid, caller) {
            return hit;
        }
        let _guard = self.locks.lock(sid).await;
        // A DELETE on this replica that held the lock until now has marked its pods first.
        if after.is_some_and(|used| self.endings.contains(&used.uid)) {
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

    fn stopped(&self, sandbox: &Sandbox) -> futures::future::BoxFuture<'static, String> {
        self.stops.stopped(&sandbox.uid)
    }

    fn ended(&self, _sid: &SessionId, sandbox: &Sandbox) -> bool {
        self.endings.contains(&sandbox.uid)
    }

    fn activity(&self, _sid: &SessionId, sandbox: &Sandbox, event: Activity) {
        self.stamper.record(&sandbox.name, &sandbox.uid, event);
    }

    async fn delete(&self, sid: &SessionId, caller: &Caller) -> Result<(), SessionError> {
        let _guard = self.locks.lock(sid).await;
        self.endings.end(sid, caller, &self.admission).await?;
        self.cache.remove(sid);
        Ok(())
    }

    async fn list(&self, caller: &Caller) -> Result<Vec<SessionSummary>, SessionError> {
        self.lookup.sessions(caller).await
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
