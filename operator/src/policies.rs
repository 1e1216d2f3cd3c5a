//! The install's ValidatingAdmissionPolicies (`config/admission`), created by the operator
//! itself at start where the installer cannot apply them. An OLM bundle may carry only the
//! kinds OLM installs (the ClusterServiceVersion, CRDs, RBAC, ServiceAccounts, Services,
//! Secrets, ConfigMaps and a few monitoring kinds: operator-registry's supported bundle
//! resources), and ValidatingAdmissionPolicy is not one; without them the operator could
//! delete any ClusterRoleBinding and a server could create any pod. So the bundle's CSV sets
//! `CLI_MCP_CREATE_ADMISSION_POLICIES=true` and grants `create` and `get` on the two kinds
//! (and `get` and `list` on every CliMcpInstance, which the API server demands of whoever creates a
//! policy and a binding whose parameters they are), and the operator creates the policies
//! embedded in its binary (the same files kustomize and the chart install) before it
//! reconciles anything.
//!
//! The ClusterRoleBinding policy names the operator's username exactly; here that is the
//! username the API server knows this process by (a `SelfSubjectReview`), which must be a
//! ServiceAccount's. That policy and its binding get the ServiceAccount's namespace as a
//! suffix, so two installs in two namespaces each have their own; the other policies know
//! the operator by what RBAC grants it, name no install, and are shared.
//!
//! Only `create` (and `get`): a policy that exists is left as it is (an operator that could
//! change or delete the policies that hold it would hold nothing). One that differs from
//! this operator's copy (another version made it) is named in a warning: after an upgrade
//! that changes them, delete them and restart the operator (docs/olm.md).

use anyhow::{bail, Context as _};
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::{Api, Client};
use serde::Deserialize as _;
use serde_json::Value;

use crate::api_call::is_status;

/// `config/admission`'s policies and bindings, as kustomize and the chart install them.
const MANIFESTS: &[(&str, &str)] = &[
    (
        "cluster_role_bindings.yaml",
        include_str!("../../config/admission/cluster_role_bindings.yaml"),
    ),
    (
        "sandbox_pods.yaml",
        include_str!("../../config/admission/sandbox_pods.yaml"),
    ),
    (
        "tenant_pods.yaml",
        include_str!("../../config/admission/tenant_pods.yaml"),
    ),
    (
        "instance_names.yaml",
        include_str!("../../config/admission/instance_names.yaml"),
    ),
];

/// The operator username `config/admission` names in the ClusterRoleBinding policy
/// (`config/default`'s, followed by the `:` its comparison appends).
pub const CONFIG_OPERATOR: &str = "system:serviceaccount:cli-mcp-system:cli-mcp-operator:";
/// The `cli-mcp.redhat.com/policy` label of that policy and its binding.
const PER_OPERATOR: &str = "cluster-role-bindings";
const POLICY_LABEL: &str = "cli-mcp.redhat.com/policy";
const GROUP: &str = "admissionregistration.k8s.io";

/// A ServiceAccount's namespace and name from its username
/// (`system:serviceaccount:<namespace>:<name>`).
pub fn service_account(username: &str) -> Option<(&str, &str)> {
    let rest = username.strip_prefix("system:serviceaccount:")?;
    let (ns, name) = rest.split_once(':')?;
    (!ns.is_empty() && !name.is_empty() && !name.contains(':')).then_some((ns, name))
}

/// The policies and bindings this operator creates, for the operator ServiceAccount
/// `name` of namespace `ns`: config/admission's, the ClusterRoleBinding policy naming that
/// ServiceAccount and, with its binding, suffixed with `ns`. Policies come before their
/// bindings. Pure.
pub fn policies(ns: &str, name: &str) -> anyhow::Result<Vec<Value>> {
    let operator = format!("system:serviceaccount:{ns}:{name}:");
    let mut out = Vec::new();
    for (file, text) in MANIFESTS {
        for doc in serde_yaml::Deserializer::from_str(text) {
            let v = Value::deserialize(doc)
                .with_context(|| format!("config/admission/{file} is not YAML"))?;
            if v.is_null() {
                continue;
            }
            if v["metadata"]["labels"][POLICY_LABEL] != PER_OPERATOR {
                out.push(v);
                continue;
            }
            out.push(for_operator(v, &operator, ns, file)?);
        }
    }
    // Policies first: a binding of a policy not there yet enforces nothing meanwhile.
    out.sort_by_key(|v| v["kind"] != "ValidatingAdmissionPolicy");
    Ok(out)
}

