//! Starting a session's sandbox: claim a warm pool pod (guarded patch, then `/assign`), else
//! create the session's own pod (deterministic name, so concurrent creators adopt one pod),
//! wait for it to be Ready, and converge with other replicas that did the same.

use std::collections::HashSet;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::ResourceExt;
use serde_json::json;

use cli_mcp_api::activity::stamp_now;
use cli_mcp_api::names::{annotation, label};
use cli_mcp_api::pod_state::{is_assigned, is_deleting, is_ready};
use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxRole};
use cli_mcp_api::seal::{self, sealed};
use cli_mcp_api::token::{HmacKey, SandboxNonce};
use cli_mcp_api::SessionId;

use super::admission::Reservation;
use super::pods::{annotation_of, deleted_while_starting, pod_key};
use super::steps::timed;
use super::KubeBackend;
use crate::auth::Caller;
use crate::metrics::Launch;
use crate::sessions::{owner_allows, SessionError};

/// A warm pod is retried after a 409 at most this many times (the 409 may come from a
/// status update, not from another claimer).
pub(super) const CLAIM_ATTEMPTS_PER_POD: usize = 2;

/// How long the converge check waits for the pod watch to report the pod just written before
/// it asks the API with a LIST instead (the watch usually reports it within milliseconds).
const CONVERGE_VIEW_WAIT: Duration = Duration::from_millis(500);

impl KubeBackend {
    /// Claims a warm pod, else creates one; returns it Ready, converged with other replicas
    /// that started the session at the same time (see [`Self::converge`]). The reservation
    /// is handed on as soon as the pod is written, and the slots become owned by the pod. A
    /// pod another replica created for the session first is adopted without them (they are
    /// freed: that replica's slots are the session's).
    pub(super) async fn start_new(
        &self,
        sid: &SessionId,
        caller: &Caller,
        reservation: &mut Reservation<'_>,
    ) -> Result<(Pod, Launch), SessionError> {
        if let Some(p) = Box::pin(self.claim_warm(sid, caller, reservation)).await? {
            return Ok((p, Launch::Warm));
        }
        let (p, created) = Box::pin(timed("create", self.create_cold(sid, caller))).await?;
        reservation.written(&pod_key(&p));
        let ready = if created {
            // Independent: the seal and the bind are API writes, the wait is for the pod's
            // agent.
            let (seal_written, bound, ready) = tokio::join!(
                Box::pin(timed("seal", self.seal(&p))),
                Box::pin(timed("bind", reservation.slots().bind(&p))),
                Box::pin(timed("ready", self.agent_wait.wait_ready(p.clone()))),
            );
            if let Err(e) = bound {
                // No session runs without its place.
                self.pods.retire(&p, "no-slot").await;
                return Err(e);
            }
            match (seal_written, ready) {
                // A pod that never started was deleted by the wait, which says why.
                (_, Err(e)) => return Err(e),
                (Err(e), Ok(_)) => {
                    // Unsealed, no replica would route to it: gone at once, not left for
                    // another replica to find and wait on.
                    self.pods.retire(&p, "unsealed").await;
                    return Err(e);
                }
                (Ok(seal), Ok(mut ready)) => {
                    // The wait may have returned the pod as it was before the seal was
                    // written.
                    if ready.uid() == p.uid() {
                        ready
                            .annotations_mut()
                            .insert(annotation::SEAL.into(), seal);
                    }
                    ready
                }
            }
        } else {
            Box::pin(timed("ready", self.agent_wait.wait_ready(p))).await?
        };
        let pod = Box::pin(timed("converge", self.converge(sid, ready, caller))).await?;
        Ok((pod, Launch::Cold))
    }

    /// Tries the warm pool; `None` when no pod could be claimed. The candidates come from the
    /// pool's watch ([`super::warm`]), without an API call. The view may lag behind the pool
    /// (a pod that became Ready a moment ago): before a cold start, and while the view cannot
    /// be trusted, the pool is listed instead, so no start goes cold that a LIST would have
    /// made warm.
    pub(super) async fn claim_warm(
        &self,
        sid: &SessionId,
        caller: &Caller,
        reservation: &mut Reservation<'_>,
    ) -> Result<Option<Pod>, SessionError> {
        let mut tried = HashSet::new();
        // From the view, only pods this replica could claim (what `claimable` keeps; its
        // warnings are for a listed pool only).
        let mut view = self.pool.pods(|p| self.could_claim(p));
        loop {
            let listed = view.is_none();
            let pool = match view.take() {
                Some(pods) => pods,
                None => {
                    timed(
                        "pool",
                        self.pods.api().list(
                            &ListParams::default().labels(&self.instance.unassigned_selector()),
                        ),
                    )
                    .await?
                    .items
                }
            };
            let candidates = self.claimable(pool, listed);
            for pod in candidates {
                if !tried.insert(pod.name_any()) {
                    continue;
                }
                let claim = Box::pin(self.try_claim(pod, sid, caller, reservation));
                if let Some(claimed) = claim.await? {
                    return Ok(Some(claimed));
                }
            }
            if listed {
                return Ok(None);
            }
        }
    }

