//! `spec.proxy`: the credential proxy between the sandboxes and every API they may call,
//! its targets and its pods.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, LocalObjectReference, ResourceRequirements, Toleration,
};
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{placement as placement_rules, resources};

/// Most proxy targets of one instance.
pub const MAX_PROXY_TARGETS: usize = 8;
/// Most domains of one allow-list target.
pub const MAX_ALLOWLIST_DOMAINS: usize = 16;
/// Most proxy replicas.
pub const MAX_PROXY_REPLICAS: i32 = 10;

/// The credential proxy of an instance.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
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

    /// RuntimeClass of the proxy pods (`runtimeClassName`). The RuntimeClass must exist
    /// (`kubectl get runtimeclass`), else the pods are refused. Default: the node's default
    /// runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = placement_rules::class_name("spec.proxy.runtimeClassName", "RuntimeClass", "runtimeclass"))]
    pub runtime_class_name: Option<String>,

    /// Node labels the proxy pods must run on (`nodeSelector`). At most 32.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    #[x_kube(
        validation = placement_rules::label_keys("spec.proxy.nodeSelector"),
        validation = placement_rules::label_values("spec.proxy.nodeSelector")
    )]
    pub node_selector: BTreeMap<String, String>,

    /// Taints the proxy pods tolerate (standard pod `tolerations`). At most 32.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[x_kube(
        validation = placement_rules::toleration_operator("spec.proxy.tolerations"),
        validation = placement_rules::toleration_effect("spec.proxy.tolerations"),
        validation = placement_rules::toleration_exists("spec.proxy.tolerations"),
        validation = placement_rules::toleration_keyless("spec.proxy.tolerations"),
        validation = placement_rules::toleration_seconds("spec.proxy.tolerations")
    )]
    pub tolerations: Vec<Toleration>,

    /// Node affinity and pod (anti-)affinity of the proxy pods (standard pod `affinity`).
    /// Without a `podAntiAffinity` here, the replicas prefer different nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,

    /// PriorityClass of the proxy pods (`priorityClassName`): every sandbox call needs the
    /// proxy, so give it at least the sandboxes' priority. It must exist
    /// (`kubectl get priorityclass`), else the pods are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = placement_rules::class_name("spec.proxy.priorityClassName", "PriorityClass", "priorityclass"))]
    pub priority_class_name: Option<String>,

    /// Secrets (type kubernetes.io/dockerconfigjson, in the instance's namespace) the
    /// kubelet pulls the proxy image with (`imagePullSecrets`). At most 16.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    // Bounded item schema: see spec.sandbox.imagePullSecrets.
    #[schemars(
        length(max = 16),
        extend("items" = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}}})
    )]
    #[x_kube(validation = placement_rules::pull_secrets("spec.proxy.imagePullSecrets"))]
    pub image_pull_secrets: Vec<LocalObjectReference>,
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
}

/// Kind of a proxy target.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ProxyTargetType {
    Kubernetes,
    Allowlist,
}
