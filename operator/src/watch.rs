//! The watches behind one controller: the root `CliMcpInstance` stream (filtered to spec,
//! finalizer and deletion changes), a reflector per owned kind (label-selected to objects
//! this operator manages), the sandbox pods (filtered so `last-activity` patches and other
//! noise do not wake the reconciler), a metadata-only watch of Secrets that maps an
//! admin's kubeconfig or TLS Secret to the instances that reference it, and the cluster's
//! RuntimeClasses (`runtime_classes.rs`).

mod runtime_classes;

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{future, Stream, StreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::{Ingress, NetworkPolicy};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Role, RoleBinding};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::{annotation, label};

use crate::children::expose::{HttpRoute, Route};
use crate::children::{secrets, INSTANCE_NAMESPACE_LABEL};
use crate::context::{Scope, Stores};
use crate::demand::{self, SessionStarts};
use crate::sandbox_pod::SandboxPod;

fn managed() -> watcher::Config {
    watcher::Config::default().labels(&format!("{}={}", label::APP_MANAGED_BY, label::MANAGED_BY))
}

fn api<K>(client: &Client, ns: Option<&str>) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
{
    match ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// A reflector plus its trigger stream (every touched object, deletes included).
fn reflect<K>(
    api: Api<K>,
    cfg: watcher::Config,
) -> (
    Store<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = watcher(api, cfg)
        .default_backoff()
        .reflect(writer)
        .touched_objects();
    (reader, stream)
}

/// What of a sandbox pod matters to the reconciler: labels (claims), deletion, the
/// hash/commitment annotations and, of a pool pod, phase, readiness and container states —
/// not `last-activity` and not the resourceVersion. (An assigned pod is cached without its
/// status: nothing reads it.)
pub fn pod_fingerprint(p: &SandboxPod) -> u64 {
    let mut h = DefaultHasher::new();
    p.labels().hash(&mut h);
    p.is_deleting().hash(&mut h);
    for key in [annotation::SANDBOX_HASH, annotation::TOKEN_SHA256] {
        p.annotations().get(key).hash(&mut h);
    }
    if let Some(st) = p.unassigned().and_then(|p| p.status.as_ref()) {
        st.phase.hash(&mut h);
        for c in st.conditions.iter().flatten() {
            (&c.type_, &c.status).hash(&mut h);
        }
        for cs in st.container_statuses.iter().flatten() {
            cs.ready.hash(&mut h);
            cs.restart_count.hash(&mut h);
            let waiting = cs
                .state
                .as_ref()
                .and_then(|s| s.waiting.as_ref())
                .and_then(|w| w.reason.clone());
            waiting.hash(&mut h);
            cs.state
                .as_ref()
                .map(|s| s.terminated.is_some())
                .hash(&mut h);
        }
    }
    h.finish()
}

/// Sandbox pods: reflected into a store (as [`SandboxPod`]s: only what the operator
/// reads), and passed on as triggers only when their fingerprint changed (or they were
/// deleted).
fn sandbox_pods(
    client: &Client,
    ns: Option<&str>,
    starts: SessionStarts,
) -> (
    Store<SandboxPod>,
    impl Stream<Item = Result<SandboxPod, watcher::Error>> + Send + 'static,
) {
    let (reader, writer) = reflector::store();
    let cfg = watcher::Config::default().labels(&format!(
        "{}={}",
        label::COMPONENT,
        label::COMPONENT_SANDBOX
    ));
    let seen = Arc::new(Mutex::new(Fingerprints::new(starts)));
    // Sandbox pods are what grows with sessions: they are read straight into the reduced
    // SandboxPod, never kept as a whole Pod.
    let stream = watcher(api::<SandboxPod>(client, ns), cfg)
        .default_backoff()
        .reflect(writer)
        .filter_map(move |ev| {
            let out = match ev {
                Ok(ev) => {
                    let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                    seen.passes(ev).map(Ok)
                }
                Err(e) => Some(Err(e)),
            };
            future::ready(out)
        });
    (reader, stream)
}

/// The fingerprint of every sandbox pod the watch reported, to pass on only pods that
/// changed, and whether it was assigned, to record the sessions that start
/// ([`SessionStarts`]). A relist (after a 410, an API server restart) reports no `Delete`
/// for pods deleted during the gap: what the relist did not report is forgotten at its end,
/// so the map holds the pods that exist, not every pod there ever was.
struct Fingerprints {
    /// Pod key -> (fingerprint, ever seen assigned).
    seen: HashMap<String, (u64, bool)>,
    /// The pods a list in progress reported so far.
    listing: Option<HashSet<String>>,
    starts: SessionStarts,
}

impl Fingerprints {
    fn new(starts: SessionStarts) -> Self {
        Self {
            seen: HashMap::new(),
            listing: None,
            starts,
        }
    }

    /// The pod to pass on as a trigger, if the event says something new about one.
    fn passes(&mut self, ev: watcher::Event<SandboxPod>) -> Option<SandboxPod> {
        let key = |p: &SandboxPod| p.uid().unwrap_or_else(|| p.name_any());
        match ev {
            watcher::Event::Init => {
                self.listing = Some(HashSet::new());
                None
            }
            watcher::Event::InitApply(p) | watcher::Event::Apply(p) => {
                let k = key(&p);
                if let Some(listing) = self.listing.as_mut() {
                    listing.insert(k.clone());
                }
                let fp = pod_fingerprint(&p);
                let assigned = p.is_assigned();
                let before = self.seen.get(&k).copied();
                let ever = before.map(|(_, ever)| ever);
                self.seen.insert(k, (fp, assigned || ever == Some(true)));
                let listing = self.listing.is_some();
                if demand::starts_session(ever, listing, assigned, p.is_deleting()) {
                    if let (Some(ns), Some(instance)) =
                        (p.namespace(), p.labels().get(label::INSTANCE))
                    {
                        self.starts.record(&ns, instance, Instant::now());
                    }
                }
                (before.map(|(fp, _)| fp) != Some(fp)).then_some(p)
            }
            watcher::Event::InitDone => {
                if let Some(listed) = self.listing.take() {
                    self.seen.retain(|k, _| listed.contains(k));
                }
                None
            }
            watcher::Event::Delete(p) => {
                self.seen.remove(&key(&p));
                Some(p)
            }
        }
    }
}

/// The API's status code of a watch error, when the API answered.
fn status_code(e: &watcher::Error) -> Option<u16> {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => Some(s.code),
        watcher::Error::WatchError(s) => Some(s.code),
        _ => None,
    }
}

