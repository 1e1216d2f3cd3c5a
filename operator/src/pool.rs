//! The warm pool: keep `warmPoolSize` unassigned, Ready, current sandboxes.
//!
//! [`plan`] is pure: from the pods in the cache, the pending writes ("expectations") and the
//! current config it decides what to create and what to delete. [`reconcile`] carries the
//! plan out:
//! - creates are recorded as expectations before they are sent, so a burst of reconciles
//!   or a cache that has not seen the new pods yet never creates twice;
//! - every delete re-reads the pod from the API, skips it if a session claimed it (the
//!   `session-id` label appeared) and deletes with UID + resourceVersion preconditions, so a
//!   claim that lands in between wins (409) and the pod is kept;
//! - pods stuck in image-pull or crash loops are kept (the kubelet retries them with its own
//!   backoff) and fill their slots, so a bad image never turns into a create/delete storm;
//!   dead pods (Failed) are deleted and the next create waits an exponential backoff;
//! - every pod created is sealed right after its create (`cli_mcp_api::seal`). A pod without
//!   a valid seal is not warm: anyone who may create pods can plant one under a pool pod's
//!   name with its labels and env. Past the seal's grace (the moment between a create and
//!   its seal) it is replaced as a stale pod is.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{stream, StreamExt};
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use cli_mcp_api::activity;
use cli_mcp_api::names::{annotation, label, InstanceName, PoolSuffix};
use cli_mcp_api::pod_state::{self, is_assigned, is_deleting, is_ready, is_terminal};
use cli_mcp_api::sandbox::{build_sandbox_pod, made_for_key, SandboxConfig, SandboxRole};
use cli_mcp_api::seal::{self, SealCheck};
use cli_mcp_api::token::HmacKey;

use crate::context::{Context, PoolExpectations};
use crate::error::{Error, Result};
use crate::sandbox_pod::SandboxPod;

/// Most pool pods whose events are read in one reconcile, to learn why their pod sandbox
/// is not created (each is one list call).
pub const MAX_SANDBOX_EVENT_READS: usize = 5;
/// How soon a pool with pods waiting for their pod sandbox is looked at again: the kubelet
/// reports a failed sandbox only in an Event, which wakes nothing.
pub const SANDBOX_RECHECK: Duration = Duration::from_secs(10);
/// The kubelet's Event reason when the runtime cannot create a pod's sandbox (a RuntimeClass
/// handler the node lacks, a CNI failure).
pub const FAILED_SANDBOX_REASON: &str = "FailedCreatePodSandBox";

/// How long an expectation is trusted before the cache is assumed to have missed it.
pub const EXPECTATION_TTL: Duration = Duration::from_secs(30);
/// Most creates sent in one reconcile (the rest follow on the next one).
pub const MAX_CREATES_PER_RECONCILE: usize = 50;

/// Why a pool pod is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteReason {
    /// Built from an older config or an older HMAC key.
    Stale,
    /// Phase Failed/Succeeded.
    Dead,
    /// More pods than desired.
    Surplus,
    /// No valid seal past the seal's grace: planted under a pool pod's name, or left by an
    /// operator that stopped between a create and its seal.
    Unsealed,
}

impl DeleteReason {
    pub fn as_str(self) -> &'static str {
        match self {
            // The metric's documented reasons are stale|dead|surplus: an unsealed pod is
            // replaced as a stale one is (its log line says which).
            DeleteReason::Stale | DeleteReason::Unsealed => "stale",
            DeleteReason::Dead => "dead",
            DeleteReason::Surplus => "surplus",
        }
    }
}

/// A pool pod that is not making progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailingPod {
    pub name: String,
    pub reason: String,
    pub message: String,
}

/// What to do, decided from the cache.
#[derive(Debug, Default)]
pub struct Plan {
    pub create: usize,
    pub delete: Vec<(Arc<SandboxPod>, DeleteReason)>,
    pub ready: i32,
    pub failing: Vec<FailingPod>,
    /// Pods whose config or key is outdated (being replaced).
    pub stale: usize,
    /// Scheduled pods still without a pod sandbox: their events may say why.
    pub awaiting_sandbox: Vec<Arc<SandboxPod>>,
    /// When to look again at the unsealed pods still within the seal's grace: sealed by then,
    /// or replaced (a seal arriving wakes nothing).
    pub seal_recheck: Option<Duration>,
}

/// Current inputs of the pool.
pub struct PlanInputs<'a> {
    pub desired: i32,
    /// `SandboxConfig::hash` of the current config.
    pub hash: &'a str,
    /// The current key; pods whose assign commitment does not match it are stale.
    pub key: Option<&'a HmacKey>,
    /// False when creates are not allowed (missing Secrets, backoff).
    pub may_create: bool,
    /// The wall clock, against the pods' `creationTimestamp` (the seal's grace).
    pub now: Timestamp,
}

