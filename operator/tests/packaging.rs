//! The kustomize build of config/default and the `helm template` output of the chart apply
//! cleanly to the local Kubernetes, and the operator they deploy (a real in-cluster pod with
//! the packaged, least-privilege RBAC and leader election) makes an instance Ready.
//!
//! helm and kustomize come from `hack/build-helm-kustomize.sh` (built from the Go module
//! proxy once, then cached outside the repo).

mod support;

use std::path::Path;
use std::process::Command;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_e2e::journey::{apply_yaml, tools};
use cli_mcp_e2e::testing::{cluster, wait_for, workspace_root, TestCluster, TestNamespace};
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
    let r = wait_for(
        ns.api::<Deployment>(),
        deployment,
        "operator Deployment available",
        TIMEOUT,
        |d: Option<&Deployment>| {
            d.and_then(|d| d.status.as_ref())
                .is_some_and(|s| s.ready_replicas.unwrap_or(0) >= 1)
        },
    )
    .await;
    if let Err(e) = r {
        panic!("operator did not become ready: {e}");
    }
    create_instance(&ns, "pkg", json!({"sandbox": {"warmPoolSize": 1}})).await;
    let ok = wait_for(
        ns.api::<CliMcpInstance>(),
        "pkg",
        "instance Ready",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| o.is_some_and(|o| is_true(o, "Ready")),
    )
    .await;
    let logs = || {
        let pods = std::fs::read_dir(c.info.kubelet_state_dir.join("pods"))
            .into_iter()
            .flatten()
            .flatten();
        pods.filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("{}_", ns.name))
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("operator.log")).ok())
        .collect::<Vec<_>>()
        .join("\n---\n")
    };
    if let Err(e) = ok {
        panic!(
            "instance not Ready under the packaged operator: {e}\n{}",
            logs()
        );
    }
    let api = ns.api::<CliMcpInstance>();
    api.delete("pkg", &DeleteParams::default())
        .await
        .expect("delete instance");
    wait_for(
        api,
        "pkg",
        "instance released",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| o.is_none(),
    )
    .await
    .unwrap_or_else(|e| panic!("finalizer not released: {e}\n{}", logs()));
}

fn overlay(dir: &Path, ns: &str) {
    // kustomize accepts only relative paths: the overlay lives under .run/ in the repo.
    let k = format!(
        r#"resources:
  - ../../config/default
namespace: {ns}
images:
  - name: cli-mcp-operator
    newTag: e2e
patches:
  - target: {{kind: Deployment, name: cli-mcp-operator}}
    patch: |-
      - op: replace
        path: /spec/template/spec/containers/0/env/0/value
        value: {server}
      - op: replace
        path: /spec/template/spec/containers/0/env/1/value
        value: {sandbox}
      - op: replace
        path: /spec/template/spec/containers/0/env/2/value
        value: {ns}
"#,
        server = SERVER_IMAGE,
        sandbox = SANDBOX_IMAGE,
    );
    std::fs::write(dir.join("kustomization.yaml"), k).expect("write overlay");
}

#[tokio::test]
async fn kustomize_output_applies_and_its_operator_works() {
    let bin = tools();
    let c = cluster().await.expect("cluster");
    let ns = c.namespace("kustomize").await.expect("namespace");
    let dir = workspace_root().join(format!(".run/kustomize-{}", ns.name));
    std::fs::create_dir_all(&dir).expect("overlay dir");
    overlay(&dir, &ns.name);
    let yaml = run(Command::new(bin.join("kustomize")).arg("build").arg(&dir));
    let _ = std::fs::remove_dir_all(&dir);
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
