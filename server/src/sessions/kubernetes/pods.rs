//! Small facts about sandbox pods that only this backend needs, and removing one.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use cli_mcp_api::names::{annotation, label};
use cli_mcp_api::pod_state::{
    cannot_start, is_ready, is_terminal, phase, session_of, unschedulable, unschedulable_hint,
};
use cli_mcp_api::wire::AGENT_PORT;
use cli_mcp_api::SessionId;

use super::activity::ActivityStamper;
use crate::sessions::{SessionError, SessionSummary};

/// The instance's sandbox pods, and removing one; cheap to clone. Removing a pod also stops
/// its activity stamps.
#[derive(Debug, Clone)]
pub struct SandboxPods {
    api: Api<Pod>,
    stamper: Arc<ActivityStamper>,
}

impl SandboxPods {
    pub fn new(api: Api<Pod>, stamper: Arc<ActivityStamper>) -> Self {
        Self { api, stamper }
    }

    /// The pods of the instance's namespace.
    pub fn api(&self) -> &Api<Pod> {
        &self.api
    }

    /// `pod`'s `last-activity` annotation says `at`, as its claim wrote it (see
    /// [`ActivityStamper::written_by_claim`]).
    pub fn claimed_at(&self, pod: &Pod, at: String) {
        if let Some(uid) = pod.uid() {
            self.stamper.written_by_claim(&pod.name_any(), &uid, at);
        }
    }

    /// Deletes a sandbox whose disappearance is not a reset of its session's state (see
    /// `annotation::RETIRED`): marked first, so every replica's pod watch sees why.
    pub async fn retire(&self, pod: &Pod, why: &str) {
        let patch = json!({"metadata": {"annotations": {annotation::RETIRED: why}}});
        match self
            .api
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
        self.delete(pod).await;
    }

    /// Deletes exactly `pod` (uid precondition): gone or replaced is fine.
    pub async fn delete(&self, pod: &Pod) {
        let name = pod.name_any();
        self.stamper.forget(&name);
        let mut dp = DeleteParams::default();
        if let Some(uid) = pod.uid() {
            dp = dp.preconditions(kube::api::Preconditions {
                uid: Some(uid),
                resource_version: None,
            });
        }
        match self.api.delete(&name, &dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() || s.is_conflict() => {}
            Err(e) => tracing::warn!(pod = %name, error = %e, "cannot delete sandbox pod"),
        }
    }
}

/// Which pod this is across its lifetime: its uid (its name when the API gave none), so two
/// pods of one name at different times are different pods.
pub(super) fn pod_key(p: &Pod) -> String {
    p.uid().unwrap_or_else(|| p.name_any())
}

/// The session a pod serves, when its label holds a valid session id.
pub(super) fn session(p: &Pod) -> Option<SessionId> {
    session_of(p).and_then(|s| SessionId::parse(s).ok())
}

/// A pod this call was waiting for was deleted by someone else: the operator (an instance
/// being deleted, or a sandbox made by a server replica whose HMAC key or config is outdated,
/// as happens while one is replaced) or an admin. Nothing is wrong with the sandbox image.
pub(super) fn deleted_while_starting(name: &str) -> SessionError {
    SessionError::Sandbox(format!(
        "pod {name} was deleted while it was starting (by the operator or an admin: while the instance's HMAC key or configuration changes, the operator removes sandboxes made by server replicas that are being replaced); retry the call"
    ))
}

/// The session a pod serves as `GET /sessions` lists it; `None` for a pod without a session
/// id label.
pub(super) fn summary_of(p: &Pod) -> Option<SessionSummary> {
    Some(SessionSummary {
        session_id: session_of(p)?.to_owned(),
        sandbox: p.name_any(),
        launch: p.labels().get(label::LAUNCH).cloned(),
        created_at: annotation_of(p, annotation::CREATED_AT).map(str::to_owned),
        last_activity: annotation_of(p, annotation::LAST_ACTIVITY).map(str::to_owned),
        ready: is_ready(p),
    })
}

/// Whether the pod's agent has been up before: Ready now, or its container has restarted or
/// has exited at least once.
pub(super) fn has_run(p: &Pod) -> bool {
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

pub(super) fn has_launch(p: &Pod, launch: &str) -> bool {
    p.labels().get(label::LAUNCH).map(String::as_str) == Some(launch)
}

pub(super) fn annotation_of<'a>(p: &'a Pod, key: &str) -> Option<&'a str> {
    p.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

pub(super) fn pod_ip(p: &Pod) -> Option<&str> {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .filter(|ip| !ip.is_empty())
}

/// Whether the sandbox's agent container is running (started; maybe not Ready yet).
pub(super) fn agent_running(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.name == cli_mcp_api::sandbox::CONTAINER_NAME
                    && c.state.as_ref().is_some_and(|s| s.running.is_some())
            })
        })
}

pub(super) fn endpoint_of(p: &Pod) -> Option<String> {
    let ip = pod_ip(p)?;
    Some(match ip.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(v6)) => format!("http://[{v6}]:{AGENT_PORT}"),
        _ => format!("http://{ip}:{AGENT_PORT}"),
    })
}

/// Why a pod will not become ready by itself, if it will not.
pub(super) fn start_failure(p: &Pod) -> Option<String> {
    // No node fits it: waiting out the start timeout would only delay the same answer.
    if let Some(m) = unschedulable(p) {
        return Some(unschedulable_hint(&m));
    }
    if is_terminal(p) {
        return Some(format!("the pod is {}", phase(p).unwrap_or_default()));
    }
    cannot_start(p).map(|c| format!("container {} is {}: {}", c.container, c.reason, c.message))
}

/// Phase and conditions of a pod that is not ready, for a timeout message.
pub(super) fn pending_reason(p: &Pod) -> String {
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

    #[test]
    fn the_agent_counts_as_running_once_its_container_runs() {
        let pod = |state: serde_json::Value, name: &str| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": "x"},
                "status": {"phase": "Pending", "containerStatuses": [{
                    "name": name, "image": "i", "imageID": "", "ready": false,
                    "restartCount": 0, "state": state
                }]}
            }))
            .expect("pod")
        };
        let running = json!({"running": {"startedAt": "2026-12-01T00:00:00Z"}});
        assert!(agent_running(&pod(running.clone(), "agent")));
        assert!(
            !agent_running(&pod(running, "sidecar")),
            "another container"
        );
        assert!(!agent_running(&pod(
            json!({"waiting": {"reason": "ContainerCreating"}}),
            "agent"
        )));
        assert!(!agent_running(
            &serde_json::from_value(json!({"metadata": {"name": "x"}})).expect("pod")
        ));
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
        // A pod no node can take fails at once, saying which resource and what fixes it.
        let unplaced: Pod = serde_json::from_value(json!({
            "metadata": {"name": "x"},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled",
                "status": "False", "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 Insufficient cpu."}]}
        }))
        .expect("pod");
        let why = start_failure(&unplaced).expect("fatal");
        assert!(
            why.contains("Insufficient cpu") && why.contains("spec.sandbox.resources.requests"),
            "{why}"
        );
    }

    #[test]
    fn endpoints_bracket_ipv6() {
        let p: Pod = serde_json::from_value(json!({"status": {"podIP": "fd00::5"}})).expect("pod");
        assert_eq!(endpoint_of(&p).as_deref(), Some("http://[fd00::5]:8090"));
        let p: Pod =
            serde_json::from_value(json!({"status": {"podIP": "10.244.1.7"}})).expect("pod");
        assert_eq!(endpoint_of(&p).as_deref(), Some("http://10.244.1.7:8090"));
    }
}
