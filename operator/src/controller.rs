//! The one reconcile entry: [`reconcile`] runs the finalizer helper, which calls
//! [`apply_instance`] for live instances and [`crate::teardown::cleanup`] for deleted ones.
//!
//! [`apply_instance`] is one call per step; each step's comment says whether it talks to
//! the API server (client) or only reads the caches and computes (no client):
//! 1. read the CR once ([`Spec::read`]); an unusable spec only gets an `InvalidSpec` status;
//! 2. remove a Go-era predecessor's leftovers, once per instance ([`migrate::go_leftovers`]);
//! 3. resolve what the children need from the cluster ([`resolve::resolve`]: the
//!    generate-once Secrets, the admin's Secrets, the API server's addresses, whether the
//!    cluster serves the expose kind, the sandbox briefing, the RuntimeClasses it lacks);
//! 4. build the whole desired set from the complete [`Inputs`] ([`children::build_all`],
//!    pure; nothing changes it afterwards);
//! 5. apply it ([`apply::apply_all`], server-side apply);
//! 6. pass a rotated kubeconfig on to the proxy pods ([`rotation::nudge_proxy_pods`]);
//! 7. delete the expose kinds no longer desired ([`sweep::expose_orphans`], by label);
//! 8. fail closed: no sandbox starts while the credential proxy is not serving;
//! 9. the sandboxes: the warm pool's size ([`pool::size`]), the pool ([`pool::reconcile`])
//!    and idle GC ([`idle::collect`]);
//! 10. whether NetworkPolicy and Pod Security are in force ([`crate::isolation`]);
//! 11. what the status is computed from ([`Observed`]), built once;
//! 12. the status ([`status::compute`]), written only when it changed;
//! 13. requeue at the soonest deadline (idle expiry, pool backoff, renewal, the briefing's
//!     next review) or the resync period.
//!
//! A reconcile that fails is retried after a backoff of its own instance ([`error_policy`],
//! [`crate::retry`]), which a successful reconcile resets.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{finalizer, Event as FinalizerEvent};
use kube::{Api, Resource, ResourceExt};

use cli_mcp_api::crd::{CliMcpInstance, CliMcpInstanceStatus, CrdError};
use cli_mcp_api::names::{label, FIELD_MANAGER, FINALIZER};

use crate::children::{self, Inputs, Spec};
use crate::context::{cached, Context};
use crate::error::{Error, Result};
use crate::idle::IdlePlan;
use crate::isolation::{Findings, ProbeTarget};
use crate::pool::{self, PoolOutcome};
use crate::resolve::{self, Resolved};
use crate::status::{self, DeploymentState, Observed};
use crate::{apply, idle, migrate, retry, rotation, runtime_class, sweep, teardown};

/// Re-check period while something the admin must create is missing, a Secret or a
/// RuntimeClass (their watches usually wake us first).
const MISSING_SECRET_RECHECK: Duration = Duration::from_secs(60);
/// Re-check period while a teardown waits (pods terminating): progress, not a failure, so
/// no backoff; pod and Deployment events usually wake it first.
const WAITING_RECHECK: Duration = Duration::from_secs(2);

