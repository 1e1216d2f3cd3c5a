//! The sandbox briefing (operator/src/briefing): what the models are told about their
//! sandbox, in the server Deployment's `CLI_MCP_BRIEFING`.
//!
//! - the tools it names are the built image's: the record `hack/build-images.sh` writes
//!   beside the archives, inside the sandbox image and in its label agree, the operator's
//!   packaged `CLI_MCP_SANDBOX_TOOLS` says the same, and the briefing names each version;
//! - on the local Kubernetes, with a real ServiceAccount's kubeconfig: a review that fails says
//!   "unknown", a rotated kubeconfig is reviewed at once, an identity with no rights is said
//!   to have none, and a RoleBinding given or taken shows within the refresh interval;
//! - `make run`'s sample with the investigator kubeconfig stays under the length bound.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::label;
use cli_mcp_api::names::InstanceName;
use cli_mcp_api::pod_state::{is_deleting, is_ready};
use cli_mcp_e2e::testing::{
    cluster, wait_for, wait_for_set, workspace_root, TestCluster, TestNamespace,
};
use cli_mcp_operator::briefing::{self, parse_tools, Kube, Tool};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::ByteString;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{json, Value};

use support::*;

/// The refresh interval the operators of these tests run with (`--briefing-refresh`).
const REFRESH: Duration = Duration::from_secs(2);
/// How much later than the refresh interval a change may show: the reconcile's own time,
/// the Deployment write, the watch that sees it, on a busy test machine. Less than the
/// operator's other periodic checks of an instance (15 s and more), so that only the
/// refresh can show the change in time.
const SLACK: Duration = Duration::from_secs(10);
/// The bound a typical instance's briefing stays under, in characters.
const TYPICAL_BOUND: usize = 1500;

