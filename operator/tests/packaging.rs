//! The kustomize build of config/default and the `helm template` output of the chart apply
//! cleanly to the local Kubernetes, and the operator they deploy (a real in-cluster pod with
//! the packaged, least-privilege RBAC and leader election) makes an instance Ready.
//!
//! Without a cluster: what a Helm or kustomize user meets before anything runs: the chart's
//! schema refuses wrong values, its README lists every value, leader election off means
//! one replica, the ServiceMonitor is opt-in, image tags are the workspace version, and a
//! `namespace:` overlay keeps the operator able to read the API server's addresses.
//!
//! helm and kustomize come from `hack/build-helm-kustomize.sh` (built from the Go module
//! proxy once, then cached outside the repo).

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_e2e::instance::wait_instance;
use cli_mcp_e2e::journey::{apply_yaml, kustomize_build, operator_overlay, tools};
use cli_mcp_e2e::testing::{
    cluster, wait_deployment_ready, wait_for_set, wait_gone, workspace_root, TestCluster,
    TestNamespace,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::DeleteParams;
use serde_json::{json, Value};

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
                l.starts_with("- apiGroups:")
                    || l.starts_with("resources:")
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

fn chart_dir() -> PathBuf {
    workspace_root().join("charts/cli-mcp-operator")
}

fn helm(args: &[&str]) -> Output {
    Command::new(tools().join("helm"))
        .args(args)
        .output()
        .expect("run helm")
}

/// `helm template t <chart> <args>`, which must succeed.
fn helm_template(args: &[&str]) -> String {
    let chart = chart_dir();
    let mut all = vec!["template", "t", chart.to_str().expect("UTF-8 path")];
    all.extend_from_slice(args);
    let out = helm(&all);
    assert!(
        out.status.success(),
        "helm {all:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// `config/default` under `namespace: other` and `namePrefix: team-`, listing the transformer
/// `config/<transformer>` when given (what a renaming overlay must list).
fn renamed_overlay(dir: &str, transformer: Option<&str>) -> Vec<Value> {
    let t = transformer
        .map(|t| format!("transformers:\n  - ../../config/{t}\n"))
        .unwrap_or_default();
    documents(&kustomize_build(
        &format!("{dir}-{}", transformer.is_some()),
        &format!("resources:\n  - ../../config/default\nnamespace: other\nnamePrefix: team-\n{t}"),
    ))
}

/// The objects of a multi-document YAML stream.
fn documents(yaml: &str) -> Vec<Value> {
    use serde::Deserialize as _;
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| {
            let v = serde_yaml::Value::deserialize(doc).expect("a YAML document");
            serde_json::to_value(v).expect("JSON")
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn named<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

fn env_of<'a>(deployment: &'a Value, name: &str) -> &'a Value {
    deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == name)
        .map(|e| &e["value"])
        .unwrap_or_else(|| panic!("no env {name}"))
}

/// `[workspace.package] version` of Cargo.toml.
fn workspace_version() -> String {
    let cargo = std::fs::read_to_string(workspace_root().join("Cargo.toml")).expect("Cargo.toml");
    let section = cargo
        .split("\n[")
        .find(|s| s.starts_with("workspace.package]"))
        .expect("[workspace.package] in Cargo.toml");
    section
        .lines()
        .find_map(|l| l.trim().strip_prefix("version"))
        .and_then(|l| l.trim().strip_prefix('='))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .expect("version in [workspace.package]")
}

#[test]
fn chart_schema_refuses_wrong_values_with_the_path_and_the_type() {
    let chart = chart_dir();
    let chart = chart.to_str().expect("UTF-8 path");
    let lint = helm(&["lint", chart]);
    assert!(
        lint.status.success(),
        "the defaults must pass: {}",
        String::from_utf8_lossy(&lint.stdout)
    );
    let refused = |args: &[&str], expected: &[&str]| {
        for verb in ["template", "lint"] {
            let mut all = vec![verb, chart];
            all.extend_from_slice(args);
            let out = helm(&all);
            assert!(!out.status.success(), "helm {all:?} accepted it");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            for e in expected {
                assert!(text.contains(e), "helm {all:?}: no {e:?} in:\n{text}");
            }
        }
    };
    refused(
        &["--set", "replicaCount=two"],
        &["/replicaCount", "want integer"],
    );
    refused(
        &["--set", "leaderElection.enabled=yes"],
        &["/leaderElection/enabled", "want boolean"],
    );
    refused(
        &["--set", "watchNamespaces=team-a"],
        &["/watchNamespaces", "want array"],
    );
    refused(
        &["--set", "image.pullPolicy=Sometimes"],
        &["/image/pullPolicy"],
    );
    refused(
        &["--set", "metrics.port=70000"],
        &["/metrics/port", "maximum"],
    );
    // A misspelt key would otherwise be ignored without a word.
    refused(&["--set", "replicas=3"], &["'replicas' not allowed"]);
    refused(
        &["--set", "metrics.serviceMonitor.enable=true"],
        &["'enable' not allowed"],
    );
}

#[test]
fn leader_election_off_renders_exactly_one_replica_and_the_flag() {
    let docs = documents(&helm_template(&[
        "--set",
        "leaderElection.enabled=false",
        "--set",
        "replicaCount=3",
    ]));
    let d = named(&docs, "Deployment", "t-cli-mcp-operator");
    assert_eq!(d["spec"]["replicas"], 1);
    // A rolling update would run the new pod next to the old one: two reconcilers.
    assert_eq!(d["spec"]["strategy"]["type"], "Recreate");
    // Explicitly null, so that an upgrade from the default strategy removes its parameters.
    assert!(d["spec"]["strategy"]
        .as_object()
        .is_some_and(|s| s.get("rollingUpdate") == Some(&Value::Null)));
    assert_eq!(env_of(d, "CLI_MCP_LEADER_ELECT"), "false");
    assert!(
        !docs.iter().any(|d| d["metadata"]["name"]
            .as_str()
            .is_some_and(|n| n.ends_with("-leader-election"))),
        "no Lease RBAC without leader election"
    );

    let docs = documents(&helm_template(&["--set", "replicaCount=3"]));
    let d = named(&docs, "Deployment", "t-cli-mcp-operator");
    assert_eq!(d["spec"]["replicas"], 3);
    assert!(d["spec"]["strategy"].is_null(), "{}", d["spec"]);
    assert_eq!(env_of(d, "CLI_MCP_LEADER_ELECT"), "true");
    named(&docs, "Role", "t-cli-mcp-operator-leader-election");
}

#[test]
fn metrics_service_always_and_service_monitor_only_when_enabled() {
    let docs = documents(&helm_template(&[]));
    assert!(of_kind(&docs, "ServiceMonitor").is_empty());
    let svc = named(&docs, "Service", "t-cli-mcp-operator-metrics");
    let d = named(&docs, "Deployment", "t-cli-mcp-operator");
    // The Service selects the operator pods and reaches the port /metrics is served on.
    let pod_labels = &d["spec"]["template"]["metadata"]["labels"];
    for (k, v) in svc["spec"]["selector"].as_object().expect("selector") {
        assert_eq!(&pod_labels[k], v, "selector {k}");
    }
    assert_eq!(svc["spec"]["ports"][0]["name"], "metrics");
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "health");
    let container = &d["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["ports"][0]["name"], "health");
    assert_eq!(container["ports"][0]["containerPort"], 8081);
    assert_eq!(env_of(d, "CLI_MCP_HEALTH_LISTEN"), "0.0.0.0:8081");

    let docs = documents(&helm_template(&[
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.serviceMonitor.labels.release=prom",
        "--set",
        "metrics.port=9090",
    ]));
    let monitors = of_kind(&docs, "ServiceMonitor");
    assert_eq!(monitors.len(), 1);
    let sm = monitors[0];
    assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(sm["metadata"]["labels"]["release"], "prom");
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(sm["spec"]["endpoints"][0]["path"], "/metrics");
    assert_eq!(sm["spec"]["endpoints"][0]["interval"], "30s");
    // It selects the metrics Service, and only that Service.
    let svc = named(&docs, "Service", "t-cli-mcp-operator-metrics");
    let selected = |labels: &Value| {
        sm["spec"]["selector"]["matchLabels"]
            .as_object()
            .expect("matchLabels")
            .iter()
            .all(|(k, v)| &labels[k] == v)
    };
    assert!(selected(&svc["metadata"]["labels"]));
    let services = of_kind(&docs, "Service");
    assert_eq!(
        services
            .iter()
            .filter(|s| selected(&s["metadata"]["labels"]))
            .count(),
        1
    );
    assert_eq!(svc["spec"]["ports"][0]["port"], 9090);
    let d = named(&docs, "Deployment", "t-cli-mcp-operator");
    assert_eq!(env_of(d, "CLI_MCP_HEALTH_LISTEN"), "0.0.0.0:9090");
}

/// The README's table, built from values.yaml (keys in order, defaults) and
/// values.schema.json (types, descriptions). Problems: keys one file has and the other
/// lacks, a value without a description.
fn values_table() -> (String, Vec<String>) {
    let dir = chart_dir();
    let values: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(dir.join("values.yaml")).expect("values.yaml"),
    )
    .expect("values.yaml is YAML");
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("values.schema.json")).expect("values.schema.json"),
    )
    .expect("values.schema.json is JSON");
    let mut rows = vec![
        "| key | type | default | description |".to_owned(),
        "|---|---|---|---|".to_owned(),
    ];
    let mut problems = Vec::new();
    table_rows(&schema, &values, "", &mut rows, &mut problems);
    (rows.join("\n") + "\n", problems)
}

