//! The pool's plan, without a client: from the pods in the cache, the pending writes
//! ("expectations") and the current config, what to create and what to delete
//! ([`plan`]), and what a pool pod's state means for it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use cli_mcp_api::names::{annotation, label, InstanceName};
use cli_mcp_api::pod_state::{self, is_deleting, is_ready, is_terminal};
use cli_mcp_api::sandbox::made_for_key;
use cli_mcp_api::seal::{self, SealCheck};
use cli_mcp_api::token::HmacKey;

use crate::context::PoolExpectations;
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

#[cfg(test)]
mod tests {
    use super::*;
    use cli_mcp_api::names::PoolSuffix;
    use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxRole};

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
}
