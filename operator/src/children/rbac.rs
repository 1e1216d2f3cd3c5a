//! ServiceAccounts, the server's Role and RoleBinding, the per-instance ClusterRoleBinding
//! to `system:auth-delegator` (TokenReview + SubjectAccessReview), the credential proxy's
//! Role, RoleBinding and ClusterRoleBinding (it verifies the sandboxes' tokens), and the
//! client identity: who may use the MCP endpoint.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{
    ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use sha2::{Digest, Sha256};

use cli_mcp_api::crd::ClientKind;
use cli_mcp_api::names::{label, InstanceName, GROUP, PLURAL};

use super::{Inputs, INSTANCE_NAMESPACE_LABEL};

/// The server's ServiceAccount (its token is used for the API and for TokenReviews).
pub fn server_service_account(inp: &Inputs) -> ServiceAccount {
    ServiceAccount {
        metadata: inp
            .spec
            .meta(inp.spec.name.server(), label::COMPONENT_SERVER),
        ..Default::default()
    }
}

/// The sandbox ServiceAccount: no token, no bindings. Sandboxes reach the API only with the
/// kubeconfig the admin gives them.
pub fn sandbox_service_account(inp: &Inputs) -> ServiceAccount {
    ServiceAccount {
        metadata: inp
            .spec
            .meta(inp.spec.name.sandbox(), label::COMPONENT_SANDBOX),
        automount_service_account_token: Some(false),
        ..Default::default()
    }
}

/// What the server may do in its namespace: manage sandbox pods and the session slots
/// (Leases that make `maxSessions` and `maxSessionsPerClient` exact across replicas), and
/// read the credential proxy's one Deployment, so it creates no sandbox while the proxy is
/// down. No Secrets: tokens derive from the mounted HMAC key and pods carry only
/// commitments.
pub fn server_role(inp: &Inputs) -> Role {
    let verbs = |v: &[&str]| v.iter().map(|v| (*v).to_owned()).collect();
    let rules = vec![
        PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["pods".into()]),
            verbs: verbs(&["get", "list", "watch", "create", "patch", "delete"]),
            ..Default::default()
        },
        PolicyRule {
            api_groups: Some(vec!["coordination.k8s.io".into()]),
            resources: Some(vec!["leases".into()]),
            verbs: verbs(&["list", "watch", "create", "patch", "delete"]),
            ..Default::default()
        },
        PolicyRule {
            api_groups: Some(vec!["apps".into()]),
            resources: Some(vec!["deployments".into()]),
            resource_names: Some(vec![inp.spec.name.proxy()]),
            verbs: verbs(&["get"]),
            ..Default::default()
        },
    ];
    Role {
        metadata: inp
            .spec
            .meta(inp.spec.name.server(), label::COMPONENT_SERVER),
        rules: Some(rules),
    }
}

fn server_subject(inp: &Inputs) -> Subject {
    Subject {
        kind: "ServiceAccount".into(),
        name: inp.spec.name.server(),
        namespace: Some(inp.spec.namespace.clone()),
        ..Default::default()
    }
}

pub fn server_role_binding(inp: &Inputs) -> RoleBinding {
    RoleBinding {
        metadata: inp
            .spec
            .meta(inp.spec.name.server(), label::COMPONENT_SERVER),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: inp.spec.name.server(),
        },
        subjects: Some(vec![server_subject(inp)]),
    }
}

/// The verbs the server's SubjectAccessReview asks for: `create` (POST), `get`, `delete`.
pub const MCP_VERBS: [&str; 3] = ["create", "get", "delete"];

/// The instance's client ServiceAccount: an identity that may use the MCP endpoint and
/// nothing else (`kubectl create token cli-mcp-<name>-client`).
pub fn client_service_account(inp: &Inputs) -> ServiceAccount {
    ServiceAccount {
        metadata: inp
            .spec
            .meta(inp.spec.name.client(), label::COMPONENT_CLIENT),
        automount_service_account_token: Some(false),
        ..Default::default()
    }
}