fn table_rows(
    schema: &Value,
    values: &serde_yaml::Value,
    prefix: &str,
    rows: &mut Vec<String>,
    problems: &mut Vec<String>,
) {
    let props = schema["properties"].as_object();
    let Some(map) = values.as_mapping() else {
        problems.push(format!(
            "{prefix}: the schema has properties, values.yaml no mapping"
        ));
        return;
    };
    for (k, v) in map {
        let key = k.as_str().unwrap_or_default();
        let path = format!("{prefix}{key}");
        let Some(s) = props.and_then(|p| p.get(key)) else {
            problems.push(format!("{path}: in values.yaml, not in values.schema.json"));
            continue;
        };
        if let Some(desc) = s["description"].as_str() {
            let ty = match &s["type"] {
                Value::String(t) => t.clone(),
                Value::Array(ts) => ts
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(" or "),
                _ => {
                    problems.push(format!("{path}: no type in values.schema.json"));
                    String::new()
                }
            };
            let default = serde_json::to_string(v).expect("JSON");
            rows.push(format!("| `{path}` | {ty} | `{default}` | {desc} |"));
        } else if s["properties"].is_object() {
            table_rows(s, v, &format!("{path}."), rows, problems);
        } else {
            problems.push(format!("{path}: no description in values.schema.json"));
        }
    }
    for key in props.into_iter().flat_map(|p| p.keys()) {
        // Helm gives a subchart its parent's `global`; it has no default here.
        if prefix.is_empty() && key == "global" {
            continue;
        }
        if !map.contains_key(key.as_str()) {
            problems.push(format!(
                "{prefix}{key}: in values.schema.json, not in values.yaml"
            ));
        }
    }
}