fn run(cmd: &mut Command) -> Vec<u8> {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn json_file(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn blob(root: &Path, digest: &str) -> PathBuf {
    root.join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"))
}

/// The sandbox archive's `/etc/cli-mcp/tools.json` (the last layer that has it) and its
/// config's label `io.cli-mcp.tools`.
fn image_record(archive: &Path) -> (String, String) {
    let scratch = tempfile::tempdir().expect("temporary directory");
    run(Command::new("tar")
        .arg("-xf")
        .arg(archive)
        .arg("-C")
        .arg(scratch.path()));
    let index = json_file(&scratch.path().join("index.json"));
    let manifest = json_file(&blob(
        scratch.path(),
        index["manifests"][0]["digest"].as_str().expect("manifest"),
    ));
    let config = json_file(&blob(
        scratch.path(),
        manifest["config"]["digest"].as_str().expect("config"),
    ));
    let label = config["config"]["Labels"]["io.cli-mcp.tools"]
        .as_str()
        .expect("label io.cli-mcp.tools on the sandbox image")
        .to_owned();
    let mut file = None;
    for layer in manifest["layers"].as_array().expect("layers") {
        let path = blob(scratch.path(), layer["digest"].as_str().expect("digest"));
        let out = Command::new("tar")
            .arg("-xzf")
            .arg(&path)
            .args(["-O", "./etc/cli-mcp/tools.json"])
            .output()
            .expect("tar");
        if out.status.success() && !out.stdout.is_empty() {
            file = Some(String::from_utf8(out.stdout).expect("UTF-8"));
        }
    }
    (
        file.expect("/etc/cli-mcp/tools.json in a layer of the sandbox image"),
        label,
    )
}

/// `CLI_MCP_SANDBOX_TOOLS` of the operator Deployment in config/manager.
fn manager_tools() -> String {
    let yaml = std::fs::read_to_string(workspace_root().join("config/manager/manager.yaml"))
        .expect("config/manager/manager.yaml");
    let found = serde_yaml::Deserializer::from_str(&yaml)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .find_map(|v: Value| {
            v.pointer("/spec/template/spec/containers/0/env")?
                .as_array()?
                .iter()
                .find(|e| e["name"] == "CLI_MCP_SANDBOX_TOOLS")?["value"]
                .as_str()
                .map(str::to_owned)
        });
    found.expect("CLI_MCP_SANDBOX_TOOLS in config/manager/manager.yaml")
}

/// The record of the built image, in every place the build puts it, is what the packaged
/// operator is told, and the briefing names each tool with its version. Builds the images
/// (cached by `hack/build-images.sh`) from the binaries of this build.
#[test]
fn the_briefing_names_the_built_images_tools() {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_cli-mcp-operator"))
        .parent()
        .expect("bin dir");
    let images = cli_mcp_e2e::project_images::build(bin_dir).expect("hack/build-images.sh");
    let recorded = std::fs::read_to_string(images.dir.join("sandbox-tools.json"))
        .expect("sandbox-tools.json beside the archives");
    let tools = parse_tools(recorded.trim()).expect("a valid record");
    let (file, label) = image_record(&images.dir.join("cli-mcp-sandbox.tar"));
    assert_eq!(
        parse_tools(file.trim()).as_ref(),
        Ok(&tools),
        "the image's file"
    );
    assert_eq!(
        parse_tools(&label).as_ref(),
        Ok(&tools),
        "the image's label"
    );
    assert_eq!(
        parse_tools(&manager_tools()).as_ref(),
        Ok(&tools),
        "config/manager/manager.yaml's CLI_MCP_SANDBOX_TOOLS is not what the image has; set it \
         (and the chart's sandboxTools) to {}",
        recorded.trim()
    );
    let values: Value = serde_yaml::from_str(
        &std::fs::read_to_string(workspace_root().join("charts/cli-mcp-operator/values.yaml"))
            .expect("the chart's values.yaml"),
    )
    .expect("YAML");
    assert_eq!(
        values["sandboxTools"].as_str().map(parse_tools),
        Some(Ok(tools.clone())),
        "the chart's sandboxTools is not what the image has; set it to {}",
        recorded.trim()
    );
    for want in ["bash", "kubectl", "jq", "yq", "curl"] {
        assert!(tools.iter().any(|t| t.name == want), "{want} in {tools:?}");
    }
    let text = briefing::render(&briefing::Facts {
        image: "cli-mcp-sandbox:0.1.0",
        tools: Some(&tools),
        kube: &Kube::NoTarget,
        domains: Vec::new(),
        extra_egress: false,
        default_timeout_secs: 60,
        max_timeout_secs: 300,
        output_budget: 65536,
        idle_timeout: Duration::from_secs(1800),
    });
    for Tool { name, version } in &tools {
        assert!(
            text.contains(&format!("{name} {version}")),
            "{name} {version} in:\n{text}"
        );
    }
}

/// The generated briefing of instance `name`, as its server Deployment carries it.
fn briefing_of(d: &Deployment) -> Option<String> {
    d.spec
        .template
        .spec
        .as_ref()?
        .containers
        .first()?
        .env
        .as_ref()?
        .iter()
        .find(|e| e.name == "CLI_MCP_BRIEFING")?
        .value
        .clone()
}

/// Waits (watching the Deployment, until `within`) for a briefing that satisfies `ok`.
async fn wait_briefing(
    ns: &TestNamespace,
    name: &str,
    op: &Operator,
    what: &str,
    within: Duration,
    ok: impl Fn(&str) -> bool,
) -> String {
    let server = InstanceName::parse(name).expect("name").server();
    let d = wait_for(
        ns.api::<Deployment>(),
        &server,
        what,
        within,
        |d: Option<&Deployment>| d.and_then(briefing_of).is_some_and(|b| ok(&b)),
    )
    .await;
    match d {
        Ok(Some(d)) => briefing_of(&d).unwrap_or_default(),
        Ok(None) => panic!("{what}: Deployment {server} is gone"),
        Err(e) => {
            let now = ns.api::<Deployment>().get_opt(&server).await.ok().flatten();
            panic!(
                "{what}: {e}\nbriefing now: {:?}\noperator log:\n{}",
                now.as_ref().and_then(briefing_of),
                op.log_tail()
            )
        }
    }
}

/// A kubeconfig for the test cluster's API server (as the admin kubeconfig names it, which
/// the host reaches) with `token`, default namespace `namespace`.
fn kubeconfig(c: &TestCluster, user: &str, token: &str, namespace: &str) -> String {
    let admin = kube::config::Kubeconfig::read_from(&c.info.kubeconfig).expect("admin kubeconfig");
    let cluster = admin.clusters[0].cluster.as_ref().expect("cluster");
    let server = cluster.server.clone().expect("server");
    let ca = cluster
        .certificate_authority_data
        .clone()
        .expect("certificate-authority-data");
    format!(
        "apiVersion: v1\nkind: Config\n\
         clusters: [{{name: test, cluster: {{server: \"{server}\", certificate-authority-data: \"{ca}\"}}}}]\n\
         users: [{{name: {user}, user: {{token: \"{token}\"}}}}]\n\
         contexts: [{{name: {user}, context: {{cluster: test, user: {user}, namespace: {namespace}}}}}]\n\
         current-context: {user}\n"
    )
}

/// ServiceAccount `sa` in the namespace, and a token of it (one hour).
async fn service_account_token(ns: &TestNamespace, sa: &str) -> String {
    let api = ns.api::<ServiceAccount>();
    let account: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": sa}})).expect("ServiceAccount");
    api.create(&PostParams::default(), &account)
        .await
        .expect("create ServiceAccount");
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    api.create_token_request(sa, &PostParams::default(), &request)
        .await
        .expect("TokenRequest")
        .status
        .and_then(|s| s.token)
        .expect("a token")
}

/// Replaces the kubeconfig the instance's proxy holds (a rotation).
async fn rotate_kubeconfig(ns: &TestNamespace, instance: &str, text: &str) {
    let name = InstanceName::parse(instance)
        .expect("name")
        .kubeconfig_secret();
    let data = BTreeMap::from([(
        "kubeconfig".to_owned(),
        ByteString(text.as_bytes().to_vec()),
    )]);
    ns.api::<Secret>()
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "data": data })),
        )
        .await
        .expect("replace the kubeconfig");
}

