//! On OpenShift (detected by its `route.openshift.io` API group), sandbox pods fix no user,
//! group or fsGroup: the `restricted-v2` SCC assigns a UID from the namespace's range and
//! refuses a pod that names another. Elsewhere they run as the fixed sandbox UID. The test
//! owns a private cluster: the Route CRD it installs (a stand-in, enough for discovery) would
//! make every other test's operator take the cluster for OpenShift.

mod support;

use cli_mcp_api::names::InstanceName;
use cli_mcp_api::sandbox::{SandboxConfig, SANDBOX_UID};
use cli_mcp_e2e::testing::{private_cluster, wait_for, wait_for_set};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use support::*;

fn pod_ids(p: &Pod) -> (Option<i64>, Option<i64>, Option<i64>) {
    let sc = p
        .spec
        .as_ref()
        .and_then(|s| s.security_context.clone())
        .unwrap_or_default();
    assert_eq!(sc.run_as_non_root, Some(true), "{p:?}");
    (sc.run_as_user, sc.run_as_group, sc.fs_group)
}

/// The SandboxConfig the operator hands the server (its on-demand pods are built from it).
async fn server_sandbox_config(
    ns: &cli_mcp_e2e::testing::TestNamespace,
    n: &InstanceName,
    assigns: bool,
) {
    let d = wait_for(
        ns.api::<Deployment>(),
        &n.server(),
        "the server's sandbox config",
        TIMEOUT,
        |d: Option<&Deployment>| {
            d.and_then(|d| d.spec.template.spec.as_ref())
                .and_then(|p| p.containers[0].env.clone())
                .into_iter()
                .flatten()
                .find(|e| e.name == cli_mcp_operator::children::deployment::SANDBOX_CONFIG_ENV)
                .and_then(|e| e.value)
                .and_then(|v| serde_json::from_str::<SandboxConfig>(&v).ok())
                .is_some_and(|c| c.platform_assigns_uid == assigns)
        },
    )
    .await;
    assert!(
        d.is_ok(),
        "server Deployment never carried platformAssignsUid={assigns}: {d:?}"
    );
}

#[tokio::test]
async fn on_openshift_sandbox_pods_fix_no_uid() {
    let pc = private_cluster("openshift").await.expect("private cluster");
    let c = &pc.test;
    install_crd(c).await;
    let ns = c.namespace("openshift").await.expect("namespace");
    let name = "oc";
    let n = InstanceName::parse(name).expect("name");
    create_instance(&ns, name, json!({"sandbox": {"warmPoolSize": 1}})).await;

    // Plain Kubernetes: the fixed UID.
    let mut op = Operator::start(c, &ns.name, "k8s");
    let pool = wait_pool(&ns, name, 1, &op).await;
    let fixed = Some(SANDBOX_UID);
    assert_eq!(pod_ids(&pool[0]), (fixed, fixed, fixed));
    server_sandbox_config(&ns, &n, false).await;
    op.kill();

    // The cluster now serves route.openshift.io: a restarted operator detects OpenShift, and
    // the pool is replaced by pods without a fixed UID (the sandbox config's hash changed).
    apply_crd(
        c,
        serde_yaml::from_str(include_str!("fixtures/route-crd.yaml")).expect("fixture"),
    )
    .await;
    let op = Operator::start(c, &ns.name, "openshift");
    let replaced = wait_for_set(
        ns.api::<Pod>(),
        &n.unassigned_selector(),
        "pool pods without a fixed UID",
        TIMEOUT,
        |pods: &[Pod]| {
            !pods.is_empty()
                && pods.iter().all(|p| {
                    p.metadata.deletion_timestamp.is_none() && pod_ids(p) == (None, None, None)
                })
        },
    )
    .await;
    assert!(replaced.is_ok(), "{replaced:?}\n{}", op.log_tail());
    server_sandbox_config(&ns, &n, true).await;
    assert!(
        op.log_tail().contains("OpenShift"),
        "the operator did not say it detected OpenShift:\n{}",
        op.log_tail()
    );
}
