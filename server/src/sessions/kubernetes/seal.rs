//! Sandbox pods are trusted by their seal (`cli_mcp_api::seal`), never by their name, labels
//! or annotations: whoever may create pods in the namespace can copy all of those onto a pod
//! of their own, but not the uid the API server gave the original, which the seal is bound to.
//!
//! This replica seals every pod it creates, right after the create. Every pod a session is
//! routed to must be sealed: a pod found for a session, or offered by the warm pool, that is
//! not sealed is never sent a command or a token. A pod that may still be sealed by its writer
//! (younger than the seal's grace) is waited for; any other unsealed pod is deleted, so the
//! session can get a real one.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::wait::await_condition;
use kube::ResourceExt;
use serde_json::json;

use cli_mcp_api::names::annotation;
use cli_mcp_api::pod_state::is_deleting;
use cli_mcp_api::seal::{self, sealed, SealCheck};
use cli_mcp_api::SessionId;

use super::pods::deleted_while_starting;
use super::KubeBackend;
use crate::sessions::SessionError;

/// The `retired` reason of a pod deleted because it is not sealed.
const RETIRED_UNSEALED: &str = "unsealed";

impl KubeBackend {
    /// Seals `pod`, which this replica has just created, and returns the seal written. The
    /// uid in the patch is a precondition: a namesake created since is not sealed (409).
    pub(super) async fn seal(&self, pod: &Pod) -> Result<String, SessionError> {
        let name = pod.name_any();
        let value = seal::seal_for(pod, &self.key).ok_or_else(|| {
            SessionError::Sandbox(format!(
                "the API server returned pod {name} without a namespace or uid, so it cannot be sealed"
            ))
        })?;
        let patch =
            json!({"metadata": {"uid": pod.uid(), "annotations": {annotation::SEAL: &value}}});
        match self
            .pods
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(value),
            Err(kube::Error::Api(s)) if s.is_not_found() || s.is_conflict() => {
                Err(deleted_while_starting(&name))
            }
            Err(e) => Err(match SessionError::from(e) {
                SessionError::Kubernetes(m) => {
                    SessionError::Kubernetes(format!("sealing pod {name}: {m}"))
                }
                SessionError::KubernetesRefused(m) => {
                    SessionError::KubernetesRefused(format!("sealing pod {name}: {m}"))
                }
                other => other,
            }),
        }
    }

    /// `pod` once it is sealed: at once, or within the seal's grace (the replica that has
    /// just created it seals it right after the create). A pod that is not sealed and will not
    /// be is deleted, never routed to; `None` then, and also when the pod went away or was
    /// replaced while this waited: the session has no usable pod.
    pub(super) async fn sealed_or_removed(
        &self,
        pod: Pod,
        sid: &SessionId,
    ) -> Result<Option<Pod>, SessionError> {
        let wait = match seal::check(&pod, &self.key, Timestamp::now()) {
            SealCheck::Sealed => return Ok(Some(pod)),
            SealCheck::Awaited(left) => left.min(self.limits.start_timeout),
            SealCheck::Unsealed => Duration::ZERO,
        };
        let name = pod.name_any();
        if !wait.is_zero() {
            let (uid, key) = (pod.uid(), self.key.clone());
            let settled = move |p: Option<&Pod>| {
                p.is_none_or(|p| p.uid() != uid || is_deleting(p) || sealed(p, &key))
            };
            match tokio::time::timeout(wait, await_condition(self.pods.clone(), &name, settled))
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
        self.retire_pod(pod, RETIRED_UNSEALED).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use k8s_openapi::api::core::v1::Pod;
    use kube::ResourceExt;

    use cli_mcp_api::names::{annotation, InstanceName, PoolSuffix};
    use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxRole};
    use cli_mcp_api::seal::seal_for;
    use cli_mcp_api::token::{HmacKey, SandboxNonce};
    use cli_mcp_api::SessionId;

    use super::super::KubeBackend;
    use crate::agent_client::AgentClient;
    use crate::cli::Limits;
    use crate::metrics::Metrics;

    fn key() -> HmacKey {
        HmacKey::from_bytes([8; 32])
    }

    fn cfg() -> SandboxConfig {
        SandboxConfig::new(InstanceName::parse("demo").expect("name"), "ns1", "img:1")
    }

    /// A backend whose client points nowhere: the rules tested here make no API call.
    fn backend() -> Arc<KubeBackend> {
        let url = "http://127.0.0.1:9".parse().expect("url");
        let client = kube::Client::try_from(kube::Config::new(url)).expect("client");
        let agent = AgentClient::new(1 << 16).expect("agent client");
        KubeBackend::new(
            client,
            cfg(),
            key(),
            agent,
            Limits::default(),
            Arc::new(Metrics::new()),
        )
    }

    /// `p` as the API server returns it once Ready, sealed by its writer.
    fn stored_and_sealed(mut p: Pod, uid: &str) -> Pod {
        p.metadata.uid = Some(uid.into());
        p.metadata.resource_version = Some("7".into());
        p.status = Some(
            serde_json::from_value(serde_json::json!({
                "phase": "Running", "podIP": "10.1.0.7",
                "conditions": [{"type": "Ready", "status": "True"}]
            }))
            .expect("status"),
        );
        let seal = seal_for(&p, &key()).expect("namespace, name and uid");
        p.annotations_mut().insert(annotation::SEAL.into(), seal);
        p
    }

    /// The attack: the original deleted and recreated under its name with all its labels,
    /// annotations (the seal too) and env. Only the uid differs: the API server chose it.
    fn planted_namesake(original: &Pod) -> Pod {
        let mut p = original.clone();
        p.metadata.uid = Some("uid-the-api-server-gave-the-plant".into());
        p
    }

    fn warm_pod() -> Pod {
        let suffix = PoolSuffix::from_random_bytes([4; PoolSuffix::LEN]);
        let name = cfg().instance.pool_pod(&suffix);
        let assign = key().assign_token(&name).commitment();
        let p = build_sandbox_pod(&cfg(), &SandboxRole::Pool { suffix, assign }, "t");
        stored_and_sealed(p, "uid-warm")
    }

    #[tokio::test]
    async fn a_planted_warm_namesake_is_never_claimable() {
        let b = backend();
        let original = warm_pod();
        let planted = planted_namesake(&original);
        assert!(b.could_claim(&original));
        assert!(!b.could_claim(&planted), "the view's filter");
        let listed = b.claimable(vec![planted.clone()], true);
        assert!(listed.is_empty(), "a listed pool");
        let mut unsealed = original.clone();
        unsealed.annotations_mut().remove(annotation::SEAL);
        assert!(!b.could_claim(&unsealed));
        let both = b.claimable(vec![planted, original.clone(), unsealed], false);
        assert_eq!(both.len(), 1);
        assert_eq!(both[0].uid(), original.uid());
    }

    #[tokio::test]
    async fn a_planted_session_namesake_is_never_routed_to() {
        let b = backend();
        let sid = SessionId::parse("s1").expect("sid");
        let role =
            SandboxRole::session(&key(), sid.clone(), SandboxNonce::from_bytes([3; 16]), None);
        let original = stored_and_sealed(build_sandbox_pod(&cfg(), &role, "t"), "uid-session");
        let route = b
            .route_of(&sid, &original)
            .expect("the sealed pod is routed to");
        assert_eq!(route.uid, "uid-session");
        // Its session-id label, token-sha256 and sandbox-nonce are copied: the token check
        // alone would pass, the seal does not.
        let planted = planted_namesake(&original);
        let err = b
            .route_of(&sid, &planted)
            .expect_err("a look-alike is not routed to");
        assert!(err.to_string().contains("no valid seal"), "{err}");
        // Sealed pods are used without a wait or an API call.
        let kept = b
            .sealed_or_removed(original.clone(), &sid)
            .await
            .expect("no API call")
            .expect("sealed");
        assert_eq!(kept.uid(), original.uid());
    }
}
