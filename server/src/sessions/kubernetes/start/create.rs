//! Creating a session's own pod when no warm pod could be claimed: the credential proxy
//! checked first (fail closed), the pod created under its deterministic name (concurrent
//! creators meet in `AlreadyExists` and adopt one pod), sealed by this replica, its slots
//! bound, and its agent waited for.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::ResourceExt;
use serde_json::json;

use cli_mcp_api::activity::stamp_now;
use cli_mcp_api::names::annotation;
use cli_mcp_api::pod_state::is_deleting;
use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxRole};
use cli_mcp_api::seal;
use cli_mcp_api::token::SandboxNonce;
use cli_mcp_api::SessionId;

use super::Starter;
use crate::auth::Caller;
use crate::sessions::kubernetes::admission::Reservation;
use crate::sessions::kubernetes::pods::{annotation_of, deleted_while_starting, pod_key};
use crate::sessions::kubernetes::steps::timed;
use crate::sessions::{owner_allows, SessionError};

/// What a created pod comes to once its seal, the bind of its slots and the wait for its
/// agent, which go out side by side, have all returned.
#[derive(Debug)]
enum Created {
    /// Sealed, bound and Ready: the session's pod (before the converge check).
    Ready(Box<Pod>),
    /// The start fails; the pod is retired with this reason first.
    Retire(&'static str, SessionError),
    /// The start fails; the pod is already gone (the wait deleted it and says why).
    Failed(SessionError),
}

impl Starter {
    /// The cold start: creates the session's pod (or adopts the one another replica created
    /// first), hands the reservation on, and returns the pod once Ready; sealed and bound
    /// when this replica created it.
    pub(super) async fn start_cold(
        &self,
        sid: &SessionId,
        caller: &Caller,
        reservation: &mut Reservation<'_>,
    ) -> Result<Pod, SessionError> {
        let (p, created) = Box::pin(timed("create", self.create_cold(sid, caller))).await?;
        reservation.written(&pod_key(&p));
        if !created {
            return Box::pin(timed("ready", self.agent_wait.wait_ready(p))).await;
        }
        // Independent: the seal and the bind are API writes, the wait is for the pod's agent.
        let (seal_written, bound, ready) = tokio::join!(
            Box::pin(timed("seal", self.seal(&p))),
            Box::pin(timed("bind", reservation.slots().bind(&p))),
            Box::pin(timed("ready", self.agent_wait.wait_ready(p.clone()))),
        );
        match after_create(&p, seal_written, bound.map(drop), ready) {
            Created::Ready(ready) => Ok(*ready),
            Created::Retire(why, e) => {
                self.pods.retire(&p, why).await;
                Err(e)
            }
            Created::Failed(e) => Err(e),
        }
    }

    /// Seals `pod`, which this replica has just created, and returns the seal written. The
    /// uid in the patch is a precondition: a namesake created since is not sealed (409).
    async fn seal(&self, pod: &Pod) -> Result<String, SessionError> {
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
            .api()
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

    /// Fail closed: with a credential proxy, no sandbox is created while its Deployment has
    /// no ready replica (the sandbox could reach nothing it was given, and the operator
    /// creates no warm pods either). One GET per new cold session, next to the pod's create
    /// and the wait for its agent; a watch of the Deployment would cost every replica a
    /// stream and could answer from a stale view, where this check must see the present.
    async fn proxy_serves(&self) -> Result<(), SessionError> {
        if self.cfg.proxy.is_none() {
            return Ok(());
        }
        // Named as the operator names it (every proxy child has the instance's proxy name).
        let name = self.cfg.instance.proxy();
        let ready = self
            .deployments
            .get_opt(&name)
            .await?
            .and_then(|d| d.status)
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0);
        if ready >= 1 {
            return Ok(());
        }
        Err(SessionError::Sandbox(format!(
            "the instance's credential proxy (Deployment {name}) has no ready replica, and no \
             sandbox starts without it; retry in a few seconds, or ask the admin to check the \
             CliMcpInstance's Ready condition"
        )))
    }

