//! `spec.proxy`: the credential proxy between the sandboxes and every API they may call,
//! its targets and its pods.

use k8s_openapi::api::core::v1::ResourceRequirements;
use kube::KubeSchema;
use schemars::{JsonSchema, Schema};
use serde::{Deserialize, Serialize};

use super::placement::{PlacementPart, PlacementSpec};
use super::resources;
use crate::proxy::RouteIdentity;

/// Most proxy targets of one instance.
pub const MAX_PROXY_TARGETS: usize = 8;
/// Most domains of one allow-list target.
pub const MAX_ALLOWLIST_DOMAINS: usize = 16;
/// Most proxy replicas.
pub const MAX_PROXY_REPLICAS: i32 = 10;

/// What the placement fields of `spec.proxy` say in the CRD.
const PLACEMENT: PlacementPart = PlacementPart {
    path: "spec.proxy",
    runtime_class_name:
        "RuntimeClass of the proxy pods (`runtimeClassName`). The RuntimeClass must exist \
        (`kubectl get runtimeclass`), else the pods are refused and the instance is \
        Ready=False with reason RuntimeClassNotFound. Default: the node's default runtime.",
    node_selector: "Node labels the proxy pods must run on (`nodeSelector`). At most 32.",
    tolerations: "Taints the proxy pods tolerate (standard pod `tolerations`). At most 32.",
    affinity: "Node affinity and pod (anti-)affinity of the proxy pods (standard pod \
        `affinity`). Without a `podAntiAffinity` here, the replicas prefer different nodes.",
    priority_class_name:
        "PriorityClass of the proxy pods (`priorityClassName`): every sandbox call needs the \
        proxy, so give it at least the sandboxes' priority. It must exist (`kubectl get \
        priorityclass`), else the pods are refused.",
    image_pull_secrets:
        "Secrets (type kubernetes.io/dockerconfigjson, in the instance's namespace) the \
        kubelet pulls the proxy image with (`imagePullSecrets`). At most 16.",
};

/// Gives the placement fields of this part's schema their descriptions and CEL rules.
fn placement_schema(schema: &mut Schema) {
    PLACEMENT.apply(schema);
}

/// The credential proxy of an instance.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = placement_schema)]
#[x_kube(
    validation = Rule::new("self.targets.filter(t, t.type == 'kubernetes').size() <= 1").message(
        "spec.proxy.targets: at most one target of type kubernetes (one kubeconfig Secret; it may hold several clusters)"
    )
)]
pub struct ProxySpec {
    /// What the sandboxes may reach through the proxy (1..8 targets): one `kubernetes`
    /// target (the API servers of a kubeconfig Secret, token injected) and `allowlist`
    /// targets (HTTPS domains reachable as they are, nothing injected). Everything else gets
    /// no tunnel.
    #[schemars(length(min = 1, max = 8))]
    #[x_kube(merge_strategy = ListMerge::Atomic)]
    pub targets: Vec<ProxyTarget>,

    /// Proxy replicas (1..10, default 2). With two or more, a PodDisruptionBudget keeps one
    /// serving through node drains, and losing one pod fails no call.
    #[serde(default = "default_proxy_replicas")]
    #[schemars(range(min = 1, max = 10))]
    pub replicas: i32,

    /// Compute resources of the proxy container. Default: requests cpu 20m / memory 32Mi,
    /// limits cpu 500m / memory 128Mi.
    #[serde(default = "default_proxy_resources")]
    #[x_kube(validation = Rule::new("!has(self.claims)").message(
        "spec.proxy.resources.claims is not supported; use requests and limits"
    ))]
    pub resources: ResourceRequirements,

    /// Runtime, scheduling and pull Secrets of the proxy pods: `runtimeClassName`,
    /// `nodeSelector`, `tolerations`, `affinity`, `priorityClassName` and
    /// `imagePullSecrets`, beside the fields above. Their descriptions in the CRD are
    /// `PLACEMENT`'s.
    #[serde(flatten)]
    pub placement: PlacementSpec,
}

pub(super) fn default_proxy_replicas() -> i32 {
    2
}

pub(super) fn default_proxy_resources() -> ResourceRequirements {
    resources("20m", "32Mi", "500m", "128Mi")
}

/// One thing the sandboxes may reach through the proxy.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.type == 'allowlist' || !has(self.domains)").message(
        "spec.proxy.targets: a kubernetes target takes its servers from the kubeconfig Secret; remove domains or use type allowlist"
    ),
    validation = Rule::new("self.type == 'kubernetes' || !has(self.secretName)").message(
        "spec.proxy.targets: secretName belongs to a kubernetes target; an allowlist target injects nothing"
    ),
    validation = Rule::new("self.type == 'kubernetes' || has(self.domains)").message(
        "spec.proxy.targets: an allowlist target needs domains (host or host:port, 1..16)"
    ),
    validation = Rule::new("self.type == 'allowlist' || !has(self.caConfigMap)").message(
        "spec.proxy.targets: caConfigMap belongs to an allowlist target; a kubernetes target trusts the CA embedded in its kubeconfig"
    ),
    validation = Rule::new("self.type == 'kubernetes' || !has(self.identity)").message(
        "spec.proxy.targets: identity belongs to a kubernetes target; an allowlist target injects no credential, so there is no identity to choose; remove identity"
    )
)]
pub struct ProxyTarget {
    /// `kubernetes`: the API servers of the kubeconfig in `secretName`, whose token the
    /// proxy injects; `allowlist`: the HTTPS `domains`, with nothing injected.
    #[serde(rename = "type")]
    pub type_: ProxyTargetType,