/// Fails while the README's table differs from values.yaml and the schema;
/// `CLI_MCP_UPDATE_CHART_README=1` rewrites it instead.
#[test]
fn chart_readme_lists_every_value_with_its_type_and_default() {
    const START: &str = "<!-- values table: generated by operator/tests/packaging.rs -->\n";
    const END: &str = "<!-- end of values table -->";
    let (table, problems) = values_table();
    assert!(problems.is_empty(), "{problems:#?}");
    let path = chart_dir().join("README.md");
    let readme = std::fs::read_to_string(&path).expect("charts/cli-mcp-operator/README.md");
    let (head, rest) = readme.split_once(START).expect("table start marker");
    let (current, tail) = rest.split_once(END).expect("table end marker");
    if current != table {
        if std::env::var_os("CLI_MCP_UPDATE_CHART_README").is_some() {
            std::fs::write(&path, format!("{head}{START}{table}{END}{tail}")).expect("write");
            return;
        }
        panic!(
            "{} is stale; run this test with CLI_MCP_UPDATE_CHART_README=1, or make the table:\n{table}",
            path.display()
        );
    }
    // Rows are there for every leaf value, e.g.:
    assert!(table.contains("| `leaderElection.enabled` | boolean | `true` |"));
    assert!(table.contains("| `metrics.serviceMonitor.enabled` | boolean | `false` |"));
}