/// A 404 from the API: the resource type does not exist (its CRD is not installed).
fn is_not_found(e: &watcher::Error) -> bool {
    status_code(e) == Some(404)
}

/// The watcher says `Init` before each attempt to list, and on a kind the cluster does not
/// serve the list then fails. Passed on, that `Init` would reset the backoff (any `Ok`
/// does) and count as an answer, so the watch would list again about every second, forever,
/// and flip between served and not. It is held back until the list answers, and dropped
/// when it fails.
fn hold_init<K, S>(events: S) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>>
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let mut held = false;
    events.flat_map(move |ev| {
        let out: Vec<_> = match ev {
            Ok(watcher::Event::Init) => {
                held = true;
                Vec::new()
            }
            Err(e) => {
                held = false;
                vec![Err(e)]
            }
            Ok(ev) => std::mem::take(&mut held)
                .then_some(Ok(watcher::Event::Init))
                .into_iter()
                .chain([Ok(ev)])
                .collect(),
        };
        futures::stream::iter(out)
    })
}

/// A kind only some clusters serve: Gateway API HTTPRoutes (where their CRDs are
/// installed), OpenShift Routes. The watch keeps retrying (with its own backoff, at most
/// every 30 s) instead of failing, so installing the CRDs later needs no operator restart;
/// while it gets 404 its errors are not passed on and `served` is false, which the
/// reconcile turns into a condition on instances that ask for that kind. `(found, absent)`
/// are the log lines for each state.
fn optional_kind<K>(
    client: &Client,
    ns: Option<&str>,
    served: tokio::sync::watch::Sender<Option<bool>>,
    (found, absent): (&'static str, &'static str),
) -> (
    Store<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Watched,
{
    let (reader, writer) = reflector::store();
    let mut last: Option<bool> = None;
    let stream = hold_init(watcher(api::<K>(client, ns), managed()))
        .default_backoff()
        .filter_map(move |ev| {
            let (now, out) = match ev {
                Err(e) if is_not_found(&e) => (false, None),
                Err(e) => return future::ready(Some(Err(e))),
                Ok(ev) => (true, Some(Ok(ev))),
            };
            if last != Some(now) {
                served.send_replace(Some(now));
                tracing::info!("{}", if now { found } else { absent });
                last = Some(now);
            }
            future::ready(out)
        })
        .reflect(writer)
        .touched_objects();
    (reader, stream)
}

/// The Controller's backoff on trigger errors pauses the merged stream of *all* watches
/// (so every store goes stale) whenever any one of them errs: after an apiserver restart each
/// of the watches errs (connection refused, then 410 Gone) and the shared backoff
/// climbed to 30 s pauses, stacked, for minutes. Every watch already backs off on its own
/// (`default_backoff`, like client-go's reflectors), so the merged stream needs none.
struct PerWatchBackoffOnly;

impl Iterator for PerWatchBackoffOnly {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        // `None` would end the trigger stream; zero passes the error on at once.
        Some(Duration::ZERO)
    }
}

