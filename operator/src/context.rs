//! Shared state of one controller: client, configuration, caches, expectations.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::{Ingress, NetworkPolicy};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Role, RoleBinding};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::{Client, Resource};

use cli_mcp_api::crd::CliMcpInstance;

use crate::children::expose::{HttpRoute, Route};
use crate::metrics::Metrics;

/// Which namespaces the operator watches (`WATCH_NAMESPACE`, a comma list; empty = all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    All,
    Namespaces(Vec<String>),
}

impl Scope {
    /// Parses `WATCH_NAMESPACE`: empty or unset means the whole cluster.
    pub fn parse(value: Option<&str>) -> Scope {
        let mut list: Vec<String> = value
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        list.sort();
        list.dedup();
        if list.is_empty() {
            Scope::All
        } else {
            Scope::Namespaces(list)
        }
    }

    pub fn contains(&self, ns: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Namespaces(list) => list.iter().any(|n| n == ns),
        }
    }
}

/// Process-wide configuration (from flags and env).
#[derive(Debug, Clone)]
pub struct OperatorConfig {
    /// `RELATED_IMAGE_SERVER`.
    pub server_image: String,
    /// `RELATED_IMAGE_SANDBOX`, used when `spec.sandbox.image` is empty.
    pub sandbox_image: Option<String>,
    /// `RELATED_IMAGE_PROXY`, the credential proxy every instance runs.
    pub proxy_image: Option<String>,
    pub scope: Scope,
    /// How long a teardown may wait for pods before it releases the CR anyway (the pods keep
    /// their owner references, so garbage collection still removes them).
    pub teardown_timeout: Duration,
    /// Lifetime of a generated serving certificate; renewed when a third of it is left.
    pub tls_lifetime: Duration,
    /// Periodic re-check of every instance (resync), when nothing else requeues sooner.
    pub resync: Duration,
    /// Reporter identity for Events (the pod name).
    pub identity: String,
    /// Plain Kubernetes or OpenShift (detected at start unless `--platform` says).
    pub platform: crate::platform::Platform,
    /// `CLI_MCP_SANDBOX_TOOLS`: the tools of `sandbox_image` and their versions, as the image
    /// build recorded them, for the sandbox briefing of instances that run that image.
    pub sandbox_tools: Option<Vec<crate::briefing::Tool>>,
    /// How often the reviews behind each sandbox briefing are made again.
    pub briefing_refresh: Duration,
    /// The operator's own namespace and ServiceAccount, when it was told them: no instance
    /// may be named so that one of its ServiceAccounts is this one.
    pub own_account: Option<(String, String)>,
}

impl OperatorConfig {
    pub fn new(server_image: impl Into<String>, sandbox_image: Option<String>) -> Self {
        Self {
            server_image: server_image.into(),
            sandbox_image,
            proxy_image: None,
            scope: Scope::All,
            teardown_timeout: Duration::from_secs(600),
            tls_lifetime: crate::children::secrets::DEFAULT_TLS_LIFETIME,
            resync: Duration::from_secs(600),
            identity: "cli-mcp-operator".into(),
            platform: Default::default(),
            sandbox_tools: None,
            briefing_refresh: DEFAULT_BRIEFING_REFRESH,
            own_account: None,
        }
    }
}

/// Default of `--briefing-refresh`: a changed RoleBinding shows in the briefing within a few
/// minutes, and a steady cluster costs a few reviews per instance that often.
pub const DEFAULT_BRIEFING_REFRESH: Duration = Duration::from_secs(180);