#[test]
fn image_tags_are_the_workspace_version() {
    let version = workspace_version();
    let root = workspace_root();
    // The images the rendered Deployment runs and hands to the operator.
    // Under the release registry the Makefile names (RELEASE_REGISTRY).
    let makefile = std::fs::read_to_string(root.join("Makefile")).expect("Makefile");
    let registry = makefile
        .lines()
        .find_map(|l| l.strip_prefix("RELEASE_REGISTRY := "))
        .expect("RELEASE_REGISTRY in the Makefile")
        .trim();
    // A release commit (`make publish`) adds `@sha256:<digest>`; the rest stays as here.
    let unpinned = |v: &Value| -> String {
        let s = v.as_str().unwrap_or_default();
        match s.split_once("@sha256:") {
            Some((name, hex)) if hex.len() == 64 => name.to_owned(),
            _ => s.to_owned(),
        }
    };
    let images_are_the_version = |d: &Value| {
        let c = &d["spec"]["template"]["spec"]["containers"][0];
        let want = format!("{registry}/cli-mcp-operator:{version}");
        assert_eq!(unpinned(&c["image"]), want);
        for (env, image) in [
            ("RELATED_IMAGE_SERVER", "cli-mcp-server"),
            ("RELATED_IMAGE_SANDBOX", "cli-mcp-sandbox"),
            ("RELATED_IMAGE_PROXY", "cli-mcp-proxy"),
        ] {
            let want = format!("{registry}/{image}:{version}");
            assert_eq!(unpinned(env_of(d, env)), want, "{env}");
        }
    };
    // kustomize.
    let docs = documents(&kustomize_build(
        "pkg-version",
        "resources:\n  - ../../config/default\n",
    ));
    let d = named(&docs, "Deployment", "cli-mcp-operator");
    images_are_the_version(d);
    let c = &d["spec"]["template"]["spec"]["containers"][0];
    // The journeys' overlay replaces env 0..2 by index: they must stay these three.
    let names: Vec<&Value> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .take(3)
        .map(|e| &e["name"])
        .collect();
    assert_eq!(
        names,
        [
            "RELATED_IMAGE_SERVER",
            "RELATED_IMAGE_SANDBOX",
            "WATCH_NAMESPACE"
        ]
    );
    // Helm: the same images by default, and the chart's appVersion.
    let docs = documents(&helm_template(&[]));
    images_are_the_version(named(&docs, "Deployment", "t-cli-mcp-operator"));
    let chart: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root.join("charts/cli-mcp-operator/Chart.yaml"))
            .expect("Chart.yaml"),
    )
    .expect("Chart.yaml is YAML");
    assert_eq!(chart["appVersion"].as_str(), Some(version.as_str()));
    // And the real node's registry has them under their short names.
    let aliases: Vec<&str> = cli_mcp_e2e::project_images::ALIASES
        .iter()
        .flat_map(|(_, a)| a.iter().copied())
        .collect();
    for image in ["operator", "server", "sandbox", "proxy"] {
        let name = format!("cli-mcp-{image}:{version}");
        assert!(
            aliases.contains(&name.as_str()),
            "{name} not in {aliases:?}"
        );
    }
}

/// `namespace:` moves every namespaced object; the Role and RoleBinding that let the
/// operator read the `kubernetes` Service and EndpointSlices must stay in `default`.
#[test]
fn a_namespace_overlay_keeps_the_apiserver_endpoints_rbac_in_default() {
    let overlay = |transformer: bool| {
        renamed_overlay(
            "pkg-namespace",
            transformer.then_some("rbac/apiserver-endpoints-in-default"),
        )
    };
    let docs = overlay(true);
    let role = named(&docs, "Role", "team-cli-mcp-operator-apiserver-endpoints");
    assert_eq!(role["metadata"]["namespace"], "default");
    let binding = named(
        &docs,
        "RoleBinding",
        "team-cli-mcp-operator-apiserver-endpoints",
    );
    assert_eq!(binding["metadata"]["namespace"], "default");
    assert_eq!(
        binding["roleRef"]["name"],
        "team-cli-mcp-operator-apiserver-endpoints"
    );
    // ...bound to the operator's ServiceAccount where the overlay put it.
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": "team-cli-mcp-operator", "namespace": "other"}])
    );
    named(&docs, "ServiceAccount", "team-cli-mcp-operator");
    for d in &docs {
        let name = d["metadata"]["name"].as_str().unwrap_or_default();
        let ns = &d["metadata"]["namespace"];
        if !ns.is_null() && !name.ends_with("-apiserver-endpoints") {
            assert_eq!(ns, "other", "{} {name}", d["kind"]);
        }
    }
    // Without the transformer kustomize moves them (why it is there).
    let docs = overlay(false);
    let role = named(&docs, "Role", "team-cli-mcp-operator-apiserver-endpoints");
    assert_eq!(role["metadata"]["namespace"], "other");

    // config/default itself, which lists it.
    let docs = documents(&kustomize_build(
        "pkg-namespace-default",
        "resources:\n  - ../../config/default\n",
    ));
    let binding = named(&docs, "RoleBinding", "cli-mcp-operator-apiserver-endpoints");
    assert_eq!(binding["metadata"]["namespace"], "default");
    assert_eq!(binding["subjects"][0]["namespace"], "cli-mcp-system");
    let d = named(&docs, "Deployment", "cli-mcp-operator");
    assert_eq!(d["metadata"]["namespace"], "cli-mcp-system");
}