/// The ClusterRoleBinding policy (or its binding) of config/admission, made this operator's.
fn for_operator(v: Value, operator: &str, ns: &str, file: &str) -> anyhow::Result<Value> {
    let text = serde_json::to_string(&v)?;
    if v["kind"] == "ValidatingAdmissionPolicy" && !text.contains(CONFIG_OPERATOR) {
        bail!(
            "config/admission/{file} no longer names the operator as {CONFIG_OPERATOR:?}; \
             operator/src/policies.rs must learn where it does"
        );
    }
    let mut v: Value = serde_json::from_str(&text.replace(CONFIG_OPERATOR, operator))?;
    let suffixed = |n: &Value| format!("{}-{ns}", n.as_str().unwrap_or_default());
    v["metadata"]["name"] = Value::String(suffixed(&v["metadata"]["name"]));
    if v["kind"] == "ValidatingAdmissionPolicyBinding" {
        v["spec"]["policyName"] = Value::String(suffixed(&v["spec"]["policyName"]));
    }
    Ok(v)
}

/// Whether `stored` says everything `ours` says: the API server adds defaults to what it
/// stores (`matchPolicy`, empty selectors, a rule's `scope`), so equality would call every
/// stored policy different. Arrays must have the same length. Pure.
pub fn holds(stored: &Value, ours: &Value) -> bool {
    match (stored, ours) {
        (Value::Object(s), Value::Object(o)) => o
            .iter()
            .all(|(k, v)| s.get(k).is_some_and(|sv| holds(sv, v))),
        (Value::Array(s), Value::Array(o)) => {
            s.len() == o.len() && s.iter().zip(o).all(|(a, b)| holds(a, b))
        }
        _ => stored == ours,
    }
}

/// The resource name of `kind` (one of the two admission kinds).
fn plural(kind: &str) -> String {
    format!("{}s", kind.to_ascii_lowercase()).replace("policys", "policies")
}

fn api(client: &Client, kind: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(GROUP, "v1", kind);
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, &plural(kind)),
    )
}