/// Use of this one instance's MCP endpoint: the subresource `climcpinstances/mcp` of this
/// instance by name, with exactly the verbs the server checks. Nothing else.
pub fn client_role(inp: &Inputs) -> Role {
    Role {
        metadata: inp
            .spec
            .meta(inp.spec.name.client(), label::COMPONENT_CLIENT),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![GROUP.to_owned()]),
            resources: Some(vec![format!("{PLURAL}/mcp")]),
            resource_names: Some(vec![inp.spec.name.to_string()]),
            verbs: MCP_VERBS.iter().map(|v| (*v).to_owned()).collect(),
            ..Default::default()
        }]),
    }
}

/// Binds the client Role to the client ServiceAccount and to `spec.server.clients`.
pub fn client_role_binding(inp: &Inputs) -> RoleBinding {
    let own = Subject {
        kind: "ServiceAccount".into(),
        name: inp.spec.name.client(),
        namespace: Some(inp.spec.namespace.clone()),
        ..Default::default()
    };
    let extra = inp.spec.clients.iter().map(|c| match c.kind {
        ClientKind::ServiceAccount => Subject {
            kind: c.kind.as_str().into(),
            name: c.name.clone(),
            namespace: Some(
                c.namespace
                    .clone()
                    .unwrap_or_else(|| inp.spec.namespace.clone()),
            ),
            ..Default::default()
        },
        ClientKind::User | ClientKind::Group => Subject {
            kind: c.kind.as_str().into(),
            name: c.name.clone(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        },
    });
    let mut subjects = vec![own];
    for s in extra {
        // A subject listed twice would be harmless to RBAC but noisy in every diff.
        if !subjects.contains(&s) {
            subjects.push(s);
        }
    }
    RoleBinding {
        metadata: inp
            .spec
            .meta(inp.spec.name.client(), label::COMPONENT_CLIENT),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: inp.spec.name.client(),
        },
        subjects: Some(subjects),
    }
}

/// Labels of a per-instance ClusterRoleBinding of `component` (it cannot have an owner
/// reference to a namespaced CR, so the finalizer removes it; the labels map it back to the
/// instance).
pub fn cluster_binding_labels(inp: &Inputs, component: &str) -> BTreeMap<String, String> {
    let mut l = inp.spec.labels(component);
    l.insert(
        INSTANCE_NAMESPACE_LABEL.to_owned(),
        inp.spec.namespace.clone(),
    );
    l
}

/// A per-instance ClusterRoleBinding of `subject` to `system:auth-delegator`.
fn delegator_binding(
    inp: &Inputs,
    name: String,
    component: &str,
    subject: Subject,
) -> ClusterRoleBinding {
    ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(name),
            labels: Some(cluster_binding_labels(inp, component)),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: "system:auth-delegator".into(),
        },
        subjects: Some(vec![subject]),
    }
}

/// The server's: TokenReview and SubjectAccessReview of MCP callers.
pub fn auth_delegator_binding(inp: &Inputs) -> ClusterRoleBinding {
    delegator_binding(
        inp,
        inp.spec.name.auth_delegator_binding(&inp.spec.namespace),
        label::COMPONENT_SERVER,
        server_subject(inp),
    )
}

/// The name of the credential proxy's per-instance ClusterRoleBinding to
/// `system:auth-delegator`: `cli-mcp-<ns>-<n>-proxy-auth-delegator-<h>`, `h` the same 8 hex
/// of sha256(`<ns>/<n>`) as the server's (see `InstanceName::auth_delegator_binding`: the
/// namespace and the hash keep tenants apart).
pub fn proxy_auth_delegator_binding_name(name: &InstanceName, namespace: &str) -> String {
    let digest = Sha256::digest(format!("{namespace}/{name}").as_bytes());
    format!(
        "cli-mcp-{namespace}-{name}-proxy-auth-delegator-{}",
        &hex::encode(digest)[..8]
    )
}

fn proxy_subject(inp: &Inputs) -> Subject {
    Subject {
        kind: "ServiceAccount".into(),
        name: inp.spec.name.proxy(),
        namespace: Some(inp.spec.namespace.clone()),
        ..Default::default()
    }
}