/// Reflector stores of everything the controller owns, filled by the watches in
/// [`crate::watch`]. Reads during a reconcile come from here, not from the API.
#[derive(Clone)]
pub struct Stores {
    pub instances: Store<CliMcpInstance>,
    /// Sandbox pods, reduced to what the operator reads ([`crate::sandbox_pod`]).
    pub pods: Store<crate::sandbox_pod::SandboxPod>,
    /// The sessions the pod watch saw start, per instance (what a pool sized by demand
    /// follows).
    pub session_starts: crate::demand::SessionStarts,
    pub secrets: Store<Secret>,
    pub config_maps: Store<ConfigMap>,
    pub deployments: Store<Deployment>,
    pub services: Store<Service>,
    pub service_accounts: Store<ServiceAccount>,
    pub roles: Store<Role>,
    pub role_bindings: Store<RoleBinding>,
    pub network_policies: Store<NetworkPolicy>,
    pub pod_disruption_budgets: Store<PodDisruptionBudget>,
    pub cluster_role_bindings: Store<ClusterRoleBinding>,
    pub ingresses: Store<Ingress>,
    pub http_routes: Store<HttpRoute>,
    /// Whether the cluster serves Gateway API HTTPRoutes: `Some(true)` once the HTTPRoute
    /// watch listed, `Some(false)` while it gets 404 (no Gateway API CRDs), `None` before
    /// its first answer.
    pub http_routes_served: tokio::sync::watch::Receiver<Option<bool>>,
    pub routes: Store<Route>,
    /// Whether the cluster serves OpenShift Routes, as [`Self::http_routes_served`].
    pub routes_served: tokio::sync::watch::Receiver<Option<bool>>,
    /// The cluster's RuntimeClasses (cluster-scoped), to check the ones instances name.
    pub runtime_classes: Store<RuntimeClass>,
    /// Whether [`Self::runtime_classes`] holds the cluster's classes: `Some(true)` once
    /// listed, `Some(false)` while the operator may not list them, `None` before an answer.
    pub runtime_classes_listed: tokio::sync::watch::Receiver<Option<bool>>,
    /// Set once [`Self::synced`] has seen every cache it waits for listed: from then on a
    /// reconcile asks one flag, not five stores (with a timer each).
    pub synced: Arc<tokio::sync::OnceCell<()>>,
}

impl Stores {
    /// Stores no watch fills: empty whatever the API holds, and never synced. For tests of
    /// what a reconcile does on caches that lag behind the API (or hold exactly what a test
    /// puts in through a writer of its own).
    pub fn detached() -> Self {
        let never = || tokio::sync::watch::channel(None).1;
        Self {
            instances: reflector::store().0,
            pods: reflector::store().0,
            session_starts: Default::default(),
            secrets: reflector::store().0,
            config_maps: reflector::store().0,
            deployments: reflector::store().0,
            services: reflector::store().0,
            service_accounts: reflector::store().0,
            roles: reflector::store().0,
            role_bindings: reflector::store().0,
            network_policies: reflector::store().0,
            pod_disruption_budgets: reflector::store().0,
            cluster_role_bindings: reflector::store().0,
            ingresses: reflector::store().0,
            http_routes: reflector::store().0,
            http_routes_served: never(),
            routes: reflector::store().0,
            routes_served: never(),
            runtime_classes: reflector::store().0,
            runtime_classes_listed: never(),
            synced: Arc::default(),
        }
    }

    /// Returns once the caches a reconcile judges an instance by have listed: the instances,
    /// the sandbox pods, Deployments, Secrets and NetworkPolicies. kube's controller waits
    /// only for the instances' own cache, so the first reconciles of a new process (a
    /// restart, a new leader) saw no Deployment, no warm pod and no NetworkPolicy yet, and
    /// wrote `Ready=False` with Warning events, which then waited for a full pool to turn
    /// back. (The HTTPRoute and Route caches are not waited for: a cluster without those
    /// APIs never fills them; they have their own served flags.)
    pub async fn synced(&self) {
        self.synced
            .get_or_init(|| async {
                wait_ready(&self.instances).await;
                wait_ready(&self.pods).await;
                wait_ready(&self.deployments).await;
                wait_ready(&self.secrets).await;
                wait_ready(&self.network_policies).await;
            })
            .await;
    }

    /// Whether the cluster serves HTTPRoutes, waiting (at most `limit`) for the HTTPRoute
    /// watch's first answer so a reconcile right after start does not report a missing API
    /// it has not asked about yet. `None`: still no answer.
    pub async fn http_routes_served(&self, limit: Duration) -> Option<bool> {
        served(&self.http_routes_served, limit).await
    }