/// What `helm package` ships: the schema, the README, the CRD, and every file NOTES.txt
/// names (it must not send a user to files only the repository has).
#[test]
fn packaged_chart_carries_its_docs_and_notes_name_no_missing_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let chart = chart_dir();
    let out = helm(&[
        "package",
        chart.to_str().expect("UTF-8"),
        "--destination",
        dir.path().to_str().expect("UTF-8"),
    ]);
    assert!(
        out.status.success(),
        "helm package: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tgz = std::fs::read_dir(dir.path())
        .expect("read dir")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "tgz"))
        .expect("a .tgz");
    let list = Command::new("tar")
        .arg("-tzf")
        .arg(&tgz)
        .output()
        .expect("tar");
    assert!(list.status.success());
    let files: Vec<String> = String::from_utf8_lossy(&list.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("cli-mcp-operator/"))
        .map(str::to_owned)
        .collect();
    for f in [
        "values.schema.json",
        "README.md",
        "crds/cli-mcp.redhat.com_climcpinstances.yaml",
        "templates/NOTES.txt",
    ] {
        assert!(files.iter().any(|p| p == f), "{f} not in {files:?}");
    }
    let notes = std::fs::read_to_string(chart.join("templates/NOTES.txt")).expect("NOTES.txt");
    for word in notes.split_whitespace() {
        let word = word.trim_matches(|c: char| "()`'\",.;:".contains(c));
        let looks_like_a_file = [".yaml", ".yml", ".md", ".json", ".txt"]
            .iter()
            .any(|ext| word.ends_with(ext));
        if looks_like_a_file {
            assert!(
                files.iter().any(|p| Path::new(p).ends_with(word)),
                "NOTES.txt names {word}, which the packaged chart lacks ({files:?})"
            );
        }
    }
}

#[test]
fn both_packages_grant_the_credential_proxy_pod_disruption_budget() {
    let root = workspace_root();
    let kz = documents(&std::fs::read_to_string(root.join("config/rbac/role.yaml")).expect("role"));
    let chart = documents(&helm_template(&[]));
    let rule = json!({
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        // No delete: it goes with its instance by owner-reference GC.
        "verbs": ["get", "list", "watch", "create", "patch"],
    });
    let grants = |docs: &[Value]| {
        of_kind(docs, "ClusterRole")
            .iter()
            .any(|r| r["rules"].as_array().is_some_and(|rs| rs.contains(&rule)))
    };
    assert!(grants(&kz), "config/rbac/role.yaml");
    assert!(grants(&chart), "the chart");
}

/// Both packages let the operator read the cluster's RuntimeClasses, and only read them,
/// in the ClusterRole bound cluster-wide (the cluster-scoped part, whatever namespaces are
/// watched): it checks every runtimeClassName before making pods with it.
#[test]
fn both_packages_let_the_operator_read_runtime_classes_and_nothing_more() {
    let root = workspace_root();
    let kz = documents(&std::fs::read_to_string(root.join("config/rbac/role.yaml")).expect("role"));
    let chart = documents(&helm_template(&["--set", "watchNamespaces={team-a}"]));
    let read = json!({
        "apiGroups": ["node.k8s.io"],
        "resources": ["runtimeclasses"],
        "verbs": ["get", "list", "watch"],
    });
    for (docs, what) in [(&kz, "config/rbac/role.yaml"), (&chart, "the chart")] {
        let roles = of_kind(docs, "ClusterRole");
        let granting: Vec<&&Value> = roles
            .iter()
            .filter(|r| {
                r["rules"].as_array().into_iter().flatten().any(|rule| {
                    rule["resources"]
                        .as_array()
                        .is_some_and(|rs| rs.contains(&json!("runtimeclasses")))
                })
            })
            .collect();
        assert_eq!(granting.len(), 1, "{what}: one ClusterRole reads them");
        let rules = granting[0]["rules"].as_array().expect("rules");
        assert!(rules.contains(&read), "{what} lacks {read}");
        assert!(
            cluster_wide_resources(docs).contains(&"runtimeclasses".to_owned()),
            "{what}: RuntimeClasses are cluster-scoped, so read cluster-wide"
        );
    }
}

#[test]
fn both_packages_grant_the_exposed_endpoints_objects() {
    let root = workspace_root();
    let kz = documents(&std::fs::read_to_string(root.join("config/rbac/role.yaml")).expect("role"));
    let chart = documents(&helm_template(&[]));
    let verbs = ["get", "list", "watch", "create", "patch", "delete"];
    let rules = [
        json!({"apiGroups": ["networking.k8s.io"], "resources": ["ingresses"], "verbs": verbs}),
        json!({"apiGroups": ["gateway.networking.k8s.io"], "resources": ["httproutes"], "verbs": verbs}),
        json!({"apiGroups": ["route.openshift.io"], "resources": ["routes"], "verbs": verbs}),
        json!({"apiGroups": ["route.openshift.io"], "resources": ["routes/custom-host"], "verbs": ["create", "update"]}),
    ];
    for (docs, what) in [(&kz, "config/rbac/role.yaml"), (&chart, "the chart")] {
        for rule in &rules {
            let granted = of_kind(docs, "ClusterRole")
                .iter()
                .any(|r| r["rules"].as_array().is_some_and(|rs| rs.contains(rule)));
            assert!(granted, "{what} lacks {rule}");
        }
    }
}

