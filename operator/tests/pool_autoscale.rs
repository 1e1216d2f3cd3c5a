//! A warm pool sized by demand (`spec.sandbox.warmPool`), on the local Kubernetes with the
//! operator running: a burst of new sessions grows the pool at once, and a calm of
//! `scaleDownDelay` after the demand has aged out of the last minute shrinks it back to
//! `min`, with no pod created and deleted in turn on the way. Bounds that make no sense are
//! refused by the API server with what to fix.

mod support;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxRole};
use cli_mcp_api::SessionId;
use cli_mcp_e2e::testing::{cluster, wait_for, TestNamespace};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, PostParams};
use kube::ResourceExt;
use serde_json::json;
use std::time::Duration;

use support::*;

const MIN: i32 = 2;
const MAX: i32 = 30;
/// Sessions that arrive at once: the two warm pods claimed, the rest started cold.
const ARRIVALS: usize = 20;
/// The demand leaves the last minute's count 60 s after the burst, and the pool shrinks a
/// `scaleDownDelay` (30 s) after that: well within this.
const SHRINK_TIMEOUT: Duration = Duration::from_secs(240);

/// A session pod as a server's cold start makes it, held before scheduling (a scheduling
/// gate): the operator counts a session when its pod appears, and no node needs to run it.
async fn cold_session(ns: &TestNamespace, cr: &CliMcpInstance, sid: &str) {
    let cfg = cr.sandbox_config(Some(SANDBOX_IMAGE)).expect("config");
    let key = hmac_key(ns, &cr.name_any()).await;
    let role = SandboxRole::session(
        &key,
        SessionId::parse(sid).expect("sid"),
        cli_mcp_api::token::SandboxNonce::from_bytes(rand::random()),
        None,
    );
    let mut pod = build_sandbox_pod(&cfg, &role, &cli_mcp_api::activity::stamp_now());
    if let Some(spec) = pod.spec.as_mut() {
        spec.scheduling_gates = Some(vec![serde_json::from_value(
            json!({"name": "cli-mcp.test/held"}),
        )
        .expect("gate")]);
    }
    ns.api::<Pod>()
        .create(&PostParams::default(), &pod)
        .await
        .expect("create a cold session pod");
}

/// The targets the operator's `WarmPoolResized` Events name, with when each was made, oldest
/// first. Each Event stands for one resize: a repeat folded into an earlier one's series
/// would hide a target reached twice, so none may have a series.
async fn resizes(ns: &TestNamespace) -> Vec<(i32, i32, k8s_openapi::jiff::Timestamp)> {
    let mut events: Vec<Event> = ns
        .api::<Event>()
        .list(&ListParams::default())
        .await
        .expect("list events")
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("WarmPoolResized"))
        .collect();
    assert!(events.iter().all(|e| e.series.is_none()), "{events:?}");
    events.sort_by_key(|e| e.event_time.clone().map(|t| t.0));
    events
        .iter()
        .filter_map(|e| {
            let (from, to) = cli_mcp_operator::pool::resize_of(e.note.as_deref()?)?;
            Some((from, to, e.event_time.clone()?.0))
        })
        .collect()
}

