//! The warm pool never trusts a stale cache with creates.
//!
//! After an apiserver restart the operator's watches relist, and for a while its cache can
//! miss pods that exist; pool expectations are dropped after `EXPECTATION_TTL`. Creating from
//! the cache alone then created pods that already existed (the apiserver-restart fault test
//! saw 7 warm pods for a pool of 2). Here the reconciler gets stores that are never fed — the
//! cache of an operator whose watches stalled — against the real API server of the local
//! Kubernetes: the API is not mocked, only the cache is made stale on purpose.

use std::sync::Arc;

use cli_mcp_api::names::InstanceName;
use cli_mcp_api::pod_state;
use cli_mcp_api::sandbox::SandboxConfig;
use cli_mcp_api::token::HmacKey;
use cli_mcp_e2e::testing::cluster;
use cli_mcp_operator::context::Stores;
use cli_mcp_operator::metrics::Metrics;
use cli_mcp_operator::{pool, Context, OperatorConfig};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::ResourceExt;

#[tokio::test]
async fn a_stale_cache_never_creates_pods_that_already_exist() {
    let c = cluster().await.expect("cluster");
    let ns = c.namespace("pool-cache").await.expect("namespace");
    let ctx = Context::new(
        c.client.clone(),
        Arc::new(OperatorConfig::new("cli-mcp-server:dev", None)),
        Arc::new(Metrics::new()),
        Stores::detached(),
    );
    let instance = InstanceName::try_from("stale".to_owned()).expect("name");
    // An image the local cluster cannot pull: the pods only need to exist, not to run.
    let cfg = SandboxConfig::new(instance.clone(), &ns.name, "cli-mcp-e2e-unpullable:0");
    let key = HmacKey::from_bytes([7; 32]);
    let uid = "pool-cache-test";
    let pods = ns.api::<Pod>();
    // Pods name the sandbox ServiceAccount; admission refuses them without it.
    let sa = ServiceAccount {
        metadata: ObjectMeta {
            name: Some(instance.sandbox()),
            ..Default::default()
        },
        ..Default::default()
    };
    ns.api::<ServiceAccount>()
        .create(&PostParams::default(), &sa)
        .await
        .expect("sandbox ServiceAccount");
    let count = || async {
        pods.list(&ListParams::default().labels(&instance.unassigned_selector()))
            .await
            .expect("list pods")
            .items
            .into_iter()
            .filter(|p| !pod_state::is_deleting(p))
            .count()
    };

    let (_, error) = pool::reconcile(&ctx, uid, &cfg, 2, Some(&key), None).await;
    assert!(error.is_none(), "first reconcile: {error:?}");
    assert_eq!(count().await, 2, "the first reconcile fills the pool");

    // The expectations of those creates expire while the cache still has not seen them.
    ctx.pool.forget(uid);
    let (_, error) = pool::reconcile(&ctx, uid, &cfg, 2, Some(&key), None).await;
    assert!(error.is_none(), "second reconcile: {error:?}");
    assert_eq!(
        count().await,
        2,
        "a reconcile on a stale cache must not create pods that exist"
    );

    // What is really missing is still created.
    let victim = pods
        .list(&ListParams::default().labels(&instance.unassigned_selector()))
        .await
        .expect("list")
        .items
        .pop()
        .expect("a pool pod");
    pods.delete(&victim.name_any(), &DeleteParams::default().grace_period(0))
        .await
        .expect("delete a pool pod");
    ctx.pool.forget(uid);
    let (_, error) = pool::reconcile(&ctx, uid, &cfg, 2, Some(&key), None).await;
    assert!(error.is_none(), "third reconcile: {error:?}");
    assert_eq!(count().await, 2, "the missing pod is replaced, once");

    ns.delete().await.expect("delete namespace");
}
