//! Ending a session on purpose (`DELETE /sessions/{id}`), and knowing afterwards that its
//! sandbox was ended so: a call that was running in it must fail, not start the session
//! again.

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::ResourceExt;

use cli_mcp_api::names::{annotation, InstanceName};
use cli_mcp_api::pod_state::is_deleting;
use cli_mcp_api::SessionId;

use super::admission::Admission;
use super::pods::{annotation_of, SandboxPods};
use crate::auth::Caller;
use crate::sessions::{owner_allows, EndedSandboxes, Sandbox, SessionError};

/// The `retired` reason of the pods `DELETE /sessions/{id}` removes.
const RETIRED_SESSION_ENDED: &str = "session-ended";

/// Whether `pod` was ended by `DELETE /sessions/{id}` (on any replica).
fn ended_on_purpose(pod: &Pod) -> bool {
    annotation_of(pod, annotation::RETIRED) == Some(RETIRED_SESSION_ENDED)
}

/// Ends sessions, and remembers the sandboxes ended.
#[derive(Debug)]
pub struct Endings {
    pods: SandboxPods,
    instance: InstanceName,
    /// Pods ended by `DELETE /sessions/{id}`, by this replica or (read from the pod) another:
    /// a call that was running in one must not start the session again.
    ended: EndedSandboxes,
}

impl Endings {
    pub fn new(pods: SandboxPods, instance: InstanceName) -> Self {
        Self {
            pods,
            instance,
            ended: EndedSandboxes::default(),
        }
    }

    /// Whether this replica knows the sandbox `uid` was ended on purpose.
    pub fn contains(&self, uid: &str) -> bool {
        self.ended.contains(uid)
    }

    /// Whether the pod behind `used` was ended by `DELETE /sessions/{id}`: known from this
    /// replica's own deletions, else read from the pod itself (another replica's deletion).
    /// A pod that is gone altogether without this replica having seen why counts as not
    /// ended (its session starts again, and the call says the sandbox was replaced).
    pub async fn was_ended(&self, used: &Sandbox) -> bool {
        if self.ended.contains(&used.uid) {
            return true;
        }
        match self.pods.api().get_opt(&used.name).await {
            Ok(Some(pod)) if pod.uid().as_deref() == Some(used.uid.as_str()) => {
                let ended = ended_on_purpose(&pod);
                if ended {
                    self.ended.end(&used.uid);
                }
                ended
            }
            _ => self.ended.contains(&used.uid),
        }
    }

    /// Ends session `sid` for `caller` (refused when any of its pods is someone else's): each
    /// of its pods marked ended, retired, and its places in `admission` freed before this
    /// returns.
    pub async fn end(
        &self,
        sid: &SessionId,
        caller: &Caller,
        admission: &Admission,
    ) -> Result<(), SessionError> {
        let list = self
            .pods
            .api()
            .list(&ListParams::default().labels(&self.instance.session_selector(sid)))
            .await?;
        if list
            .items
            .iter()
            .any(|p| !owner_allows(annotation_of(p, annotation::OWNER), caller))
        {
            return Err(SessionError::Forbidden(sid.clone()));
        }
        for pod in list.items.iter().filter(|p| !is_deleting(p)) {
            // Marked before it goes, so the call running in it fails instead of starting the
            // session again.
            if let Some(uid) = pod.uid() {
                self.ended.end(&uid);
            }
            tracing::info!(session = %sid, pod = %pod.name_any(), "deleting session sandbox");
            self.pods.retire(pod, RETIRED_SESSION_ENDED).await;
            // Its places are free when DELETE answers.
            admission.session_ended(sid, pod).await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn retired(why: Option<&str>) -> Pod {
        let mut p = Pod::default();
        if let Some(why) = why {
            p.annotations_mut()
                .insert(annotation::RETIRED.into(), why.into());
        }
        p
    }

    #[test]
    fn only_a_pod_retired_by_delete_was_ended_on_purpose() {
        assert!(ended_on_purpose(&retired(Some(RETIRED_SESSION_ENDED))));
        assert!(!ended_on_purpose(&retired(Some("duplicate"))));
        assert!(!ended_on_purpose(&retired(None)), "gone without a word");
    }
}
