//! Claiming a warm pool pod for a session: the candidates (the pool's view, or a LIST of the
//! pool), the claim's guarded patch, then `/assign`, the bind of the session's slots and the
//! converge check side by side. A claimed pod that fails any of those is retired, never left
//! half-assigned.

use std::collections::HashSet;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;

use cli_mcp_api::activity::stamp_now;
use cli_mcp_api::names::{annotation, label};
use cli_mcp_api::pod_state::{is_assigned, is_deleting, is_ready};
use cli_mcp_api::seal::sealed;
use cli_mcp_api::token::{HmacKey, SandboxNonce};
use cli_mcp_api::SessionId;

use super::Starter;
use crate::auth::Caller;
use crate::sessions::kubernetes::admission::Reservation;
use crate::sessions::kubernetes::pods::pod_key;
use crate::sessions::kubernetes::steps::timed;
use crate::sessions::SessionError;

/// A warm pod is retried after a 409 at most this many times (the 409 may come from a
/// status update, not from another claimer).
const CLAIM_ATTEMPTS_PER_POD: usize = 2;

impl Starter {
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
        let mut view = self.pool.pods(|p| self.fit.could_claim(p));
        loop {
            let listed = view.is_none();
            let pool = match view.take() {
                Some(pods) => pods,
                None => {
                    timed(
                        "pool",
                        self.pods.api().list(
                            &ListParams::default().labels(&self.cfg.instance.unassigned_selector()),
                        ),
                    )
                    .await?
                    .items
                }
            };
            let candidates = self.fit.claimable(pool, listed);
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
    async fn try_claim(
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
            let stamp = stamp_now();
            let patch = claim_patch(&rv, sid, token, nonce, caller, &stamp);
            match timed(
                "claim",
                self.pods
                    .api()
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch)),
            )
            .await
            {
                Ok(p) => {
                    self.pods.claimed_at(&p, stamp);
                    return Ok(Some(p));
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
}

/// The claim's merge patch of a warm pod at `resource_version` (the guard): the session's
/// label and launch, its token's hash and nonce, the first activity stamp, and with auth the
/// owner and the caller (user and groups, for the credential proxy's audit and impersonation).
fn claim_patch(
    resource_version: &str,
    sid: &SessionId,
    token: &str,
    nonce: &SandboxNonce,
    caller: &Caller,
    stamp: &str,
) -> serde_json::Value {
    let mut annotations = serde_json::Map::new();
    annotations.insert(annotation::TOKEN_SHA256.into(), json!(token));
    annotations.insert(annotation::SANDBOX_NONCE.into(), json!(nonce.to_hex()));
    annotations.insert(annotation::LAST_ACTIVITY.into(), json!(stamp));
    if let Some(owner) = &caller.owner {
        annotations.insert(annotation::OWNER.into(), json!(owner));
    }
    if let Some(who) = caller.annotation() {
        annotations.insert(annotation::CALLER.into(), json!(who));
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

#[cfg(test)]
mod tests {
    use super::*;

    use cli_mcp_api::names::PoolSuffix;
    use cli_mcp_api::proxy::SessionCaller;
    use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxRole};

    use crate::sessions::kubernetes::testing::{cfg, key, planted_namesake, stored_and_sealed};

    fn sid() -> SessionId {
        SessionId::parse("s1").expect("sid")
    }

    #[test]
    fn the_claim_is_guarded_and_carries_the_session_its_token_and_its_owner() {
        let nonce = SandboxNonce::from_bytes([3; 16]);
        let alice = Caller::identified("alice").with_groups(vec!["dev".into(), "ops".into()]);
        let p = claim_patch("42", &sid(), "abc", &nonce, &alice, "2026-12-06T00:00:00Z");
        let meta = &p["metadata"];
        assert_eq!(
            meta["resourceVersion"], "42",
            "a claim without it is not guarded"
        );
        assert_eq!(meta["labels"][label::SESSION_ID], "s1");
        assert_eq!(meta["labels"][label::LAUNCH], label::LAUNCH_WARM);
        let a = &meta["annotations"];
        assert_eq!(a[annotation::TOKEN_SHA256], "abc");
        assert_eq!(a[annotation::SANDBOX_NONCE], nonce.to_hex());
        assert_eq!(a[annotation::LAST_ACTIVITY], "2026-12-06T00:00:00Z");
        assert_eq!(a[annotation::OWNER], crate::auth::owner_hash("alice"));
        let who = a[annotation::CALLER].as_str().expect("a string annotation");
        assert_eq!(
            SessionCaller::from_annotation(who),
            Some(SessionCaller {
                user: "alice".into(),
                groups: vec!["dev".into(), "ops".into()],
            })
        );
        // --auth none: no owner, no caller (the proxy knows none).
        let anonymous = claim_patch("42", &sid(), "abc", &nonce, &Caller::anonymous(), "t");
        let a = &anonymous["metadata"]["annotations"];
        assert!(a.get(annotation::OWNER).is_none());
        assert!(a.get(annotation::CALLER).is_none());
    }

    #[test]
    fn the_claims_caller_annotation_is_bounded() {
        let groups: Vec<String> = (0..500)
            .map(|n| format!("group-{n:04}-{}", "x".repeat(40)))
            .collect();
        let many = Caller::identified("alice").with_groups(groups);
        let nonce = SandboxNonce::from_bytes([3; 16]);
        let p = claim_patch("42", &sid(), "abc", &nonce, &many, "t");
        let who = p["metadata"]["annotations"][annotation::CALLER]
            .as_str()
            .expect("a string annotation");
        assert!(
            who.len() <= crate::auth::MAX_CALLER_ANNOTATION,
            "{}",
            who.len()
        );
        let back = SessionCaller::from_annotation(who).expect("valid");
        assert_eq!(back.user, "alice");
        assert!(!back.groups.is_empty() && back.groups.len() <= crate::auth::MAX_CALLER_GROUPS);
        assert!(
            back.groups[0].starts_with("group-0000-"),
            "the first ones are kept"
        );
    }

    #[test]
    fn after_a_409_only_a_ready_unassigned_sealed_pod_is_claimed_again() {
        let suffix = PoolSuffix::from_random_bytes([4; PoolSuffix::LEN]);
        let name = cfg().instance.pool_pod(&suffix);
        let assign = key().assign_token(&name).commitment();
        let p = build_sandbox_pod(&cfg(), &SandboxRole::Pool { suffix, assign }, "t");
        let warm = stored_and_sealed(p, "uid-warm");
        assert!(still_claimable(&warm, &key()));
        assert!(
            !still_claimable(&planted_namesake(&warm), &key()),
            "another uid"
        );
        let mut taken = warm.clone();
        taken
            .labels_mut()
            .insert(label::SESSION_ID.into(), "other".into());
        assert!(!still_claimable(&taken, &key()), "claimed by another");
        let mut going = warm;
        going.metadata.deletion_timestamp = going.metadata.creation_timestamp.clone().or(Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ),
        ));
        assert!(!still_claimable(&going, &key()), "being deleted");
    }
}