/// The operator of these tests: refreshing every [`REFRESH`], told the packaged tools.
fn operator(c: &TestCluster, ns: &TestNamespace) -> Operator {
    let refresh = REFRESH.as_secs().to_string();
    let tools = manager_tools();
    Operator::start_with(
        c,
        &ns.name,
        "op",
        &[
            ("CLI_MCP_BRIEFING_REFRESH", refresh.as_str()),
            ("CLI_MCP_SANDBOX_TOOLS", tools.as_str()),
        ],
    )
}

/// A failed review says "unknown", a rotated kubeconfig is reviewed at once, an identity
/// without rights is said to have none, and a RoleBinding given, then taken, shows within
/// the refresh interval.
#[tokio::test]
async fn the_briefing_follows_the_kubeconfig_and_its_rbac() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("briefing-rbac").await.expect("namespace");
    let op = operator(&c, &ns);
    let name = "brief";
    create_instance(&ns, name, json!({})).await;
    let long = TIMEOUT;
    let text = wait_briefing(&ns, name, &op, "a failed review says unknown", long, |b| {
        b.contains("what its identity may do is unknown")
    })
    .await;
    assert!(text.contains("- Tools: bash 5.2.15"), "{text}");

    let token = service_account_token(&ns, "reader").await;
    rotate_kubeconfig(&ns, name, &kubeconfig(&c, "reader", &token, &ns.name)).await;
    let who = format!("as system:serviceaccount:{}:reader", ns.name);
    let nothing = format!("In namespace {} (it may not list namespaces", ns.name);
    let text = wait_briefing(
        &ns,
        name,
        &op,
        "the rotated kubeconfig reviewed",
        long,
        |b| b.contains(&who) && b.contains(&nothing),
    )
    .await;
    assert!(
        text.contains("may do nothing (no RBAC rights of its own)."),
        "an identity without rights is said to have none:\n{text}"
    );

    wait_ready(&ns, name, &op).await;
    quiet_then_refreshed(&ns, name, &op).await;

    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "configmap-writer"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                   "verbs": ["get", "list", "create", "delete"]}]
    }))
    .expect("Role");
    ns.api::<Role>()
        .create(&PostParams::default(), &role)
        .await
        .expect("create Role");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "reader-writes-configmaps"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "configmap-writer"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns.name}]
    }))
    .expect("RoleBinding");
    let bindings = ns.api::<RoleBinding>();
    let given = Instant::now();
    bindings
        .create(&PostParams::default(), &binding)
        .await
        .expect("create RoleBinding");
    let within = REFRESH + SLACK;
    let text = wait_briefing(&ns, name, &op, "the RoleBinding shown", within, |b| {
        b.contains("write core (configmaps)")
    })
    .await;
    eprintln!(
        "the RoleBinding showed after {:?}:\n{text}",
        given.elapsed()
    );
    assert!(!text.contains("may do nothing"), "{text}");

    quiet_then_refreshed(&ns, name, &op).await;
    let taken = Instant::now();
    bindings
        .delete("reader-writes-configmaps", &Default::default())
        .await
        .expect("delete RoleBinding");
    wait_briefing(
        &ns,
        name,
        &op,
        "the removed RoleBinding shown",
        within,
        |b| b.contains("may do nothing"),
    )
    .await;
    eprintln!("its removal showed after {:?}", taken.elapsed());
    finish(ns, name, &op).await;
}

