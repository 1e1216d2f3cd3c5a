//! The OLM bundle (`bundle/`), generated from what kustomize renders of `config/default` and
//! `config/samples`, plus the hand-written CSV metadata and icon in `config/manifests/`. It is
//! never edited by hand: `hack/olm-bundle.sh` writes it and a test fails when it is stale.
//!
//! What OLM changes compared with a kustomize install:
//! - OLM makes the ServiceAccount, the RBAC and the Deployment from the ClusterServiceVersion,
//!   so those objects become the CSV's install strategy.
//! - Rules on namespaced resources become `permissions`: OLM grants them in each namespace the
//!   OperatorGroup targets (as ClusterRoles only for AllNamespaces), so an operator installed
//!   for some namespaces cannot read Secrets in others. Rules on cluster-scoped resources
//!   become `clusterPermissions`.
//! - A Role that kustomize puts in another namespace (reading the API server's address in
//!   `default`) has no place in a bundle: OLM creates Roles only in the operator's namespace and
//!   the targets. Its rules become cluster permissions, each still narrowed as the Role was.
//! - `WATCH_NAMESPACE` comes from the CSV's `olm.targetNamespaces` annotation (a comma list,
//!   empty for all namespaces: the form the operator already reads).
//! - The install's ValidatingAdmissionPolicies are not kinds a bundle may carry (listed in
//!   [`Bundle::not_carried`]). The operator creates them itself at start instead
//!   (`crate::policies`, the same files): the CSV's Deployment sets
//!   `CLI_MCP_CREATE_ADMISSION_POLICIES=true` and its cluster permissions grant `create` and
//!   `get` on the two kinds, nothing more, and `get` and `list` on every CliMcpInstance (the API
//!   server demands them of whoever creates a policy, and its binding, with CliMcpInstances
//!   as parameters).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context as _;
use base64::Engine as _;
use serde::Deserialize as _;
use serde_json::{json, Map, Value};

mod install;

use install::{install_strategy, rules};

/// The package and channel the bundle publishes.
pub const PACKAGE: &str = "cli-mcp-operator";
pub const CHANNEL: &str = "alpha";

/// Bundle paths relative to the workspace root, in the order they are written.
pub const CSV_PATH: &str = "bundle/manifests/cli-mcp-operator.clusterserviceversion.yaml";
pub const ANNOTATIONS_PATH: &str = "bundle/metadata/annotations.yaml";
pub const DOCKERFILE_PATH: &str = "bundle/bundle.Dockerfile";
/// The hand-written inputs, relative to the workspace root.
pub const BASE_CSV: &str = "config/manifests/bases/cli-mcp-operator.clusterserviceversion.yaml";
pub const ICON: &str = "config/manifests/icon.svg";

/// Inputs, all as text so that the pure part needs no file system.
pub struct Inputs<'a> {
    /// `kustomize build config/default`.
    pub rendered: &'a str,
    /// `kustomize build config/samples`.
    pub samples: &'a str,
    /// `config/manifests/bases/cli-mcp-operator.clusterserviceversion.yaml`.
    pub base_csv: &'a str,
    /// `config/manifests/icon.svg`.
    pub icon_svg: &'a [u8],
    /// The workspace version (the operator's own).
    pub version: &'a str,
}

/// The generated files and what the bundle leaves out.
#[derive(Debug)]
pub struct Bundle {
    /// (path relative to the workspace root, contents).
    pub files: Vec<(String, String)>,
    /// `Kind/name` of rendered objects OLM cannot install from a bundle.
    pub not_carried: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("{what} is not valid YAML: {source}")]
    Yaml {
        what: &'static str,
        source: serde_yaml::Error,
    },
    #[error("config/default renders no {0}; the bundle needs exactly one")]
    Missing(&'static str),
    #[error("config/default renders more than one {0}; the bundle can carry one")]
    Duplicate(&'static str),
    #[error(
        "config/default renders {0}, which an OLM bundle cannot carry and this generator does not know; \
         teach operator/src/olm/ where it goes"
    )]
    UnknownKind(String),
    #[error(
        "an RBAC rule mixes namespaced and cluster-scoped resources ({0}); split it so OLM can grant \
         each part at its scope"
    )]
    MixedScope(String),
    #[error("{0}")]
    Invalid(String),
}

