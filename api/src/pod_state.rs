//! What a sandbox pod's observed state means.
//!
//! The server (routing, waiting for a pod to start), the operator (pool planning, idle GC,
//! the pod watch) and the tests all read pods through these functions, so "Ready",
//! "deleting", "terminal", "assigned" and "cannot start" mean the same thing on every side.
//! Each is a plain question about a `Pod`; what to do about the answer is the caller's policy.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::names::label;

/// Container waiting reasons that mean the pod will not start on its own soon: the image
/// cannot be pulled or named, the container keeps crashing, or its configuration (a missing
/// Secret or ConfigMap key, a bad mount) keeps it from being created or run. The kubelet keeps
/// retrying these with its own backoff, but nothing changes until someone fixes the cause.
pub const CANNOT_START_REASONS: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// A container that waits for one of [`CANNOT_START_REASONS`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CannotStart {
    pub container: String,
    pub reason: String,
    pub message: String,
}

/// Condition `Ready=True`: the agent passes its readiness probe and may be routed to.
pub fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// `deletionTimestamp` is set: the pod is going away (graceful termination, a finalizer) and
/// must be neither routed to nor counted, even while its containers still run.
pub fn is_deleting(p: &Pod) -> bool {
    is_deleting_meta(&p.metadata)
}

/// [`is_deleting`] of a pod's metadata alone (a cache that keeps no more of a pod).
pub fn is_deleting_meta(m: &ObjectMeta) -> bool {
    m.deletion_timestamp.is_some()
}

/// The pod's phase, if the kubelet reported one.
pub fn phase(p: &Pod) -> Option<&str> {
    p.status.as_ref().and_then(|s| s.phase.as_deref())
}

/// Phase `Failed` or `Succeeded`: its containers never run again (evicted, or every
/// container exited for good), whatever the restart policy says.
pub fn is_terminal(p: &Pod) -> bool {
    matches!(phase(p), Some("Failed" | "Succeeded"))
}

/// The session the pod is assigned to: its `session-id` label. A pool pod has none until a
/// server claims it.
pub fn session_of(p: &Pod) -> Option<&str> {
    session_of_meta(&p.metadata)
}

/// [`session_of`] of a pod's metadata alone.
pub fn session_of_meta(m: &ObjectMeta) -> Option<&str> {
    m.labels
        .as_ref()
        .and_then(|l| l.get(label::SESSION_ID))
        .map(String::as_str)
}

/// The pod carries a `session-id` label (claimed warm pod, or a cold session pod).
pub fn is_assigned(p: &Pod) -> bool {
    is_assigned_meta(&p.metadata)
}

/// [`is_assigned`] of a pod's metadata alone.
pub fn is_assigned_meta(m: &ObjectMeta) -> bool {
    session_of_meta(m).is_some()
}

/// containerd's words when the kubelet creates a container in a pod sandbox that has died
/// (under gVisor an out-of-memory kill stops the sandbox whole, agent and pause alike): a
/// `CreateContainerError` the kubelet mends by itself, making a new sandbox on its next sync.
const SANDBOX_TASK_GONE: &str = "failed to get sandbox container task";

/// The first container that waits for a reason in [`CANNOT_START_REASONS`] (but for a
/// sandbox the kubelet is about to make anew, see [`SANDBOX_TASK_GONE`]).
pub fn cannot_start(p: &Pod) -> Option<CannotStart> {
    let statuses = p.status.as_ref()?.container_statuses.as_ref()?;
    statuses.iter().find_map(|cs| {
        let w = cs.state.as_ref()?.waiting.as_ref()?;
        let reason = w.reason.as_deref()?;
        let message = w.message.as_deref().unwrap_or_default();
        let mends_itself = reason == "CreateContainerError" && message.contains(SANDBOX_TASK_GONE);
        (CANNOT_START_REASONS.contains(&reason) && !mends_itself).then(|| CannotStart {
            container: cs.name.clone(),
            reason: reason.to_owned(),
            message: message.to_owned(),
        })
    })
}

/// The scheduler's message when it cannot place the pod (`PodScheduled=False`, reason
/// `Unschedulable`): no node fits it until capacity or the pod's requests change.
pub fn unschedulable(p: &Pod) -> Option<String> {
    p.status
        .as_ref()?
        .conditions
        .iter()
        .flatten()
        .find(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        })
        .map(|c| c.message.clone().unwrap_or_default())
}

