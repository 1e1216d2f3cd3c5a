//! Idle collection of assigned sandboxes.
//!
//! An assigned sandbox whose `last-activity` (else `created-at`, else its creation time) is
//! older than `idleTimeout` is deleted. The reconcile is requeued for the soonest remaining
//! expiry, so collection needs no pod events: the pod watch ignores `last-activity` patches.
//! A sandbox whose token commitment does not match the current HMAC key (the key Secret was
//! deleted and regenerated) is deleted too, so its session gets a clean reset on next use.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Resource, ResourceExt};

use cli_mcp_api::activity::{last_activity_meta, stamp_gap, STAMP_RESOLUTION};
use cli_mcp_api::names::annotation;
use cli_mcp_api::pod_state::session_of_meta;
use cli_mcp_api::sandbox::session_token_of_meta;
use cli_mcp_api::token::HmacKey;
use cli_mcp_api::SessionId;

use crate::api_call::is_status;
use crate::context::Context;
use crate::error::Error;
use crate::sandbox_pod::SandboxPod;

/// Why an assigned sandbox is collected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectReason {
    Idle,
    StaleKey,
}

impl CollectReason {
    pub fn as_str(self) -> &'static str {
        match self {
            CollectReason::Idle => "idle",
            CollectReason::StaleKey => "stale-key",
        }
    }
}

#[derive(Debug, Default)]
pub struct IdlePlan {
    pub collect: Vec<(Arc<SandboxPod>, CollectReason)>,
    /// Time until the next assigned sandbox expires.
    pub next_expiry: Option<Duration>,
    /// Live sessions (assigned, not terminating, not collected now).
    pub active: i32,
}

fn has_stale_token(m: &ObjectMeta, key: &HmacKey) -> bool {
    let Some(sid) = session_of_meta(m).and_then(|s| SessionId::parse(s).ok()) else {
        return false;
    };
    // A pod without a commitment is mid-claim or not ours to judge; one with a commitment
    // that no token of this key opens (another key, or an older version's pod without a
    // sandbox nonce) can never be used again.
    m.annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(annotation::TOKEN_SHA256))
        && session_token_of_meta(m, &sid, key).is_none()
}

/// Decides which assigned sandboxes to collect. Pure.
pub fn plan(
    pods: &[Arc<SandboxPod>],
    idle: Duration,
    now: Timestamp,
    key: Option<&HmacKey>,
) -> IdlePlan {
    let mut out = IdlePlan::default();
    for p in pods.iter().filter(|p| p.is_assigned() && !p.is_deleting()) {
        let m = p.meta();
        if key.is_some_and(|k| has_stale_token(m, k)) {
            out.collect.push((p.clone(), CollectReason::StaleKey));
            continue;
        }
        // Unparseable times are never collected: fail safe, keep the session.
        let Some(last) = last_activity_meta(m) else {
            out.active += 1;
            continue;
        };
        let age = now.duration_since(last);
        let age = Duration::try_from(age).unwrap_or(Duration::ZERO);
        // The stamp is truncated to whole seconds, and the server writes a session's newest
        // activity up to a stamp gap late (`--activity-stamp-gap`, which the operator sets
        // from the same idle timeout): a session is idle only once `idle` has passed since the
        // end of the stamped second plus that gap, else a session in use could be collected
        // just before its idleTimeout.
        let idle = idle + STAMP_RESOLUTION + stamp_gap(idle);
        if age >= idle {
            out.collect.push((p.clone(), CollectReason::Idle));
        } else {
            out.active += 1;
            let left = idle - age;
            out.next_expiry = Some(out.next_expiry.map_or(left, |d: Duration| d.min(left)));
        }
    }
    out
}

