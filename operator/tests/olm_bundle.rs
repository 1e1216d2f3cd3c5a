//! The OLM bundle (`bundle/`): generated from config/ and never edited by hand, so the
//! checked-in copy must equal what `operator/src/olm/` makes of kustomize's renderings now;
//! it must pass `operator-sdk bundle validate` (built from the Go module proxy by
//! `hack/build-operator-sdk.sh`, cached outside the repo); and it must install what the
//! kustomize install does, at no wider scope. Fix staleness with `hack/olm-bundle.sh` (or
//! `UPDATE_BUNDLE=1 cargo test -p cli-mcp-operator --test olm_bundle`). No cluster needed.

use std::path::{Path, PathBuf};
use std::process::Command;

use cli_mcp_e2e::journey::{hack_bin_dir, kustomize_build};
use cli_mcp_e2e::testing::workspace_root;
use cli_mcp_operator::olm::{self, CSV_PATH};
use serde::Deserialize as _;
use serde_json::Value;

/// `kustomize build config/<dir>`, as `hack/olm-bundle.sh` renders it.
fn kustomize(dir: &str) -> String {
    kustomize_build(
        &format!("olm-bundle-{dir}"),
        &format!("resources:\n  - ../../config/{dir}\n"),
    )
}

fn generated() -> olm::Bundle {
    olm::from_checkout(
        &workspace_root(),
        &kustomize("default"),
        &kustomize("samples"),
    )
    .expect("the bundle generates")
}

fn docs(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).expect("YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn csv(b: &olm::Bundle) -> Value {
    let text = &b.files.iter().find(|(p, _)| p == CSV_PATH).expect("CSV").1;
    serde_yaml::from_str(text).expect("CSV parses")
}

#[test]
fn checked_in_bundle_is_current() {
    let root = workspace_root();
    let b = generated();
    if std::env::var_os("UPDATE_BUNDLE").is_some() {
        for (path, text) in &b.files {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("bundle dir");
            std::fs::write(&path, text).expect("write bundle file");
        }
    }
    let stale = olm::stale(&root, &b);
    assert!(
        stale.is_empty(),
        "stale OLM bundle files: {stale:?}; regenerate with hack/olm-bundle.sh \
         (or UPDATE_BUNDLE=1 cargo test -p cli-mcp-operator --test olm_bundle)"
    );
    // Nothing else hides in bundle/: a file the generator no longer writes is stale too.
    let mut present = Vec::new();
    let mut dirs = vec![root.join("bundle")];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).expect("read bundle/") {
            let path = e.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let rel = path.strip_prefix(&root).expect("under root");
                present.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    present.sort();
    let mut expected: Vec<String> = b.files.iter().map(|(p, _)| p.clone()).collect();
    expected.sort();
    assert_eq!(
        present, expected,
        "bundle/ holds files the generator does not write"
    );
}

fn operator_sdk() -> PathBuf {
    hack_bin_dir("build-operator-sdk.sh").join("operator-sdk")
}

fn validate(sdk: &Path, dir: &Path) -> (bool, String) {
    let out = Command::new(sdk)
        .args(["bundle", "validate"])
        .arg(dir)
        .args(["--select-optional", "suite=operatorframework"])
        .output()
        .expect("run operator-sdk");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn bundle_passes_operator_sdk_validate() {
    let sdk = operator_sdk();
    let (ok, text) = validate(&sdk, &workspace_root().join("bundle"));
    assert!(ok, "operator-sdk bundle validate bundle/:\n{text}");
    // RBAC rules carry no API version, so the deprecated-API check flags every rule on a
    // resource whose v1beta1 was removed; the operator uses discovery.k8s.io/v1,
    // events.k8s.io/v1 and node.k8s.io/v1. Any other warning fails.
    for line in text.lines().filter(|l| l.contains("level=warning")) {
        // (The validator lists the three in any order.)
        let known = line.contains("deprecated and removed in v1.25")
            && line.contains("endpointslices: ([")
            && line.contains("events: ([")
            && line.contains("runtimeclasses: ([")
            && line.matches("Rules[").count() == 3;
        assert!(known, "operator-sdk warns:\n{line}");
    }

    // The validator can fail: the same bundle with an example of a kind it does not own.
    let broken = tempfile::tempdir().expect("tempdir");
    for sub in ["manifests", "metadata"] {
        std::fs::create_dir_all(broken.path().join(sub)).expect("dir");
    }
    for (path, text) in generated().files {
        let rel = path.strip_prefix("bundle/").expect("under bundle/");
        let text = if path == CSV_PATH {
            text.replace("\"kind\": \"CliMcpInstance\"", "\"kind\": \"NotOwned\"")
        } else {
            text
        };
        std::fs::write(broken.path().join(rel), text).expect("write");
    }
    let (ok, text) = validate(&sdk, broken.path());
    assert!(!ok, "a bundle with an unowned alm-example passed:\n{text}");
    assert!(text.contains("NotOwned"), "{text}");
}

fn rule_resources(rules: &Value) -> Vec<String> {
    rules
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|r| r["resources"].as_array().cloned().unwrap_or_default())
        .filter_map(|r| r.as_str().map(str::to_string))
        .collect()
}

