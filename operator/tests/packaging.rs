//! The kustomize build of config/default and the `helm template` output of the chart apply
//! cleanly to the local Kubernetes, and the operator they deploy (a real in-cluster pod with
//! the packaged, least-privilege RBAC and leader election) makes an instance Ready.
//!
//! helm and kustomize come from `hack/build-helm-kustomize.sh` (built from the Go module
//! proxy once, then cached outside the repo).

mod support;

use std::process::Command;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_e2e::instance::wait_instance;
use cli_mcp_e2e::journey::{apply_yaml, kustomize_build, operator_overlay, tools};
use cli_mcp_e2e::testing::{
    cluster, wait_deployment_ready, wait_gone, workspace_root, TestCluster, TestNamespace,
};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::DeleteParams;
use serde_json::json;

use support::*;

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run tool");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// The deployed operator runs in the cluster and makes an instance Ready.
async fn operator_works(c: &TestCluster, ns: TestNamespace, deployment: &str) {
    let r = wait_deployment_ready(ns.api::<Deployment>(), deployment, TIMEOUT).await;
    if let Err(e) = r {
        panic!("operator did not become ready: {e}");
    }
    create_instance(&ns, "pkg", json!({"sandbox": {"warmPoolSize": 1}})).await;
    let api = ns.api::<CliMcpInstance>();
    let ok = wait_instance(api.clone(), "pkg", "instance Ready", TIMEOUT, |o| {
        is_true(o, "Ready")
    })
    .await;
    let logs = || c.pod_logs(&ns.name, "operator", usize::MAX);
    if let Err(e) = ok {
        panic!(
            "instance not Ready under the packaged operator: {e}\n{}",
            logs()
        );
    }
    api.delete("pkg", &DeleteParams::default())
        .await
        .expect("delete instance");
    wait_gone(api, "pkg", "instance released", TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("finalizer not released: {e}\n{}", logs()));
}

#[tokio::test]
async fn kustomize_output_applies_and_its_operator_works() {
    let c = cluster().await.expect("cluster");
    let ns = c.namespace("kustomize").await.expect("namespace");
    // Only the images and the watched namespace change: the packaged RBAC, replicas and
    // requests are what is tested.
    let yaml = kustomize_build(
        &format!("kustomize-{}", ns.name),
        &operator_overlay(&ns.name, false),
    );
    assert!(yaml.contains("kind: CustomResourceDefinition"));
    let outside = apply_yaml(&c, &ns.name, &yaml, |_| {}).await;
    operator_works(&c, ns.clone(), "cli-mcp-operator").await;
    for (api, name) in outside {
        let _ = api.delete(&name, &DeleteParams::default()).await;
    }
    ns.delete().await.expect("delete namespace");
}

#[tokio::test]
async fn helm_template_output_applies_and_its_operator_works() {
    let bin = tools();
    let c = cluster().await.expect("cluster");
    let ns = c.namespace("helm").await.expect("namespace");
    let chart = workspace_root().join("charts/cli-mcp-operator");
    let yaml = run(Command::new(bin.join("helm"))
        .args(["template", "e2e"])
        .arg(&chart)
        .args(["--namespace", &ns.name, "--include-crds"])
        .args(["--set", &format!("watchNamespaces={{{}}}", ns.name)])
        .args(["--set", "image.tag=e2e"])
        .args(["--set", &format!("serverImage={SERVER_IMAGE}")])
        .args(["--set", &format!("sandboxImage={SANDBOX_IMAGE}")]));
    assert!(yaml.contains("kind: CustomResourceDefinition"));
    // The chart and kustomize install the same CRD.
    let crd = std::fs::read_to_string(
        workspace_root().join("config/crd/bases/cli-mcp.redhat.com_climcpinstances.yaml"),
    )
    .expect("CRD");
    assert!(yaml.contains(crd.lines().nth(3).expect("a line")));
    let outside = apply_yaml(&c, &ns.name, &yaml, |_| {}).await;
    operator_works(&c, ns.clone(), "e2e-cli-mcp-operator").await;
    for (api, name) in outside {
        let _ = api.delete(&name, &DeleteParams::default()).await;
    }
    ns.delete().await.expect("delete namespace");
}

#[test]
fn chart_and_kustomize_grant_the_same_rules() {
    // Both RBAC sources list the same (apiGroups, resources, verbs) triples.
    let root = workspace_root();
    let kz: String = [
        "role.yaml",
        "leader_election_role.yaml",
        "apiserver_endpoints_role.yaml",
    ]
    .iter()
    .map(|f| std::fs::read_to_string(root.join("config/rbac").join(f)).expect("rbac file"))
    .collect();
    let chart = std::fs::read_to_string(root.join("charts/cli-mcp-operator/templates/rbac.yaml"))
        .expect("rbac.yaml");
    let rules = |text: &str| {
        let mut v: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|l| {
                l.starts_with("resources:")
                    || l.starts_with("verbs:")
                    || l.starts_with("resourceNames:")
            })
            .map(str::to_owned)
            .collect();
        v.sort();
        v
    };
    assert_eq!(rules(&kz), rules(&chart));
}