/// Collects idle sandboxes of one instance; returns the plan that was carried out, and the
/// first failed delete (the others are still tried), for the caller to return once the
/// instance's status is written.
pub async fn collect(
    ctx: &Context,
    pods: &[Arc<SandboxPod>],
    namespace: &str,
    idle: Duration,
    key: Option<&HmacKey>,
) -> (IdlePlan, Option<Error>) {
    let mut p = plan(pods, idle, Timestamp::now(), key);
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let mut kept = 0;
    let mut first_err = None;
    for (pod, reason) in &p.collect {
        // The cached resourceVersion is the precondition: a last-activity patch that landed
        // after our read makes the delete fail (409) and the session lives on.
        let dp = crate::api_call::delete_exactly(pod.as_ref(), true);
        match api.delete(&pod.name_any(), &dp).await {
            Ok(_) => {
                ctx.metrics.api_write("Pod", "delete");
                ctx.metrics.session_collected(reason.as_str());
                tracing::info!(
                    pod = %pod.name_any(),
                    session = session_of_meta(pod.meta()).unwrap_or_default(),
                    reason = reason.as_str(),
                    "collected sandbox"
                );
            }
            Err(e) if is_status(&e, 409) => {
                kept += 1;
                // Re-check soon with the newer object.
                p.next_expiry = Some(Duration::from_secs(1));
            }
            Err(e) if is_status(&e, 404) => {}
            Err(e) => {
                kept += 1;
                let what = format!("deleting sandbox {namespace}/{}", pod.name_any());
                first_err.get_or_insert(Error::idle(what)(e));
            }
        }
    }
    p.active += kept;
    (p, first_err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli_mcp_api::names::InstanceName;
    use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxRole};

    fn session(sid: &str, last: &str, key: &HmacKey) -> Arc<SandboxPod> {
        Arc::new(SandboxPod::from_pod(&session_pod(sid, last, key)))
    }

    fn session_pod(sid: &str, last: &str, key: &HmacKey) -> Pod {
        let cfg = SandboxConfig::new(InstanceName::parse("demo").expect("n"), "ns", "img");
        let sid = SessionId::parse(sid).expect("sid");
        build_sandbox_pod(
            &cfg,
            &SandboxRole::session(
                key,
                sid,
                cli_mcp_api::token::SandboxNonce::from_bytes([3; 16]),
                None,
            ),
            last,
        )
    }

    #[test]
    fn idle_sessions_are_collected_and_the_soonest_expiry_is_returned() {
        let k = HmacKey::from_bytes([1; 32]);
        let now: Timestamp = "2026-01-01T01:00:00Z".parse().expect("ts");
        let pods = vec![
            session("old", "2026-01-01T00:00:00Z", &k),
            session("recent", "2026-01-01T00:59:00Z", &k),
            session("newer", "2026-01-01T00:59:30Z", &k),
            session("garbage", "not-a-time", &k),
        ];
        let p = plan(&pods, Duration::from_secs(600), now, Some(&k));
        assert_eq!(p.collect.len(), 1);
        assert_eq!(p.collect[0].1, CollectReason::Idle);
        assert_eq!(p.active, 3);
        // 600 s after the end of the stamped second, plus the stamp gap (a sixtieth: 10 s).
        assert_eq!(p.next_expiry, Some(Duration::from_secs(551)));
    }

    #[test]
    fn sessions_under_an_old_key_are_collected() {
        let old = HmacKey::from_bytes([1; 32]);
        let new = HmacKey::from_bytes([2; 32]);
        let now: Timestamp = "2026-01-01T00:00:10Z".parse().expect("ts");
        let pods = vec![session("s", "2026-01-01T00:00:00Z", &old)];
        let p = plan(&pods, Duration::from_secs(600), now, Some(&new));
        assert_eq!(p.collect[0].1, CollectReason::StaleKey);
        let p = plan(&pods, Duration::from_secs(600), now, Some(&old));
        assert!(p.collect.is_empty());
    }

    #[test]
    fn sessions_without_a_sandbox_nonce_are_collected() {
        // An older version's pod: its token was bound to the session id alone, so a token
        // leaked from any earlier sandbox of that id would open it.
        let k = HmacKey::from_bytes([1; 32]);
        let now: Timestamp = "2026-01-01T00:00:10Z".parse().expect("ts");
        let mut pod = session_pod("s", "2026-01-01T00:00:00Z", &k);
        pod.annotations_mut().remove(annotation::SANDBOX_NONCE);
        let pod = Arc::new(SandboxPod::from_pod(&pod));
        let p = plan(&[pod], Duration::from_secs(600), now, Some(&k));
        assert_eq!(p.collect.len(), 1);
        assert_eq!(p.collect[0].1, CollectReason::StaleKey);
    }

    #[test]
    fn a_session_is_not_collected_within_its_stamped_second_and_stamp_gap() {
        let k = HmacKey::from_bytes([1; 32]);
        // Stamped 00:00:00 (truncated): the activity may have been at 00:00:00.999, and a
        // newer one may wait up to the stamp gap (2 s under a 60 s idle timeout) unwritten.
        let pods = vec![session("s", "2026-01-01T00:00:00Z", &k)];
        let at = |t: &str| t.parse::<Timestamp>().expect("ts");
        for early in ["2026-01-01T00:01:00.500Z", "2026-01-01T00:01:02.999Z"] {
            let p = plan(&pods, Duration::from_secs(60), at(early), Some(&k));
            assert!(
                p.collect.is_empty(),
                "collected at {early}, before idleTimeout had surely passed"
            );
        }
        let p = plan(
            &pods,
            Duration::from_secs(60),
            at("2026-01-01T00:01:03Z"),
            Some(&k),
        );
        assert_eq!(p.collect.len(), 1);
    }
}