    /// Creates the session's own pod, or adopts it when another replica created it first
    /// (then `false`).
    async fn create_cold(
        &self,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<(Pod, bool), SessionError> {
        self.proxy_serves().await?;
        let mut pod = build_sandbox_pod(
            &self.cfg,
            &SandboxRole::session(
                &self.key,
                sid.clone(),
                SandboxNonce::from_bytes(rand::random()),
                caller.owner.clone(),
            ),
            &stamp_now(),
        );
        record_caller(&mut pod, caller);
        let name = pod.name_any();
        for _ in 0..3 {
            match self.pods.api().create(&PostParams::default(), &pod).await {
                Ok(p) => return Ok((p, true)),
                Err(kube::Error::Api(s)) if s.is_already_exists() => {
                    match self.pods.api().get_opt(&name).await? {
                        // Gone in between: create again.
                        None => continue,
                        // The previous pod of this session is still terminating: wait for it.
                        Some(old) if is_deleting(&old) => {
                            self.wait_gone(&old).await?;
                            continue;
                        }
                        // Another replica created it: adopted once sealed, if it is the
                        // caller's. The lookup that checks the owner was skipped for a session
                        // new to the pod watch, so a different identity racing on the same id
                        // ends here, and must not run in that pod. A look-alike planted under
                        // the session's name is deleted, and the create tried again.
                        Some(existing) => {
                            let Some(existing) =
                                self.lookup.sealed_or_removed(existing, sid).await?
                            else {
                                continue;
                            };
                            if !owner_allows(annotation_of(&existing, annotation::OWNER), caller) {
                                return Err(SessionError::Forbidden(sid.clone()));
                            }
                            return Ok((existing, false));
                        }
                    }
                }
                Err(e) => return Err(missing_runtime_class(&e).unwrap_or_else(|| e.into())),
            }
        }
        Err(SessionError::Sandbox(format!(
            "pod {name} kept being replaced while it was created; retry the call"
        )))
    }

    async fn wait_gone(&self, pod: &Pod) -> Result<(), SessionError> {
        let name = pod.name_any();
        let uid = pod.uid();
        let cond = move |p: Option<&Pod>| p.is_none_or(|p| p.uid() != uid);
        tokio::time::timeout(
            self.start_timeout,
            await_condition(self.pods.api().clone(), &name, cond),
        )
        .await
        .map_err(|_| {
            SessionError::Sandbox(format!(
                "the previous pod {name} of this session is still terminating after {:?}",
                self.start_timeout
            ))
        })?
        .map_err(|e| SessionError::Kubernetes(e.to_string()))?;
        Ok(())
    }
}

/// The API server's RuntimeClass admission refuses a pod naming a class the cluster lacks
/// (`pods "…" is forbidden: pod rejected: RuntimeClass "x" not found`). Passed on as it is,
/// that reads like this server's own permissions; it is the instance's
/// `spec.sandbox.runtimeClassName`, which only an admin can fix, so the caller is told that.
fn missing_runtime_class(e: &kube::Error) -> Option<SessionError> {
    let kube::Error::Api(s) = e else {
        return None;
    };
    let (_, rest) = s.message.split_once("RuntimeClass \"")?;
    let (class, _) = rest.split_once("\" not found")?;
    (s.code == 403).then(|| {
        SessionError::Sandbox(format!(
            "the instance's sandboxes name RuntimeClass \"{class}\" \
             (spec.sandbox.runtimeClassName), which this cluster does not have, so the API \
             server refuses them; ask the cluster admin to create that RuntimeClass (and \
             install its runtime) or to change the field: the CliMcpInstance's Ready \
             condition says RuntimeClassNotFound until then, and a retry gets the same"
        ))
    })
}

/// With auth, who the session's pod serves (annotation `caller`: user and groups), for the
/// credential proxy's audit and impersonation; with auth off, nothing.
fn record_caller(pod: &mut Pod, caller: &Caller) {
    if let Some(who) = caller.annotation() {
        pod.annotations_mut().insert(annotation::CALLER.into(), who);
    }
}

/// What the created pod `p` comes to, given its seal (`seal_written`), the bind of its
/// slots (`bound`) and the wait for its agent (`ready`).
fn after_create(
    p: &Pod,
    seal_written: Result<String, SessionError>,
    bound: Result<(), SessionError>,
    ready: Result<Pod, SessionError>,
) -> Created {
    if let Err(e) = bound {
        // No session runs without its place.
        return Created::Retire("no-slot", e);
    }
    match (seal_written, ready) {
        // A pod that never started was deleted by the wait, which says why.
        (_, Err(e)) => Created::Failed(e),
        // Unsealed, no replica would route to it: gone at once, not left for another replica
        // to find and wait on.
        (Err(e), Ok(_)) => Created::Retire("unsealed", e),
        (Ok(seal), Ok(mut ready)) => {
            // The wait may have returned the pod as it was before the seal was written.
            if ready.uid() == p.uid() {
                ready
                    .annotations_mut()
                    .insert(annotation::SEAL.into(), seal);
            }
            Created::Ready(Box::new(ready))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some("cli-mcp-demo-s-x".into());
        p.metadata.uid = Some(uid.into());
        p
    }

    fn err(m: &str) -> SessionError {
        SessionError::Sandbox(m.into())
    }

    #[test]
    fn a_missing_runtime_class_is_told_as_the_instances_and_other_refusals_as_they_are() {
        let api = |code: u16, message: &str| {
            kube::Error::Api(
                kube::core::Status::failure(message, "Forbidden")
                    .with_code(code)
                    .boxed(),
            )
        };
        let refused = api(
            403,
            "pods \"cli-mcp-demo-s-x\" is forbidden: pod rejected: RuntimeClass \"gvisor\" \
             not found",
        );
        let e = missing_runtime_class(&refused)
            .expect("a missing class")
            .to_string();
        assert!(
            e.starts_with("the sandbox of this session could not be started")
                && e.contains("RuntimeClass \"gvisor\"")
                && e.contains("spec.sandbox.runtimeClassName")
                && e.contains("RuntimeClassNotFound"),
            "{e}"
        );
        // Any other refusal keeps the API's own words.
        for other in [
            api(403, "pods \"x\" is forbidden: exceeded quota: pods"),
            api(422, "RuntimeClass \"gvisor\" not found"),
        ] {
            assert!(missing_runtime_class(&other).is_none(), "{other}");
        }
    }

    #[test]
    fn a_created_pod_records_its_caller_only_with_auth() {
        use cli_mcp_api::proxy::SessionCaller;
        let mut p = pod("u1");
        record_caller(&mut p, &Caller::anonymous());
        assert!(p.annotations().get(annotation::CALLER).is_none());
        let alice = Caller::identified("alice").with_groups(vec!["dev".into()]);
        record_caller(&mut p, &alice);
        let who = p.annotations().get(annotation::CALLER).expect("auth on");
        assert_eq!(
            SessionCaller::from_annotation(who),
            Some(SessionCaller {
                user: "alice".into(),
                groups: vec!["dev".into()],
            })
        );
    }

    #[test]
    fn a_created_pod_without_its_slots_is_retired_whatever_else_happened() {
        let p = pod("u1");
        let c = after_create(&p, Ok("seal".into()), Err(err("slot")), Ok(pod("u1")));
        assert!(matches!(c, Created::Retire("no-slot", _)), "{c:?}");
        let c = after_create(&p, Err(err("seal")), Err(err("slot")), Err(err("wait")));
        assert!(matches!(c, Created::Retire("no-slot", _)), "{c:?}");
    }

    #[test]
    fn an_unsealed_ready_pod_is_retired_and_a_pod_that_never_started_is_already_gone() {
        let p = pod("u1");
        let c = after_create(&p, Err(err("seal")), Ok(()), Ok(pod("u1")));
        assert!(matches!(c, Created::Retire("unsealed", _)), "{c:?}");
        let c = after_create(&p, Ok("seal".into()), Ok(()), Err(err("wait")));
        assert!(matches!(c, Created::Failed(_)), "{c:?}");
    }

    #[test]
    fn the_ready_pod_carries_the_seal_written_unless_it_is_another_pod() {
        let p = pod("u1");
        let Created::Ready(ready) = after_create(&p, Ok("s1".into()), Ok(()), Ok(pod("u1"))) else {
            panic!("ready");
        };
        assert_eq!(
            ready
                .annotations()
                .get(annotation::SEAL)
                .map(String::as_str),
            Some("s1")
        );
        let Created::Ready(other) = after_create(&p, Ok("s1".into()), Ok(()), Ok(pod("u2"))) else {
            panic!("ready");
        };
        assert!(other.annotations().get(annotation::SEAL).is_none());
    }
}