/// Why a pod is not making progress, if it is stuck: the scheduler cannot place it, or a
/// container waits for something only a fix can change.
pub fn failing_state(p: &Pod) -> Option<(String, String)> {
    if let Some(message) = pod_state::unschedulable(p) {
        return Some(("Unschedulable".to_owned(), message));
    }
    pod_state::cannot_start(p).map(|c| (c.reason, c.message))
}

/// Scheduled, but the kubelet has not got a pod sandbox for it yet (no container has run):
/// normal for a moment after scheduling, and for good when the runtime refuses the sandbox.
pub fn awaits_sandbox(p: &Pod) -> bool {
    let Some(status) = p.status.as_ref() else {
        return false;
    };
    let cond = |ty: &str| {
        status
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == ty)
            .map(|c| c.status.as_str())
    };
    let started = status.container_statuses.iter().flatten().any(|c| {
        c.state
            .as_ref()
            .is_some_and(|s| s.running.is_some() || s.terminated.is_some())
    });
    pod_state::phase(p) == Some("Pending")
        && cond("PodScheduled") == Some("True")
        && cond("PodReadyToStartContainers") == Some("False")
        && !started
}

/// True when the pod was built from another config or key than the current one.
pub fn is_stale(p: &Pod, hash: &str, key: Option<&HmacKey>) -> bool {
    if p.annotations()
        .get(annotation::SANDBOX_HASH)
        .map(String::as_str)
        != Some(hash)
    {
        return true;
    }
    key.is_some_and(|key| !made_for_key(p, key))
}

/// Sandbox pods of one instance from the scope-wide cache.
pub fn instance_pods(
    all: &[Arc<SandboxPod>],
    namespace: &str,
    name: &InstanceName,
) -> Vec<Arc<SandboxPod>> {
    all.iter()
        .filter(|p| {
            p.namespace().as_deref() == Some(namespace)
                && p.labels().get(label::INSTANCE).map(String::as_str) == Some(name.as_str())
                && p.labels().get(label::COMPONENT).map(String::as_str)
                    == Some(label::COMPONENT_SANDBOX)
        })
        .cloned()
        .collect()
}

/// Drops expectations the cache has caught up with (or that are too old to trust).
pub fn observe(exp: &mut PoolExpectations, pods: &[Arc<SandboxPod>], now: Instant) {
    let names: HashSet<String> = pods.iter().map(|p| p.name_any()).collect();
    exp.creates
        .retain(|name, at| !names.contains(name) && now.duration_since(*at) < EXPECTATION_TTL);
    exp.deletes.retain(|uid, at| {
        let still_live = pods
            .iter()
            .any(|p| p.uid().as_deref() == Some(uid.as_str()) && !p.is_deleting());
        still_live && now.duration_since(*at) < EXPECTATION_TTL
    });
}

/// Decides creates and deletes. Pure.
pub fn plan(pods: &[Arc<SandboxPod>], exp: &PoolExpectations, inp: &PlanInputs<'_>) -> Plan {
    let mut out = Plan::default();
    // With the order surplus is removed in: failing first, then not Ready, then the oldest.
    type Order = (bool, bool, Option<k8s_openapi::jiff::Timestamp>, String);
    let mut occupying: Vec<(Order, Arc<SandboxPod>)> = Vec::new();
    for cached in pods {
        // Assigned pods are not the pool's (and are cached without what is read here).
        let Some(p) = cached.unassigned() else {
            continue;
        };
        if is_deleting(p) {
            continue;
        }
        if p.uid().is_some_and(|u| exp.deletes.contains_key(&u)) {
            continue;
        }
        if is_terminal(p) {
            out.delete.push((cached.clone(), DeleteReason::Dead));
            continue;
        }
        if is_stale(p, inp.hash, inp.key) {
            out.stale += 1;
            out.delete.push((cached.clone(), DeleteReason::Stale));
            continue;
        }
        // A pod being sealed still holds its slot (no second create for it), but nobody can
        // claim it yet, so it is not counted Ready.
        let mut awaiting_seal = false;
        match inp.key.map(|key| seal::check(p, key, inp.now)) {
            Some(SealCheck::Unsealed) => {
                out.stale += 1;
                out.delete.push((cached.clone(), DeleteReason::Unsealed));
                continue;
            }
            Some(SealCheck::Awaited(left)) => {
                awaiting_seal = true;
                out.seal_recheck = Some(out.seal_recheck.map_or(left, |d| d.min(left)));
            }
            Some(SealCheck::Sealed) | None => {}
        }
        let failing = failing_state(p);
        let ready = is_ready(p) && !awaiting_seal;
        let order = (
            failing.is_none(),
            ready,
            p.metadata.creation_timestamp.clone().map(|t| t.0),
            p.name_any(),
        );
        if let Some((reason, message)) = failing {
            out.failing.push(FailingPod {
                name: p.name_any(),
                reason,
                message,
            });
        } else if ready {
            out.ready += 1;
        } else if awaits_sandbox(p) {
            out.awaiting_sandbox.push(cached.clone());
        }
        occupying.push((order, cached.clone()));
    }
    let desired = inp.desired.max(0) as usize;
    let pending = exp.creates.len();
    let occupied = occupying.len() + pending;
    if occupied < desired && inp.may_create {
        out.create = (desired - occupied).min(MAX_CREATES_PER_RECONCILE);
    }
    if occupied > desired {
        let surplus = (occupied - desired).min(occupying.len());
        occupying.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, p) in occupying.into_iter().take(surplus) {
            out.delete.push((p, DeleteReason::Surplus));
        }
    }
    out
}