    /// Whether the cluster serves OpenShift Routes, as [`Self::http_routes_served`].
    pub async fn routes_served(&self, limit: Duration) -> Option<bool> {
        served(&self.routes_served, limit).await
    }

    /// Whether the RuntimeClass cache holds the cluster's classes, waiting (at most `limit`)
    /// for the watch's first answer as [`Self::http_routes_served`] does.
    pub async fn runtime_classes_listed(&self, limit: Duration) -> bool {
        served(&self.runtime_classes_listed, limit).await == Some(true)
    }

    /// The handler of RuntimeClass `class`, if the cache holds that class.
    pub fn runtime_handler(&self, class: &str) -> Option<String> {
        self.runtime_classes
            .get(&ObjectRef::new(class))
            .map(|rc| rc.handler.clone())
    }
}

/// `Store::wait_until_ready` wakes only the last task that polled it (a oneshot underneath)
/// and the controller polls it too, so poll again periodically until it resolves (at once,
/// once it has).
async fn wait_ready<K>(store: &Store<K>)
where
    K: Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    while tokio::time::timeout(Duration::from_millis(200), store.wait_until_ready())
        .await
        .is_err()
    {}
}

async fn served(rx: &tokio::sync::watch::Receiver<Option<bool>>, limit: Duration) -> Option<bool> {
    let mut waiting = rx.clone();
    let known = tokio::time::timeout(limit, waiting.wait_for(Option::is_some)).await;
    match known {
        Ok(Ok(v)) => *v,
        _ => *rx.borrow(),
    }
}

/// An object from a reflector store.
pub fn cached<K>(store: &Store<K>, ns: &str, name: &str) -> Option<Arc<K>>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    store.get(&ObjectRef::new(name).within(ns))
}

/// Hash of the last applied desired object and the resourceVersion the apiserver returned.
/// When the store still shows that resourceVersion and the desired object hashes the same,
/// applying again could not change anything, so no request is sent: a steady state makes no
/// API writes at all.
/// Entries go with their instance ([`Self::forget_owner`]), so the cache holds the children
/// of live instances only.
#[derive(Default)]
pub struct ApplyCache {
    inner: Mutex<HashMap<String, Applied>>,
}

struct Applied {
    hash: String,
    rv: String,
    /// The uid of the object's controller (its instance), if it has one.
    owner: Option<String>,
}

impl ApplyCache {
    pub fn is_current(&self, key: &str, hash: &str, observed_rv: Option<&str>) -> bool {
        let Some(rv) = observed_rv else { return false };
        let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        guard
            .get(key)
            .is_some_and(|a| a.hash == hash && a.rv.as_str() == rv)
    }

    pub fn record(&self, key: String, hash: String, rv: String, owner: Option<String>) {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        guard.insert(key, Applied { hash, rv, owner });
    }

    /// Forgets the objects whose controller is the instance `uid` (at its teardown).
    pub fn forget_owner(&self, uid: &str) {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        guard.retain(|_, a| a.owner.as_deref() != Some(uid));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn forget_prefix(&self, prefix: &str) {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        guard.retain(|k, _| !k.starts_with(prefix));
    }
}

/// Pool writes that the pod store has not shown yet (controller "expectations"). Counting
/// them keeps a burst of reconciles, or a stale cache, from creating a pod twice.
#[derive(Default, Debug)]
pub struct PoolExpectations {
    /// Pool pod name -> when we created it.
    pub creates: HashMap<String, Instant>,
    /// Pod uid -> when we deleted it.
    pub deletes: HashMap<String, Instant>,
}

/// Backoff of one instance's pool after pods failed (image pull, crash loop, eviction).
#[derive(Default, Debug, Clone)]
pub struct PoolBackoff {
    pub failures: u32,
    pub not_before: Option<Instant>,
    /// The API server refused the last pool pod built from config hash `.0`, saying `.1`
    /// (admission: a RuntimeClass or PriorityClass that does not exist, a policy). Kept until
    /// a create succeeds or the config changes, so the status keeps saying it through the
    /// backoff.
    pub refused: Option<(String, String)>,
}

impl PoolBackoff {
    pub const MAX: Duration = Duration::from_secs(300);

