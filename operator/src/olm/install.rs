//! The CSV's install strategy: the operator's Deployment as OLM runs it (`WATCH_NAMESPACE`
//! from the OperatorGroup), and its RBAC as bound to its ServiceAccount in the rendering,
//! split into namespaced `permissions` (granted per target namespace) and
//! `clusterPermissions`.

use serde_json::{json, Value};

use super::{kind, name, namespace, BundleError};

/// Cluster-scoped resources the operator's rules may name. A rule on anything else is
/// namespaced. An unknown cluster-scoped resource would only be granted in target
/// namespaces, where it means nothing; the install test would show it missing.
const CLUSTER_SCOPED: &[&str] = &[
    "clusterroles",
    "clusterrolebindings",
    "namespaces",
    "nodes",
    "customresourcedefinitions",
    "tokenreviews",
    "subjectaccessreviews",
    "validatingadmissionpolicies",
    "validatingadmissionpolicybindings",
    "runtimeclasses",
    "priorityclasses",
];

fn binds_sa(binding: &Value, sa: &str, sa_ns: &str) -> bool {
    binding["subjects"].as_array().is_some_and(|subjects| {
        subjects
            .iter()
            .any(|s| s["kind"] == "ServiceAccount" && s["name"] == sa && s["namespace"] == sa_ns)
    })
}

/// Which list a rule goes to: `Ok(true)` for cluster-scoped.
fn cluster_scoped(rule: &Value) -> Result<bool, BundleError> {
    let resources: Vec<&str> = rule["resources"]
        .as_array()
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let base = |r: &&str| r.split('/').next().unwrap_or(r).to_string();
    let cluster = resources
        .iter()
        .filter(|r| CLUSTER_SCOPED.contains(&base(r).as_str()))
        .count();
    match cluster {
        0 => Ok(false),
        n if n == resources.len() => Ok(true),
        _ => Err(BundleError::MixedScope(resources.join(", "))),
    }
}

/// The operator's rules, split by scope, as bound to its ServiceAccount in the rendering.
pub(super) fn rules(
    objs: &[Value],
    sa: &str,
    sa_ns: &str,
) -> Result<(Vec<Value>, Vec<Value>), BundleError> {
    let role = |k: &str, n: &str, ns: Option<&str>| {
        objs.iter()
            .find(|o| kind(o) == k && name(o) == n && ns.is_none_or(|ns| namespace(o) == ns))
            .ok_or_else(|| {
                BundleError::Invalid(format!(
                    "a binding names {k} {n}, which config/default does not render"
                ))
            })
    };
    let (mut namespaced, mut cluster) = (Vec::new(), Vec::new());
    for b in objs.iter().filter(|o| binds_sa(o, sa, sa_ns)) {
        let role_name = b["roleRef"]["name"].as_str().unwrap_or_default();
        let role_kind = b["roleRef"]["kind"].as_str().unwrap_or_default();
        let (source, elsewhere) = match (kind(b), role_kind) {
            ("ClusterRoleBinding", "ClusterRole") => (role("ClusterRole", role_name, None)?, false),
            ("RoleBinding", "Role") => {
                let ns = namespace(b);
                (role("Role", role_name, Some(ns))?, ns != sa_ns)
            }
            ("RoleBinding", "ClusterRole") => {
                (role("ClusterRole", role_name, None)?, namespace(b) != sa_ns)
            }
            (k, r) => {
                return Err(BundleError::Invalid(format!(
                    "{k} {} binds the operator to a {r}, which the bundle cannot express",
                    name(b)
                )))
            }
        };
        for rule in source["rules"].as_array().into_iter().flatten() {
            // A Role in a namespace OLM will not create Roles in (see the module docs).
            if elsewhere || cluster_scoped(rule)? {
                cluster.push(rule.clone());
            } else {
                namespaced.push(rule.clone());
            }
        }
    }
    Ok((namespaced, cluster))
}

/// The environment variable that has the operator create the admission policies a bundle
/// cannot carry (`crate::policies`), and the rules that let it: `create` and `get` only, so
/// it can never change or delete the policies that hold it (it reads one that exists to
/// warn when another version made it); and `get` and `list` on every
/// CliMcpInstance, which the API server demands of whoever creates a policy whose
/// parameters they are (the tenant policy: `get` for its `paramKind`, `list` for its
/// binding's `paramRef` selector), wherever they are — read-only, and an instance's spec
/// holds no secret.
pub(super) const CREATE_POLICIES_ENV: &str = "CLI_MCP_CREATE_ADMISSION_POLICIES";
fn create_policies_rules() -> [Value; 2] {
    use kube::Resource as _;
    let group = cli_mcp_api::crd::CliMcpInstance::group(&());
    let plural = cli_mcp_api::crd::CliMcpInstance::plural(&());
    [
        json!({
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["validatingadmissionpolicies", "validatingadmissionpolicybindings"],
            "verbs": ["create", "get"]
        }),
        json!({"apiGroups": [group], "resources": [plural], "verbs": ["get", "list"]}),
    ]
}

/// The Deployment's spec as OLM runs it: `WATCH_NAMESPACE` from the OperatorGroup, and with
/// `create_policies` the operator creating the admission policies itself.
fn olm_deployment_spec(deployment: &Value, create_policies: bool) -> Result<Value, BundleError> {
    let mut spec = deployment["spec"].clone();
    let containers = spec["template"]["spec"]["containers"]
        .as_array_mut()
        .ok_or(BundleError::Missing("container in the operator Deployment"))?;
    let mut found = false;
    for c in containers.iter_mut() {
        if create_policies {
            if let Some(env) = c["env"].as_array_mut() {
                env.push(json!({"name": CREATE_POLICIES_ENV, "value": "true"}));
            }
        }
        for e in c["env"].as_array_mut().into_iter().flatten() {
            if e["name"] == "WATCH_NAMESPACE" {
                *e = json!({
                    "name": "WATCH_NAMESPACE",
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['olm.targetNamespaces']"}}
                });
                found = true;
            }
        }
    }
    if !found {
        return Err(BundleError::Missing(
            "WATCH_NAMESPACE variable in the operator Deployment",
        ));
    }
    Ok(spec)
}

/// The install strategy's spec: the operator's Deployment and its permissions, namespaced
/// and (when there are any) cluster-wide. With `create_policies` (the rendering has
/// admission policies, which a bundle cannot carry) the operator creates them at start,
/// and may.
pub(super) fn install_strategy(
    deployment: &Value,
    sa: &str,
    namespaced: Vec<Value>,
    mut cluster: Vec<Value>,
    create_policies: bool,
) -> Result<Value, BundleError> {
    if create_policies {
        cluster.extend(create_policies_rules());
    }
    let mut install = json!({
        "deployments": [{
            "name": name(deployment),
            "label": deployment["metadata"]["labels"].clone(),
            "spec": olm_deployment_spec(deployment, create_policies)?,
        }],
        "permissions": [{"serviceAccountName": sa, "rules": namespaced}],
    });
    if !cluster.is_empty() {
        install["clusterPermissions"] = json!([{"serviceAccountName": sa, "rules": cluster}]);
    }
    Ok(install)
}
