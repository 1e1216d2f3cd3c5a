//! `spec.sandbox.runtimeClassName` on real containers: a private real-node cluster (kubelet on
//! containerd/runc) with the operator installed from `config/default`.
//!
//! - A RuntimeClass whose handler is `runc` (the runtime the node's containerd configures):
//!   the session pod the server creates on demand and the warm pod the operator keeps both
//!   carry it, become Ready, and answer a session's command; the server pods run under it
//!   too (`spec.server.runtimeClassName`).
//! - A RuntimeClass whose handler containerd lacks: the replacement warm pod never starts;
//!   the kubelet's reason (containerd has no such runtime) is in the pod's events, and the
//!   instance's status names the pod and that reason.
//! - A RuntimeClass that does not exist: the API server refuses the pods and the status
//!   quotes it; back to the runc class, the pool fills again at once.
//!
//! Skipped, saying so, when not root or when the host cannot run the real node.

use std::time::Instant;

use cli_mcp_api::names::{label, InstanceName};
use cli_mcp_api::pod_state::is_ready;
use cli_mcp_e2e::journey::{stdout, text, Env};
use cli_mcp_e2e::real_node_rig::RealNodeRig;
use cli_mcp_e2e::testing::{wait_for_set, TIMEOUT};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::api::{DeleteParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use serde_json::json;

/// The runtime handler the real node's containerd configures (`runtimes.runc`).
const HANDLER: &str = "runc";
const RUNC_CLASS: &str = "cli-mcp-test-runc";
const MISSING_HANDLER: &str = "cli-mcp-no-such-handler";
const MISSING_CLASS: &str = "cli-mcp-test-missing-handler";
/// A RuntimeClass no one creates.
const ABSENT_CLASS: &str = "cli-mcp-test-absent";

fn runtime_class(name: &str, handler: &str) -> RuntimeClass {
    serde_json::from_value(json!({
        "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
        "metadata": {"name": name}, "handler": handler,
    }))
    .expect("RuntimeClass")
}

fn runtime_class_of(p: &Pod) -> Option<&str> {
    p.spec
        .as_ref()
        .and_then(|s| s.runtime_class_name.as_deref())
}

/// The pods of `selector` once one of them is Ready and live, with that one first.
async fn ready_one(pods: Api<Pod>, selector: &str) -> Pod {
    let live_ready = |p: &Pod| is_ready(p) && p.metadata.deletion_timestamp.is_none();
    wait_for_set(pods, selector, selector, TIMEOUT, |ps: &[Pod]| {
        ps.iter().any(live_ready)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .into_iter()
    .find(live_ready)
    .expect("a ready pod")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sandbox_runtime_class_reaches_pool_and_session_pods() {
    let t0 = Instant::now();
    let Some(rig) = RealNodeRig::start("real_node_placement").await else {
        return;
    };
    let client = rig.pc.test.client.clone();
    let classes: Api<RuntimeClass> = Api::all(client.clone());
    for (name, handler) in [(RUNC_CLASS, HANDLER), (MISSING_CLASS, MISSING_HANDLER)] {
        classes
            .create(&PostParams::default(), &runtime_class(name, handler))
            .await
            .unwrap_or_else(|e| panic!("creating RuntimeClass {name}: {e}"));
    }

    let env = Env::install_on(rig.pc.test.clone(), "rn-placement").await;
    env.dummy_kubeconfig("a").await;
    let mut cr = env.cr("a", 0);
    cr["spec"]["sandbox"]["runtimeClassName"] = json!(RUNC_CLASS);
    cr["spec"]["server"]["runtimeClassName"] = json!(RUNC_CLASS);
    env.apply_cr(&cr).await;
    env.wait_ready("a").await;
    eprintln!("instance a ready after {:.1?}", t0.elapsed());
    let instance = InstanceName::parse("a").expect("name");
    let pods = env.api::<Pod>();
    let server = ready_one(
        pods.clone(),
        &format!(
            "{}=a,{}={}",
            label::INSTANCE,
            label::COMPONENT,
            label::COMPONENT_SERVER
        ),
    )
    .await;
    assert_eq!(runtime_class_of(&server), Some(RUNC_CLASS), "spec.server's");

    // No warm pool: the session's pod is the server's own, created on demand.
    let mcp = env.client("a").await;
    let r = mcp.bash("cold", "echo cold-$((6 * 7))").await;
    assert_eq!(r["isError"], false, "{}", text(&r));
    assert_eq!(stdout(&r).trim(), "cold-42");
    let cold = ready_one(
        pods.clone(),
        &format!("{},{}=cold", instance.sandbox_selector(), label::SESSION_ID),
    )
    .await;
    assert_eq!(
        cold.labels().get(label::LAUNCH).map(String::as_str),
        Some(label::LAUNCH_COLD),
        "the server made this pod"
    );
    assert_eq!(runtime_class_of(&cold), Some(RUNC_CLASS));

    // A warm pool: the operator's pod carries the same class, and a session claims it.
    cr["spec"]["sandbox"]["warmPoolSize"] = json!(1);
    env.apply_cr(&cr).await;
    let warm = ready_one(pods.clone(), &instance.unassigned_selector()).await;
    assert_eq!(runtime_class_of(&warm), Some(RUNC_CLASS));
    let r = mcp.bash("warm", "echo warm-ok").await;
    assert_eq!(r["isError"], false, "{}", text(&r));
    assert_eq!(stdout(&r).trim(), "warm-ok");
    let claimed = pods.get(&warm.name_any()).await.expect("the warm pod");
    assert_eq!(
        claimed.labels().get(label::SESSION_ID).map(String::as_str),
        Some("warm"),
        "the session was given the warm pod"
    );
    eprintln!(
        "cold and warm sandboxes ran under {RUNC_CLASS} after {:.1?}",
        t0.elapsed()
    );

    // A class whose handler containerd lacks: the pool's replacement pod never starts.
    cr["spec"]["sandbox"]["runtimeClassName"] = json!(MISSING_CLASS);
    env.apply_cr(&cr).await;
    let broken = wait_for_set(
        pods.clone(),
        &instance.unassigned_selector(),
        "a warm pod of the missing handler",
        TIMEOUT,
        |ps: &[Pod]| {
            ps.iter()
                .any(|p| runtime_class_of(p) == Some(MISSING_CLASS))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", env.logs("operator")))
    .into_iter()
    .find(|p| runtime_class_of(p) == Some(MISSING_CLASS))
    .expect("the new warm pod");
    let name = broken.name_any();
    let events: Api<Event> = env.api();
    let want = format!("no runtime for \"{MISSING_HANDLER}\" is configured");
    let event = tokio::time::timeout(
        TIMEOUT,
        watcher(
            events,
            watcher::Config::default().fields(&format!("involvedObject.name={name}")),
        )
        .applied_objects()
        .try_filter(|e| {
            futures::future::ready(e.reason.as_deref() == Some("FailedCreatePodSandBox"))
        })
        .boxed()
        .try_next(),
    )
    .await
    .unwrap_or_else(|_| panic!("no FailedCreatePodSandBox event for {name} within {TIMEOUT:?}"))
    .unwrap_or_else(|e| panic!("watching events: {e}"))
    .expect("an event");
    let note = event.message.clone().unwrap_or_default();
    assert!(note.contains(&want), "kubelet's reason: {note}");
    let now = pods.get(&name).await.expect("the broken pod");
    assert!(!is_ready(&now), "{now:?}");
    assert!(
        now.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_none_or(|cs| cs
                .iter()
                .all(|c| c.state.as_ref().is_none_or(|s| s.running.is_none()))),
        "no container of {name} runs: {:?}",
        now.status
    );

    let o = env
        .wait_status("a", "the pool reports the pod that cannot start", |s| {
            s.conditions.iter().any(|c| {
                c.type_ == "WarmPoolReady" && c.status == "False" && c.message.contains(&want)
            })
        })
        .await;
    let message = o
        .status
        .iter()
        .flat_map(|s| s.conditions.iter())
        .find(|c| c.type_ == "WarmPoolReady")
        .map(|c| c.message.clone())
        .expect("WarmPoolReady");
    assert!(message.contains(&name), "{message}");
    assert!(message.contains("runtimeClassName"), "{message}");
    eprintln!("reported: {message}");

    // A class that does not exist: the API server refuses the pods, and the status says so.
    cr["spec"]["sandbox"]["runtimeClassName"] = json!(ABSENT_CLASS);
    env.apply_cr(&cr).await;
    let want = format!("RuntimeClass \"{ABSENT_CLASS}\" not found");
    let o = env
        .wait_status("a", "the pool reports the refused pods", |s| {
            s.conditions.iter().any(|c| {
                c.type_ == "WarmPoolReady" && c.reason == "Blocked" && c.message.contains(&want)
            })
        })
        .await;
    eprintln!(
        "refused: {:?}",
        o.status
            .iter()
            .flat_map(|s| s.conditions.iter())
            .find(|c| c.type_ == "WarmPoolReady")
            .map(|c| c.message.clone())
    );
    // Back to a class that works: the pool recovers without waiting out the backoff.
    cr["spec"]["sandbox"]["runtimeClassName"] = json!(RUNC_CLASS);
    env.apply_cr(&cr).await;
    let warm = ready_one(pods.clone(), &instance.unassigned_selector()).await;
    assert_eq!(runtime_class_of(&warm), Some(RUNC_CLASS));

    for name in [RUNC_CLASS, MISSING_CLASS] {
        let _ = classes.delete(name, &DeleteParams::default()).await;
    }
    env.finish(Some("a")).await;
}