    /// Registers one more failure and returns the delay before the next create.
    pub fn fail(&mut self, now: Instant) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let secs = 2u64
            .saturating_pow(self.failures.min(16))
            .min(Self::MAX.as_secs());
        let d = Duration::from_secs(secs);
        self.not_before = Some(now + d);
        d
    }

    pub fn reset(&mut self) {
        self.failures = 0;
        self.not_before = None;
    }

    /// Remaining wait, if creates are held back.
    pub fn remaining(&self, now: Instant) -> Option<Duration> {
        self.not_before
            .and_then(|t| t.checked_duration_since(now))
            .filter(|d| !d.is_zero())
    }
}

/// The longest Event note the API server stores (events.k8s.io/v1 refuses a longer one with
/// a 422, and the Event is lost).
pub const MAX_EVENT_NOTE: usize = 1024;

/// `note` cut to [`MAX_EVENT_NOTE`] bytes on a character boundary, ending in `…` when cut:
/// an apply error quoting a whole object is still worth its first kilobyte.
pub fn event_note(mut note: String) -> String {
    const MORE: &str = "…";
    if note.len() <= MAX_EVENT_NOTE {
        return note;
    }
    let mut end = MAX_EVENT_NOTE - MORE.len();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    note.truncate(end);
    note.push_str(MORE);
    note
}

/// Per-instance pool bookkeeping, keyed by the CR's uid.
#[derive(Default)]
pub struct PoolState {
    inner: Mutex<HashMap<String, InstancePool>>,
}

/// One instance's pool bookkeeping.
#[derive(Default)]
struct InstancePool {
    expectations: PoolExpectations,
    backoff: PoolBackoff,
    autoscaler: crate::demand::autoscale::Autoscaler,
}

impl PoolState {
    pub fn with<R>(
        &self,
        uid: &str,
        f: impl FnOnce(&mut PoolExpectations, &mut PoolBackoff) -> R,
    ) -> R {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let entry = guard.entry(uid.to_owned()).or_default();
        f(&mut entry.expectations, &mut entry.backoff)
    }

    /// The sizing memory of a pool sized by demand.
    pub fn with_autoscaler<R>(
        &self,
        uid: &str,
        f: impl FnOnce(&mut crate::demand::autoscale::Autoscaler) -> R,
    ) -> R {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard.entry(uid.to_owned()).or_default().autoscaler)
    }

    pub fn forget(&self, uid: &str) {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        guard.remove(uid);
    }
}

/// The instances (by uid) a once-per-process step has been done for, such as the check for
/// the Go operator's leftovers ([`crate::migrate`]). An entry goes with its instance.
#[derive(Default)]
pub struct InstanceSet(Mutex<HashSet<String>>);

impl InstanceSet {
    pub fn contains(&self, uid: &str) -> bool {
        self.0.lock().is_ok_and(|s| s.contains(uid))
    }

    pub fn insert(&self, uid: &str) {
        if let Ok(mut s) = self.0.lock() {
            s.insert(uid.to_string());
        }
    }

    /// The instance `uid` is gone (its teardown is complete).
    pub fn forget(&self, uid: &str) {
        if let Ok(mut s) = self.0.lock() {
            s.remove(uid);
        }
    }
}

/// Everything a reconcile needs.
pub struct Context {
    pub client: Client,
    pub config: Arc<OperatorConfig>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub stores: Stores,
    pub applied: ApplyCache,
    pub pool: PoolState,
    /// Where the API server is (for the sandbox NetworkPolicy), refreshed now and then.
    pub api_peers: Mutex<Option<(Instant, crate::children::ApiServerPeers)>>,
    /// Instances already checked for the Go operator's leftovers.
    pub migrated: InstanceSet,
    /// Consecutive failed reconciles of each failing instance, for their retry backoff.
    pub retries: crate::retry::RetryBackoff,
    /// Whether NetworkPolicy and Pod Security are in force for each instance.
    pub isolation: crate::isolation::IsolationProbes,
    /// The last reviews behind each instance's sandbox briefing.
    pub briefings: crate::briefing::BriefingCache,
}