/// Kinds OLM cannot install from a bundle; left for the admin to apply from `config/`.
const NOT_CARRIED: &[&str] = &[
    "Namespace",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
];

fn docs(text: &str, what: &'static str) -> Result<Vec<Value>, BundleError> {
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let v = Value::deserialize(doc).map_err(|source| BundleError::Yaml { what, source })?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

fn kind(v: &Value) -> &str {
    v["kind"].as_str().unwrap_or_default()
}

fn name(v: &Value) -> &str {
    v["metadata"]["name"].as_str().unwrap_or_default()
}

fn namespace(v: &Value) -> &str {
    v["metadata"]["namespace"].as_str().unwrap_or_default()
}

fn one<'v>(objs: &'v [Value], k: &'static str) -> Result<&'v Value, BundleError> {
    let mut found = objs.iter().filter(|o| kind(o) == k);
    let first = found.next().ok_or(BundleError::Missing(k))?;
    if found.next().is_some() {
        return Err(BundleError::Duplicate(k));
    }
    Ok(first)
}

/// Every image the operator runs or makes others run: its own and the `RELATED_IMAGE_*`
/// ones, so disconnected installs mirror them all.
fn related_images(deployment: &Value) -> Vec<Value> {
    let mut images = BTreeMap::new();
    for c in deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(image) = c["image"].as_str() {
            images.insert("operator".to_string(), image.to_string());
        }
        for e in c["env"].as_array().into_iter().flatten() {
            let (Some(n), Some(v)) = (e["name"].as_str(), e["value"].as_str()) else {
                continue;
            };
            if let Some(rest) = n.strip_prefix("RELATED_IMAGE_") {
                images.insert(rest.to_ascii_lowercase(), v.to_string());
            }
        }
    }
    images
        .into_iter()
        .map(|(name, image)| json!({"name": name, "image": image}))
        .collect()
}

fn yaml(v: &Value) -> Result<String, BundleError> {
    serde_yaml::to_string(v).map_err(|source| BundleError::Yaml {
        what: "a generated object",
        source,
    })
}

const HEADER: &str =
    "# Generated by hack/olm-bundle.sh from config/ (operator/src/olm/). Do not edit.\n";

/// The bundle from its inputs, one call per part. Pure.
pub fn bundle(inp: &Inputs<'_>) -> Result<Bundle, BundleError> {
    let objs = docs(inp.rendered, "the config/default rendering")?;
    let samples = docs(inp.samples, "the config/samples rendering")?;
    let mut csv: Value =
        serde_yaml::from_str(inp.base_csv).map_err(|source| BundleError::Yaml {
            what: "the base ClusterServiceVersion",
            source,
        })?;
    let not_carried = not_carried(&objs)?;
    let deployment = one(&objs, "Deployment")?;
    let sa_obj = one(&objs, "ServiceAccount")?;
    let (sa, sa_ns) = (name(sa_obj), namespace(sa_obj));
    let (namespaced, cluster) = rules(&objs, sa, sa_ns)?;
    let crds: Vec<&Value> = objs
        .iter()
        .filter(|o| kind(o) == "CustomResourceDefinition")
        .collect();
    if crds.is_empty() {
        return Err(BundleError::Missing("CustomResourceDefinition"));
    }
    let owned = owned_crds(&csv, &crds)?;
    let alm_examples = alm_examples(&samples, &crds)?;
    let suggested_ns = objs
        .iter()
        .find(|o| kind(o) == "Namespace")
        .map(|o| name(o).to_string())
        .unwrap_or_else(|| sa_ns.to_string());
    csv_metadata(
        &mut csv,
        inp.version,
        deployment,
        alm_examples,
        &suggested_ns,
    )?;
    let create_policies = not_carried
        .iter()
        .any(|o| o.starts_with("ValidatingAdmissionPolicy"));
    let install = install_strategy(deployment, sa, namespaced, cluster, create_policies)?;
    csv_spec(&mut csv, inp, owned, install, deployment)?;

    let mut files = vec![(CSV_PATH.to_string(), format!("{HEADER}{}", yaml(&csv)?))];
    files.extend(crd_files(&crds)?);
    files.extend(metadata_files(inp.version)?);
    Ok(Bundle { files, not_carried })
}

