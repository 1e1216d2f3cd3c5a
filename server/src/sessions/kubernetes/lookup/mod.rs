//! Finding a session's pod by label (duplicates resolved the same way by every replica; pods
//! of an old HMAC key, pods that terminated for good and pods without a valid seal removed),
//! and adopting a pod that already exists, found or started by another replica: the one place
//! that checks the pod is sealed and the caller may use it. [`seal`] is the seal's part of
//! that (waiting for a young pod's seal, removing pods that will never have one);
//! [`existing`] the read-only lookups (a session's files, `GET /sessions`); [`route_of`] the
//! last gate before a pod is routed to.

mod existing;
mod seal;

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::ResourceExt;

use cli_mcp_api::names::{annotation, label, InstanceName};
use cli_mcp_api::pod_state::{is_deleting, is_terminal};
use cli_mcp_api::sandbox::session_token_of;
use cli_mcp_api::seal::sealed;
use cli_mcp_api::token::HmacKey;
use cli_mcp_api::SessionId;

use super::agent_wait::AgentWait;
use super::pods::{annotation_of, endpoint_of, has_launch, has_run, SandboxPods};
use super::routes::Route;
use crate::auth::Caller;
use crate::metrics::Launch;
use crate::sessions::{owner_allows, SessionError};

/// What the label lookup found.
pub enum Found {
    Pod(Box<Pod>),
    /// A pod made with another HMAC key (the instance key was rotated): deleted.
    Stale,
    Nothing,
}

/// Finds and adopts the pods of sessions (see the module's doc).
#[derive(Debug)]
pub struct Lookup {
    pods: SandboxPods,
    key: HmacKey,
    instance: InstanceName,
    /// `--start-timeout`: the longest wait for the seal of a pod its writer may still seal.
    start_timeout: Duration,
    agent: AgentWait,
}

impl Lookup {
    pub fn new(
        pods: SandboxPods,
        key: HmacKey,
        instance: InstanceName,
        start_timeout: Duration,
        agent: AgentWait,
    ) -> Self {
        Self {
            pods,
            key,
            instance,
            start_timeout,
            agent,
        }
    }

    /// The route to `pod`, the session's, once it is sealed and holds a token of `sid`.
    pub fn route(&self, sid: &SessionId, pod: &Pod) -> Result<Route, SessionError> {
        route_of(sid, pod, &self.key)
    }