impl Context {
    /// Publishes an Event on the instance. Events are best effort: a failure is only logged.
    pub async fn publish(&self, cr: &CliMcpInstance, type_: EventType, reason: &str, note: String) {
        self.publish_action(cr, type_, reason, "Reconcile", note)
            .await
    }

    /// [`Self::publish`] with the action taken. The recorder folds an Event into an earlier
    /// one of the same type, reason and action (a series keeps the first note), so an
    /// action that differs, such as the size a pool was set to, keeps each note readable.
    pub async fn publish_action(
        &self,
        cr: &CliMcpInstance,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(event_note(note)),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &cr.object_ref(&())).await {
            tracing::debug!("publishing event {reason}: {e}");
        }
    }

    pub fn new(
        client: Client,
        config: Arc<OperatorConfig>,
        metrics: Arc<Metrics>,
        stores: Stores,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: cli_mcp_api::names::FIELD_MANAGER.into(),
                instance: Some(config.identity.clone()),
            },
        );
        Self {
            client,
            config,
            recorder,
            metrics,
            stores,
            applied: ApplyCache::default(),
            pool: PoolState::default(),
            api_peers: Mutex::new(None),
            migrated: Default::default(),
            retries: Default::default(),
            isolation: Default::default(),
            briefings: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_event_note_is_cut_to_what_the_api_server_stores() {
        assert_eq!(event_note("short".into()), "short");
        // Multi-byte characters across the cut: never split one.
        let long = "é".repeat(MAX_EVENT_NOTE);
        let cut = event_note(long);
        assert!(cut.len() <= MAX_EVENT_NOTE, "{}", cut.len());
        assert!(cut.ends_with('…') && cut.starts_with("éé"));
        let exact = "x".repeat(MAX_EVENT_NOTE);
        assert_eq!(event_note(exact.clone()), exact);
    }

    #[test]
    fn watch_namespace_parsing() {
        assert_eq!(Scope::parse(None), Scope::All);
        assert_eq!(Scope::parse(Some(" , ")), Scope::All);
        assert_eq!(
            Scope::parse(Some("b, a,b")),
            Scope::Namespaces(vec!["a".into(), "b".into()])
        );
        assert!(Scope::parse(Some("a")).contains("a"));
        assert!(!Scope::parse(Some("a")).contains("b"));
    }

    #[test]
    fn apply_cache_needs_same_hash_and_rv() {
        let c = ApplyCache::default();
        assert!(!c.is_current("k", "h", Some("1")));
        c.record("k".into(), "h".into(), "1".into(), None);
        assert!(c.is_current("k", "h", Some("1")));
        assert!(!c.is_current("k", "h2", Some("1")));
        assert!(!c.is_current("k", "h", Some("2")));
        assert!(!c.is_current("k", "h", None));
    }

    #[test]
    fn an_instances_entries_go_with_it() {
        let c = ApplyCache::default();
        for kind in ["Service", "Deployment", "NetworkPolicy"] {
            c.record(
                format!("{kind}/ns/cli-mcp-a"),
                "h".into(),
                "1".into(),
                Some("uid-a".into()),
            );
            c.record(
                format!("{kind}/ns/cli-mcp-b"),
                "h".into(),
                "1".into(),
                Some("uid-b".into()),
            );
        }
        c.record("ClusterRoleBinding//x".into(), "h".into(), "1".into(), None);
        c.forget_owner("uid-a");
        assert_eq!(c.len(), 4);
        assert!(!c.is_current("Service/ns/cli-mcp-a", "h", Some("1")));
        assert!(c.is_current("Service/ns/cli-mcp-b", "h", Some("1")));
    }

    #[test]
    fn backoff_grows_and_caps() {
        let mut b = PoolBackoff::default();
        let now = Instant::now();
        assert_eq!(b.fail(now), Duration::from_secs(2));
        assert_eq!(b.fail(now), Duration::from_secs(4));
        for _ in 0..20 {
            b.fail(now);
        }
        assert_eq!(b.fail(now), PoolBackoff::MAX);
        assert!(b.remaining(now).is_some());
        b.reset();
        assert!(b.remaining(now).is_none());
    }
}