/// Creates the policies that are missing, as the ServiceAccount this process runs as.
/// Returns the names it created. An error says what to fix.
pub async fn ensure(client: &Client) -> anyhow::Result<Vec<String>> {
    let review = Api::<SelfSubjectReview>::all(client.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .context("asking the API server who this operator is (SelfSubjectReview)")?;
    let username = review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username)
        .unwrap_or_default();
    let Some((ns, name)) = service_account(&username) else {
        bail!(
            "CLI_MCP_CREATE_ADMISSION_POLICIES: the policies name the operator's ServiceAccount, \
             but this operator runs as {username:?}; run it as a ServiceAccount or apply \
             config/admission yourself and unset the variable"
        );
    };
    // Policies, then bindings; one that fails does not keep the others from being made
    // (each holds on its own), and the error names every one that failed.
    let (mut created, mut failed, mut differ) = (Vec::new(), Vec::new(), Vec::new());
    for v in policies(ns, name)? {
        let kind = v["kind"].as_str().unwrap_or_default().to_owned();
        let obj: DynamicObject = serde_json::from_value(v)?;
        let obj_name = obj.metadata.name.clone().unwrap_or_default();
        let what = format!("{kind} {obj_name}");
        let api = api(client, &kind);
        match api.create(&PostParams::default(), &obj).await {
            Ok(_) => created.push(what),
            Err(e) if is_status(&e, 409) => match api.get(&obj_name).await {
                Ok(stored) if holds(&stored.data["spec"], &obj.data["spec"]) => {}
                Ok(_) => differ.push(what),
                Err(e) => tracing::warn!("{what} exists, but reading it failed: {e}"),
            },
            Err(e) => failed.push(format!("{what}: {e}")),
        }
    }
    if !differ.is_empty() {
        tracing::warn!(
            "{} differ from this operator's copy of config/admission (another version made \
             them) and are left as they are; to have this version's, delete them \
             (kubectl delete validatingadmissionpolicybinding,validatingadmissionpolicy \
             -l app.kubernetes.io/component=admission,app.kubernetes.io/part-of=cli-mcp) and \
             restart the operator",
            differ.join(", ")
        );
    }
    if !failed.is_empty() {
        bail!(
            "could not create {} (needs Kubernetes 1.30 or later, `create` on {GROUP} \
             validatingadmissionpolicies and validatingadmissionpolicybindings and `get` and \
             `list` on every CliMcpInstance, which the bundle's CSV grants); created {created:?}",
            failed.join("; ")
        );
    }
    tracing::info!(
        operator = %username,
        created = ?created,
        "admission policies in place (created the missing ones)"
    );
    Ok(created)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_accounts_username_and_nothing_else() {
        assert_eq!(
            service_account("system:serviceaccount:ops:cli-mcp-operator"),
            Some(("ops", "cli-mcp-operator"))
        );
        for not in [
            "kubernetes-admin",
            "system:serviceaccount:ops",
            "system:serviceaccount::x",
            "system:serviceaccount:ops:",
            "system:serviceaccount:ops:a:b",
        ] {
            assert_eq!(service_account(not), None, "{not}");
        }
    }

    #[test]
    fn the_cluster_role_binding_policy_names_this_operator_and_the_rest_is_config() {
        let all = policies("ops", "team-op").expect("policies");
        let names: Vec<String> = all
            .iter()
            .map(|v| format!("{} {}", v["kind"], v["metadata"]["name"]))
            .collect();
        // Every policy and binding of config/admission, policies first.
        assert_eq!(all.len(), 10, "{names:?}");
        assert!(all[..5]
            .iter()
            .all(|v| v["kind"] == "ValidatingAdmissionPolicy"));
        let crb = all
            .iter()
            .find(|v| v["metadata"]["name"] == "cli-mcp-operator-cluster-role-bindings-ops")
            .expect("the ClusterRoleBinding policy, suffixed");
        let text = crb.to_string();
        assert!(
            text.contains("'system:serviceaccount:ops:team-op:' == request.userInfo.username"),
            "{text}"
        );
        assert!(!text.contains(CONFIG_OPERATOR), "{text}");
        let binding = all
            .iter()
            .find(|v| {
                v["kind"] == "ValidatingAdmissionPolicyBinding"
                    && v["metadata"]["labels"][POLICY_LABEL] == PER_OPERATOR
            })
            .expect("its binding");
        assert_eq!(
            binding["spec"]["policyName"],
            "cli-mcp-operator-cluster-role-bindings-ops"
        );
        // The others name no operator and keep config/admission's names.
        for v in all
            .iter()
            .filter(|v| v["metadata"]["labels"][POLICY_LABEL] != PER_OPERATOR)
        {
            assert!(!v.to_string().contains("team-op"), "{v}");
            assert!(
                !v["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .ends_with("-ops"),
                "{v}"
            );
        }
    }

    #[test]
    fn a_stored_policy_holds_ours_with_the_api_servers_defaults_added_and_nothing_changed() {
        let ours = serde_json::json!({"failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"resources": ["pods"]}]},
            "validations": [{"expression": "a"}]});
        let defaulted = serde_json::json!({"failurePolicy": "Fail", "matchPolicy": "Equivalent",
            "matchConstraints": {"resourceRules": [{"resources": ["pods"], "scope": "*"}],
                                 "namespaceSelector": {}},
            "validations": [{"expression": "a"}]});
        assert!(holds(&defaulted, &ours));
        let mut changed = defaulted.clone();
        changed["validations"][0]["expression"] = serde_json::json!("b");
        assert!(!holds(&changed, &ours));
        let mut more = defaulted.clone();
        more["validations"] = serde_json::json!([{"expression": "a"}, {"expression": "c"}]);
        assert!(!holds(&more, &ours));
        assert!(!holds(&serde_json::json!(null), &ours));
    }

    #[test]
    fn every_file_of_config_admission_is_embedded() {
        // A policy added to config/admission (its kustomization's resources) and not here
        // would be missing from every OLM install.
        let kustomization: Value =
            serde_yaml::from_str(include_str!("../../config/admission/kustomization.yaml"))
                .expect("kustomization");
        let mut listed: Vec<&str> = kustomization["resources"]
            .as_array()
            .expect("resources")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let mut embedded: Vec<&str> = MANIFESTS.iter().map(|(f, _)| *f).collect();
        listed.sort();
        embedded.sort();
        assert_eq!(listed, embedded);
    }

    #[test]
    fn plural_names_of_the_two_kinds() {
        assert_eq!(
            plural("ValidatingAdmissionPolicy"),
            "validatingadmissionpolicies"
        );
        assert_eq!(
            plural("ValidatingAdmissionPolicyBinding"),
            "validatingadmissionpolicybindings"
        );
    }
}