    /// Kubernetes targets: the Secret whose key `kubeconfig` holds the admin kubeconfig
    /// (token users, https servers with embedded CA). Default `cli-mcp-<name>-kubeconfig`.
    /// Only the proxy mounts it, and only that key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(
        "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')"
    ).message("spec.proxy.targets[].secretName must be the name of a Secret (a DNS-1123 subdomain)"))]
    pub secret_name: Option<String>,

    /// Allowlist targets: `host` (port 443) or `host:port`, an IPv6 address in brackets;
    /// no wildcards, schemes or paths. 1..16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16), inner(length(min = 1, max = 253)))]
    #[x_kube(
        merge_strategy = ListMerge::Set,
        validation = Rule::new("self.all(d, !d.contains('*') && !d.contains('/') && !d.startsWith('.'))").message(
            "spec.proxy.targets[].domains: each entry is host or host:port (1..253 characters), without '*', scheme, path or a leading dot"
        )
    )]
    pub domains: Option<Vec<String>>,

    /// Allowlist targets: a ConfigMap in the instance's namespace whose key `ca.crt` holds
    /// the PEM CA certificates (1..32, at most 64 KiB) the proxy verifies these domains'
    /// upstreams against — those alone, not the system roots. For upstreams with a private
    /// CA. Default: the proxy image's system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(
        "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')"
    ).message("spec.proxy.targets[].caConfigMap must be the name of a ConfigMap (a DNS-1123 subdomain)"))]
    pub ca_config_map: Option<String>,

    /// Kubernetes targets: whose identity the requests reach the API servers with.
    /// `shared` (default): the kubeconfig's user, for every session alike.
    /// `impersonateCaller`: the kubeconfig's user impersonates the session's MCP caller (user
    /// and groups) and names the session in the extra `cli-mcp.redhat.com/session`, so the
    /// cluster's RBAC decides per person and its audit log names person and session. The
    /// kubeconfig's user then needs `impersonate` on `users`, `groups` (and `serviceaccounts`
    /// for ServiceAccount callers) and `userextras/cli-mcp.redhat.com/session`
    /// (docs/contract.md). A session without a caller (`spec.server.auth: None`) is refused,
    /// never served as the shared identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<ProxyTargetIdentity>,
}

/// Kind of a proxy target.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ProxyTargetType {
    Kubernetes,
    Allowlist,
}

/// Whose identity a kubernetes target's requests carry (`spec.proxy.targets[].identity`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ProxyTargetIdentity {
    // The kubeconfig's user (plain comments: variant docs would make the schema a oneOf).
    #[default]
    Shared,
    // The session's MCP caller, impersonated by the kubeconfig's user.
    ImpersonateCaller,
}

impl From<ProxyTargetIdentity> for RouteIdentity {
    fn from(i: ProxyTargetIdentity) -> Self {
        match i {
            ProxyTargetIdentity::Shared => RouteIdentity::Shared,
            ProxyTargetIdentity::ImpersonateCaller => RouteIdentity::ImpersonateCaller,
        }
    }
}

#[cfg(test)]
mod tests {
    use kube::CustomResourceExt;

    use crate::crd::CliMcpInstance;

    /// `identity` is `shared` or `impersonateCaller`, with no schema default (a default would
    /// be stored on allow-list targets too, which the rule below refuses), and admission
    /// refuses it on an allow-list target.
    #[test]
    fn identity_is_two_values_on_kubernetes_targets_only() {
        let crd = serde_json::to_value(CliMcpInstance::crd()).expect("json");
        let target = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["proxy"]["properties"]["targets"]["items"];
        let identity = &target["properties"]["identity"];
        let values: Vec<_> = identity["enum"]
            .as_array()
            .expect("enum")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert_eq!(values, ["shared", "impersonateCaller"]);
        assert!(identity.get("default").is_none(), "{identity}");
        assert!(identity["description"]
            .as_str()
            .is_some_and(|d| d.contains("userextras/cli-mcp.redhat.com/session")));
        let rules = target["x-kubernetes-validations"]
            .as_array()
            .expect("rules");
        assert!(
            rules.iter().any(
                |r| r["rule"] == "self.type == 'kubernetes' || !has(self.identity)"
                    && r["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("identity belongs to a kubernetes target"))
            ),
            "{rules:?}"
        );
    }
}
