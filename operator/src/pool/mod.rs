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

use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use cli_mcp_api::names::annotation;
use cli_mcp_api::pod_state::{is_assigned, is_deleting};
use cli_mcp_api::sandbox::SandboxConfig;
use cli_mcp_api::seal;
use cli_mcp_api::token::HmacKey;

use crate::api_call::{delete_exactly, is_status};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::sandbox_pod::SandboxPod;

mod pass;
mod plan;
mod size;
pub use plan::*;
pub use size::{resize_of, size, PoolSize};

use pass::Pass;

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
    /// The RuntimeClass the current warm pods carry, for `status.sandbox`.
    pub carried: crate::runtime_class::Carried,
    /// Sized by demand: the new sessions of the last minute, for the status.
    pub sessions_last_minute: Option<i32>,
}

impl PoolOutcome {
    /// Adds what sizing the pool by demand found: the status's demand, and the next look
    /// while the size may still change.
    pub fn sized_by_demand(&mut self, size: &PoolSize) {
        self.sessions_last_minute = size.sessions_last_minute;
        if let Some(recheck) = size.recheck {
            self.requeue = Some(self.requeue.map_or(recheck, |r| r.min(recheck)));
        }
    }
}

/// Brings the pool of one instance towards the desired state. A failed API call does not
/// stop the pass (the deletes run when the list failed, the creates when a delete did): what
/// was done is the outcome, and the first error comes with it, for the caller to return
/// once the instance's status says so. One call per step; only the plan and the outcome
/// are client-free.
pub async fn reconcile(
    ctx: &Context,
    uid: &str,
    cfg: &SandboxConfig,
    desired: i32,
    key: Option<&HmacKey>,
    blocked: Option<String>,
) -> (PoolOutcome, Option<Error>) {
    // 1. Plan from the cache and the expectations (no client).
    let mut pass = Pass::plan(ctx, uid, cfg, desired, key, blocked.is_none());
    // 2. A consistent list before any create (client).
    pass.recount_before_creating().await;
    // 3. Deletes first: they free slots and never race a claim (client).
    pass.delete().await;
    // 4. Creates, each sealed at once (client).
    pass.create().await;
    // 5. Why pods wait for their pod sandbox, from the kubelet's Events (client).
    let awaiting = pass.read_sandbox_failures().await;
    // 6. The outcome for the status, and the first error (no client).
    pass.outcome(blocked, awaiting)
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
    let what = |verb: &str| format!("{verb} pool pod {}", pod.name_any());
    let read = api.get_opt(&pod.name_any()).await;
    let Some(fresh) = read.map_err(Error::pool(what("re-reading")))? else {
        return Ok(None);
    };
    if fresh.uid() != pod.uid() || is_assigned(&fresh) || is_deleting(&fresh) {
        return Ok(None);
    }
    if spare_sealed.is_some_and(|key| seal::sealed(&fresh, key)) {
        return Ok(None);
    }
    let dp = delete_exactly(&fresh, true);
    match api.delete(&fresh.name_any(), &dp).await {
        Ok(_) => Ok(fresh.uid()),
        // 409: it changed (claimed) since the read; 404: gone. Either way: keep hands off.
        Err(e) if is_status(&e, 409) || is_status(&e, 404) => Ok(None),
        Err(e) => Err(Error::pool(what("deleting"))(e)),
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

#[cfg(test)]
mod tests {
    use super::*;

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
