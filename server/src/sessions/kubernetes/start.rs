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
use cli_mcp_api::sandbox::{build_sandbox_pod, session_token_of, SandboxRole};
use cli_mcp_api::seal::sealed;
use cli_mcp_api::token::SandboxNonce;
use cli_mcp_api::wire::AssignRequest;
use cli_mcp_api::SessionId;

use super::admission::Reservation;
use super::pods::{
    agent_running, annotation_of, deleted_while_starting, endpoint_of, has_launch, pending_reason,
    pod_ip, pod_key, start_failure,
};
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
                Box::pin(timed("ready", self.wait_ready(p.clone()))),
            );
            if let Err(e) = bound {
                // No session runs without its place.
                self.retire_pod(&p, "no-slot").await;
                return Err(e);
            }
            match (seal_written, ready) {
                // A pod that never started was deleted by the wait, which says why.
                (_, Err(e)) => return Err(e),
                (Err(e), Ok(_)) => {
                    // Unsealed, no replica would route to it: gone at once, not left for
                    // another replica to find and wait on.
                    self.retire_pod(&p, "unsealed").await;
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
            Box::pin(timed("ready", self.wait_ready(p))).await?
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
                        self.pods.list(
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
        mut pod: Pod,
        sid: &SessionId,
        caller: &Caller,
        reservation: &mut Reservation<'_>,
    ) -> Result<Option<Pod>, SessionError> {
        let name = pod.name_any();
        // A fresh nonce per claim: the token opens this sandbox and no other of the session.
        let nonce = SandboxNonce::from_bytes(rand::random());
        let token = self.key.session_token(sid, &nonce).commitment().to_hex();
        let mut claimed = None;
        for attempt in 0..CLAIM_ATTEMPTS_PER_POD {
            // Without a resourceVersion the patch would not be guarded.
            let Some(rv) = pod.resource_version() else {
                return Ok(None);
            };
            let mut annotations = serde_json::Map::new();
            annotations.insert(annotation::TOKEN_SHA256.into(), json!(token));
            annotations.insert(annotation::SANDBOX_NONCE.into(), json!(nonce.to_hex()));
            annotations.insert(annotation::LAST_ACTIVITY.into(), json!(stamp_now()));
            if let Some(owner) = &caller.owner {
                annotations.insert(annotation::OWNER.into(), json!(owner));
            }
            let patch = json!({
                "metadata": {
                    "resourceVersion": rv,
                    "labels": { label::SESSION_ID: sid.as_str(), label::LAUNCH: label::LAUNCH_WARM },
                    "annotations": annotations,
                }
            });
            match timed(
                "claim",
                self.pods
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch)),
            )
            .await
            {
                Ok(p) => {
                    claimed = Some(p);
                    break;
                }
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
                    match self.pods.get_opt(&name).await? {
                        // Another uid is another pod: only a sealed one is claimed.
                        Some(p)
                            if !is_deleting(&p)
                                && is_ready(&p)
                                && !is_assigned(&p)
                                && sealed(&p, &self.key) =>
                        {
                            pod = p
                        }
                        _ => {
                            self.pool.taken(&name);
                            return Ok(None);
                        }
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        let Some(claimed) = claimed else {
            return Ok(None);
        };
        self.pool.taken(&name);
        reservation.written(&pod_key(&claimed));
        // Once the claim is written, three steps that do not depend on each other go out
        // together: the agent's `/assign`, the bind of the session's slots to the pod, and
        // the converge check (a LIST, which must begin after the claim was written).
        let (assigned, bound, winner) = tokio::join!(
            Box::pin(timed("assign", self.assign(&claimed, sid, &token))),
            Box::pin(timed("bind", reservation.slots().bind(&claimed))),
            Box::pin(timed("converge", self.other_winner(sid, &claimed))),
        );
        if let Ok(Some(winner)) = winner {
            // Another replica gave the session a pod at the same time and that one wins
            // (ours was retired by the check): use it. Our slots go with our pod, or are
            // freed unbound: that replica's are the session's.
            return self.adopt(winner, sid, caller).await.map(Some);
        }
        if let Err(e) = assigned {
            tracing::warn!(pod = %name, session = %sid, error = %e,
                "claimed warm pod did not accept /assign; deleting it and trying the next");
            self.retire_pod(&claimed, "not-assigned").await;
            // Bound to the pod just deleted, the slots would go with it: given back, and the
            // session takes new ones for the next candidate. A lost slot fails the start.
            let bound = bound?;
            reservation.slots().give_back(bound).await;
            reservation.slots().retake(sid, caller).await?;
            return Ok(None);
        }
        if let Err(e) = bound {
            // No session runs without its place.
            self.retire_pod(&claimed, "no-slot").await;
            return Err(e);
        }
        // A failed check leaves the pod claimed, assigned and bound: the call fails, and the
        // session's next call finds the pod by its label.
        winner?;
        Ok(Some(claimed))
    }

    /// `POST /assign` on a warm pod (idempotent in the agent: a repeat of the same
    /// assignment succeeds).
    pub(super) async fn assign(
        &self,
        pod: &Pod,
        sid: &SessionId,
        token_sha256: &str,
    ) -> Result<(), String> {
        let endpoint = endpoint_of(pod).ok_or("the pod has no IP")?;
        let req = AssignRequest {
            session_id: sid.clone(),
            token_sha256: token_sha256.to_owned(),
        };
        self.agent
            .assign(&endpoint, &self.key.assign_token(&pod.name_any()), &req)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
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
            match self.pods.create(&PostParams::default(), &pod).await {
                Ok(p) => return Ok((p, true)),
                Err(kube::Error::Api(s)) if s.is_already_exists() => {
                    match self.pods.get_opt(&name).await? {
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
                            let Some(existing) = self.sealed_or_removed(existing, sid).await?
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
            await_condition(self.pods.clone(), &name, cond),
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

    /// Waits until `pod`'s agent can be used: Ready with an IP (watched, not polled), or —
    /// once its container runs with an IP — its agent answering `/healthz` to the server
    /// directly. The kubelet probes readiness once a second, so without the direct check a
    /// cold start would wait up to a second for a probe that asks the same question. A pod
    /// that cannot start is deleted, so the next call starts a fresh one.
    pub(super) async fn wait_ready(&self, pod: Pod) -> Result<Pod, SessionError> {
        if is_ready(&pod) && pod_ip(&pod).is_some() {
            return Ok(pod);
        }
        let name = pod.name_any();
        let uid = pod.uid();
        let settled = |want: Option<String>| {
            move |p: Option<&Pod>| match p {
                None => true,
                Some(p) => {
                    p.uid() != want
                        || is_deleting(p)
                        || (is_ready(p) && pod_ip(p).is_some())
                        || start_failure(p).is_some()
                }
            }
        };
        let deadline = tokio::time::Instant::now() + self.limits.start_timeout;
        let want = uid.clone();
        let running = move |p: Option<&Pod>| {
            settled(want.clone())(p) || p.is_some_and(|p| agent_running(p) && pod_ip(p).is_some())
        };
        let waited = match tokio::time::timeout_at(
            deadline,
            await_condition(self.pods.clone(), &name, running),
        )
        .await
        {
            Ok(Ok(Some(p))) if p.uid() == uid && !is_deleting(&p) && !is_ready(&p) => {
                match (start_failure(&p), endpoint_of(&p)) {
                    (None, Some(endpoint)) => {
                        tokio::select! {
                            () = self.until_healthy(&endpoint) => return Ok(p),
                            w = tokio::time::timeout_at(
                                deadline,
                                await_condition(self.pods.clone(), &name, settled(uid.clone())),
                            ) => w,
                        }
                    }
                    _ => Ok(Ok(Some(p))),
                }
            }
            other => other,
        };
        let outcome: Result<(), String> = match waited {
            Err(_) => {
                let why = self
                    .pods
                    .get_opt(&name)
                    .await
                    .ok()
                    .flatten()
                    .map(|p| pending_reason(&p))
                    .unwrap_or_default();
                Err(format!(
                    "pod {name} did not become ready within {:?}{why}",
                    self.limits.start_timeout
                ))
            }
            Ok(Err(e)) => return Err(SessionError::Kubernetes(e.to_string())),
            Ok(Ok(None)) => return Err(deleted_while_starting(&name)),
            Ok(Ok(Some(p))) if p.uid() != uid || is_deleting(&p) => {
                return Err(deleted_while_starting(&name))
            }
            Ok(Ok(Some(p))) => match start_failure(&p) {
                Some(reason) => Err(format!("pod {name} cannot start: {reason}")),
                None => return Ok(p),
            },
        };
        let msg = outcome.err().unwrap_or_default();
        self.retire_pod(&pod, "never-started").await;
        Err(SessionError::Sandbox(format!(
            "{msg}; it was deleted, and the next call starts a new sandbox (check the instance's sandbox image and resources)"
        )))
    }

    /// Returns once the agent at `endpoint` answers `/healthz`; the caller bounds the wait.
    /// Polls (the agent cannot announce itself), from 5 ms up to 100 ms apart: a container
    /// that has just started usually answers within tens of milliseconds.
    async fn until_healthy(&self, endpoint: &str) {
        let mut pause = Duration::from_millis(5);
        while !self.agent.healthy(endpoint).await {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(100));
        }
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
            Some(winner) => self.adopt(winner, sid, caller).await,
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
            .list(&ListParams::default().labels(&self.instance.session_selector(sid)))
            .await?;
        let live: Vec<Pod> = list.items.into_iter().filter(|p| !is_deleting(p)).collect();
        if live.len() <= 1 {
            return Ok(None);
        }
        Ok(self
            .resolve_duplicates(live, sid)
            .await
            .filter(|winner| winner.uid() != ours.uid()))
    }

    /// A claimed warm pod found by label may not have had its `/assign` yet (its claimer is
    /// still on the way): assign it ourselves; the agent accepts a repeat of the same
    /// assignment.
    pub(super) async fn ensure_assigned(
        &self,
        pod: &Pod,
        sid: &SessionId,
    ) -> Result<(), SessionError> {
        if !has_launch(pod, label::LAUNCH_WARM) || !is_ready(pod) {
            return Ok(());
        }
        let token = session_token_of(pod, sid, &self.key).ok_or_else(|| {
            SessionError::Sandbox(format!(
                "pod {} was claimed for session {sid} without a token of this server's key",
                pod.name_any()
            ))
        })?;
        self.assign(pod, sid, &token.commitment().to_hex())
            .await
            .map_err(|e| {
                SessionError::Sandbox(format!(
                    "pod {} did not accept /assign: {e}",
                    pod.name_any()
                ))
            })
    }
}