pub async fn reconcile(cr: Arc<CliMcpInstance>, ctx: Arc<Context>) -> Result<Action> {
    // Not on empty caches: see `Stores::synced`. At once after the first sync.
    ctx.stores.synced().await;
    let start = Instant::now();
    let ns = cr
        .namespace()
        .ok_or_else(|| Error::NoNamespace(cr.name_any()))?;
    let api: Api<CliMcpInstance> = Api::namespaced(ctx.client.clone(), &ns);
    let result = finalizer(&api, FINALIZER, cr, |event| async {
        match event {
            FinalizerEvent::Apply(cr) => apply_instance(cr, &ctx).await,
            FinalizerEvent::Cleanup(cr) => teardown::cleanup(cr, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)));
    let label = match &result {
        // A teardown that finished forgets the instance's count; a live instance's is reset
        // or grown where its apply outcome is known (`apply_instance`).
        Ok(_) => "ok",
        Err(e) => e.metric_label(),
    };
    ctx.metrics.reconciled(label, start.elapsed());
    result
}

pub fn error_policy(cr: Arc<CliMcpInstance>, err: &Error, ctx: Arc<Context>) -> Action {
    Action::requeue(retry_after(&cr, err, &ctx))
}

/// How long `cr` waits after `err`: teardown progress a short fixed time, a failure the
/// instance's own backoff ([`crate::retry`]).
fn retry_after(cr: &CliMcpInstance, err: &Error, ctx: &Context) -> Duration {
    if err.is_waiting() {
        tracing::debug!(instance = %cr.name_any(), "{err}");
        return WAITING_RECHECK;
    }
    failed_again(ctx, cr, "reconcile failed", err)
}

/// The next check of a reconcile whose writes were `refused` (the first refusal) or all went
/// through, given the other deadlines (`next`). A refused apply (a webhook or a quota
/// refusing every write) is recorded in the status rather than returned, and backs off like
/// a failed reconcile: all of the instance's writes were resent every 10 s while it lasted.
/// Only a reconcile whose writes all went through resets the count.
fn after_apply(
    ctx: &Context,
    cr: &CliMcpInstance,
    refused: Option<&str>,
    next: Duration,
) -> Duration {
    match refused {
        Some(error) => next.min(failed_again(ctx, cr, "writes refused", &error)),
        None => {
            ctx.retries.reset(&cr.uid().unwrap_or_default());
            next
        }
    }
}

/// Counts one more failure of `cr` (`what` failed with `error`), logs it, and returns the
/// instance's backoff.
fn failed_again(
    ctx: &Context,
    cr: &CliMcpInstance,
    what: &str,
    error: &dyn std::fmt::Display,
) -> Duration {
    let failures = ctx.retries.fail(&cr.uid().unwrap_or_default());
    let delay = retry::jittered(retry::delay(failures), rand::random::<f64>());
    tracing::warn!(
        namespace = %cr.namespace().unwrap_or_default(),
        instance = %cr.name_any(),
        error = %error,
        failures,
        "{what}; retrying in {:.1}s",
        delay.as_secs_f64()
    );
    delay
}

/// Reconciles a live instance, one call per step (see the module docs).
pub async fn apply_instance(cr: Arc<CliMcpInstance>, ctx: &Context) -> Result<Action> {
    // 1. Read the CR once (no client).
    let ns = cr
        .namespace()
        .ok_or_else(|| Error::NoNamespace(cr.name_any()))?;
    let spec = match read_spec(ctx, &cr) {
        Ok(spec) => spec,
        Err(e) => return invalid_spec(ctx, &cr, e).await,
    };
    // 2. Before anything is applied: a Go-era server Deployment must go, not be merged
    //    into (client, once per instance).
    migrate::go_leftovers(ctx, &cr, &spec.name, &ns).await?;
    // 3. What the children need from the cluster (client).
    let resolved = resolve::resolve(ctx, &cr, &spec).await?;
    let inputs = resolved.inputs(spec);
    // 4. The whole desired set (no client).
    let desired = children::build_all(&inputs);
    // 5. Apply it; a refused write is recorded for the status, not returned (client).
    let apply_error = apply::apply_all(ctx, &ns, &desired).await;
    // 6. Pass a rotated kubeconfig on to the running proxy pods (client).
    rotation::nudge_proxy_pods(ctx, &inputs).await;
    // 7. Delete the Ingress, HTTPRoute or Route no longer desired (client).
    sweep::expose_orphans(ctx, &inputs).await;
    // 8. Fail closed: whether sandboxes may start (no client).
    let proxy_unavailable = proxy_gate(ctx, &inputs);
    // 9. The warm pool and the idle GC (client).
    let sandboxes = sandboxes(ctx, &cr, &inputs, &resolved, proxy_unavailable.clone()).await;
    // 10. Whether NetworkPolicy and Pod Security are in force (client, results cached).
    let isolation = probe_isolation(ctx, &inputs.spec, proxy_unavailable.is_none()).await;
    // 11. What the status is computed from, built once (no client).
    let found = Found {
        apply_error,
        proxy_unavailable,
        pool: sandboxes.pool,
        active_sessions: sandboxes.idle.active,
        isolation,
    };
    let obs = observe(&cr, ctx, &inputs, &resolved, found);
    // 12. The status, written only when it changed (client).
    write_status(ctx, &cr, &obs).await?;
    // A failed call of the pool or the idle GC is returned once the status says so.
    if let Some(e) = sandboxes.error {
        return Err(e);
    }
    // 13. When to look again (no client): the certificate's renewal and the briefing's
    //     next review are deadlines too.
    let due = [resolved.tls_renew_in, resolved.briefing_due_in]
        .into_iter()
        .flatten()
        .min();
    let next = requeue(ctx, &cr, &obs, &sandboxes.idle, due);
    Ok(Action::requeue(next))
}

/// The spec as the builders read it, with what the platform decides (no client).
fn read_spec(ctx: &Context, cr: &CliMcpInstance) -> std::result::Result<Spec, CrdError> {
    let cfg = &ctx.config;
    let mut spec = Spec::read(
        cr,
        &cfg.server_image,
        cfg.sandbox_image.as_deref(),
        cfg.proxy_image.as_deref(),
    )?;
    spec.not_the_operators(cfg.own_account.as_ref())?;
    // One place for both the pool's pods and the server's (it gets this config as a flag).
    spec.sandbox.platform_assigns_uid = cfg.platform.assigns_uid();
    if cfg.platform.has_service_ca() {
        spec.use_service_ca();
    }
    Ok(spec)
}

/// What the pool and the idle GC did, and the first failed API call of either.
struct Sandboxes {
    pool: PoolOutcome,
    idle: IdlePlan,
    error: Option<Error>,
}

/// The warm pool, then the idle GC. A failed API call in one does not skip the other, nor
/// the status: its error is returned after the status says so.
async fn sandboxes(
    ctx: &Context,
    cr: &CliMcpInstance,
    inputs: &Inputs,
    resolved: &Resolved,
    proxy_unavailable: Option<String>,
) -> Sandboxes {
    let spec = &inputs.spec;
    let key = resolved.key.as_ref();
    // The instance's pods, read from the cache once for the pool's size and the idle GC.
    let pods = pool::instance_pods(&ctx.stores.pods.state(), &spec.namespace, &spec.name);
    let size = pool::size(ctx, cr, spec, &pods).await;
    let (mut pool, pool_error) = pool::reconcile(
        ctx,
        &spec.owner.uid,
        &spec.sandbox,
        size.desired,
        key,
        resolved.blocked().or(proxy_unavailable),
    )
    .await;
    pool.sized_by_demand(&size);
    let (idle, idle_error) =
        idle::collect(ctx, &pods, &spec.namespace, spec.idle_timeout, key).await;
    Sandboxes {
        pool,
        idle,
        error: pool_error.or(idle_error),
    }
}

/// Whether NetworkPolicy and Pod Security are in force where the instance runs: each
/// finding cached while fresh, else probed anew.
async fn probe_isolation(ctx: &Context, spec: &Spec, proxy_ready: bool) -> Findings {
    ctx.isolation
        .observe(ProbeTarget {
            uid: &spec.owner.uid,
            proxy_ready,
            proxy_selector: format!(
                "{}={},{}={}",
                label::INSTANCE,
                spec.name,
                label::COMPONENT,
                label::COMPONENT_PROXY
            ),
            sandbox: &spec.sandbox,
            pods: Api::namespaced(ctx.client.clone(), &spec.namespace),
        })
        .await
}

/// When to look again: the soonest deadline, a refused apply's backoff, or `due` (the
/// serving certificate's renewal, the briefing's next review).
fn requeue(
    ctx: &Context,
    cr: &CliMcpInstance,
    obs: &Observed,
    idle: &IdlePlan,
    due: Option<Duration>,
) -> Duration {
    // Something due: back when it is, a little late so it has passed.
    let renew = due.map(|d| d + Duration::from_millis(500));
    let next = after_apply(
        ctx,
        cr,
        obs.apply_error.as_deref(),
        next_check(ctx, obs, idle),
    );
    renew.map_or(next, |r| next.min(r))
}

/// Fail closed: why no sandbox may start now — the credential proxy's inputs are not
/// usable, its Deployment has no ready replica, or a NetworkPolicy that confines the
/// sandboxes or the proxy is missing. `None` when all hold.
fn proxy_gate(ctx: &Context, inputs: &Inputs) -> Option<String> {
    let spec = &inputs.spec;
    if inputs.proxy.is_none() {
        return Some(
            "the credential proxy's inputs are not usable (see the Ready condition)".into(),
        );
    }
    let ns = &spec.namespace;
    let name = spec.name.proxy();
    for np in [name.clone(), spec.name.sandbox()] {
        if cached(&ctx.stores.network_policies, ns, &np).is_none() {
            return Some(format!(
                "NetworkPolicy {np} does not exist yet; no sandbox starts without it"
            ));
        }
    }
    match cached(&ctx.stores.deployments, ns, &name).map(|d| deployment_state(&d)) {
        Some(d) if d.ready >= 1 => None,
        Some(d) => Some(format!(
            "credential proxy Deployment {name} has {}; sandboxes wait for it",
            d.replicas_summary()
        )),
        None => Some(format!(
            "credential proxy Deployment {name} not observed yet; sandboxes wait for it"
        )),
    }
}

/// Re-check period while an asked-for HTTPRoute cannot be stored (the watch notices the
/// Gateway API CRDs being installed, but has no object of this instance to wake it with).
const EXPOSE_RECHECK: Duration = Duration::from_secs(30);

/// The public host of the endpoint or, for a Route a router refused, why. A Route's host
/// is the one a router admitted (assigned by the router when the spec gives none), else
/// the spec's; the other kinds publish the spec's host.
fn published(ctx: &Context, spec: &Spec) -> (Option<String>, Option<String>) {
    let given = spec.expose_host().map(str::to_owned);
    if spec
        .expose
        .as_ref()
        .and_then(|e| e.route.as_ref())
        .is_none()
    {
        return (given, None);
    }
    let observed = cached(&ctx.stores.routes, &spec.namespace, &spec.name.server());
    let (admitted, refused) = observed
        .map(|r| children::expose::route_admission(&r))
        .unwrap_or_default();
    match refused {
        Some(why) => (None, Some(why)),
        None => (admitted.or(given), None),
    }
}

/// Only objects that bypassed admission (or a missing default image) land here.
async fn invalid_spec(ctx: &Context, cr: &CliMcpInstance, e: CrdError) -> Result<Action> {
    let obs = Observed {
        generation: cr.meta().generation,
        spec_error: Some(e.to_string()),
        ..Default::default()
    };
    write_status(ctx, cr, &obs).await?;
    Ok(Action::requeue(ctx.config.resync))
}

/// What the steps after the build found, for the status.
struct Found {
    apply_error: Option<String>,
    /// Why no sandbox may start (the credential proxy is not serving).
    proxy_unavailable: Option<String>,
    pool: PoolOutcome,
    active_sessions: i32,
    isolation: Findings,
}

/// What the status is computed from, after the children, the pool and the idle GC ran;
/// the rest is read from the caches.
fn observe(
    cr: &CliMcpInstance,
    ctx: &Context,
    inputs: &Inputs,
    resolved: &Resolved,
    found: Found,
) -> Observed {
    let spec = &inputs.spec;
    let (host, expose_problem) = match &inputs.expose_unavailable {
        Some(p) => (None, Some(p.clone())),
        None => published(ctx, spec),
    };
    let sandbox = runtime_class::sandbox_status(
        &found.pool.carried,
        spec.sandbox.placement.runtime_class_name.as_deref(),
        |class| ctx.stores.runtime_handler(class),
    );
    Observed {
        generation: cr.meta().generation,
        spec_error: None,
        missing_secrets: resolved.missing.clone(),
        invalid_secrets: resolved.invalid.clone(),
        kubeconfig_invalid: resolved.kubeconfig_invalid.clone(),
        proxy_ca_invalid: resolved.proxy_ca_invalid.clone(),
        // Ready names KubeconfigInvalid first when both hold: that one says what to fix.
        proxy_unavailable: found.proxy_unavailable,
        apply_error: found.apply_error,
        deployment: cached(
            &ctx.stores.deployments,
            &spec.namespace,
            &spec.name.server(),
        )
        .map(|d| deployment_state(&d)),
        pool: found.pool,
        active_sessions: found.active_sessions,
        image: Some(spec.sandbox.image.clone()),
        endpoint: Some(spec.endpoint()),
        ca_config_map: inputs.ca_config_map_name(),
        selector: Some(spec.name.server_selector()),
        api_server_problem: inputs.api_server.problem.clone(),
        external_endpoint: host.map(|h| format!("https://{h}/mcp")),
        expose_problem,
        serving_cert_pending: resolved.serving_cert_pending.clone(),
        runtime_class_missing: runtime_class::message(&resolved.runtime_classes_missing),
        sandbox: Some(sandbox),
        isolation: found.isolation,
    }
}

/// The soonest deadline: the pool's backoff or pending writes, the next idle expiry, a
/// missing Secret, a failed apply — else the resync period.
fn next_check(ctx: &Context, obs: &Observed, idle: &IdlePlan) -> Duration {
    let mut next = ctx.config.resync;
    let mut consider = |d: Option<Duration>| {
        if let Some(d) = d {
            next = next.min(d);
        }
    };
    consider(obs.pool.requeue);
    // A little slack so the expiry has passed when we look again.
    consider(idle.next_expiry.map(|d| d + Duration::from_millis(500)));
    if !obs.missing_secrets.is_empty()
        || !obs.invalid_secrets.is_empty()
        || obs.serving_cert_pending.is_some()
        || obs.proxy_ca_invalid.is_some()
        || obs.runtime_class_missing.is_some()
    {
        consider(Some(MISSING_SECRET_RECHECK));
    }
    if obs.expose_problem.is_some() {
        consider(Some(EXPOSE_RECHECK));
    }
    if obs.api_server_problem.is_some() {
        consider(Some(resolve::API_PEERS_RETRY));
    }
    // A proxy pod just became ready: probe it once an enforcer has had time to program it.
    if matches!(&obs.isolation.network_policy,
        crate::isolation::Finding::Unknown { reason, .. } if *reason == crate::isolation::SETTLING)
    {
        consider(Some(crate::isolation::SETTLE));
    }
    next
}

fn deployment_state(d: &Deployment) -> DeploymentState {
    let st = d.status.clone().unwrap_or_default();
    let current = st.observed_generation.unwrap_or(0) >= d.metadata.generation.unwrap_or(0);
    let conds = st.conditions.unwrap_or_default();
    let available = conds
        .iter()
        .any(|c| c.type_.as_deref() == Some("Available") && c.status.as_deref() == Some("True"));
    let message = conds
        .iter()
        .find(|c| c.status.as_deref() == Some("False"))
        .and_then(|c| c.message.clone())
        .unwrap_or_default();
    DeploymentState {
        replicas: st.replicas.unwrap_or(0),
        ready: st.ready_replicas.unwrap_or(0),
        available: current && available && st.ready_replicas.unwrap_or(0) >= 1,
        message,
    }
}

fn sorted(s: &CliMcpInstanceStatus) -> CliMcpInstanceStatus {
    let mut s = s.clone();
    s.conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
    s
}

fn now_time() -> Time {
    let now = k8s_openapi::jiff::Timestamp::now();
    Time(now.round(k8s_openapi::jiff::Unit::Second).unwrap_or(now))
}

/// Writes the status computed from `obs` (only when it changed) and publishes an Event for
/// every condition that changed.
async fn write_status(ctx: &Context, cr: &CliMcpInstance, obs: &Observed) -> Result<()> {
    let prev = cr.status.as_ref();
    let next = status::compute(prev, obs, now_time());
    if prev.map(sorted) == Some(sorted(&next)) {
        return Ok(());
    }
    let ns = cr.namespace().unwrap_or_default();
    let api: Api<CliMcpInstance> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = serde_json::json!({
        "apiVersion": CliMcpInstance::api_version(&()),
        "kind": CliMcpInstance::kind(&()),
        "status": next,
    });
    api.patch_status(
        &cr.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(|source| Error::Status {
        name: format!("{ns}/{}", cr.name_any()),
        source,
    })?;
    ctx.metrics.api_write("CliMcpInstance", "apply-status");
    for t in status::transitions(prev, &next) {
        let type_ = if t.healthy {
            EventType::Normal
        } else {
            EventType::Warning
        };
        ctx.publish(
            cr,
            type_,
            &t.reason,
            format!("{} is {}: {}", t.type_, t.status, t.message),
        )
        .await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::children::test_support::cr;
    use crate::context::Stores;
    use crate::metrics::Metrics;
    use crate::OperatorConfig;

    fn instance(name: &str, uid: &str) -> CliMcpInstance {
        let mut c = cr(serde_json::json!({}));
        c.metadata.name = Some(name.into());
        c.metadata.uid = Some(uid.into());
        c
    }

    /// A context on empty caches; nothing here talks to an API server.
    fn context() -> Context {
        let stores = Stores::detached();
        // Never connected to: the port is closed and the retry path makes no request.
        let url = "http://127.0.0.1:9".parse().expect("url");
        let client = kube::Client::try_from(kube::Config::new(url)).expect("client");
        Context::new(
            client,
            Arc::new(OperatorConfig::new("cli-mcp-server:dev", None)),
            Arc::new(Metrics::new()),
            stores,
        )
    }

    fn within(d: Duration, full_secs: u64) -> bool {
        let full = Duration::from_secs(full_secs);
        d <= full && d >= full.mul_f64(1.0 - retry::JITTER)
    }

    #[tokio::test]
    async fn failures_back_off_per_instance_and_waiting_does_not() {
        let a = instance("a", "uid-a");
        let b = instance("b", "uid-b");
        let ctx = context();
        let failed = Error::NoNamespace("x".into());
        let waiting = Error::Waiting("pods".into());

        for secs in [5, 10, 20] {
            let d = retry_after(&a, &failed, &ctx);
            assert!(within(d, secs), "{d:?} after a {secs}s step");
        }
        assert_eq!(retry_after(&a, &waiting, &ctx), WAITING_RECHECK);
        let d = retry_after(&a, &failed, &ctx);
        assert!(within(d, 40), "waiting is not a failure: {d:?}");
        let d = retry_after(&b, &failed, &ctx);
        assert!(within(d, 5), "another instance has its own backoff: {d:?}");
        ctx.retries.reset("uid-a");
        let d = retry_after(&a, &failed, &ctx);
        assert!(within(d, 5), "a success starts over: {d:?}");
    }

    /// Refused writes are reported in the status, not returned as an error, and back off all
    /// the same; a reconcile whose writes went through starts over; and a refused apply never
    /// pushes the check past a sooner deadline.
    #[tokio::test]
    async fn refused_applies_back_off_and_a_clean_apply_resets() {
        let a = instance("a", "uid-a");
        let ctx = context();
        let resync = Duration::from_secs(300);
        for secs in [5, 10, 20] {
            let d = after_apply(&ctx, &a, Some("refused"), resync);
            assert!(within(d, secs), "{d:?} after a {secs}s step");
        }
        assert_eq!(after_apply(&ctx, &a, None, resync), resync);
        let d = after_apply(&ctx, &a, Some("refused"), resync);
        assert!(within(d, 5), "a clean apply starts over: {d:?}");
        let soon = Duration::from_secs(1);
        assert_eq!(after_apply(&ctx, &a, Some("refused"), soon), soon);
        let failed = Error::NoNamespace("x".into());
        let d = retry_after(&a, &failed, &ctx);
        assert!(within(d, 20), "one count for both kinds of failure: {d:?}");
    }
}
