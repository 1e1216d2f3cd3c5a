//! `runtimeClassName` naming a RuntimeClass the cluster lacks, on the local Kubernetes: the
//! instance says so (`Ready=False`, reason `RuntimeClassNotFound`, naming the class, the
//! fields naming it and the fix), the operator makes no sandbox pod and does not spin, and
//! the server Deployment's pod template says the class is missing. Once the RuntimeClass is
//! created the instance goes on by itself, woken by the RuntimeClass watch (well before the
//! once-a-minute recheck): the pool fills with pods carrying the class, the server's pods
//! start, and `status.sandbox` reports the class and its handler.
//!
//! The RuntimeClass is cluster-scoped, so it is named after the test's namespace: other
//! tests share the cluster. (The process kubelet runs every pod the same whatever its
//! class; the API server's RuntimeClass admission is what is under test.)

mod support;

use std::time::{Duration, Instant};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::InstanceName;
use cli_mcp_e2e::instance::wait_instance;
use cli_mcp_e2e::testing::{cluster, wait_for};
use cli_mcp_operator::children::RUNTIME_CLASS_MISSING_ANNOTATION;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::Api;
use serde_json::json;

use support::*;

const NAME: &str = "rtc";
/// A window in which a spinning reconcile would show (it backs off or waits for a watch).
const QUIET: Duration = Duration::from_secs(10);
/// At most this many reconciles in [`QUIET`] while the class is missing: the instance is
/// looked at again when something it watches changes, or once a minute.
const QUIET_RECONCILES: u64 = 3;
/// The pool fills within this long of the class's creation: the watch woke the instance,
/// not the once-a-minute recheck.
const WOKEN_WITHIN: Duration = Duration::from_secs(30);

fn runtime_class(name: &str, handler: &str) -> RuntimeClass {
    serde_json::from_value(json!({
        "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
        "metadata": {"name": name}, "handler": handler,
    }))
    .expect("RuntimeClass")
}

fn class_of(p: &Pod) -> Option<&str> {
    p.spec
        .as_ref()
        .and_then(|s| s.runtime_class_name.as_deref())
}

#[tokio::test]
async fn a_missing_runtime_class_is_reported_and_the_instance_goes_on_once_it_exists() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("rtclass").await.expect("namespace");
    let class = format!("{}-sandbox", ns.name);
    let classes: Api<RuntimeClass> = Api::all(c.client.clone());
    let op = Operator::start(&c, &ns.name, "op");
    let spec = json!({
        "sandbox": {"warmPoolSize": 2, "runtimeClassName": class},
        "server": {"runtimeClassName": class},
    });
    create_instance(&ns, NAME, spec).await;
    let n = InstanceName::parse(NAME).expect("name");

    // Said, with the class, both fields and the fix.
    let o = op.ok(wait_instance(
        ns.api::<CliMcpInstance>(),
        NAME,
        "Ready=False RuntimeClassNotFound",
        TIMEOUT,
        |o| condition(o, "Ready") == Some(("False".into(), "RuntimeClassNotFound".into())),
    )
    .await);
    let ready = find_condition(&o, "Ready").expect("Ready");
    let named = format!("RuntimeClass \"{class}\" not found");
    for words in [
        named.as_str(),
        "spec.sandbox.runtimeClassName and spec.server.runtimeClassName",
        "create its RuntimeClass",
        "change or remove the field",
    ] {
        assert!(
            ready.message.contains(words),
            "{words:?}: {}",
            ready.message
        );
    }
    let pool = find_condition(&o, "WarmPoolReady").expect("WarmPoolReady");
    assert_eq!(pool.reason, "Blocked", "{}", pool.message);
    assert!(pool.message.contains(&named), "{}", pool.message);
    // No warm pod yet: the class the next one is made with, and no handler to name.
    let sandbox = o.status.as_ref().and_then(|s| s.sandbox.clone());
    let sandbox = sandbox.expect("status.sandbox");
    assert_eq!(sandbox.runtime_class_name.as_deref(), Some(class.as_str()));
    assert_eq!(sandbox.runtime_handler, None);

    // The server's pod template says which class its refused pods wait for.
    let d = op.ok(wait_for(
        ns.api::<Deployment>(),
        &n.server(),
        "the server template marked",
        TIMEOUT,
        |d: Option<&Deployment>| {
            d.and_then(|d| template_annotation(d, RUNTIME_CLASS_MISSING_ANNOTATION))
                .as_deref()
                == Some(class.as_str())
        },
    )
    .await);
    assert!(d.is_some());

    // Once the credential proxy serves, nothing but the missing class holds the pool back:
    // still no sandbox pod, and the operator does not spin on the instance.
    op.ok(wait_for(
        ns.api::<Deployment>(),
        &n.proxy(),
        "a ready proxy replica",
        TIMEOUT,
        |d: Option<&Deployment>| {
            d.and_then(|d| d.status.as_ref())
                .and_then(|s| s.ready_replicas)
                .is_some_and(|r| r >= 1)
        },
    )
    .await);
    let before = op.reconciles().await;
    tokio::time::sleep(QUIET).await;
    let reconciles = op.reconciles().await - before;
    assert!(
        reconciles <= QUIET_RECONCILES,
        "{reconciles} reconciles in {QUIET:?} while the class is missing\noperator log:\n{}",
        op.log_tail()
    );
    let pods = ns
        .api::<Pod>()
        .list(&ListParams::default().labels(&sandbox_selector(NAME)))
        .await
        .expect("list sandbox pods");
    assert!(pods.items.is_empty(), "sandbox pods: {:?}", pods.items);

    // The class appears: the watch wakes the instance, the pool fills with pods carrying
    // it, the server's pods start, and the status names the class's handler.
    let t0 = Instant::now();
    classes
        .create(&PostParams::default(), &runtime_class(&class, "runc"))
        .await
        .expect("create the RuntimeClass");
    let warm = wait_pool(&ns, NAME, 2, &op).await;
    let took = t0.elapsed();
    assert!(
        took < WOKEN_WITHIN,
        "the pool filled {took:?} after the class appeared"
    );
    for p in &warm {
        assert_eq!(class_of(p), Some(class.as_str()));
    }
    let o = wait_ready(&ns, NAME, &op).await;
    let sandbox = o.status.as_ref().and_then(|s| s.sandbox.clone());
    let sandbox = sandbox.expect("status.sandbox");
    assert_eq!(sandbox.runtime_class_name.as_deref(), Some(class.as_str()));
    assert_eq!(sandbox.runtime_handler.as_deref(), Some("runc"));
    let d = ns
        .api::<Deployment>()
        .get(&n.server())
        .await
        .expect("server Deployment");
    assert_eq!(
        template_annotation(&d, RUNTIME_CLASS_MISSING_ANNOTATION),
        None
    );

    finish(ns, NAME, &op).await;
    classes
        .delete(&class, &DeleteParams::default())
        .await
        .expect("delete the RuntimeClass");
}