#[tokio::test]
async fn a_burst_grows_the_pool_at_once_and_a_calm_shrinks_it_without_churn() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("autoscale").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    let spec = json!({"sandbox": {"warmPool": {"min": MIN, "max": MAX, "scaleDownDelay": "30s"}}});
    create_instance(&ns, "demand", spec).await;
    wait_ready(&ns, "demand", &op).await;
    let pods = wait_pool(&ns, "demand", MIN as usize, &op).await;
    let instances = ns.api::<CliMcpInstance>();
    let cr = instances.get("demand").await.expect("cr");
    let status = cr.status.clone().expect("status");
    assert_eq!(status.warm_pool.desired, MIN);
    assert_eq!(status.warm_pool.sessions_last_minute, Some(0));

    // The burst: both warm pods claimed, the rest started cold, all at once.
    let key = hmac_key(&ns, "demand").await;
    let api = ns.api::<Pod>();
    for (i, p) in unassigned(&pods).into_iter().enumerate() {
        claim(&api, p, &format!("warm{i}"), &key)
            .await
            .expect("claim");
    }
    for i in MIN as usize..ARRIVALS {
        cold_session(&ns, &cr, &format!("cold{i}")).await;
    }
    // 20 sessions within a few seconds: a lead (at least 5 s) holds most or all of them, and
    // never more than arrived.
    let grown = wait_for(
        instances.clone(),
        "demand",
        "the pool grown",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            o.and_then(|o| o.status.as_ref())
                .is_some_and(|s| s.warm_pool.desired >= 10)
        },
    )
    .await;
    let st = op.ok(grown).expect("instance").status.expect("status");
    assert!(st.warm_pool.desired <= ARRIVALS as i32, "{st:?}");
    assert!(
        st.warm_pool.sessions_last_minute.unwrap_or(0) >= ARRIVALS as i32,
        "{st:?}"
    );
    let filled = wait_for(
        instances.clone(),
        "demand",
        "the grown pool full",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            o.and_then(|o| o.status.as_ref()).is_some_and(|s| {
                s.warm_pool.desired >= 10 && s.warm_pool.ready == s.warm_pool.desired
            })
        },
    )
    .await;
    op.ok(filled);

    // Calm: back to min once the burst has left the last minute and the delay has passed.
    let shrunk = wait_for(
        instances.clone(),
        "demand",
        "the pool back to min",
        SHRINK_TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            o.and_then(|o| o.status.as_ref())
                .is_some_and(|s| s.warm_pool.desired == MIN && s.warm_pool.ready == MIN)
        },
    )
    .await;
    op.ok(shrunk);
    wait_pool(&ns, "demand", MIN as usize, &op).await;

    // No churn: the target only rose, then only fell, and each pod the shrink deleted was
    // one the growth had made (a pod made and deleted in turn would show as more deletes).
    let steps = resizes(&ns).await;
    eprintln!("warm pool targets (from, to, when): {steps:?}");
    assert!(!steps.is_empty(), "no WarmPoolResized event");
    let peak = steps.iter().map(|s| s.1).max().unwrap_or(MIN);
    let top = steps.iter().position(|s| s.1 == peak).unwrap_or(0);
    assert!(
        steps[..=top].iter().all(|(from, to, _)| to > from),
        "{steps:?}"
    );
    assert!(
        steps[top + 1..].iter().all(|(from, to, _)| to < from),
        "{steps:?}"
    );
    assert_eq!(steps.first().map(|s| s.0), Some(MIN), "{steps:?}");
    assert_eq!(steps.last().map(|s| s.1), Some(MIN), "{steps:?}");
    // The hold: back at min only once the burst left the last minute (60 s after its first
    // session) and a scaleDownDelay (30 s) passed after that last high recommendation: some
    // 90 s after the burst began, less the few seconds it took to arrive and be seen. Without
    // the hold it would be some 60 s.
    let held = steps
        .last()
        .map(|s| s.2.duration_since(steps[top].2).as_secs_f64());
    assert!(held.is_some_and(|h| h >= 75.0), "{held:?} {steps:?}");
    let surplus = op
        .metric("cli_mcp_operator_pool_pods_deleted_total{reason=\"surplus\"}")
        .await;
    assert_eq!(surplus as i32, peak - MIN, "{steps:?}\n{}", op.log_tail());
    finish(ns, "demand", &op).await;
}

#[tokio::test]
async fn bounds_that_make_no_sense_are_refused_with_what_to_fix() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("autoscale-bounds").await.expect("namespace");
    let pool = |b: serde_json::Value| json!({"sandbox": {"warmPool": b}});
    for (spec, says) in [
        (
            pool(json!({"min": 5, "max": 2})),
            "warmPool.min must not exceed warmPool.max",
        ),
        (
            pool(json!({"min": 0, "max": 0})),
            "warmPool.max must be between 1 and 200",
        ),
        (
            pool(json!({"min": -1, "max": 3})),
            "warmPool.min must be between 0 and 200",
        ),
        (
            pool(json!({"min": 0, "max": 300})),
            "warmPool.max must be between 1 and 200",
        ),
        (
            pool(json!({"min": 0, "max": 3, "scaleDownDelay": "5s"})),
            "scaleDownDelay must be a duration",
        ),
        (
            pool(json!({"min": 0, "max": 3, "scaleDownDelay": "soon"})),
            "scaleDownDelay must be a duration",
        ),
        (pool(json!({"max": 3})), "min: Required value"),
        (
            json!({"sandbox": {"warmPoolSize": 4, "warmPool": {"min": 0, "max": 3}}}),
            "set either spec.sandbox.warmPoolSize",
        ),
    ] {
        let e = rejected(&c, &ns, "bounds", spec.clone()).await;
        assert!(e.contains(says), "{spec}: {e}");
    }
    ns.delete().await.expect("delete namespace");
}