/// What the credential proxy may read in its namespace: pods, so it can tell that the pod a
/// sandbox's token names is a live, sealed sandbox of this instance (its IP, its session and
/// caller). Read only; a Role cannot narrow pods by label, the proxy's own check does.
pub fn proxy_role(inp: &Inputs) -> Role {
    Role {
        metadata: inp.spec.meta(inp.spec.name.proxy(), label::COMPONENT_PROXY),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["pods".into()]),
            verbs: ["get", "list", "watch"].map(String::from).to_vec(),
            ..Default::default()
        }]),
    }
}

pub fn proxy_role_binding(inp: &Inputs) -> RoleBinding {
    RoleBinding {
        metadata: inp.spec.meta(inp.spec.name.proxy(), label::COMPONENT_PROXY),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: inp.spec.name.proxy(),
        },
        subjects: Some(vec![proxy_subject(inp)]),
    }
}

/// The proxy's: TokenReview of the sandboxes' projected tokens (audience this instance's
/// proxy), as itself.
pub fn proxy_auth_delegator_binding(inp: &Inputs) -> ClusterRoleBinding {
    delegator_binding(
        inp,
        proxy_auth_delegator_binding_name(&inp.spec.name, &inp.spec.namespace),
        label::COMPONENT_PROXY,
        proxy_subject(inp),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::children::test_support::inputs;

    #[test]
    fn server_role_grants_pods_session_slots_and_the_proxy_deployment_only() {
        let inp = inputs(serde_json::json!({}));
        let r = server_role(&inp);
        let rules = r.rules.expect("rules");
        assert_eq!(rules.len(), 3);
        assert_eq!(rules[0].resources, Some(vec!["pods".to_string()]));
        assert!(!rules[0].verbs.contains(&"update".to_string()));
        // The session slots: Leases, without `update` or `deletecollection`.
        assert_eq!(
            rules[1].api_groups,
            Some(vec!["coordination.k8s.io".to_string()])
        );
        assert_eq!(rules[1].resources, Some(vec!["leases".to_string()]));
        assert_eq!(
            rules[1].verbs,
            ["list", "watch", "create", "patch", "delete"]
        );
        let sa = sandbox_service_account(&inp);
        assert_eq!(sa.automount_service_account_token, Some(false));
        assert_eq!(sa.metadata.name.as_deref(), Some("cli-mcp-demo-sandbox"));

        // `get` on the credential proxy's one Deployment (every instance has one), nothing
        // more.
        assert_eq!(rules[2].resources, Some(vec!["deployments".to_string()]));
        assert_eq!(
            rules[2].resource_names,
            Some(vec!["cli-mcp-demo-proxy".to_string()])
        );
        assert_eq!(rules[2].verbs, ["get"]);
    }

    #[test]
    fn auth_delegator_binding_is_per_instance() {
        let inp = inputs(serde_json::json!({}));
        let b = auth_delegator_binding(&inp);
        assert_eq!(
            b.metadata.name.as_deref(),
            Some("cli-mcp-ns1-demo-auth-delegator-08c69f66")
        );
        assert_eq!(b.role_ref.name, "system:auth-delegator");
        let s = &b.subjects.expect("subjects")[0];
        assert_eq!(s.name, "cli-mcp-demo");
        assert_eq!(s.namespace.as_deref(), Some("ns1"));
        assert!(b.metadata.owner_references.is_none());
        assert_eq!(
            b.metadata.labels.expect("labels")[INSTANCE_NAMESPACE_LABEL],
            "ns1"
        );
    }

    #[test]
    fn the_proxy_reads_pods_and_reviews_tokens_and_nothing_else() {
        let inp = inputs(serde_json::json!({}));
        let r = proxy_role(&inp);
        assert_eq!(r.metadata.name.as_deref(), Some("cli-mcp-demo-proxy"));
        assert_eq!(r.metadata.namespace.as_deref(), Some("ns1"));
        let rules = r.rules.expect("rules");
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].api_groups, Some(vec![String::new()]));
        assert_eq!(rules[0].resources, Some(vec!["pods".to_owned()]));
        assert_eq!(rules[0].verbs, ["get", "list", "watch"]);
        let b = proxy_role_binding(&inp);
        assert_eq!(b.role_ref.kind, "Role");
        assert_eq!(b.role_ref.name, "cli-mcp-demo-proxy");
        let proxy_sa = |subjects: Option<Vec<Subject>>| {
            let s = subjects.expect("subjects");
            assert_eq!(s.len(), 1);
            (s[0].kind.clone(), s[0].name.clone(), s[0].namespace.clone())
        };
        let sa = (
            "ServiceAccount".to_owned(),
            "cli-mcp-demo-proxy".to_owned(),
            Some("ns1".to_owned()),
        );
        assert_eq!(proxy_sa(b.subjects), sa);

        let crb = proxy_auth_delegator_binding(&inp);
        assert_eq!(
            crb.metadata.name.as_deref(),
            Some("cli-mcp-ns1-demo-proxy-auth-delegator-08c69f66")
        );
        assert_ne!(
            crb.metadata.name,
            auth_delegator_binding(&inp).metadata.name
        );
        assert_eq!(crb.role_ref.kind, "ClusterRole");
        assert_eq!(crb.role_ref.name, "system:auth-delegator");
        assert!(crb.metadata.owner_references.is_none());
        let l = crb.metadata.labels.expect("labels");
        assert_eq!(l[INSTANCE_NAMESPACE_LABEL], "ns1");
        assert_eq!(l[label::INSTANCE], "demo");
        assert_eq!(l[label::COMPONENT], "proxy");
        assert_eq!(l[label::APP_MANAGED_BY], label::MANAGED_BY);
        assert_eq!(proxy_sa(crb.subjects), sa);
        // Tenants stay apart, as with the server's binding.
        let c = InstanceName::parse("c").expect("valid");
        let b_c = InstanceName::parse("b-c").expect("valid");
        assert_ne!(
            proxy_auth_delegator_binding_name(&c, "a-b"),
            proxy_auth_delegator_binding_name(&b_c, "a")
        );
    }

    #[test]
    fn the_client_role_allows_only_this_instances_mcp_endpoint() {
        let inp = inputs(serde_json::json!({}));
        let r = client_role(&inp);
        assert_eq!(r.metadata.name.as_deref(), Some("cli-mcp-demo-client"));
        let rules = r.rules.expect("rules");
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].api_groups, Some(vec![GROUP.to_owned()]));
        assert_eq!(
            rules[0].resources,
            Some(vec!["climcpinstances/mcp".to_owned()])
        );
        assert_eq!(rules[0].resource_names, Some(vec!["demo".to_owned()]));
        assert_eq!(rules[0].verbs, ["create", "get", "delete"]);
        let sa = client_service_account(&inp);
        assert_eq!(sa.metadata.name.as_deref(), Some("cli-mcp-demo-client"));
        assert_eq!(sa.automount_service_account_token, Some(false));
    }

    #[test]
    fn the_client_binding_names_the_client_account_and_spec_clients() {
        let inp = inputs(serde_json::json!({"server": {"clients": [
            {"kind": "User", "name": "alice@example.com"},
            {"kind": "Group", "name": "sre"},
            {"kind": "ServiceAccount", "name": "bot"},
            {"kind": "ServiceAccount", "name": "ci", "namespace": "pipelines"},
            {"kind": "Group", "name": "sre"},
        ]}}));
        let b = client_role_binding(&inp);
        assert_eq!(b.role_ref.kind, "Role");
        assert_eq!(b.role_ref.name, "cli-mcp-demo-client");
        let got: Vec<(String, String, Option<String>, Option<String>)> = b
            .subjects
            .expect("subjects")
            .into_iter()
            .map(|s| (s.kind, s.name, s.namespace, s.api_group))
            .collect();
        let rbac = Some("rbac.authorization.k8s.io".to_owned());
        let ns = |n: &str| Some(n.to_owned());
        assert_eq!(
            got,
            [
                (
                    "ServiceAccount".into(),
                    "cli-mcp-demo-client".into(),
                    ns("ns1"),
                    None
                ),
                (
                    "User".into(),
                    "alice@example.com".into(),
                    None,
                    rbac.clone()
                ),
                ("Group".into(), "sre".into(), None, rbac.clone()),
                ("ServiceAccount".into(), "bot".into(), ns("ns1"), None),
                ("ServiceAccount".into(), "ci".into(), ns("pipelines"), None),
            ]
        );
    }
}