/// `make run`'s sample instance with the investigator kubeconfig of config/samples (its
/// ClusterRole and ClusterRoleBinding renamed for this namespace), reviewed for real in a
/// cluster with the other tests' namespaces: the briefing names the identity and what it
/// may read, and stays under the bound.
#[tokio::test]
async fn the_samples_briefing_stays_short() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("briefing-sample").await.expect("namespace");
    let op = operator(&c, &ns);
    let n = ns.name.clone();
    let yaml = std::fs::read_to_string(
        workspace_root().join("config/samples/investigation-kubeconfig.yaml"),
    )
    .expect("sample");
    let cluster_name = format!("{n}-cli-mcp-investigator");
    let outside = cli_mcp_e2e::journey::apply_yaml(&c, &n, &yaml, |v| {
        let kind = v["kind"].as_str().unwrap_or_default().to_owned();
        if kind == "ClusterRole" || kind == "ClusterRoleBinding" {
            v["metadata"]["name"] = json!(cluster_name);
        }
        if kind == "ClusterRoleBinding" {
            v["roleRef"]["name"] = json!(cluster_name);
            v["subjects"][0]["namespace"] = json!(n);
        }
    })
    .await;
    let token = service_account_token_of_secret(&ns, "cli-mcp-investigator-token").await;
    let sample = std::fs::read_to_string(
        workspace_root().join("config/samples/cli-mcp_v1alpha1_climcpinstance.yaml"),
    )
    .expect("sample CR");
    let mut cr: Value = serde_yaml::from_str(&sample).expect("sample CR");
    let name = cr["metadata"]["name"].as_str().expect("name").to_owned();
    cr["spec"]["sandbox"]["warmPoolSize"] = json!(0);
    let kc = kubeconfig(&c, "investigator", &token, "default");
    cli_mcp_e2e::instance::kubeconfig_secret(&ns, &name, &kc).await;
    let cr = instance(&name, cr["spec"].clone());
    ns.api::<CliMcpInstance>()
        .create(&PostParams::default(), &cr)
        .await
        .expect("create the sample");
    let who = format!("as system:serviceaccount:{n}:cli-mcp-investigator");
    let text = wait_briefing(&ns, &name, &op, "the sample reviewed", TIMEOUT, |b| {
        b.contains(&who)
    })
    .await;
    eprintln!("{} characters:\n{text}", text.chars().count());
    for needle in [
        "namespaces: read-only core (configmaps,",
        "apps (daemonsets, deployments, replicasets, statefulsets)",
        "May write nothing.",
        "- Tools: bash 5.2.15",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    assert!(
        text.chars().count() <= TYPICAL_BOUND,
        "{} characters, over {TYPICAL_BOUND}:\n{text}",
        text.chars().count()
    );
    finish(ns, &name, &op).await;
    for (api, object) in outside {
        let _ = api.delete(&object, &Default::default()).await;
    }
}

/// Waits until the instance is quiet: its server and proxy Deployments rolled out (every
/// replica updated and available) and every pod of it ready, none terminating. From then
/// on no event wakes the operator for a while.
async fn wait_quiet(ns: &TestNamespace, name: &str, op: &Operator) {
    let n = InstanceName::parse(name).expect("name");
    for deployment in [n.server(), n.proxy()] {
        let done = wait_for(
            ns.api::<Deployment>(),
            &deployment,
            "the Deployment rolled out",
            TIMEOUT,
            |d: Option<&Deployment>| {
                d.is_some_and(|d| {
                    let want = d.spec.replicas.unwrap_or(1);
                    d.status.as_ref().is_some_and(|s| {
                        s.observed_generation == d.metadata.generation
                            && s.updated_replicas == Some(want)
                            && s.available_replicas == Some(want)
                            && s.replicas == Some(want)
                    })
                })
            },
        )
        .await;
        op.ok(done);
    }
    let pods = wait_for_set(
        ns.api::<Pod>(),
        &format!("{}={name}", label::INSTANCE),
        "every pod of the instance ready, none terminating",
        TIMEOUT,
        |pods: &[Pod]| !pods.is_empty() && pods.iter().all(|p| is_ready(p) && !is_deleting(p)),
    )
    .await;
    op.ok(pods);
}

/// Waits until the instance is quiet ([`wait_quiet`]), then until the operator reconciles it
/// once more. A quiet instance wakes the operator for nothing but the briefing's refresh
/// sooner than REFRESH + SLACK (its other periodic checks are 15 s and more apart), and that
/// reconcile has just reviewed: a change made now can show only through the next refresh.
async fn quiet_then_refreshed(ns: &TestNamespace, name: &str, op: &Operator) {
    wait_quiet(ns, name, op).await;
    let before = op.reconciles().await;
    let deadline = Instant::now() + REFRESH + SLACK;
    while op.reconciles().await <= before {
        assert!(
            Instant::now() < deadline,
            "the operator did not reconcile the quiet instance within {:?}: the briefing's \
             refresh did not come\noperator log:\n{}",
            REFRESH + SLACK,
            op.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The token of a `kubernetes.io/service-account-token` Secret, once it is issued.
async fn service_account_token_of_secret(ns: &TestNamespace, secret: &str) -> String {
    let s = wait_for(
        ns.api::<Secret>(),
        secret,
        "the ServiceAccount token issued",
        TIMEOUT,
        |s: Option<&Secret>| {
            s.and_then(|s| s.data.as_ref())
                .is_some_and(|d| d.contains_key("token"))
        },
    )
    .await
    .expect("token")
    .expect("Secret");
    let data = s.data.unwrap_or_default();
    String::from_utf8(data["token"].0.clone()).expect("token is UTF-8")
}