    /// A pod that already exists for the session (found by label, or started by another
    /// replica at the same time as this one), once it is sealed, the caller may use it and
    /// its agent answers. The seal comes first: a look-alike's copied owner must not decide
    /// anything.
    pub async fn adopt(
        &self,
        pod: Pod,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<Pod, SessionError> {
        let name = pod.name_any();
        let Some(pod) = self.sealed_or_removed(pod, sid).await? else {
            return Err(SessionError::Sandbox(format!(
                "pod {name} has no valid seal of this instance, so it was not used (it was deleted, or went away); retry the call"
            )));
        };
        if !owner_allows(annotation_of(&pod, annotation::OWNER), caller) {
            return Err(SessionError::Forbidden(sid.clone()));
        }
        // A pod that has run before and stopped answering is restarting its agent (the
        // kubelet may already report CrashLoopBackOff for the pause between restarts, which
        // for a new pod would mean it cannot start).
        let pod = if has_run(&pod) {
            pod
        } else {
            self.agent.wait_ready(pod).await?
        };
        self.agent.await_agent(pod, sid).await
    }

    /// After a failed start (`failed`): another replica may have given the session its pod
    /// meanwhile (and deleted ours as the loser): that one, adopted.
    pub async fn started_elsewhere(
        &self,
        sid: &SessionId,
        caller: &Caller,
        failed: SessionError,
    ) -> Result<(Pod, Launch), SessionError> {
        let Found::Pod(p) = self.find(sid).await? else {
            return Err(failed);
        };
        tracing::info!(session = %sid, pod = %p.name_any(), error = %failed,
            "another replica started this session; using its pod");
        let launch = if has_launch(&p, label::LAUNCH_WARM) {
            Launch::Warm
        } else {
            Launch::Cold
        };
        Ok((self.adopt(*p, sid, caller).await?, launch))
    }

    /// Session pods by label, duplicates resolved, pods of an old key and unsealed pods
    /// removed.
    pub async fn find(&self, sid: &SessionId) -> Result<Found, SessionError> {
        let list = self
            .pods
            .api()
            .list(&ListParams::default().labels(&self.instance.session_selector(sid)))
            .await?;
        let (dead, live): (Vec<Pod>, Vec<Pod>) = list
            .items
            .into_iter()
            .filter(|p| !is_deleting(p))
            .partition(is_terminal);
        // A Failed or Succeeded pod (a kubelet eviction leaves the pod object in phase
        // Failed) never runs again: remove it, and the session starts afresh.
        for pod in &dead {
            tracing::warn!(session = %sid, pod = %pod.name_any(),
                phase = pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or_default(),
                "session pod has terminated for good; deleting it and starting a new sandbox");
            self.pods.delete(pod).await;
        }
        let Some(winner) = self.resolve_duplicates(live, sid).await else {
            return Ok(if dead.is_empty() {
                Found::Nothing
            } else {
                Found::Stale
            });
        };
        if session_token_of(&winner, sid, &self.key).is_none() {
            tracing::warn!(session = %sid, pod = %winner.name_any(),
                "session pod holds no token of this session under this server's key (the instance key changed, or an older version made it without a sandbox nonce); replacing it");
            self.pods.delete(&winner).await;
            return Ok(Found::Stale);
        }
        // Its name, labels and annotations can all be copied; its seal cannot.
        Ok(match self.sealed_or_removed(winner, sid).await? {
            Some(pod) => Found::Pod(Box::new(pod)),
            None => Found::Stale,
        })
    }

    /// Picks the winner among pods of one session and deletes the others. Pods that will
    /// never be sealed take no part (and are deleted).
    pub async fn resolve_duplicates(&self, pods: Vec<Pod>, sid: &SessionId) -> Option<Pod> {
        let mut pods = self.without_unsealed(pods, sid).await;
        if pods.len() > 1 {
            pods.sort_by(winner_order);
            for loser in &pods[1..] {
                tracing::info!(pod = %loser.name_any(), winner = %pods[0].name_any(),
                    "two sandboxes for one session; deleting the loser");
                self.pods.retire(loser, "duplicate").await;
            }
        }
        pods.into_iter().next()
    }
}

/// Order of preference among pods of one session: oldest first, then by name. Every replica
/// computes the same order from the same objects.
pub(super) fn winner_order(a: &Pod, b: &Pod) -> std::cmp::Ordering {
    let ts = |p: &Pod| p.metadata.creation_timestamp.as_ref().map(|t| t.0);
    match (ts(a), ts(b)) {
        (Some(x), Some(y)) => x.cmp(&y),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => std::cmp::Ordering::Equal,
    }
    .then_with(|| a.name_any().cmp(&b.name_any()))
}

/// The route of session `sid` to `pod`, once the pod is sealed and holds the session's
/// token.
fn route_of(sid: &SessionId, pod: &Pod, key: &HmacKey) -> Result<Route, SessionError> {
    // The last gate before a pod is sent the session's token and commands.
    if !sealed(pod, key) {
        return Err(SessionError::Sandbox(format!(
            "pod {} has no valid seal of this instance for its uid, so it is not used; retry the call",
            pod.name_any()
        )));
    }
    let endpoint = endpoint_of(pod)
        .ok_or_else(|| SessionError::Sandbox(format!("pod {} has no IP", pod.name_any())))?;
    let token = session_token_of(pod, sid, key).ok_or_else(|| {
        SessionError::Sandbox(format!(
            "pod {} was not made for session {sid} under this server's key; retry (it is replaced)",
            pod.name_any()
        ))
    })?;
    Ok(Route {
        pod: pod.name_any(),
        uid: pod.uid().unwrap_or_default(),
        endpoint,
        token,
        owner: annotation_of(pod, annotation::OWNER).map(str::to_owned),
        launch: match pod.labels().get(label::LAUNCH).map(String::as_str) {
            Some(label::LAUNCH_WARM) => Some(Launch::Warm),
            Some(label::LAUNCH_COLD) => Some(Launch::Cold),
            _ => None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn pod(name: &str, created: Option<&str>) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.metadata.creation_timestamp = created.map(|t| Time(t.parse().expect("timestamp")));
        p
    }

    #[test]
    fn the_oldest_pod_wins_then_the_name() {
        let mut pods = [
            pod("b", Some("2026-01-01T00:00:02Z")),
            pod("c", Some("2026-01-01T00:00:01Z")),
            pod("a", Some("2026-01-01T00:00:02Z")),
        ];
        pods.sort_by(winner_order);
        let names: Vec<_> = pods.iter().map(|p| p.name_any()).collect();
        assert_eq!(names, ["c", "a", "b"]);
    }
}