/// What the pool looks like after a reconcile, for the status.
#[derive(Debug, Default, Clone)]
pub struct PoolOutcome {
    pub desired: i32,
    pub ready: i32,
    pub failing: Vec<FailingPod>,
    pub stale: usize,
    /// Why creates are held back (missing Secret, invalid key), if they are.
    pub blocked: Option<String>,
    pub backoff: Option<Duration>,
    pub requeue: Option<Duration>,
    /// An API call of this pass failed (a list, a delete, a create): said in the pool's
    /// condition; the reconcile returns the error once the status is written.
    pub api_error: Option<String>,
}

/// Brings the pool of one instance towards the desired state. A failed API call does not
/// stop the pass (the deletes run when the list failed, the creates when a delete did): what
/// was done is the outcome, and the first error comes with it, for the caller to return
/// once the instance's status says so.
pub async fn reconcile(
    ctx: &Context,
    uid: &str,
    cfg: &SandboxConfig,
    desired: i32,
    key: Option<&HmacKey>,
    blocked: Option<String>,
) -> (PoolOutcome, Option<Error>) {
    let now = Instant::now();
    let wall = Timestamp::now();
    let all = ctx.stores.pods.state();
    let pods = instance_pods(&all, &cfg.namespace, &cfg.instance);
    let hash = cfg.hash();
    let (the_plan, backoff_left, pending, refused) = ctx.pool.with(uid, |exp, backoff| {
        observe(exp, &pods, now);
        // A new config may well be accepted: try it at once.
        if backoff.refused.as_ref().is_some_and(|(h, _)| *h != hash) {
            backoff.refused = None;
            backoff.reset();
        }
        let refused = backoff.refused.as_ref().map(|(_, why)| why.clone());
        let backoff_left = backoff.remaining(now);
        let inp = PlanInputs {
            desired,
            hash: &hash,
            key,
            may_create: blocked.is_none() && key.is_some() && backoff_left.is_none(),
            now: wall,
        };
        let p = plan(&pods, exp, &inp);
        // Over only once the pool is full: one Ready pod says nothing about the pod that
        // keeps failing beside it, whose replacements must keep backing off.
        if p.ready >= desired && p.failing.is_empty() && refused.is_none() {
            backoff.reset();
        }
        (
            p,
            backoff_left,
            exp.creates.len() + exp.deletes.len(),
            refused,
        )
    });
    let mut refused = refused;

    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &cfg.namespace);
    let listed: Api<SandboxPod> = Api::namespaced(ctx.client.clone(), &cfg.namespace);
    let mut first_err = None;
    let mut backoff = backoff_left;
    let mut the_plan = the_plan;

    // The cache can lag far behind the API (a watch relisting after an apiserver restart),
    // and an expectation is dropped after EXPECTATION_TTL: creating from the cache alone
    // then creates pods that already exist. Before creating, a (consistent) list of the
    // instance's unassigned sandboxes decides how many are really missing.
    // A failed list only holds back the creates: the deletes below still run.
    if the_plan.create > 0 {
        match listed
            .list(&ListParams::default().labels(&cfg.instance.unassigned_selector()))
            .await
        {
            Ok(list) => {
                let live: Vec<Arc<SandboxPod>> = list.items.into_iter().map(Arc::new).collect();
                the_plan.create = ctx.pool.with(uid, |exp, _| {
                    observe(exp, &live, now);
                    let inp = PlanInputs {
                        desired,
                        hash: &hash,
                        key,
                        may_create: true,
                        now: wall,
                    };
                    plan(&live, exp, &inp).create
                });
            }
            Err(e) => {
                the_plan.create = 0;
                first_err = Some(e.into());
            }
        }
    }

    // Deletes first: they free slots and never race a claim (see `delete_unclaimed`).
    for (pod, reason) in &the_plan.delete {
        // An unsealed pod is judged on the cache's copy: one sealed since is kept.
        let spare_sealed = key.filter(|_| *reason == DeleteReason::Unsealed);
        match delete_unclaimed(&api, pod, spare_sealed).await {
            Ok(Some(uid_deleted)) => {
                ctx.metrics.api_write("Pod", "delete");
                ctx.metrics.pool_deleted(reason.as_str());
                if *reason == DeleteReason::Unsealed {
                    tracing::warn!(pod = %pod.name_any(), namespace = %cfg.namespace,
                        "deleted a pool pod without a valid seal (planted under a pool pod's name by someone who may create pods, or left unsealed by an operator that stopped); replacing it");
                }
                ctx.pool.with(uid, |exp, b| {
                    exp.deletes.insert(uid_deleted, Instant::now());
                    if *reason == DeleteReason::Dead {
                        backoff = Some(b.fail(Instant::now()));
                    }
                });
            }
            Ok(None) => {}
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }

    if let Some(key) = key.filter(|_| the_plan.create > 0) {
        let pods: Vec<Pod> = (0..the_plan.create)
            .map(|_| {
                let suffix = PoolSuffix::from_random_bytes(rand::random());
                let name = cfg.instance.pool_pod(&suffix);
                let assign = key.assign_token(&name).commitment();
                build_sandbox_pod(
                    cfg,
                    &SandboxRole::Pool { suffix, assign },
                    &activity::stamp_now(),
                )
            })
            .collect();
        ctx.pool.with(uid, |exp, _| {
            for p in &pods {
                exp.creates.insert(p.name_any(), Instant::now());
            }
        });
        type Created = (String, kube::Result<Pod>, Option<kube::Result<()>>);
        let results: Vec<Created> = stream::iter(pods)
            .map(|p| {
                let api = api.clone();
                async move {
                    let name = p.name_any();
                    let created = api.create(&PostParams::default(), &p).await;
                    let sealed = match &created {
                        Ok(c) => Some(seal_created(&api, c, key).await),
                        Err(_) => None,
                    };
                    (name, created, sealed)
                }
            })
            .buffer_unordered(8)
            .collect()
            .await;
        let mut newly_refused = None;
        let mut create_failed = None;
        for (name, r, sealed) in results {
            match r {
                Ok(_) => {
                    ctx.metrics.api_write("Pod", "create");
                    ctx.metrics.pool_created.inc();
                    ctx.pool.with(uid, |_, b| b.refused = None);
                    refused = None;
                    match sealed {
                        Some(Ok(())) => ctx.metrics.api_write("Pod", "patch"),
                        Some(Err(e)) => {
                            tracing::warn!(pod = %name, error = %e,
                                "cannot seal a pool pod just created; it is never claimed, and is replaced once the seal's grace is over");
                            first_err.get_or_insert(e.into());
                        }
                        None => {}
                    }
                }
                Err(e) => {
                    ctx.pool.with(uid, |exp, _| exp.creates.remove(&name));
                    if let Some(why) = admission_refusal(&e) {
                        newly_refused = Some(why);
                    } else if !is_status(&e, 409) {
                        create_failed.get_or_insert(e);
                    }
                }
            }
        }
        // A failing webhook, a 429 or a 5xx: the next creates wait for the pool's backoff
        // (2 s, doubling), not just for the next reconcile, which would send them all again.
        if create_failed.is_some() && newly_refused.is_none() {
            ctx.pool
                .with(uid, |_, b| backoff = Some(b.fail(Instant::now())));
        }
        if let Some(e) = create_failed {
            first_err.get_or_insert(e.into());
        }
        // Retrying a refused pod unchanged is refused again: back off, and say why.
        if let Some(why) = newly_refused {
            ctx.pool.with(uid, |_, b| {
                b.refused = Some((hash.clone(), why.clone()));
                backoff = Some(b.fail(Instant::now()));
            });
            refused = Some(why);
        }
    }

    let deleted: HashSet<Option<String>> = the_plan.delete.iter().map(|(p, _)| p.uid()).collect();
    let awaiting: Vec<&Arc<SandboxPod>> = the_plan
        .awaiting_sandbox
        .iter()
        .filter(|p| !deleted.contains(&p.uid()))
        .collect();
    for p in awaiting.iter().take(MAX_SANDBOX_EVENT_READS) {
        if let Some(message) = sandbox_failure(ctx, &cfg.namespace, p).await {
            the_plan.failing.push(FailingPod {
                name: p.name_any(),
                reason: FAILED_SANDBOX_REASON.to_owned(),
                message,
            });
        }
    }
    let requeue = match (
        pending > 0 || !the_plan.delete.is_empty() || the_plan.create > 0,
        backoff,
    ) {
        // A failed API call: the reconcile fails (and is retried) after the status is written.
        _ if first_err.is_some() => None,
        (_, Some(b)) => Some(b),
        // Expectations resolve through pod events; this only guards against a lost event.
        (true, None) => Some(EXPECTATION_TTL),
        (false, None) if !awaiting.is_empty() => Some(SANDBOX_RECHECK),
        (false, None) => None,
    };
    // A pod within the seal's grace is looked at again when the grace ends: nothing else
    // wakes the pool for a plant that is never sealed.
    let requeue = match (requeue, the_plan.seal_recheck) {
        _ if first_err.is_some() => None,
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let outcome = PoolOutcome {
        desired,
        ready: the_plan.ready,
        failing: the_plan.failing,
        stale: the_plan.stale,
        blocked: blocked.or_else(|| {
            refused
                .map(|why| format!("the API server refuses the pool pods: {why}; fix spec.sandbox"))
        }),
        backoff,
        requeue,
        api_error: first_err.as_ref().map(ToString::to_string),
    };
    (outcome, first_err)
}

/// The kubelet's latest word on why `pod`'s sandbox cannot be created, from its Events.
/// `None` when there is none yet, or the Events cannot be read (the operator then reports the
/// pod as filling, as before, and says why in its log).
async fn sandbox_failure(ctx: &Context, namespace: &str, pod: &SandboxPod) -> Option<String> {
    let uid = pod.uid()?;
    let api: Api<Event> = Api::namespaced(ctx.client.clone(), namespace);
    let lp = ListParams::default().fields(&format!(
        "involvedObject.uid={uid},reason={FAILED_SANDBOX_REASON}"
    ));
    match api.list(&lp).await {
        Ok(list) => list
            .items
            .into_iter()
            .max_by_key(|e| (e.count.unwrap_or(0), e.last_timestamp.clone().map(|t| t.0)))
            .and_then(|e| e.message)
            .filter(|m| !m.is_empty()),
        Err(e) => {
            // Refused once is refused every time: say so once, not every 10s per pod.
            static REFUSAL_LOGGED: std::sync::atomic::AtomicBool =
                std::sync::atomic::AtomicBool::new(false);
            let refused = is_status(&e, 403);
            if !refused || !REFUSAL_LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    pod = %pod.name_any(),
                    error = %e,
                    "cannot read the events of a pool pod without a pod sandbox; grant the operator list on events to see the kubelet's reason"
                );
            }
            None
        }
    }
}