impl Backoff for PerWatchBackoffOnly {
    fn reset(&mut self) {}
}

/// Whether instance `cr` uses the Secret `name` of its namespace that the operator did not
/// make: the admin's kubeconfig or TLS Secret, or the certificate OpenShift's service CA
/// issues for it (and renews, which must roll the server). The last is asked of every
/// instance without `tlsSecretName`: off OpenShift no such Secret exists.
fn uses_secret(cr: &CliMcpInstance, name: &str) -> bool {
    let named = |s: Option<&str>| s == Some(name);
    named(
        cr.proxy_plan()
            .ok()
            .and_then(|p| p.kubeconfig_secret)
            .as_deref(),
    ) || named(cr.spec.server.tls_secret_name.as_deref())
        || (cr.spec.server.tls_secret_name.is_none()
            && cr
                .instance_name()
                .is_ok_and(|n| secrets::service_tls_secret_name(&n) == name))
}

fn instance_ref(name: &str, ns: &str) -> ObjectRef<CliMcpInstance> {
    ObjectRef::new(name).within(ns)
}

/// Root predicate: spec (generation), finalizers and deletion — not status or annotations,
/// so our own status writes do not wake us.
fn root_fingerprint(o: &CliMcpInstance) -> Option<u64> {
    let mut h = DefaultHasher::new();
    o.metadata.generation.hash(&mut h);
    o.finalizers().hash(&mut h);
    o.metadata.deletion_timestamp.is_some().hash(&mut h);
    Some(h.finish())
}

/// The controller being built: every watch is added to it in turn.
type Ctl = Controller<CliMcpInstance>;

/// The bounds of a namespaced kind the operator watches.
trait Watched:
    Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
    + Clone
    + Debug
    + DeserializeOwned
    + Send
    + Sync
    + 'static
{
}
impl<K> Watched for K where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + Debug
        + DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// Builds the controller for one watch scope (`ns = None`: the whole cluster): the root
/// watch, then one call per watch, each adding its trigger and giving back its store.
pub fn build(client: &Client, ns: Option<&str>, scope: &Scope) -> (Ctl, Stores) {
    let (instances, root) = root_watch(client, ns);
    let c = Controller::for_stream(root, instances.clone());
    let (c, deployments) = own::<Deployment>(c, client, ns);
    let (c, services) = own::<Service>(c, client, ns);
    let (c, service_accounts) = own::<ServiceAccount>(c, client, ns);
    let (c, roles) = own::<Role>(c, client, ns);
    let (c, role_bindings) = own::<RoleBinding>(c, client, ns);
    let (c, network_policies) = own::<NetworkPolicy>(c, client, ns);
    let (c, pod_disruption_budgets) = own::<PodDisruptionBudget>(c, client, ns);
    let (c, config_maps) = own::<ConfigMap>(c, client, ns);
    let (c, secrets) = own::<Secret>(c, client, ns);
    let (c, ingresses) = own::<Ingress>(c, client, ns);
    let (c, http_routes, http_routes_served) = own_optional::<HttpRoute>(
        c,
        client,
        ns,
        (
            "watching Gateway API HTTPRoutes",
            "this cluster serves no gateway.networking.k8s.io/v1 HTTPRoute (the Gateway API CRDs are not installed); instances with spec.server.expose.httpRoute wait for them",
        ),
    );
    let (c, routes, routes_served) = own_optional::<Route>(
        c,
        client,
        ns,
        (
            "watching OpenShift Routes",
            "this cluster serves no route.openshift.io/v1 Route; instances with spec.server.expose.route wait for it",
        ),
    );
    let (c, cluster_role_bindings) = watch_cluster_role_bindings(c, client, scope);
    let session_starts = SessionStarts::default();
    let (c, pods) = watch_sandbox_pods(c, client, ns, session_starts.clone());
    let c = watch_admin_secrets(c, client, ns, &instances);
    let c = watch_admin_config_maps(c, client, ns, &instances);
    let (c, runtime_classes, runtime_classes_listed) =
        runtime_classes::watch_runtime_classes(c, client, &instances);
    let controller = c
        .trigger_backoff(PerWatchBackoffOnly)
        .with_config(controller::Config::default().debounce(Duration::from_millis(100)));
    let stores = Stores {
        instances,
        pods,
        session_starts,
        secrets,
        config_maps,
        deployments,
        services,
        service_accounts,
        roles,
        role_bindings,
        network_policies,
        pod_disruption_budgets,
        cluster_role_bindings,
        ingresses,
        http_routes,
        http_routes_served,
        routes,
        routes_served,
        runtime_classes,
        runtime_classes_listed,
        synced: Arc::default(),
    };
    (controller, stores)
}