/// What to tell an admin about a sandbox the scheduler cannot place: the scheduler's own
/// message (which names the resource, e.g. `Insufficient cpu`) and what fixes it. Idle
/// shells need little, so requests sized for busy ones are the usual cause.
pub fn unschedulable_hint(scheduler_message: &str) -> String {
    let short: Vec<&str> = ["cpu", "memory", "ephemeral-storage", "pods"]
        .into_iter()
        .filter(|r| {
            scheduler_message.contains(&format!("Insufficient {r}"))
                || (*r == "pods" && scheduler_message.contains("Too many pods"))
        })
        .collect();
    let what = if short.is_empty() {
        String::new()
    } else {
        format!(" (the nodes are out of {})", short.join(" and "))
    };
    format!(
        "no node can take the sandbox pod{what}: {scheduler_message}; lower \
         spec.sandbox.resources.requests (limits still bound a busy session) or add nodes"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unschedulable_sandbox_is_explained_with_its_resource_and_the_fix() {
        let h = unschedulable_hint("0/1 nodes are available: 1 Insufficient cpu.");
        assert!(
            h.contains("out of cpu") && h.contains("spec.sandbox.resources.requests"),
            "{h}"
        );
        let h = unschedulable_hint(
            "0/1 nodes are available: 1 Insufficient cpu, 1 Insufficient memory.",
        );
        assert!(h.contains("out of cpu and memory"), "{h}");
        let h = unschedulable_hint("0/1 nodes are available: 1 node(s) had untolerated taint.");
        assert!(
            !h.contains("out of") && h.contains("untolerated taint"),
            "{h}"
        );
    }

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).expect("pod")
    }

    #[test]
    fn ready_means_the_ready_condition_is_true() {
        let ready = pod(serde_json::json!({
            "status": {"phase": "Running", "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True"}]}
        }));
        assert!(is_ready(&ready));
        let not_ready = pod(serde_json::json!({
            "status": {"phase": "Running", "conditions": [
                {"type": "ContainersReady", "status": "True"},
                {"type": "Ready", "status": "False"}]}
        }));
        assert!(!is_ready(&not_ready));
        assert!(!is_ready(&Pod::default()));
    }

    #[test]
    fn deleting_terminal_and_assigned() {
        let p = pod(serde_json::json!({
            "metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z",
                         "labels": {"cli-mcp.redhat.com/session-id": "s1"}},
            "status": {"phase": "Running"}
        }));
        assert!(is_deleting(&p) && !is_terminal(&p));
        assert_eq!(session_of(&p), Some("s1"));
        assert!(is_assigned(&p));
        for (ph, terminal) in [
            ("Failed", true),
            ("Succeeded", true),
            ("Running", false),
            ("Pending", false),
        ] {
            let p = pod(serde_json::json!({"status": {"phase": ph}}));
            assert_eq!(is_terminal(&p), terminal, "{ph}");
        }
        let fresh = Pod::default();
        assert!(!is_deleting(&fresh) && !is_terminal(&fresh) && !is_assigned(&fresh));
    }

    #[test]
    fn a_container_created_into_a_dead_sandbox_mends_itself() {
        let waiting = |message: &str| {
            pod(serde_json::json!({"status": {"containerStatuses": [
                {"name": "agent", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                 "state": {"waiting": {"reason": "CreateContainerError", "message": message}}}]}}))
        };
        let gone = "failed to get sandbox container task: no running task found: task 87dd not found: not found";
        assert_eq!(cannot_start(&waiting(gone)), None);
        let other = cannot_start(&waiting(
            "failed to create containerd container: mount denied",
        ));
        assert_eq!(other.map(|c| c.reason), Some("CreateContainerError".into()));
    }

    #[test]
    fn cannot_start_lists_reasons_that_need_a_fix() {
        let waiting = |reason: &str| {
            pod(serde_json::json!({"status": {"containerStatuses": [
                {"name": "agent", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                 "state": {"waiting": {"reason": reason, "message": "why"}}}]}}))
        };
        for r in CANNOT_START_REASONS {
            assert_eq!(
                cannot_start(&waiting(r)),
                Some(CannotStart {
                    container: "agent".into(),
                    reason: (*r).into(),
                    message: "why".into(),
                })
            );
        }
        // Normal start-up states pass on their own.
        for r in ["ContainerCreating", "PodInitializing"] {
            assert_eq!(cannot_start(&waiting(r)), None, "{r}");
        }
        assert_eq!(cannot_start(&Pod::default()), None);
    }

    #[test]
    fn unschedulable_carries_the_scheduler_message() {
        let p = pod(
            serde_json::json!({"status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/1 nodes: Insufficient cpu"}]}}),
        );
        assert_eq!(
            unschedulable(&p).as_deref(),
            Some("0/1 nodes: Insufficient cpu")
        );
        let scheduled = pod(serde_json::json!({"status": {"conditions": [
            {"type": "PodScheduled", "status": "True"}]}}));
        assert_eq!(unschedulable(&scheduled), None);
    }
}