/// The admission policies and bindings of a rendered package, by name, with the
/// operator's username replaced by `<operator>` so that both packages compare.
fn admission_objects(docs: &[Value], operator: &str) -> Vec<Value> {
    let mut out: Vec<Value> = docs
        .iter()
        .filter(|d| {
            d["kind"]
                .as_str()
                .is_some_and(|k| k.starts_with("ValidatingAdmissionPolicy"))
        })
        .map(|d| {
            let text = serde_json::to_string(d).expect("JSON");
            serde_json::from_str(&text.replace(operator, "<operator>")).expect("JSON")
        })
        .collect();
    out.sort_by_key(|d| format!("{}/{}", d["kind"], d["metadata"]["name"]));
    out
}

#[test]
fn both_packages_install_the_same_admission_policies() {
    let kz = documents(&kustomize_build(
        "pkg-admission-default",
        "resources:\n  - ../../config/default\n",
    ));
    let chart = documents(&helm_template(&["--namespace", "ops"]));
    let kz = admission_objects(&kz, "system:serviceaccount:cli-mcp-system:cli-mcp-operator");
    let chart = admission_objects(&chart, "system:serviceaccount:ops:t-cli-mcp-operator");
    let names = |v: &[Value]| -> Vec<String> {
        v.iter()
            .map(|d| {
                format!(
                    "{} {}",
                    d["kind"].as_str().unwrap_or_default(),
                    d["metadata"]["name"].as_str().unwrap_or_default()
                )
            })
            .collect()
    };
    assert_eq!(
        names(&kz),
        [
            "ValidatingAdmissionPolicy cli-mcp-instance-names",
            "ValidatingAdmissionPolicy cli-mcp-operator-cluster-role-bindings",
            "ValidatingAdmissionPolicy cli-mcp-sandbox-pod-deletions",
            "ValidatingAdmissionPolicy cli-mcp-sandbox-pods",
            "ValidatingAdmissionPolicy cli-mcp-tenant-pods",
            "ValidatingAdmissionPolicyBinding cli-mcp-instance-names",
            "ValidatingAdmissionPolicyBinding cli-mcp-operator-cluster-role-bindings",
            "ValidatingAdmissionPolicyBinding cli-mcp-sandbox-pod-deletions",
            "ValidatingAdmissionPolicyBinding cli-mcp-sandbox-pods",
            "ValidatingAdmissionPolicyBinding cli-mcp-tenant-pods",
        ]
    );
    assert_eq!(names(&chart).len(), kz.len(), "{:?}", names(&chart));
    for k in &kz {
        let name = k["metadata"]["name"].as_str().expect("name");
        // The chart prefixes the release's full name; the rest is the same object.
        let suffix = name
            .trim_start_matches("cli-mcp-")
            .trim_start_matches("operator-");
        let chart_name = format!("t-cli-mcp-operator-{suffix}");
        let h = chart
            .iter()
            .find(|h| h["kind"] == k["kind"] && h["metadata"]["name"] == chart_name.as_str())
            .unwrap_or_else(|| panic!("the chart has no {} {chart_name}", k["kind"]));
        let (mut ks, mut hs) = (k["spec"].clone(), h["spec"].clone());
        if k["kind"] == "ValidatingAdmissionPolicyBinding" {
            assert_eq!(hs["policyName"], h["metadata"]["name"], "{name}");
            ks["policyName"] = json!(null);
            hs["policyName"] = json!(null);
        } else if name != "cli-mcp-operator-cluster-role-bindings" {
            // The pod policies recognise an operator by what RBAC grants it, never by a
            // name (which anyone who may create ServiceAccounts can take): the same text in
            // both packages, and no operator name in it.
            let text = serde_json::to_string(&hs).expect("JSON");
            assert!(
                !text.contains("<operator>"),
                "{name} names the operator: {text}"
            );
            assert!(
                !text.contains("endsWith('cli-mcp-operator')"),
                "{name}: {text}"
            );
        }
        assert_eq!(
            ks, hs,
            "{name} differs between config/admission and the chart"
        );
    }
    // Off in the chart: none.
    let off = documents(&helm_template(&[
        "--set",
        "admissionPolicies.enabled=false",
    ]));
    assert!(admission_objects(&off, "-").is_empty());
}