/// The instances: reflected, and passed on only when the root predicate changes.
fn root_watch(
    client: &Client,
    ns: Option<&str>,
) -> (
    Store<CliMcpInstance>,
    impl Stream<Item = Result<CliMcpInstance, watcher::Error>> + Send + 'static,
) {
    let (reader, writer) = reflector::store();
    let root = watcher(
        api::<CliMcpInstance>(client, ns),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(writer)
    .applied_objects()
    .predicate_filter(root_fingerprint, Default::default());
    (reader, root)
}

/// A kind the operator owns: its managed objects reflected, each change waking its owner.
fn own<K: Watched>(c: Ctl, client: &Client, ns: Option<&str>) -> (Ctl, Store<K>) {
    let (store, stream) = reflect(api::<K>(client, ns), managed());
    (c.owns_stream(stream), store)
}

/// A kind the cluster may not serve (see [`optional_kind`]): its store and whether it is
/// served.
fn own_optional<K: Watched>(
    c: Ctl,
    client: &Client,
    ns: Option<&str>,
    logs: (&'static str, &'static str),
) -> (Ctl, Store<K>, tokio::sync::watch::Receiver<Option<bool>>) {
    let (served_tx, served) = tokio::sync::watch::channel(None);
    let (store, stream) = optional_kind::<K>(client, ns, served_tx, logs);
    (c.owns_stream(stream), store, served)
}

/// The cluster-scoped bindings carry no owner reference: mapped back to their instance by
/// the labels `instance` and `instance-namespace`.
fn watch_cluster_role_bindings(
    c: Ctl,
    client: &Client,
    scope: &Scope,
) -> (Ctl, Store<ClusterRoleBinding>) {
    let (store, stream) = reflect(Api::<ClusterRoleBinding>::all(client.clone()), managed());
    let scope = scope.clone();
    let c = c.watches_stream(stream, move |crb: ClusterRoleBinding| {
        let l = crb.labels();
        match (l.get(label::INSTANCE), l.get(INSTANCE_NAMESPACE_LABEL)) {
            (Some(n), Some(ns)) if scope.contains(ns) => Some(instance_ref(n, ns)),
            _ => None,
        }
    });
    (c, store)
}

/// Sandbox pods wake the instance named by their label (see [`sandbox_pods`]).
fn watch_sandbox_pods(
    c: Ctl,
    client: &Client,
    ns: Option<&str>,
    starts: SessionStarts,
) -> (Ctl, Store<SandboxPod>) {
    let (store, stream) = sandbox_pods(client, ns, starts);
    let c = c.watches_stream(stream, |p: SandboxPod| {
        let ns = p.namespace()?;
        p.labels()
            .get(label::INSTANCE)
            .map(|n| instance_ref(n, &ns))
    });
    (c, store)
}

/// Admin Secrets (kubeconfig, custom TLS) and the certificates OpenShift's service CA
/// issues (renewed by it) are not labelled by us: watch only their metadata and map them
/// to the instances that name them or would get them.
fn watch_admin_secrets(
    c: Ctl,
    client: &Client,
    ns: Option<&str>,
    instances: &Store<CliMcpInstance>,
) -> Ctl {
    watch_named_by::<Secret>(c, client, ns, instances, uses_secret)
}

/// Likewise the ConfigMaps holding allow-list targets' CAs.
fn watch_admin_config_maps(
    c: Ctl,
    client: &Client,
    ns: Option<&str>,
    instances: &Store<CliMcpInstance>,
) -> Ctl {
    watch_named_by::<ConfigMap>(c, client, ns, instances, uses_ca_config_map)
}

fn uses_ca_config_map(cr: &CliMcpInstance, name: &str) -> bool {
    cr.spec.proxy.as_ref().is_some_and(|p| {
        p.targets
            .iter()
            .any(|t| t.ca_config_map.as_deref() == Some(name))
    })
}

/// Watches the metadata of every `K` and wakes the instances of its namespace that
/// `names(instance, object name)` says use it.
fn watch_named_by<K>(
    c: Ctl,
    client: &Client,
    ns: Option<&str>,
    instances: &Store<CliMcpInstance>,
    names: fn(&CliMcpInstance, &str) -> bool,
) -> Ctl
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    K: Clone + std::fmt::Debug + serde::de::DeserializeOwned,
    K: Send + Sync + 'static,
{
    let objects = watcher(
        api::<PartialObjectMeta<K>>(client, ns),
        watcher::Config::default(),
    )
    .default_backoff()
    .touched_objects();
    let refs = instances.clone();
    c.watches_stream(objects, move |o: PartialObjectMeta<K>| {
        let ns = o.namespace().unwrap_or_default();
        let name = o.name_any();
        refs.state()
            .into_iter()
            .filter(|cr| cr.namespace().as_deref() == Some(ns.as_str()))
            .filter(|cr| names(cr, &name))
            .map(|cr| ObjectRef::from_obj(cr.as_ref()))
            .collect::<Vec<_>>()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cr(spec: serde_json::Value) -> CliMcpInstance {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "cli-mcp.redhat.com/v1alpha1", "kind": "CliMcpInstance",
            "metadata": {"name": "demo", "namespace": "ns1", "uid": "u1"}, "spec": spec
        }))
        .expect("instance")
    }

    #[test]
    fn a_renewed_service_ca_certificate_wakes_its_instance() {
        let plain = cr(serde_json::json!({}));
        assert!(uses_secret(&plain, "cli-mcp-demo-service-tls"));
        assert!(uses_secret(&plain, "cli-mcp-demo-kubeconfig"));
        assert!(!uses_secret(&plain, "cli-mcp-other-service-tls"));
        assert!(!uses_secret(&plain, "unrelated"));
        // The admin's certificate is the one it uses then.
        let own = cr(serde_json::json!({"server": {"tlsSecretName": "mine"}}));
        assert!(uses_secret(&own, "mine"));
        assert!(!uses_secret(&own, "cli-mcp-demo-service-tls"));
    }

    #[test]
    fn an_instance_uses_the_ca_config_maps_its_allowlist_targets_name() {
        let proxied = cr(serde_json::json!({"proxy": {"targets": [
            {"type": "allowlist", "hosts": ["api.example.com"], "caConfigMap": "corp-ca"}]}}));
        assert!(uses_ca_config_map(&proxied, "corp-ca"));
        assert!(!uses_ca_config_map(&proxied, "other"));
        assert!(!uses_ca_config_map(&cr(serde_json::json!({})), "corp-ca"));
    }

    fn not_found() -> watcher::Error {
        watcher::Error::InitialListFailed(kube::Error::Api(Box::new(
            serde_json::from_value(serde_json::json!({"code": 404, "reason": "NotFound"}))
                .expect("status"),
        )))
    }

    #[tokio::test]
    async fn a_failed_list_of_a_kind_not_served_gives_the_backoff_no_ok() {
        use watcher::Event;
        let events = futures::stream::iter(vec![
            Ok(Event::<SandboxPod>::Init),
            Err(not_found()),
            Ok(Event::Init),
            Err(not_found()),
            Ok(Event::Init),
            Ok(Event::InitApply(pod())),
            Ok(Event::InitDone),
            Ok(Event::Apply(pod())),
        ]);
        let out: Vec<&str> = hold_init(events)
            .map(|e| match e {
                Err(e) if is_not_found(&e) => "404",
                Err(_) => "error",
                Ok(Event::Init) => "init",
                Ok(Event::InitApply(_)) => "init-apply",
                Ok(Event::InitDone) => "init-done",
                Ok(Event::Apply(_)) => "apply",
                Ok(Event::Delete(_)) => "delete",
            })
            .collect()
            .await;
        // Consecutive errors (so the backoff grows), then the list as it was.
        assert_eq!(
            out,
            ["404", "404", "init", "init-apply", "init-done", "apply"]
        );
    }

    fn pod() -> SandboxPod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "resourceVersion": "1",
                "labels": {"cli-mcp.redhat.com/instance": "demo"},
                "annotations": {"cli-mcp.redhat.com/last-activity": "2026-01-01T00:00:00Z"}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .expect("pod")
    }

    fn named(name: &str) -> SandboxPod {
        let mut p = pod();
        p.meta_mut().name = Some(name.into());
        p.meta_mut().uid = Some(format!("uid-{name}"));
        p
    }

    #[test]
    fn only_changed_pods_pass_and_a_relist_forgets_pods_deleted_in_the_gap() {
        use watcher::Event;
        let mut f = Fingerprints::new(SessionStarts::default());
        assert!(f.passes(Event::Init).is_none());
        for name in ["a", "b", "c"] {
            assert!(
                f.passes(Event::InitApply(named(name))).is_some(),
                "{name} is new"
            );
        }
        assert!(f.passes(Event::InitDone).is_none());
        assert!(f.passes(Event::Apply(named("a"))).is_none(), "unchanged");
        // The watch breaks; b and c are deleted meanwhile, no Delete comes; d is new.
        assert!(f.passes(Event::Init).is_none());
        assert!(
            f.passes(Event::InitApply(named("a"))).is_none(),
            "unchanged"
        );
        assert!(f.passes(Event::InitApply(named("d"))).is_some());
        assert!(f.passes(Event::InitDone).is_none());
        let mut left: Vec<&str> = f.seen.keys().map(String::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["uid-a", "uid-d"]);
        assert!(f.passes(Event::Delete(named("a"))).is_some());
        assert_eq!(f.seen.len(), 1);
    }

    /// `name` as the watch reads it, assigned to a session or not.
    fn watched(name: &str, session: Option<&str>) -> SandboxPod {
        let mut labels = serde_json::json!({"cli-mcp.redhat.com/instance": "demo"});
        if let Some(s) = session {
            labels[label::SESSION_ID] = s.into();
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                         "labels": labels},
        }))
        .expect("pod")
    }

    #[test]
    fn the_watch_records_claims_and_cold_starts_once_and_not_what_it_lists() {
        use watcher::Event;
        let starts = SessionStarts::default();
        starts.follow("ns", "demo");
        let mut f = Fingerprints::new(starts.clone());
        let count = || starts.ages("ns", "demo", std::time::Instant::now()).len();
        // What the first list finds may have started any time: not counted.
        f.passes(Event::Init);
        f.passes(Event::InitApply(watched("old", Some("s0"))));
        f.passes(Event::InitApply(watched("warm", None)));
        f.passes(Event::InitDone);
        assert_eq!(count(), 0);
        // A warm pod claimed, then changed again; a cold start; a new pool pod.
        f.passes(Event::Apply(watched("warm", Some("s1"))));
        f.passes(Event::Apply(watched("warm", Some("s1"))));
        f.passes(Event::Apply(watched("cold", Some("s2"))));
        f.passes(Event::Apply(watched("refill", None)));
        assert_eq!(count(), 2);
        // A relist after a gap in which the refill pod was claimed: not counted (every
        // claim of the gap would look like one burst at the relist).
        f.passes(Event::Init);
        f.passes(Event::InitApply(watched("refill", Some("s3"))));
        f.passes(Event::InitApply(watched("unknown", Some("s4"))));
        f.passes(Event::InitDone);
        assert_eq!(count(), 2);
        // A label taken off and put back (by anyone who may patch pods) counts once.
        f.passes(Event::Apply(watched("again", None)));
        f.passes(Event::Apply(watched("again", Some("s5"))));
        f.passes(Event::Apply(watched("again", None)));
        f.passes(Event::Apply(watched("again", Some("s6"))));
        assert_eq!(count(), 3);
    }

    #[test]
    fn last_activity_patches_do_not_change_the_fingerprint() {
        let a = pod();
        let mut b = pod();
        b.meta_mut().resource_version = Some("2".into());
        b.annotations_mut().insert(
            annotation::LAST_ACTIVITY.into(),
            "2026-01-01T00:05:00Z".into(),
        );
        assert_eq!(pod_fingerprint(&a), pod_fingerprint(&b));
        let mut claimed = pod();
        claimed
            .labels_mut()
            .insert(label::SESSION_ID.into(), "s1".into());
        assert_ne!(pod_fingerprint(&a), pod_fingerprint(&claimed));
        let mut deleting = pod();
        deleting.meta_mut().deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ));
        assert_ne!(pod_fingerprint(&a), pod_fingerprint(&deleting));
    }
}
