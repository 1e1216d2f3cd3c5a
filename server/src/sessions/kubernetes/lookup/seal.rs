//! Sandbox pods are trusted by their seal (`cli_mcp_api::seal`), never by their name, labels
//! or annotations: whoever may create pods in the namespace can copy all of those onto a pod
//! of their own, but not the uid the API server gave the original, which the seal is bound to.
//!
//! This replica seals every pod it creates, right after the create (the start does, in
//! `start/create.rs`); what is here is the checks. Every pod a session is
//! routed to must be sealed: a pod found for a session, or offered by the warm pool, that is
//! not sealed is never sent a command or a token. A pod that may still be sealed by its writer
//! (younger than the seal's grace) is waited for; any other unsealed pod is deleted, so the
//! session can get a real one.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::wait::await_condition;
use kube::ResourceExt;

use cli_mcp_api::pod_state::is_deleting;
use cli_mcp_api::seal::{self, sealed, SealCheck};
use cli_mcp_api::SessionId;

use super::Lookup;
use crate::sessions::SessionError;

/// The `retired` reason of a pod deleted because it is not sealed.
const RETIRED_UNSEALED: &str = "unsealed";

impl Lookup {
    /// `pod` once it is sealed: at once, or within the seal's grace (the replica that has
    /// just created it seals it right after the create). A pod that is not sealed and will not
    /// be is deleted, never routed to; `None` then, and also when the pod went away or was
    /// replaced while this waited: the session has no usable pod.
    pub async fn sealed_or_removed(
        &self,
        pod: Pod,
        sid: &SessionId,
    ) -> Result<Option<Pod>, SessionError> {
        let wait = match seal::check(&pod, &self.key, Timestamp::now()) {
            SealCheck::Sealed => return Ok(Some(pod)),
            SealCheck::Awaited(left) => left.min(self.start_timeout),
            SealCheck::Unsealed => Duration::ZERO,
        };
        let name = pod.name_any();
        if !wait.is_zero() {
            let (uid, key) = (pod.uid(), self.key.clone());
            let settled = move |p: Option<&Pod>| {
                p.is_none_or(|p| p.uid() != uid || is_deleting(p) || sealed(p, &key))
            };
            match tokio::time::timeout(
                wait,
                await_condition(self.pods.api().clone(), &name, settled),
            )
            .await
            {
                Ok(Ok(Some(p)))
                    if p.uid() == pod.uid() && !is_deleting(&p) && sealed(&p, &self.key) =>
                {
                    return Ok(Some(p))
                }
                Ok(Ok(_)) => return Ok(None),
                Ok(Err(e)) => {
                    return Err(SessionError::Kubernetes(format!(
                        "waiting for the seal of pod {name}: {e}"
                    )))
                }
                // The grace is over and it is still unsealed.
                Err(_) => {}
            }
        }
        self.remove_unsealed(&pod, sid).await;
        Ok(None)
    }

    /// Drops from `pods` (one session's) those that will never be sealed, deleting them. They
    /// must not take part in choosing the session's pod: a look-alike older than the real pod
    /// would win and have the real one deleted as the loser.
    pub(super) async fn without_unsealed(&self, pods: Vec<Pod>, sid: &SessionId) -> Vec<Pod> {
        let now = Timestamp::now();
        let mut kept = Vec::with_capacity(pods.len());
        for pod in pods {
            if seal::check(&pod, &self.key, now) == SealCheck::Unsealed {
                self.remove_unsealed(&pod, sid).await;
            } else {
                kept.push(pod);
            }
        }
        kept
    }

    async fn remove_unsealed(&self, pod: &Pod, sid: &SessionId) {
        tracing::warn!(session = %sid, pod = %pod.name_any(),
            "sandbox pod has no valid seal for its uid under this server's key (a look-alike planted under a sandbox's name and labels by someone who may create pods, a pod of an older key, or one whose writer stopped before sealing it); never routing to it, deleting it");
        self.pods.retire(pod, RETIRED_UNSEALED).await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kube::{Api, ResourceExt};

    use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxRole};
    use cli_mcp_api::token::SandboxNonce;
    use cli_mcp_api::SessionId;

    use super::super::{route_of, AgentWait, Lookup, SandboxPods};
    use crate::agent_client::AgentClient;
    use crate::sessions::kubernetes::activity::ActivityStamper;
    use crate::sessions::kubernetes::testing::{
        cfg, key, nowhere, planted_namesake, stored_and_sealed,
    };

    /// A lookup whose client points nowhere: the rules tested here make no API call.
    fn lookup() -> Lookup {
        let timeout = Duration::from_secs(30);
        let pods = SandboxPods::new(
            Api::namespaced(nowhere(), "ns1"),
            ActivityStamper::new(Duration::from_secs(2)),
        );
        let agent = AgentClient::new(1 << 16).expect("agent client");
        let wait = AgentWait::new(pods.clone(), agent, key(), timeout);
        Lookup::new(pods, key(), cfg().instance, timeout, wait)
    }

    #[tokio::test]
    async fn a_planted_session_namesake_is_never_routed_to() {
        let sid = SessionId::parse("s1").expect("sid");
        let role =
            SandboxRole::session(&key(), sid.clone(), SandboxNonce::from_bytes([3; 16]), None);
        let original = stored_and_sealed(build_sandbox_pod(&cfg(), &role, "t"), "uid-session");
        let route = route_of(&sid, &original, &key()).expect("the sealed pod is routed to");
        assert_eq!(route.uid, "uid-session");
        // Its session-id label, token-sha256 and sandbox-nonce are copied: the token check
        // alone would pass, the seal does not.
        let planted = planted_namesake(&original);
        let err = route_of(&sid, &planted, &key()).expect_err("a look-alike is not routed to");
        assert!(err.to_string().contains("no valid seal"), "{err}");
        // Sealed pods are used without a wait or an API call.
        let kept = lookup()
            .sealed_or_removed(original.clone(), &sid)
            .await
            .expect("no API call")
            .expect("sealed");
        assert_eq!(kept.uid(), original.uid());
    }
}