/// `namespace:` and `namePrefix:` rename the operator's ServiceAccount; the policy that
/// guards its ClusterRoleBindings must name it where it ends up, and every binding must
/// still point at its (renamed) policy.
#[test]
fn an_overlay_keeps_the_admission_policies_on_the_renamed_operator() {
    let overlay = |transformer: bool| {
        renamed_overlay(
            "pkg-admission-overlay",
            transformer.then_some("admission/operator-identity"),
        )
    };
    let condition = |docs: &[Value]| {
        named(
            docs,
            "ValidatingAdmissionPolicy",
            "team-cli-mcp-operator-cluster-role-bindings",
        )["spec"]["matchConditions"][0]["expression"]
            .as_str()
            .expect("expression")
            .to_owned()
    };
    let docs = overlay(true);
    assert!(
        condition(&docs).starts_with("'system:serviceaccount:other:team-cli-mcp-operator:' =="),
        "{}",
        condition(&docs)
    );
    for b in of_kind(&docs, "ValidatingAdmissionPolicyBinding") {
        let policy = b["spec"]["policyName"].as_str().expect("policyName");
        named(&docs, "ValidatingAdmissionPolicy", policy);
    }
    // Without the transformer the policy keeps naming config/default's operator.
    let docs = overlay(false);
    assert!(
        condition(&docs).starts_with("'system:serviceaccount:cli-mcp-system:cli-mcp-operator:'")
    );
}

