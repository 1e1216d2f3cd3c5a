//! How many warm sandboxes an instance's pool aims at now: the fixed `warmPoolSize`, or
//! with `warmPool` the size [`crate::demand::autoscale`] chooses from the sessions the pod watch saw
//! start. A change of the chosen size is published as an Event on the instance, so an
//! admin can tell afterwards why pods were created or deleted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::events::EventType;

use cli_mcp_api::crd::{CliMcpInstance, DemandBounds, WarmPoolSizing};

use super::failing_state;
use crate::children::Spec;
use crate::context::Context;
use crate::demand::autoscale::Autoscaler;
use crate::demand::autoscale::{Demand, RECHECK};
use crate::sandbox_pod::SandboxPod;

/// The size the pool aims at, and what the status says of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSize {
    pub desired: i32,
    /// Sized by demand: the new sessions of the last minute.
    pub sessions_last_minute: Option<i32>,
    /// Sized by demand, while the size may still change without an event to wake the
    /// instance: when to look again.
    pub recheck: Option<Duration>,
}

/// The size `cr`'s pool aims at now, given its `pods` (no client but the Event of a change).
pub async fn size(
    ctx: &Context,
    cr: &CliMcpInstance,
    spec: &Spec,
    pods: &[Arc<SandboxPod>],
) -> PoolSize {
    let (uid, starts) = (&spec.owner.uid, &ctx.stores.session_starts);
    let bounds = match spec.warm_pool {
        WarmPoolSizing::Fixed(desired) => {
            // Sized by demand before: its memory must not come back if it is again.
            starts.forget(&spec.namespace, spec.name.as_str());
            ctx.pool
                .with_autoscaler(uid, |a| *a = Autoscaler::default());
            return PoolSize {
                desired,
                sessions_last_minute: None,
                recheck: None,
            };
        }
        WarmPoolSizing::ByDemand(bounds) => bounds,
    };
    starts.follow(&spec.namespace, spec.name.as_str());
    let now = Instant::now();
    let ages = starts.ages(&spec.namespace, spec.name.as_str(), now);
    let pool: Vec<&Pod> = pods.iter().filter_map(|p| p.unassigned()).collect();
    // What the status last said, for a process that has not sized this pool yet.
    let reported = cr.status.as_ref().map(|s| s.warm_pool.desired);
    let (demand, before, desired) = ctx.pool.with_autoscaler(uid, |a| {
        let demand = Demand::read(ages, &pool, a.startup());
        a.measured(demand.startup);
        let before = a.last().or(reported);
        let recommended = held_while_failing(demand.recommend(&bounds), before, &pool);
        (
            demand,
            before,
            a.target(recommended, &bounds, reported, now),
        )
    });
    if let Some(before) = before.filter(|b| *b != desired) {
        let note = resized(&demand, &bounds, before, desired);
        tracing::info!(namespace = %spec.namespace, instance = %spec.name, "{note}");
        let action = format!("ResizeTo{desired}");
        ctx.publish_action(cr, EventType::Normal, "WarmPoolResized", &action, note)
            .await;
    }
    let settled = desired == bounds.min && demand.last_minute == 0;
    PoolSize {
        desired,
        sessions_last_minute: Some(i32::try_from(demand.last_minute).unwrap_or(i32::MAX)),
        recheck: (!settled).then_some(RECHECK),
    }
}

/// `recommended`, but no more than `before` while a pool pod cannot be placed or started:
/// more pods would only wait beside it, and take the node's room from the sessions' own
/// pods. (An overloaded node also starts pods slowly, which lengthens the lead and so the
/// recommendation: this keeps that from feeding itself.)
fn held_while_failing(recommended: i32, before: Option<i32>, pool: &[&Pod]) -> i32 {
    match before {
        Some(before) if pool.iter().any(|p| failing_state(p).is_some()) => recommended.min(before),
        _ => recommended,
    }
}

/// The sizes a `WarmPoolResized` Event's note names (from, to): the tests and the bench read
/// a pool's history back from its Events.
pub fn resize_of(note: &str) -> Option<(i32, i32)> {
    let rest = note.strip_prefix("warm pool target ")?;
    let (from, rest) = rest.split_once(" -> ")?;
    Some((
        from.parse().ok()?,
        rest.split_whitespace().next()?.parse().ok()?,
    ))
}

/// What the Event of a resize says: from what to what, and why.
fn resized(demand: &Demand, bounds: &DemandBounds, before: i32, desired: i32) -> String {
    let startup = demand.startup.map_or("not measured yet".to_owned(), |s| {
        format!("{}s", s.as_secs())
    });
    format!(
        "warm pool target {before} -> {desired} (bounds {}..{}): {} new sessions in the last minute, at most {} within {}s (a new sandbox's startup {startup}, twice, and 2s to make it){}",
        bounds.min,
        bounds.max,
        demand.last_minute,
        demand.busiest,
        demand.lead().as_secs(),
        if desired < before {
            format!(" (lower after {}s of calm)", bounds.scale_down_delay.as_secs())
        } else {
            String::new()
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_pod_that_cannot_start_holds_the_target() {
        let unschedulable: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled",
                "status": "False", "reason": "Unschedulable", "message": "0/1 nodes: Too many pods"}]}
        }))
        .expect("pod");
        let fine: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "q"}, "status": {"phase": "Running"}
        }))
        .expect("pod");
        assert_eq!(
            held_while_failing(50, Some(20), &[&fine, &unschedulable]),
            20
        );
        assert_eq!(
            held_while_failing(10, Some(20), &[&unschedulable]),
            10,
            "shrinking is not held"
        );
        assert_eq!(held_while_failing(50, Some(20), &[&fine]), 50);
        assert_eq!(held_while_failing(50, None, &[&unschedulable]), 50);
    }

    #[test]
    fn a_resize_says_from_what_to_what_and_why() {
        let d = Demand {
            last_minute: 300,
            busiest: 80,
            startup: Some(Duration::from_secs(2)),
        };
        let b = DemandBounds {
            min: 2,
            max: 100,
            scale_down_delay: Duration::from_secs(300),
        };
        let up = resized(&d, &b, 2, 48);
        assert!(up.starts_with("warm pool target 2 -> 48 (bounds 2..100): 300 new sessions in the last minute, at most 80 within 6s (a new sandbox's startup 2s, twice, and 2s to make it)"), "{up}");
        assert!(resized(&d, &b, 48, 2).ends_with("(lower after 300s of calm)"));
        assert_eq!(resize_of(&up), Some((2, 48)));
        assert_eq!(resize_of("something else"), None);
    }
}
