//! An alert storm on a warm pool (docs/e2e.md), through the real MCP endpoint: as many new
//! sessions at once as the pool holds, and a few more than `maxSessions` allows. Each
//! admitted session gets a sandbox of its own, the others a clear refusal, nothing leaks,
//! and once the sessions end the instance is back to its pool and nothing else.
//! How long this takes is `make bench`'s (docs/benchmarks.md), not this test's.

use std::collections::BTreeSet;

use cli_mcp_api::names::{label, InstanceName};
use cli_mcp_api::pod_state::is_deleting;
use cli_mcp_e2e::journey::{sandbox_selector, stdout, text, CallError, Env};
use cli_mcp_e2e::testing::{wait_for_set, TIMEOUT};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::{json, Value};

const NAME: &str = "storm";
/// The warm pool, and `maxSessions`: the storm takes every warm pod at once.
const POOL: usize = 40;
/// New sessions past `maxSessions` in the same storm.
const EXTRA: usize = 10;

/// What one new session of the storm got.
enum Got {
    /// A sandbox: the pod name its shell reports, and how it was started.
    Sandbox {
        pod: String,
        launch: String,
    },
    Refused,
}

fn classify(r: Result<Value, CallError>) -> Result<Got, String> {
    let v = r.map_err(|e| e.to_string())?;
    if v["isError"] == false {
        return Ok(Got::Sandbox {
            pod: stdout(&v).trim().to_owned(),
            launch: v["structuredContent"]["new_sandbox"]
                .as_str()
                .unwrap_or("none")
                .to_owned(),
        });
    }
    let t = text(&v);
    let limit = format!("already has {POOL} sessions");
    if [limit.as_str(), "maxSessions", "retry when"]
        .iter()
        .all(|w| t.contains(w))
    {
        Ok(Got::Refused)
    } else {
        Err(v.to_string())
    }
}

/// The live session pods of the instance.
async fn session_pods(env: &Env) -> Vec<Pod> {
    env.list::<Pod>(&format!("{},{}", sandbox_selector(NAME), label::SESSION_ID))
        .await
        .into_iter()
        .filter(|p| !is_deleting(p))
        .collect()
}

#[tokio::test]
async fn a_storm_on_a_warm_pool_gets_a_sandbox_each_and_the_pool_comes_back() {
    let env = Env::install("storm").await;
    env.dummy_kubeconfig(NAME).await;
    let mut cr = env.cr(NAME, POOL as i64);
    cr["spec"]["sandbox"]["maxSessions"] = json!(POOL);
    // One client makes the whole storm: the instance's bound is under test.
    cr["spec"]["server"]["maxSessionsPerClient"] = json!(10_000);
    env.apply_cr(&cr).await;
    env.wait_ready(NAME).await;
    let mcp = env.client(NAME).await;

    let sids: Vec<String> = (0..POOL + EXTRA).map(|i| format!("storm-{i}")).collect();
    let results =
        futures::future::join_all(sids.iter().map(|sid| mcp.try_bash(sid, "echo $HOSTNAME"))).await;
    let mut pods = Vec::new();
    let mut launches = Vec::new();
    let mut admitted = Vec::new();
    let mut refused = 0;
    let mut other = Vec::new();
    for (sid, r) in sids.iter().zip(results) {
        match classify(r) {
            Ok(Got::Sandbox { pod, launch }) => {
                pods.push(pod);
                launches.push(launch);
                admitted.push(sid.clone());
            }
            Ok(Got::Refused) => refused += 1,
            Err(e) => other.push(format!("{sid}: {e}")),
        }
    }
    assert!(
        other.is_empty(),
        "neither a sandbox nor the limit's refusal: {other:#?}"
    );
    assert_eq!((pods.len(), refused), (POOL, EXTRA), "admitted vs refused");
    let distinct: BTreeSet<&String> = pods.iter().collect();
    assert_eq!(
        distinct.len(),
        POOL,
        "every session has a sandbox of its own: {pods:?}"
    );
    let live: BTreeSet<String> = session_pods(&env)
        .await
        .iter()
        .map(|p| p.name_any())
        .collect();
    let reported: BTreeSet<String> = pods.iter().cloned().collect();
    assert_eq!(
        live, reported,
        "the session pods are the sandboxes the shells reported"
    );
    let cold: Vec<&String> = launches.iter().filter(|l| *l != "warm").collect();
    assert!(
        cold.is_empty(),
        "a full pool serves the storm warm; not: {cold:?}"
    );

    // The pool fills again behind the storm; every session holds its two slots.
    env.wait_status(NAME, "pool refilled behind the storm", |s| {
        s.warm_pool.ready == POOL as i32 && s.active_sessions == POOL as i32
    })
    .await;
    let instance = InstanceName::parse(NAME).expect("instance name");
    assert_eq!(
        env.list::<Lease>(&instance.slot_selector()).await.len(),
        2 * POOL,
        "two slots per session (the instance's and its client's)"
    );

    // The sessions end: no session pod and no slot is left, and the pool is whole.
    for sid in &admitted {
        let status = mcp.try_delete(sid).await.expect("DELETE answered");
        assert!((200..300).contains(&status), "DELETE {sid}: {status}");
    }
    let gone = wait_for_set(
        env.api::<Lease>(),
        &instance.slot_selector(),
        "no slot left",
        TIMEOUT,
        |l: &[Lease]| l.is_empty(),
    )
    .await;
    assert!(gone.is_ok(), "{gone:?}\n{}", env.logs("server"));
    let pods_gone = wait_for_set(
        env.api::<Pod>(),
        &format!("{},{}", sandbox_selector(NAME), label::SESSION_ID),
        "no session pod left",
        TIMEOUT,
        |p: &[Pod]| p.is_empty(),
    )
    .await;
    assert!(pods_gone.is_ok(), "{pods_gone:?}");
    env.wait_status(NAME, "back to the pool and nothing else", |s| {
        s.warm_pool.ready == POOL as i32 && s.active_sessions == 0
    })
    .await;
    drop(mcp);
    env.finish(Some(NAME)).await;
}