/// The rules of the ClusterRoles that `subjects` of ClusterRoleBindings grant cluster-wide.
fn cluster_wide_resources(docs: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for b in of_kind(docs, "ClusterRoleBinding") {
        let role = named(
            docs,
            "ClusterRole",
            b["roleRef"]["name"].as_str().expect("roleRef"),
        );
        for r in role["rules"].as_array().expect("rules") {
            for res in r["resources"].as_array().expect("resources") {
                out.push(res.as_str().expect("resource").to_owned());
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Watching one namespace, the operator reads Secrets (and writes pods, Roles, …) only
/// there: cluster-wide it keeps only the rules on cluster-scoped objects (its
/// ClusterRoleBindings, and reading RuntimeClasses).
#[test]
fn a_namespaced_install_grants_secrets_and_pods_only_in_the_watched_namespace() {
    let cluster_scoped = ["clusterrolebindings", "clusterroles", "runtimeclasses"];
    // config/default: everything cluster-wide (the baseline this changes).
    let docs = documents(&kustomize_build(
        "pkg-ns-default",
        "resources:\n  - ../../config/default\n",
    ));
    assert!(cluster_wide_resources(&docs).contains(&"secrets".to_owned()));

    let check = |docs: &[Value], watched: &[&str], operator: (&str, &str), role: &str| {
        assert_eq!(cluster_wide_resources(docs), cluster_scoped);
        let bindings: Vec<&Value> = of_kind(docs, "RoleBinding")
            .into_iter()
            .filter(|b| b["roleRef"]["name"] == role)
            .collect();
        let mut got: Vec<&str> = bindings
            .iter()
            .map(|b| b["metadata"]["namespace"].as_str().expect("namespace"))
            .collect();
        got.sort();
        assert_eq!(got, watched);
        for b in bindings {
            assert_eq!(b["roleRef"]["kind"], "ClusterRole");
            assert_eq!(
                b["subjects"],
                json!([{"kind": "ServiceAccount", "name": operator.1, "namespace": operator.0}])
            );
        }
        let d = of_kind(docs, "Deployment")[0];
        assert_eq!(env_of(d, "WATCH_NAMESPACE"), &json!(watched.join(",")));
    };
    let docs = documents(&kustomize_build(
        "pkg-ns-namespaced",
        "resources:\n  - ../../config/namespaced\n",
    ));
    check(
        &docs,
        &["cli-mcp-instances"],
        ("cli-mcp-system", "cli-mcp-operator"),
        "cli-mcp-operator-namespaced",
    );
    // An overlay moving the operator and choosing the namespace: the RoleBinding follows
    // WATCH_NAMESPACE and the ServiceAccount, not the overlay's `namespace:`.
    let docs = documents(&kustomize_build(
        "pkg-ns-overlay",
        "resources:
  - ../../config/namespaced
namespace: ops
namePrefix: t-
patches:
  - target: {kind: Deployment, name: cli-mcp-operator}
    patch: |-
      - op: replace
        path: /spec/template/spec/containers/0/env/2/value
        value: team-a
transformers:
  - ../../config/rbac/apiserver-endpoints-in-default
  - ../../config/admission/operator-identity
  - ../../config/namespaced/watched-namespace
",
    ));
    check(
        &docs,
        &["team-a"],
        ("ops", "t-cli-mcp-operator"),
        "t-cli-mcp-operator-namespaced",
    );

    // The chart: watchNamespaces.
    let docs = documents(&helm_template(&["--namespace", "ops"]));
    assert!(cluster_wide_resources(&docs).contains(&"secrets".to_owned()));
    let docs = documents(&helm_template(&[
        "--namespace",
        "ops",
        "--set",
        "watchNamespaces={team-a,team-b}",
    ]));
    check(
        &docs,
        &["team-a", "team-b"],
        ("ops", "t-cli-mcp-operator"),
        "t-cli-mcp-operator-namespaced",
    );
}

/// config/namespaced in a cluster: the operator with its namespaced rules bound only in the
/// watched namespace, and config/admission's policies naming it (the transformers listed),
/// makes an instance Ready — its warm pod passes the pod policies, its auth-delegator
/// ClusterRoleBinding the binding policy — and releases it, deleting that binding.
#[tokio::test]
async fn kustomize_namespaced_output_applies_and_its_operator_works_under_the_policies() {
    let c = cluster().await.expect("cluster");
    let ns = c.namespace("kustomize-ns").await.expect("namespace");
    let overlay = operator_overlay(&ns.name, true)
        .replace("../../config/default", "../../config/namespaced")
        + "transformers:
  - ../../config/rbac/apiserver-endpoints-in-default
  - ../../config/admission/operator-identity
  - ../../config/namespaced/watched-namespace
";
    let yaml = kustomize_build(&format!("kustomize-ns-{}", ns.name), &overlay);
    let docs = documents(&yaml);
    // Nothing namespaced is granted cluster-wide, and the binding policy names this operator.
    assert_eq!(
        cluster_wide_resources(&docs),
        ["clusterrolebindings", "clusterroles", "runtimeclasses"]
    );
    let policy = named(
        &docs,
        "ValidatingAdmissionPolicy",
        &format!("{}-cli-mcp-operator-cluster-role-bindings", ns.name),
    );
    let operator = format!("system:serviceaccount:{0}:{0}-cli-mcp-operator", ns.name);
    assert!(policy["spec"]["matchConditions"][0]["expression"]
        .as_str()
        .is_some_and(|e| e.contains(&format!("'{operator}:'"))));
    let outside = apply_yaml(&c, &ns.name, &yaml, |_| {}).await;
    let deployment = format!("{}-cli-mcp-operator", ns.name);
    let r = wait_deployment_ready(ns.api::<Deployment>(), &deployment, TIMEOUT).await;
    if let Err(e) = r {
        panic!("operator did not become ready: {e}");
    }
    let logs = || c.pod_logs(&ns.name, "operator", usize::MAX);
    create_instance(&ns, "pkg", json!({"sandbox": {"warmPoolSize": 1}})).await;
    let api = ns.api::<CliMcpInstance>();
    let ready = wait_instance(api.clone(), "pkg", "instance Ready", TIMEOUT, |o| {
        is_true(o, "Ready")
    })
    .await;
    if let Err(e) = ready {
        panic!("instance not Ready under the policies: {e}\n{}", logs());
    }
    // The warm pod is the operator's own pod creation, which the pod policies judge.
    let pods = wait_for_set(
        ns.api::<Pod>(),
        &sandbox_selector("pkg"),
        "a warm sandbox pod",
        TIMEOUT,
        |pods: &[Pod]| !pods.is_empty(),
    )
    .await;
    if let Err(e) = pods {
        panic!("no warm pod under the policies: {e}\n{}", logs());
    }
    let binding = cli_mcp_api::names::InstanceName::parse("pkg")
        .expect("name")
        .auth_delegator_binding(&ns.name);
    let crbs: kube::Api<ClusterRoleBinding> = kube::Api::all(c.client.clone());
    assert!(crbs.get_opt(&binding).await.expect("get binding").is_some());
    api.delete("pkg", &DeleteParams::default())
        .await
        .expect("delete instance");
    wait_gone(api, "pkg", "instance released", TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("finalizer not released: {e}\n{}", logs()));
    assert!(
        crbs.get_opt(&binding).await.expect("get binding").is_none(),
        "the finalizer released the instance but its ClusterRoleBinding {binding} is still there"
    );
    for (api, name) in outside {
        let _ = api.delete(&name, &DeleteParams::default()).await;
    }
    ns.delete().await.expect("delete namespace");
}