/// `Kind/name` of the rendered objects a bundle cannot carry; any kind the bundle does not
/// know is an error.
fn not_carried(objs: &[Value]) -> Result<Vec<String>, BundleError> {
    let known = [
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
    ];
    let mut not_carried = Vec::new();
    for o in objs {
        if NOT_CARRIED.contains(&kind(o)) {
            not_carried.push(format!("{}/{}", kind(o), name(o)));
        } else if !known.contains(&kind(o)) {
            return Err(BundleError::UnknownKind(format!("{} {}", kind(o), name(o))));
        }
    }
    Ok(not_carried)
}

/// Owned CRDs: names, kinds and versions from the CRDs; display names and descriptions
/// from the base CSV, which must describe every CRD and nothing else.
fn owned_crds(csv: &Value, crds: &[&Value]) -> Result<Vec<Value>, BundleError> {
    let described: Vec<Value> = csv["spec"]["customresourcedefinitions"]["owned"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut owned = Vec::new();
    for crd in crds {
        let crd_name = name(crd);
        let mut entry = described
            .iter()
            .find(|d| d["name"] == crd_name)
            .cloned()
            .ok_or_else(|| {
                BundleError::Invalid(format!(
                    "config/manifests' base CSV does not describe the CRD {crd_name}; add it under spec.customresourcedefinitions.owned"
                ))
            })?;
        let storage = crd["spec"]["versions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["storage"] == true)
            .ok_or(BundleError::Missing("storage version in the CRD"))?;
        entry["version"] = storage["name"].clone();
        entry["kind"] = crd["spec"]["names"]["kind"].clone();
        owned.push(entry);
    }
    if described.len() != owned.len() {
        return Err(BundleError::Invalid(
            "config/manifests' base CSV describes a CRD that config/default does not render".into(),
        ));
    }
    Ok(owned)
}

/// The CSV's `alm-examples`: the samples of the bundle's CRDs, as JSON text.
fn alm_examples(samples: &[Value], crds: &[&Value]) -> Result<String, BundleError> {
    let examples: Vec<&Value> = samples
        .iter()
        .filter(|s| crds.iter().any(|c| c["spec"]["names"]["kind"] == s["kind"]))
        .collect();
    if examples.is_empty() {
        return Err(BundleError::Missing("sample of the CRD in config/samples"));
    }
    serde_json::to_string_pretty(&examples)
        .map_err(|e| BundleError::Invalid(format!("samples: {e}")))
}

/// The CSV's name and annotations: examples, operator image, suggested namespace.
fn csv_metadata(
    csv: &mut Value,
    version: &str,
    deployment: &Value,
    alm_examples: String,
    suggested_ns: &str,
) -> Result<(), BundleError> {
    let operator_image = related_images(deployment)
        .into_iter()
        .find(|i| i["name"] == "operator")
        .map(|i| i["image"].clone())
        .ok_or(BundleError::Missing("operator image"))?;
    let meta = csv["metadata"]
        .as_object_mut()
        .ok_or_else(|| BundleError::Invalid("the base CSV has no metadata".into()))?;
    meta.insert("name".into(), json!(format!("{PACKAGE}.v{version}")));
    meta.remove("namespace");
    let annotations = meta
        .entry("annotations")
        .or_insert_with(|| Value::Object(Map::new()));
    annotations["alm-examples"] = json!(alm_examples);
    annotations["containerImage"] = operator_image;
    annotations["operatorframework.io/suggested-namespace"] = json!(suggested_ns);
    annotations["operators.operatorframework.io/builder"] = json!("cli-mcp-operator olm-bundle");
    Ok(())
}

/// The CSV's spec: version, icon, owned CRDs, install modes, install strategy, images.
fn csv_spec(
    csv: &mut Value,
    inp: &Inputs<'_>,
    owned: Vec<Value>,
    install: Value,
    deployment: &Value,
) -> Result<(), BundleError> {
    let spec = csv["spec"]
        .as_object_mut()
        .ok_or_else(|| BundleError::Invalid("the base CSV has no spec".into()))?;
    spec.insert("version".into(), json!(inp.version));
    spec.insert(
        "icon".into(),
        json!([{
            "base64data": base64::engine::general_purpose::STANDARD.encode(inp.icon_svg),
            "mediatype": "image/svg+xml"
        }]),
    );
    spec.insert("customresourcedefinitions".into(), json!({"owned": owned}));
    spec.insert(
        "installModes".into(),
        json!([
            "OwnNamespace",
            "SingleNamespace",
            "MultiNamespace",
            "AllNamespaces"
        ]
        .iter()
        .map(|t| json!({"type": t, "supported": true}))
        .collect::<Vec<_>>()),
    );
    spec.insert(
        "install".into(),
        json!({"strategy": "deployment", "spec": install}),
    );
    spec.insert("relatedImages".into(), json!(related_images(deployment)));
    Ok(())
}

/// One file per CRD, `bundle/manifests/<group>_<plural>.yaml`, without a namespace.
fn crd_files(crds: &[&Value]) -> Result<Vec<(String, String)>, BundleError> {
    let mut files = Vec::new();
    for crd in crds {
        let mut crd = (*crd).clone();
        if let Some(m) = crd["metadata"].as_object_mut() {
            m.remove("namespace");
        }
        let group = crd["spec"]["group"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let plural = crd["spec"]["names"]["plural"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        files.push((
            format!("bundle/manifests/{group}_{plural}.yaml"),
            format!("{HEADER}{}", yaml(&crd)?),
        ));
    }
    Ok(files)
}

/// `metadata/annotations.yaml` and the bundle image's Dockerfile, with the same labels.
fn metadata_files(version: &str) -> Result<Vec<(String, String)>, BundleError> {
    let labels = [
        (
            "operators.operatorframework.io.bundle.mediatype.v1",
            "registry+v1",
        ),
        (
            "operators.operatorframework.io.bundle.manifests.v1",
            "manifests/",
        ),
        (
            "operators.operatorframework.io.bundle.metadata.v1",
            "metadata/",
        ),
        ("operators.operatorframework.io.bundle.package.v1", PACKAGE),
        ("operators.operatorframework.io.bundle.channels.v1", CHANNEL),
        (
            "operators.operatorframework.io.bundle.channel.default.v1",
            CHANNEL,
        ),
    ];
    let annotations: Map<String, Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    let mut files = vec![(
        ANNOTATIONS_PATH.to_string(),
        format!("{HEADER}{}", yaml(&json!({ "annotations": annotations }))?),
    )];
    // The bundle image: the same labels as annotations.yaml, as OLM's tools expect.
    let mut dockerfile = format!("{HEADER}# Build from bundle/: docker build -f bundle.Dockerfile -t <registry>/cli-mcp-operator-bundle:v{version} .\nFROM scratch\n");
    for (k, v) in labels {
        dockerfile.push_str(&format!("LABEL {k}={v}\n"));
    }
    dockerfile.push_str("COPY manifests /manifests/\nCOPY metadata /metadata/\n");
    files.push((DOCKERFILE_PATH.to_string(), dockerfile));
    Ok(files)
}

/// The bundle of the checkout at `root`, given kustomize's two renderings (as text).
pub fn from_checkout(root: &Path, rendered: &str, samples: &str) -> anyhow::Result<Bundle> {
    let base_path = root.join(BASE_CSV);
    let base_csv = std::fs::read_to_string(&base_path)
        .with_context(|| format!("reading {}", base_path.display()))?;
    let icon_path = root.join(ICON);
    let icon_svg =
        std::fs::read(&icon_path).with_context(|| format!("reading {}", icon_path.display()))?;
    Ok(bundle(&Inputs {
        rendered,
        samples,
        base_csv: &base_csv,
        icon_svg: &icon_svg,
        version: env!("CARGO_PKG_VERSION"),
    })?)
}

/// Paths under `root` whose contents differ from the bundle's (missing ones included).
pub fn stale(root: &Path, b: &Bundle) -> Vec<String> {
    b.files
        .iter()
        .filter(|(path, text)| std::fs::read_to_string(root.join(path)).ok().as_ref() != Some(text))
        .map(|(path, _)| path.clone())
        .collect()
}

/// `cli-mcp-operator olm-bundle`: write the bundle, or with `check` only compare.
pub fn generate(rendered: &Path, samples: &Path, root: &Path, check: bool) -> anyhow::Result<()> {
    let read =
        |p: &Path| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
    let b = from_checkout(root, &read(rendered)?, &read(samples)?)?;
    for left in &b.not_carried {
        let how = if left.starts_with("ValidatingAdmissionPolicy") {
            "the operator creates it at start"
        } else {
            "apply it from config/"
        };
        eprintln!("not in the bundle (an OLM bundle cannot carry it; {how}): {left}");
    }
    if check {
        let stale = stale(root, &b);
        anyhow::ensure!(
            stale.is_empty(),
            "stale OLM bundle files: {}; regenerate with hack/olm-bundle.sh",
            stale.join(", ")
        );
        return Ok(());
    }
    for (path, text) in &b.files {
        let path = root.join(path);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const RENDERED: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: sys}
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: things.example.com}
spec:
  group: example.com
  names: {kind: Thing, plural: things}
  versions: [{name: v1, served: true, storage: true}]
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: op, namespace: sys}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: op}
rules:
  - {apiGroups: [""], resources: [secrets], verbs: [get]}
  - {apiGroups: [rbac.authorization.k8s.io], resources: [clusterrolebindings], verbs: [create]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: op}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: op}
subjects: [{kind: ServiceAccount, name: op, namespace: sys}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: lease, namespace: sys}
rules: [{apiGroups: [coordination.k8s.io], resources: [leases], verbs: [get]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: lease, namespace: sys}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: lease}
subjects: [{kind: ServiceAccount, name: op, namespace: sys}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: endpoints, namespace: default}
rules: [{apiGroups: [""], resources: [services], resourceNames: [kubernetes], verbs: [get]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: endpoints, namespace: default}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: endpoints}
subjects: [{kind: ServiceAccount, name: op, namespace: sys}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: op, namespace: sys, labels: {app: op}}
spec:
  template:
    spec:
      containers:
        - name: operator
          image: op:1
          env:
            - {name: WATCH_NAMESPACE, value: ""}
            - {name: RELATED_IMAGE_SERVER, value: server:1}
"#;
    const SAMPLES: &str = "apiVersion: example.com/v1\nkind: Thing\nmetadata: {name: t}\n";
    const BASE: &str = "apiVersion: operators.coreos.com/v1alpha1\nkind: ClusterServiceVersion\nmetadata: {name: x, annotations: {capabilities: Basic Install}}\nspec:\n  displayName: X\n  customresourcedefinitions:\n    owned: [{name: things.example.com, displayName: Thing, description: A thing}]\n";

    fn inputs(rendered: &str) -> Inputs<'_> {
        Inputs {
            rendered,
            samples: SAMPLES,
            base_csv: BASE,
            icon_svg: b"<svg/>",
            version: "1.2.3",
        }
    }

    fn csv(b: &Bundle) -> Value {
        let text = &b.files.iter().find(|(p, _)| p == CSV_PATH).expect("CSV").1;
        serde_yaml::from_str(text).expect("CSV parses")
    }

    #[test]
    fn rules_are_split_by_scope_and_foreign_roles_become_cluster_rules() {
        let b = bundle(&inputs(RENDERED)).expect("bundle");
        let csv = csv(&b);
        let install = &csv["spec"]["install"]["spec"];
        let ns_rules = install["permissions"][0]["rules"].to_string();
        let cluster_rules = install["clusterPermissions"][0]["rules"].to_string();
        assert!(
            ns_rules.contains("secrets") && ns_rules.contains("leases"),
            "{ns_rules}"
        );
        assert!(!ns_rules.contains("clusterrolebindings"), "{ns_rules}");
        assert!(
            cluster_rules.contains("clusterrolebindings"),
            "{cluster_rules}"
        );
        assert!(
            cluster_rules.contains("\"kubernetes\""),
            "narrowing kept: {cluster_rules}"
        );
        assert!(!cluster_rules.contains("secrets"), "{cluster_rules}");
        assert_eq!(b.not_carried, ["Namespace/sys"]);
    }

    #[test]
    fn watch_namespace_follows_the_operator_group_and_images_are_related() {
        let csv = csv(&bundle(&inputs(RENDERED)).expect("bundle"));
        let env = csv["spec"]["install"]["spec"]["deployments"][0]["spec"]["template"]["spec"]
            ["containers"][0]["env"]
            .to_string();
        assert!(
            env.contains("metadata.annotations['olm.targetNamespaces']"),
            "{env}"
        );
        assert_eq!(
            csv["spec"]["relatedImages"],
            json!([{"name": "operator", "image": "op:1"}, {"name": "server", "image": "server:1"}])
        );
        assert_eq!(csv["metadata"]["name"], "cli-mcp-operator.v1.2.3");
        assert_eq!(
            csv["spec"]["customresourcedefinitions"]["owned"][0]["kind"],
            "Thing"
        );
        let examples: Value = serde_json::from_str(
            csv["metadata"]["annotations"]["alm-examples"]
                .as_str()
                .expect("string"),
        )
        .expect("alm-examples is JSON");
        assert_eq!(examples[0]["metadata"]["name"], "t");
        assert_eq!(
            csv["spec"]["installModes"].as_array().map(Vec::len),
            Some(4)
        );
    }

    #[test]
    fn admission_policies_are_created_by_the_operator_which_may_only_create_and_read_them() {
        let csv_of = |rendered: &str| csv(&bundle(&inputs(rendered)).expect("bundle"));
        let with = format!(
            "{RENDERED}---\napiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\nmetadata: {{name: p}}\n"
        );
        for (rendered, creates) in [(RENDERED, false), (with.as_str(), true)] {
            let csv = csv_of(rendered);
            let install = &csv["spec"]["install"]["spec"];
            let env = install["deployments"][0]["spec"]["template"]["spec"]["containers"][0]["env"]
                .to_string();
            assert_eq!(env.contains(install::CREATE_POLICIES_ENV), creates, "{env}");
            let rules = install["clusterPermissions"][0]["rules"].to_string();
            assert_eq!(
                rules.contains("validatingadmissionpolicies"),
                creates,
                "{rules}"
            );
        }
        let csv = csv_of(&with);
        let rule = csv["spec"]["install"]["spec"]["clusterPermissions"][0]["rules"]
            .as_array()
            .expect("rules")
            .iter()
            .find(|r| r["apiGroups"][0] == "admissionregistration.k8s.io")
            .cloned()
            .expect("the rule");
        assert_eq!(rule["verbs"], json!(["create", "get"]));
    }

    #[test]
    fn what_a_bundle_cannot_express_is_refused_with_the_fix() {
        let mixed = RENDERED.replace("resources: [secrets]", "resources: [secrets, clusterroles]");
        let err = bundle(&inputs(&mixed)).expect_err("mixed");
        assert!(err.to_string().contains("split it"), "{err}");

        let extra =
            format!("{RENDERED}---\napiVersion: v1\nkind: Service\nmetadata: {{name: s}}\n");
        let err = bundle(&inputs(&extra)).expect_err("unknown kind");
        assert!(err.to_string().contains("Service s"), "{err}");

        let no_watch = RENDERED.replace("WATCH_NAMESPACE", "OTHER");
        let err = bundle(&inputs(&no_watch)).expect_err("no WATCH_NAMESPACE");
        assert!(err.to_string().contains("WATCH_NAMESPACE"), "{err}");

        let err = bundle(&Inputs {
            base_csv: "metadata: {name: x}\nspec: {}\n",
            ..inputs(RENDERED)
        })
        .expect_err("undescribed CRD");
        assert!(
            err.to_string()
                .contains("does not describe the CRD things.example.com"),
            "{err}"
        );
    }
}