#[test]
fn bundle_installs_what_kustomize_does_at_no_wider_scope() {
    let rendered = docs(&kustomize("default"));
    let csv = csv(&generated());
    let install = &csv["spec"]["install"]["spec"];

    // Every image the kustomize install runs or hands out is a related image (mirrored in
    // disconnected installs).
    let deployment = rendered
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("operator Deployment");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let mut images = vec![container["image"].as_str().expect("image").to_string()];
    for e in container["env"].as_array().expect("env") {
        if e["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("RELATED_IMAGE_"))
        {
            images.push(e["value"].as_str().expect("value").to_string());
        }
    }
    let related: Vec<&str> = csv["spec"]["relatedImages"]
        .as_array()
        .expect("relatedImages")
        .iter()
        .filter_map(|i| i["image"].as_str())
        .collect();
    for image in &images {
        assert!(
            related.contains(&image.as_str()),
            "{image} not in relatedImages {related:?}"
        );
    }
    assert!(
        images.len() >= 4,
        "operator, server, sandbox and proxy images: {images:?}"
    );

    // Secrets, pods and the rest are granted per target namespace, never cluster-wide.
    let cluster = rule_resources(&install["clusterPermissions"][0]["rules"]);
    let namespaced = rule_resources(&install["permissions"][0]["rules"]);
    for r in [
        "secrets",
        "pods",
        "deployments",
        "roles",
        "rolebindings",
        "leases",
    ] {
        assert!(
            namespaced.iter().any(|n| n == r),
            "{r} missing from permissions: {namespaced:?}"
        );
        assert!(
            !cluster.iter().any(|n| n == r),
            "{r} granted cluster-wide: {cluster:?}"
        );
    }
    // Cluster-wide only what has no namespace, and the API server address the kustomize
    // install reads from `default` (narrowed to the `kubernetes` Service as there).
    let allowed = [
        "clusterrolebindings",
        "clusterroles",
        "runtimeclasses",
        "services",
        "endpointslices",
        "validatingadmissionpolicies",
        "validatingadmissionpolicybindings",
        // `get` and `list` only (below): creating the tenant policy and its binding, whose
        // parameters they are.
        "climcpinstances",
    ];
    for r in &cluster {
        assert!(
            allowed.contains(&r.as_str()),
            "{r} in clusterPermissions: {cluster:?}"
        );
    }
    let services = install["clusterPermissions"][0]["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .find(|r| r["resources"][0] == "services")
        .expect("the kubernetes Service rule");
    assert_eq!(services["resourceNames"], serde_json::json!(["kubernetes"]));
    assert_eq!(services["verbs"], serde_json::json!(["get"]));

    // The admission policies kustomize applies are not kinds a bundle may carry: the
    // operator creates them at start, with `create` and `get` on them and nothing more (it
    // could otherwise loosen the policies that hold it).
    let policies = install["clusterPermissions"][0]["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .find(|r| r["resources"][0] == "validatingadmissionpolicies")
        .expect("the admission policies rule");
    assert_eq!(policies["verbs"], serde_json::json!(["create", "get"]));
    let instances: Vec<&Value> = install["clusterPermissions"][0]["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .filter(|r| r["resources"][0] == "climcpinstances")
        .collect();
    assert_eq!(instances.len(), 1, "{instances:?}");
    assert_eq!(instances[0]["verbs"], serde_json::json!(["get", "list"]));
    assert!(rendered
        .iter()
        .any(|o| o["kind"] == "ValidatingAdmissionPolicy"));
    let create_env = install["deployments"][0]["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == "CLI_MCP_CREATE_ADMISSION_POLICIES")
        .expect("CLI_MCP_CREATE_ADMISSION_POLICIES");
    assert_eq!(create_env["value"], "true");

    // Every resource the kustomize ClusterRoles (cluster-scoped and namespaced parts) grant
    // is in the bundle.
    let roles: Vec<&Value> = rendered
        .iter()
        .filter(|o| o["kind"] == "ClusterRole")
        .collect();
    assert!(
        roles.len() >= 2,
        "the cluster-scoped and namespaced ClusterRoles: {roles:?}"
    );
    for role in roles {
        for r in rule_resources(&role["rules"]) {
            assert!(
                namespaced.contains(&r) || cluster.contains(&r),
                "{r} of ClusterRole {} is lost in the bundle",
                role["metadata"]["name"]
            );
        }
    }

    // The operator watches what the OperatorGroup targets; all four install modes.
    let env = install["deployments"][0]["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == "WATCH_NAMESPACE")
        .expect("WATCH_NAMESPACE")
        .clone();
    assert_eq!(
        env["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.annotations['olm.targetNamespaces']"
    );
    let modes: Vec<&str> = csv["spec"]["installModes"]
        .as_array()
        .expect("installModes")
        .iter()
        .filter(|m| m["supported"] == true)
        .filter_map(|m| m["type"].as_str())
        .collect();
    assert_eq!(
        modes,
        [
            "OwnNamespace",
            "SingleNamespace",
            "MultiNamespace",
            "AllNamespaces"
        ]
    );
    // alm-examples are the samples, as JSON.
    let examples: Value = serde_json::from_str(
        csv["metadata"]["annotations"]["alm-examples"]
            .as_str()
            .expect("alm-examples"),
    )
    .expect("alm-examples is JSON");
    assert_eq!(examples[0]["kind"], "CliMcpInstance");
}