/// Seals a pool pod the operator has just created (see `cli_mcp_api::seal`). The uid in the
/// patch is a precondition: a namesake created since (another uid) is not touched (409).
async fn seal_created(api: &Api<Pod>, pod: &Pod, key: &HmacKey) -> kube::Result<()> {
    // The API server always returns the namespace, name and uid; without them the pod stays
    // unsealed and is replaced after the grace.
    let Some(seal) = seal::seal_for(pod, key) else {
        return Ok(());
    };
    let patch = json!({"metadata": {"uid": pod.uid(), "annotations": {annotation::SEAL: seal}}});
    api.patch(
        &pod.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .map(|_| ())
}

/// Re-reads `pod` and deletes it only if it is still unassigned (and, with `spare_sealed`,
/// still not sealed under that key), with UID and resourceVersion preconditions. Returns the
/// deleted pod's uid, or None if it was skipped.
pub async fn delete_unclaimed(
    api: &Api<Pod>,
    pod: &SandboxPod,
    spare_sealed: Option<&HmacKey>,
) -> Result<Option<String>> {
    let Some(fresh) = api.get_opt(&pod.name_any()).await? else {
        return Ok(None);
    };
    if fresh.uid() != pod.uid() || is_assigned(&fresh) || is_deleting(&fresh) {
        return Ok(None);
    }
    if spare_sealed.is_some_and(|key| seal::sealed(&fresh, key)) {
        return Ok(None);
    }
    let dp = crate::apply::delete_exactly(&fresh, true);
    match api.delete(&fresh.name_any(), &dp).await {
        Ok(_) => Ok(fresh.uid()),
        // 409: it changed (claimed) since the read; 404: gone. Either way: keep hands off.
        Err(e) if is_status(&e, 409) || is_status(&e, 404) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The API server's message when it refused the pod itself and would refuse it again
/// unchanged: 403 (an admission plugin such as RuntimeClass or Priority, a policy, or RBAC)
/// or 422 (invalid). Conflicts and outages are not refusals.
fn admission_refusal(e: &kube::Error) -> Option<String> {
    match e {
        kube::Error::Api(s) if (s.code == 403 && !s.message.is_empty()) || s.code == 422 => {
            Some(s.message.clone())
        }
        _ => None,
    }
}

pub fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli_mcp_api::names::InstanceName;

    fn cfg() -> SandboxConfig {
        SandboxConfig::new(InstanceName::parse("demo").expect("name"), "ns1", "img:1")
    }

    fn key() -> HmacKey {
        HmacKey::from_bytes([3; 32])
    }

    fn cached(p: Pod) -> Arc<SandboxPod> {
        Arc::new(SandboxPod::from_pod(&p))
    }

    fn pool_pod(cfg: &SandboxConfig, key: &HmacKey, n: u8, ready: bool) -> Arc<SandboxPod> {
        cached(pool_pod_raw(cfg, key, n, ready))
    }

    fn pool_pod_raw(cfg: &SandboxConfig, key: &HmacKey, n: u8, ready: bool) -> Pod {
        let suffix = PoolSuffix::from_random_bytes([n; 10]);
        let name = cfg.instance.pool_pod(&suffix);
        let assign = key.assign_token(&name).commitment();
        let mut p = build_sandbox_pod(cfg, &SandboxRole::Pool { suffix, assign }, "t");
        p.metadata.uid = Some(format!("uid-{n}"));
        p.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::from_second(1_000 + i64::from(n)).expect("ts"),
        ));
        let seal = seal::seal_for(&p, key).expect("namespace, name and uid");
        p.annotations_mut().insert(annotation::SEAL.into(), seal);
        p.status = Some(
            serde_json::from_value(serde_json::json!({
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]
            }))
            .expect("status"),
        );
        p
    }

    fn inputs<'a>(desired: i32, hash: &'a str, key: &'a HmacKey) -> PlanInputs<'a> {
        PlanInputs {
            desired,
            hash,
            key: Some(key),
            may_create: true,
            now: Timestamp::from_second(NOW).expect("now"),
        }
    }

    /// The clock of the plans: long after every test pod's creation.
    const NOW: i64 = 100_000;

    #[test]
    fn fills_the_deficit_counting_pending_creates() {
        let (c, k) = (cfg(), key());
        let h = c.hash();
        let pods = vec![pool_pod(&c, &k, 1, true)];
        let mut exp = PoolExpectations::default();
        assert_eq!(plan(&pods, &exp, &inputs(3, &h, &k)).create, 2);
        // Two creates in flight that the cache has not shown yet: nothing more to create.
        exp.creates.insert("a".into(), Instant::now());
        exp.creates.insert("b".into(), Instant::now());
        let p = plan(&pods, &exp, &inputs(3, &h, &k));
        assert_eq!(p.create, 0);
        assert!(p.delete.is_empty());
    }

    #[test]
    fn claimed_pods_leave_the_pool_and_are_never_deleted() {
        let (c, k) = (cfg(), key());
        let h = c.hash();
        let mut claimed = pool_pod_raw(&c, &k, 1, true);
        claimed
            .labels_mut()
            .insert(label::SESSION_ID.into(), "s1".into());
        let pods = vec![cached(claimed), pool_pod(&c, &k, 2, true)];
        let p = plan(&pods, &PoolExpectations::default(), &inputs(0, &h, &k));
        assert_eq!(p.delete.len(), 1);
        assert_eq!(p.delete[0].0.name_any(), pods[1].name_any());
        let p = plan(&pods, &PoolExpectations::default(), &inputs(2, &h, &k));
        assert_eq!(p.create, 1, "the claimed pod is replaced");
    }

    #[test]
    fn surplus_goes_not_ready_first_then_oldest() {
        let (c, k) = (cfg(), key());
        let h = c.hash();
        let pods = vec![
            pool_pod(&c, &k, 1, true),
            pool_pod(&c, &k, 2, false),
            pool_pod(&c, &k, 3, true),
        ];
        let p = plan(&pods, &PoolExpectations::default(), &inputs(1, &h, &k));
        let deleted: Vec<_> = p
            .delete
            .iter()
            .map(|(p, _)| p.uid().unwrap_or_default())
            .collect();
        assert_eq!(deleted, vec!["uid-2".to_string(), "uid-1".to_string()]);
        assert!(p.delete.iter().all(|(_, r)| *r == DeleteReason::Surplus));
    }

    #[test]
    fn stale_config_or_key_is_replaced() {
        let (c, k) = (cfg(), key());
        let pods = vec![pool_pod(&c, &k, 1, true)];
        let mut c2 = c.clone();
        c2.image = "img:2".into();
        let h2 = c2.hash();
        let p = plan(&pods, &PoolExpectations::default(), &inputs(1, &h2, &k));
        assert_eq!(p.delete.len(), 1);
        assert_eq!(p.delete[0].1, DeleteReason::Stale);
        assert_eq!(p.create, 1);
        let k2 = HmacKey::from_bytes([4; 32]);
        let h = c.hash();
        let p = plan(&pods, &PoolExpectations::default(), &inputs(1, &h, &k2));
        assert_eq!(p.delete[0].1, DeleteReason::Stale, "new key => stale");
    }

    #[test]
    fn failing_pods_are_kept_not_churned() {
        let (c, k) = (cfg(), key());
        let h = c.hash();
        let mut bad = pool_pod_raw(&c, &k, 1, false);
        bad.status = Some(serde_json::from_value(serde_json::json!({
            "phase": "Pending",
            "containerStatuses": [{"name": "agent", "image": "x", "imageID": "", "ready": false,
                "restartCount": 0, "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}]
        })).expect("status"));
        let pods = vec![cached(bad)];
        let p = plan(&pods, &PoolExpectations::default(), &inputs(1, &h, &k));
        assert!(p.delete.is_empty(), "not deleted");
        assert_eq!(p.create, 0, "it fills its slot");
        assert_eq!(p.failing.len(), 1);
        assert_eq!(p.failing[0].reason, "ImagePullBackOff");
    }

    #[test]
    fn unschedulable_pods_are_reported() {
        let (c, k) = (cfg(), key());
        let h = c.hash();
        let mut p = pool_pod_raw(&c, &k, 1, false);
        p.status = Some(serde_json::from_value(serde_json::json!({
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 Insufficient cpu."}]
        })).expect("status"));
        let plan = plan(
            &[cached(p)],
            &PoolExpectations::default(),
            &inputs(1, &h, &k),
        );
        assert_eq!(plan.failing[0].reason, "Unschedulable");
        assert!(plan.failing[0].message.contains("Insufficient cpu"));
        assert!(plan.delete.is_empty() && plan.create == 0);
    }

    #[test]
    fn dead_pods_are_deleted_and_creation_can_be_held() {
        let (c, k) = (cfg(), key());
        let h = c.hash();
        let mut dead = pool_pod_raw(&c, &k, 1, false);
        dead.status =
            Some(serde_json::from_value(serde_json::json!({"phase": "Failed"})).expect("status"));
        let pods = vec![cached(dead)];
        let mut inp = inputs(1, &h, &k);
        inp.may_create = false;
        let p = plan(&pods, &PoolExpectations::default(), &inp);
        assert_eq!(p.delete[0].1, DeleteReason::Dead);
        assert_eq!(p.create, 0);
    }

    #[test]
    fn expectations_clear_when_the_cache_catches_up() {
        let (c, k) = (cfg(), key());
        let pods = vec![pool_pod(&c, &k, 1, true)];
        let mut exp = PoolExpectations::default();
        let now = Instant::now();
        exp.creates.insert(pods[0].name_any(), now);
        exp.creates.insert("not-yet".into(), now);
        exp.deletes.insert("uid-1".into(), now);
        exp.deletes.insert("uid-gone".into(), now);
        observe(&mut exp, &pods, now);
        assert_eq!(exp.creates.keys().collect::<Vec<_>>(), vec!["not-yet"]);
        assert_eq!(exp.deletes.keys().collect::<Vec<_>>(), vec!["uid-1"]);
        observe(&mut exp, &pods, now + EXPECTATION_TTL);
        assert!(exp.creates.is_empty() && exp.deletes.is_empty());
    }

    #[test]
    fn a_placement_change_replaces_warm_pods_and_no_placement_keeps_them() {
        let (c, k) = (cfg(), key());
        let pods = vec![pool_pod(&c, &k, 1, true)];
        let mut placed = cfg();
        placed.placement.runtime_class_name = Some("gvisor".into());
        let h = placed.hash();
        let p = plan(&pods, &PoolExpectations::default(), &inputs(1, &h, &k));
        assert_eq!(p.delete.len(), 1);
        assert_eq!(p.delete[0].1, DeleteReason::Stale);
        // A config read from an instance that sets no placement is the one the pods were
        // built from: nothing is replaced.
        let unchanged: SandboxConfig =
            serde_json::from_value(serde_json::to_value(&c).expect("json")).expect("config");
        let h = unchanged.hash();
        let p = plan(&pods, &PoolExpectations::default(), &inputs(1, &h, &k));
        assert!(p.delete.is_empty() && p.stale == 0, "{p:?}");
    }

    #[test]
    fn scheduled_pods_without_a_pod_sandbox_are_singled_out() {
        let (c, k) = (cfg(), key());
        let with_status = |n: u8, status: serde_json::Value| {
            let mut p = pool_pod_raw(&c, &k, n, false);
            p.status = Some(serde_json::from_value(status).expect("status"));
            cached(p)
        };
        let no_sandbox = with_status(
            1,
            serde_json::json!({"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "PodReadyToStartContainers", "status": "False"},
                {"type": "Ready", "status": "False"}],
              "containerStatuses": [{"name": "agent", "image": "i", "imageID": "", "ready": false,
                "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}]}),
        );
        let unscheduled = with_status(
            2,
            serde_json::json!({"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}]}),
        );
        let starting = with_status(
            3,
            serde_json::json!({"phase": "Running", "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "PodReadyToStartContainers", "status": "True"},
                {"type": "Ready", "status": "False"}],
              "containerStatuses": [{"name": "agent", "image": "i", "imageID": "", "ready": false,
                "restartCount": 0, "state": {"running": {}}}]}),
        );
        let view = |p: &SandboxPod| p.unassigned().expect("unassigned").clone();
        assert!(awaits_sandbox(&view(&no_sandbox)));
        for p in [&unscheduled, &starting, &pool_pod(&c, &k, 4, true)] {
            assert!(!awaits_sandbox(&view(p)), "{p:?}");
        }
        let h = c.hash();
        let pods = vec![no_sandbox.clone(), unscheduled, starting];
        let p = plan(&pods, &PoolExpectations::default(), &inputs(3, &h, &k));
        let names: Vec<_> = p.awaiting_sandbox.iter().map(|p| p.name_any()).collect();
        assert_eq!(names, [no_sandbox.name_any()]);
        assert!(p.failing.is_empty(), "only its events can say it fails");
        assert_eq!(p.create, 0, "it holds its slot meanwhile");
    }

    #[test]
    fn a_planted_namesake_with_a_copied_seal_is_replaced_not_kept_warm() {
        let (c, k) = (cfg(), key());
        let h = c.hash();
        // The original's name, labels, annotations (its seal too) and env, under the uid the
        // API server gave the plant.
        let mut planted = pool_pod_raw(&c, &k, 1, true);
        planted.metadata.uid = Some("uid-of-the-plant".into());
        let pods = vec![cached(planted), pool_pod(&c, &k, 2, true)];
        let p = plan(&pods, &PoolExpectations::default(), &inputs(2, &h, &k));
        assert_eq!(p.delete.len(), 1, "{p:?}");
        assert_eq!(p.delete[0].0.name_any(), pods[0].name_any());
        assert_eq!(p.delete[0].1, DeleteReason::Unsealed);
        assert_eq!(
            DeleteReason::Unsealed.as_str(),
            "stale",
            "the metric's reason"
        );
        assert_eq!((p.ready, p.stale, p.create), (1, 1, 1));
        assert_eq!(p.seal_recheck, None);
    }

    #[test]
    fn an_unsealed_pool_pod_is_awaited_within_the_grace_then_replaced() {
        let (c, k) = (cfg(), key());
        let h = c.hash();
        let mut fresh = pool_pod_raw(&c, &k, 1, true);
        fresh.annotations_mut().remove(annotation::SEAL);
        fresh.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                Timestamp::from_second(NOW - 5).expect("ts"),
            ));
        let pods = vec![cached(fresh.clone())];
        // Just created, its seal on the way: it holds its slot but cannot be claimed yet.
        let p = plan(&pods, &PoolExpectations::default(), &inputs(1, &h, &k));
        assert!(p.delete.is_empty(), "{p:?}");
        assert_eq!((p.create, p.ready, p.stale), (0, 0, 0));
        assert_eq!(
            p.seal_recheck,
            Some(seal::SEAL_GRACE - Duration::from_secs(5))
        );
        // Still unsealed once the grace is over: replaced.
        let mut later = inputs(1, &h, &k);
        later.now = Timestamp::from_second(NOW + 60).expect("ts");
        let p = plan(&pods, &PoolExpectations::default(), &later);
        assert_eq!(p.delete.len(), 1);
        assert_eq!(p.delete[0].1, DeleteReason::Unsealed);
        assert_eq!(p.create, 1);
        // Sealed by then: warm.
        let seal = seal::seal_for(&fresh, &k).expect("seal");
        fresh
            .annotations_mut()
            .insert(annotation::SEAL.into(), seal);
        let p = plan(&[cached(fresh)], &PoolExpectations::default(), &later);
        assert!(p.delete.is_empty() && p.seal_recheck.is_none());
        assert_eq!((p.create, p.ready), (0, 1));
    }

    #[test]
    fn refusals_are_told_apart_from_conflicts_and_outages() {
        let api = |code: u16, message: &str| {
            kube::Error::Api(
                serde_json::from_value(serde_json::json!({
                    "status": "Failure", "code": code, "message": message, "reason": "",
                }))
                .expect("status"),
            )
        };
        let why = "pods \"x\" is forbidden: pod rejected: RuntimeClass \"nope\" not found";
        assert_eq!(admission_refusal(&api(403, why)).as_deref(), Some(why));
        assert!(admission_refusal(&api(422, "spec.affinity: Invalid value")).is_some());
        for code in [409, 429, 500, 503] {
            assert_eq!(admission_refusal(&api(code, "x")), None, "{code}");
        }
    }
}