    /// Claims one warm pod: guarded patch, then `/assign`, the bind of the session's slots
    /// and the converge check side by side. Deletes the pod on any failure after the patch,
    /// so it is never left half-assigned. `Some` is the session's pod: the one claimed, or
    /// the one another replica gave the session at the same time.
    pub(super) async fn try_claim(
        &self,
        pod: Pod,
        sid: &SessionId,
        caller: &Caller,
        reservation: &mut Reservation<'_>,
    ) -> Result<Option<Pod>, SessionError> {
        let name = pod.name_any();
        // A fresh nonce per claim: the token opens this sandbox and no other of the session.
        let nonce = SandboxNonce::from_bytes(rand::random());
        let token = self.key.session_token(sid, &nonce).commitment().to_hex();
        let Some(claimed) = self.patch_claim(pod, sid, caller, &token, &nonce).await? else {
            return Ok(None);
        };
        self.pool.taken(&name);
        reservation.written(&pod_key(&claimed));
        self.settle_claim(claimed, sid, caller, &token, reservation)
            .await
    }

    /// The claim itself: a merge patch guarded by the pod's `resourceVersion`, tried again
    /// (at most [`CLAIM_ATTEMPTS_PER_POD`] times) on a 409 while the pod, read again, is still
    /// one to claim. `None` when the pod was lost to another claimer, changed, or went away.
    async fn patch_claim(
        &self,
        mut pod: Pod,
        sid: &SessionId,
        caller: &Caller,
        token: &str,
        nonce: &SandboxNonce,
    ) -> Result<Option<Pod>, SessionError> {
        let name = pod.name_any();
        for attempt in 0..CLAIM_ATTEMPTS_PER_POD {
            // Without a resourceVersion the patch would not be guarded.
            let Some(rv) = pod.resource_version() else {
                return Ok(None);
            };
            let owner = caller.owner.as_deref();
            let patch = claim_patch(&rv, sid, token, nonce, owner, &stamp_now());
            match timed(
                "claim",
                self.pods
                    .api()
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch)),
            )
            .await
            {
                Ok(p) => return Ok(Some(p)),
                Err(kube::Error::Api(s)) if s.is_not_found() => {
                    self.pool.taken(&name);
                    return Ok(None);
                }
                Err(kube::Error::Api(s)) if s.is_conflict() => {
                    // Lost to another claimer, or the pod changed (status update; or the
                    // pool's view was behind): look again.
                    self.metrics.claim_conflicts.inc();
                    if attempt + 1 == CLAIM_ATTEMPTS_PER_POD {
                        return Ok(None);
                    }
                    match self.pods.api().get_opt(&name).await? {
                        // Another uid is another pod: only a sealed one is claimed.
                        Some(p) if still_claimable(&p, &self.key) => pod = p,
                        _ => {
                            self.pool.taken(&name);
                            return Ok(None);
                        }
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(None)
    }

    /// Once the claim is written, three steps that do not depend on each other go out
    /// together: the agent's `/assign`, the bind of the session's slots to the pod, and the
    /// converge check (a LIST, which must begin after the claim was written). Their outcomes
    /// decide which pod the session gets, if any.
    async fn settle_claim(
        &self,
        claimed: Pod,
        sid: &SessionId,
        caller: &Caller,
        token: &str,
        reservation: &mut Reservation<'_>,
    ) -> Result<Option<Pod>, SessionError> {
        let (assigned, bound, winner) = tokio::join!(
            Box::pin(timed(
                "assign",
                self.agent_wait.assign(&claimed, sid, token)
            )),
            Box::pin(timed("bind", reservation.slots().bind(&claimed))),
            Box::pin(timed("converge", self.other_winner(sid, &claimed))),
        );
        if let Ok(Some(winner)) = winner {
            // Another replica gave the session a pod at the same time and that one wins
            // (ours was retired by the check): use it. Our slots go with our pod, or are
            // freed unbound: that replica's are the session's.
            return self.lookup.adopt(winner, sid, caller).await.map(Some);
        }
        if let Err(e) = assigned {
            tracing::warn!(pod = %claimed.name_any(), session = %sid, error = %e,
                "claimed warm pod did not accept /assign; deleting it and trying the next");
            self.pods.retire(&claimed, "not-assigned").await;
            // Bound to the pod just deleted, the slots would go with it: given back, and the
            // session takes new ones for the next candidate. A lost slot fails the start.
            let bound = bound?;
            reservation.slots().give_back(bound).await;
            reservation.slots().retake(sid, caller).await?;
            return Ok(None);
        }
        if let Err(e) = bound {
            // No session runs without its place.
            self.pods.retire(&claimed, "no-slot").await;
            return Err(e);
        }
        // A failed check leaves the pod claimed, assigned and bound: the call fails, and the
        // session's next call finds the pod by its label.
        winner?;
        Ok(Some(claimed))
    }

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
        let name = self.instance.proxy();
        let api: kube::Api<Deployment> =
            kube::Api::namespaced(self.client.clone(), &self.cfg.namespace);
        let ready = api
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
    pub(super) async fn create_cold(
        &self,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<(Pod, bool), SessionError> {
        self.proxy_serves().await?;
        let pod = build_sandbox_pod(
            &self.cfg,
            &SandboxRole::session(
                &self.key,
                sid.clone(),
                SandboxNonce::from_bytes(rand::random()),
                caller.owner.clone(),
            ),
            &stamp_now(),
        );
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
                Err(e) => return Err(e.into()),
            }
        }
        Err(SessionError::Sandbox(format!(
            "pod {name} kept being replaced while it was created; retry the call"
        )))
    }

    pub(super) async fn wait_gone(&self, pod: &Pod) -> Result<(), SessionError> {
        let name = pod.name_any();
        let uid = pod.uid();
        let cond = move |p: Option<&Pod>| p.is_none_or(|p| p.uid() != uid);
        tokio::time::timeout(
            self.limits.start_timeout,
            await_condition(self.pods.api().clone(), &name, cond),
        )
        .await
        .map_err(|_| {
            SessionError::Sandbox(format!(
                "the previous pod {name} of this session is still terminating after {:?}",
                self.limits.start_timeout
            ))
        })?
        .map_err(|e| SessionError::Kubernetes(e.to_string()))?;
        Ok(())
    }

    /// After a create: if another replica gave the session a second pod at the same time,
    /// every replica keeps the same one.
    pub(super) async fn converge(
        &self,
        sid: &SessionId,
        ours: Pod,
        caller: &Caller,
    ) -> Result<Pod, SessionError> {
        match self.other_winner(sid, &ours).await? {
            None => Ok(ours),
            Some(winner) => self.lookup.adopt(winner, sid, caller).await,
        }
    }

    /// The converge check, once `ours` is written: the session's pods as of a moment after
    /// the write, so of two replicas that wrote a pod each, at least the later one sees both;
    /// with two or more, the losers are retired and the winner is returned unless it is
    /// `ours`. Every replica picks the same winner. The pod watch's view answers as soon as it
    /// has reported `ours` (see [`super::admission::SessionView::pods_after_write`]); a LIST,
    /// which sees every pod written before it began, when the view cannot tell or shows a
    /// second pod.
    pub(super) async fn other_winner(
        &self,
        sid: &SessionId,
        ours: &Pod,
    ) -> Result<Option<Pod>, SessionError> {
        let in_view = self
            .admission
            .view()
            .pods_after_write(sid, &pod_key(ours), CONVERGE_VIEW_WAIT)
            .await;
        if in_view == Some(1) {
            return Ok(None);
        }
        let list = self
            .pods
            .api()
            .list(&ListParams::default().labels(&self.instance.session_selector(sid)))
            .await?;
        let live: Vec<Pod> = list.items.into_iter().filter(|p| !is_deleting(p)).collect();
        if live.len() <= 1 {
            return Ok(None);
        }
        Ok(self
            .lookup
            .resolve_duplicates(live, sid)
            .await
            .filter(|winner| winner.uid() != ours.uid()))
    }
}

/// The claim's merge patch of a warm pod at `resource_version` (the guard): the session's
/// label and launch, its token's hash and nonce, the first activity stamp, and the owner.
fn claim_patch(
    resource_version: &str,
    sid: &SessionId,
    token: &str,
    nonce: &SandboxNonce,
    owner: Option<&str>,
    stamp: &str,
) -> serde_json::Value {
    let mut annotations = serde_json::Map::new();
    annotations.insert(annotation::TOKEN_SHA256.into(), json!(token));
    annotations.insert(annotation::SANDBOX_NONCE.into(), json!(nonce.to_hex()));
    annotations.insert(annotation::LAST_ACTIVITY.into(), json!(stamp));
    if let Some(owner) = owner {
        annotations.insert(annotation::OWNER.into(), json!(owner));
    }
    json!({
        "metadata": {
            "resourceVersion": resource_version,
            "labels": { label::SESSION_ID: sid.as_str(), label::LAUNCH: label::LAUNCH_WARM },
            "annotations": annotations,
        }
    })
}

/// Whether a warm pod read again after a 409 is still one to claim: not going, Ready, not
/// assigned, and sealed (another uid is another pod).
fn still_claimable(p: &Pod, key: &HmacKey) -> bool {
    !is_deleting(p) && is_ready(p) && !is_assigned(p) && sealed(p, key)
}
