//! The `CliMcpInstance` custom resource and the pure mapping from a CR to the
//! [`SandboxConfig`](crate::sandbox::SandboxConfig) both pod writers use.
//!
//! This file holds the resource itself: the top of the spec with the admission rules that
//! look across its parts, and the small types the parts share. Each part of the spec is a
//! module with its defaults and admission rules: `crd/sandbox.rs` (`spec.sandbox`),
//! `crd/server.rs` (`spec.server`, with `crd/expose.rs` for `spec.server.expose`) and
//! `crd/proxy.rs` (`spec.proxy`); `crd/placement.rs` has the CEL rules of the placement
//! fields the three share. The status types are in `crd/status.rs`, and what an admitted
//! spec means as values (durations, Secret names, the `SandboxConfig`) in `crd/values.rs`.
//!
//! Every bound, enum and CEL rule here ends up in the generated CRD (`config/crd/`), so a bad
//! CR is rejected by `kubectl apply` with a message that says what to fix — it never reaches
//! the operator or crash-loops a pod. The operator and the server agree on the sandbox pod
//! because both get it from [`CliMcpInstance::sandbox_config`].

mod expose;
mod placement;
mod proxy;
mod sandbox;
mod server;
mod status;
mod values;
mod warm_pool;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::api::networking::v1::NetworkPolicyEgressRule;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use expose::{
    ExposeSpec, GatewayParentRef, HttpRouteExpose, IngressExpose, InsecureEdgePolicy, RouteExpose,
};
pub use placement::PlacementSpec;
pub use proxy::{
    ProxySpec, ProxyTarget, ProxyTargetType, MAX_ALLOWLIST_DOMAINS, MAX_PROXY_REPLICAS,
    MAX_PROXY_TARGETS,
};
pub use sandbox::{CommandTimeout, SandboxSpec, DEFAULT_SANDBOX_REQUESTS};
pub use server::{
    AuthMode, AuthorizationSpec, ClientKind, ClientSubject, ServerContainerSpec, ServerSpec,
    MAX_ALLOWED_ORIGINS,
};
pub use status::{CliMcpInstanceStatus, SandboxStatus, WarmPoolStatus};
pub use values::{parse_duration, CrdError, ProxyPlan};
pub use warm_pool::{DemandBounds, WarmPoolBounds, WarmPoolSizing};

/// Longest idle timeout (7 days), in the Go duration syntax CEL understands.
pub const MAX_IDLE_TIMEOUT: &str = "168h";
/// Shortest idle timeout.
pub const MIN_IDLE_TIMEOUT: &str = "1m";
/// Most server replicas an instance may ask for.
pub const MAX_REPLICAS: i32 = 50;
/// Largest warm pool.
pub const MAX_WARM_POOL: i32 = 200;

/// A `CliMcpInstance` runs one MCP server (Deployment + Service) whose `bash` tool executes
/// commands in a sandbox pod dedicated to the caller's session, plus an optional warm pool of
/// ready sandboxes. The operator owns every object it creates; edit only this spec.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "cli-mcp.redhat.com",
    version = "v1alpha1",
    kind = "CliMcpInstance",
    plural = "climcpinstances",
    singular = "climcpinstance",
    shortname = "cmi",
    category = "cli-mcp",
    namespaced,
    status = "CliMcpInstanceStatus",
    derive = "PartialEq",
    doc = "A CliMcpInstance gives AI agents a persistent bash shell per session, over MCP, in sandbox pods of this namespace.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        description = "The Ready condition",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Replicas",
        type_ = "integer",
        description = "Ready MCP server replicas",
        json_path = ".status.readyReplicas"
    ),
    printcolumn(
        name = "Pool",
        type_ = "integer",
        description = "Ready warm sandboxes",
        json_path = ".status.warmPool.ready"
    ),
    printcolumn(
        name = "Sessions",
        type_ = "integer",
        description = "Sandboxes assigned to a session",
        json_path = ".status.activeSessions"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        priority = "1",
        description = "Reason of the Ready condition",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason"
    ),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        priority = "1",
        description = "MCP endpoint inside the cluster",
        json_path = ".status.endpoint"
    ),
    printcolumn(
        name = "Runtime",
        type_ = "string",
        priority = "1",
        description = "RuntimeClass the sandboxes run with (none: the nodes' default runtime)",
        json_path = ".status.sandbox.runtimeClassName"
    ),
    validation = Rule::new("size(self.metadata.name) <= 44").message(
        "metadata.name must be at most 44 characters so every derived object name (cli-mcp-<name>-kubeconfig) stays a valid 63-character DNS label; choose a shorter name"
    ),
    validation = Rule::new("self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message(
        "metadata.name must be a DNS-1123 label (lowercase letters, digits and '-', no dots) because it becomes part of pod, Service and Secret names"
    ),
    validation = Rule::new("!self.metadata.name.matches('-(proxy|sandbox|client|service)$')").message(
        "metadata.name must not end with -proxy, -sandbox, -client or -service: the instance's objects would share names with those of the instance named without it (cli-mcp-<n>-proxy is both instance <n>-proxy's server and instance <n>'s credential proxy); choose another name"
    ),
    validation = Rule::new(
        "!has(self.spec) || !has(self.spec.proxy) || self.spec.proxy.targets.all(t, !has(t.secretName) || !(t.secretName in ['cli-mcp-' + self.metadata.name + '-hmac', 'cli-mcp-' + self.metadata.name + '-tls', 'cli-mcp-' + self.metadata.name + '-service-tls', 'cli-mcp-' + self.metadata.name + '-proxy-ca']))"
    ).message(
        "spec.proxy.targets[].secretName must not name the instance's own HMAC, TLS or proxy CA Secret (the proxy would hold the key that forges session tokens); name the Secret holding the admin kubeconfig"
    ),
    validation = Rule::new(
        "!has(self.spec) || !has(self.spec.sandbox) || !has(self.spec.sandbox.kubeconfigSecret) || !(self.spec.sandbox.kubeconfigSecret in ['cli-mcp-' + self.metadata.name + '-hmac', 'cli-mcp-' + self.metadata.name + '-tls', 'cli-mcp-' + self.metadata.name + '-service-tls', 'cli-mcp-' + self.metadata.name + '-proxy-ca'])"
    ).message(
        "spec.sandbox.kubeconfigSecret must not name the instance's own HMAC, TLS or proxy CA Secret; name the Secret holding the admin kubeconfig"
    ),
    validation = Rule::new(
        "!has(self.spec) || !has(self.spec.proxy) || !has(self.spec.sandbox) || !has(self.spec.sandbox.env) || self.spec.sandbox.env.all(e, !(e.name in ['HTTPS_PROXY', 'https_proxy', 'HTTP_PROXY', 'http_proxy', 'NO_PROXY', 'no_proxy', 'ALL_PROXY', 'all_proxy', 'SSL_CERT_FILE', 'CURL_CA_BUNDLE', 'REQUESTS_CA_BUNDLE', 'NODE_EXTRA_CA_CERTS', 'GIT_SSL_CAINFO']))"
    ).message(
        "spec.sandbox.env: with spec.proxy, the proxy and CA variables (HTTPS_PROXY, HTTP_PROXY, NO_PROXY, ALL_PROXY in either case, SSL_CERT_FILE, CURL_CA_BUNDLE, REQUESTS_CA_BUNDLE, NODE_EXTRA_CA_CERTS, GIT_SSL_CAINFO) are set by the operator; remove them from env"
    ),
    validation = Rule::new(
        "!has(self.spec) || !has(self.spec.proxy) || !has(self.spec.sandbox) || !has(self.spec.sandbox.kubeconfigSecret)"
    ).message(
        "set either spec.proxy or the older spec.sandbox.kubeconfigSecret, not both; move the Secret name to spec.proxy.targets[{type: kubernetes, secretName: ...}]"
    ),
    validation = Rule::new(
        "!has(self.spec) || !has(self.spec.sandbox) || !has(self.spec.sandbox.warmPool) || !has(self.spec.sandbox.warmPoolSize) || self.spec.sandbox.warmPoolSize == 0"
    ).message(
        "set either spec.sandbox.warmPoolSize (a fixed warm pool) or spec.sandbox.warmPool (bounds the operator sizes the pool within by demand), not both"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct CliMcpInstanceSpec {
    /// Number of MCP server replicas (1..50). Any replica serves any session, so scale freely
    /// (`kubectl scale cmi/<name> --replicas=N` works through the scale subresource).
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 1, max = 50))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 50").message(
        "spec.replicas must be between 1 and 50; to stop serving, delete the CliMcpInstance instead of scaling to 0"
    ))]
    pub replicas: i32,

    /// Sandbox pods: image, idle collection, warm pool, resources, environment and the
    /// kubeconfig the implied credential proxy holds.
    #[serde(default)]
    pub sandbox: SandboxSpec,

    /// The MCP server Deployment.
    #[serde(default)]
    pub server: ServerSpec,

    /// The NetworkPolicy that confines sandbox pods.
    #[serde(default)]
    pub network_policy: NetworkPolicySpec,

    /// The credential proxy between the sandboxes and every API they may call. The
    /// sandboxes never hold a real credential: they get a kubeconfig with a placeholder token
    /// and `HTTPS_PROXY` pointing at the proxy, which alone mounts the admin's kubeconfig and
    /// injects its token. Absent: the instance still gets a proxy, with one kubernetes target
    /// holding `spec.sandbox.kubeconfigSecret` (default `cli-mcp-<name>-kubeconfig`) and the
    /// defaults below.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxySpec>,

    /// Deprecated: the Go operator's name for the server container's settings, accepted so
    /// its CRs apply unchanged. Each field set here wins over the same field of
    /// `spec.server` while it is present; move them to `spec.server.resources` and
    /// `spec.server.imagePullPolicy`, then remove this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_container: Option<ServerContainerSpec>,
}

fn default_replicas() -> i32 {
    1
}

/// Image pull policy of a container.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum PullPolicy {
    Always,
    IfNotPresent,
    Never,
}

impl PullPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            PullPolicy::Always => "Always",
            PullPolicy::IfNotPresent => "IfNotPresent",
            PullPolicy::Never => "Never",
        }
    }
}

/// Compute resources with these requests and limits (the defaults of each part's pods).
fn resources(req_cpu: &str, req_mem: &str, lim_cpu: &str, lim_mem: &str) -> ResourceRequirements {
    let q = |s: &str| Quantity(s.to_owned());
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), q(req_cpu)),
            ("memory".to_owned(), q(req_mem)),
        ])),
        limits: Some(BTreeMap::from([
            ("cpu".to_owned(), q(lim_cpu)),
            ("memory".to_owned(), q(lim_mem)),
        ])),
        ..Default::default()
    }
}

/// NetworkPolicy of the sandbox pods. Ingress is allowed only from this instance's server
/// pods on the agent port; egress only to cluster DNS and the Kubernetes API server, plus
/// `extraEgress`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicySpec {
    /// Egress rules added to the defaults (standard NetworkPolicy egress rules: `to` peers
    /// and `ports`), e.g. an internal registry or a proxy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub extra_egress: Vec<NetworkPolicyEgressRule>,
    /// Whether sandboxes may query the cluster's DNS (default `Allowed`). `Denied`: they
    /// reach their credential proxy by its Service's ClusterIP, the proxy resolves the names
    /// it connects to, and nothing can leave a sandbox through the cluster's resolver.
    #[serde(default, skip_serializing_if = "SandboxDns::is_allowed")]
    pub dns: SandboxDns,
}

/// `spec.networkPolicy.dns`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum SandboxDns {
    #[default]
    Allowed,
    Denied,
}

impl SandboxDns {
    pub fn is_allowed(&self) -> bool {
        *self == SandboxDns::Allowed
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kube::CustomResourceExt;
    use std::time::Duration;

    /// A CR named `demo` in `ns1` with this spec, as read from the API server.
    pub(crate) fn cr(yaml_spec: serde_json::Value) -> CliMcpInstance {
        let mut o: CliMcpInstance = serde_json::from_value(serde_json::json!({
            "apiVersion": "cli-mcp.redhat.com/v1alpha1",
            "kind": "CliMcpInstance",
            "metadata": {"name": "demo", "namespace": "ns1", "uid": "u-1"},
            "spec": yaml_spec,
        }))
        .expect("valid CR");
        o.metadata.generation = Some(1);
        o
    }

    #[test]
    fn defaults_match_the_documented_ones() {
        let o = cr(serde_json::json!({}));
        assert_eq!(o.spec.replicas, 1);
        assert_eq!(o.spec.sandbox.idle_timeout, "30m");
        assert_eq!(o.spec.sandbox.warm_pool_size, 0);
        assert_eq!(o.spec.sandbox.max_sessions, 100);
        assert_eq!(o.spec.server.auth, AuthMode::Kubernetes);
        assert_eq!(o.spec.sandbox, SandboxSpec::default());
        assert_eq!(o.spec.server, ServerSpec::default());
        assert_eq!(
            o.spec.sandbox.idle_timeout().expect("valid"),
            Duration::from_secs(1800)
        );
        assert_eq!(o.spec.sandbox.command_timeouts().expect("valid"), (60, 300));
    }

    #[test]
    fn crd_has_names_subresources_columns_and_rules() {
        let crd = serde_json::to_value(CliMcpInstance::crd()).expect("json");
        let spec = &crd["spec"];
        assert_eq!(spec["names"]["shortNames"][0], "cmi");
        assert_eq!(spec["names"]["categories"][0], "cli-mcp");
        let v = &spec["versions"][0];
        assert_eq!(
            v["subresources"]["scale"]["specReplicasPath"],
            ".spec.replicas"
        );
        assert!(v["subresources"]["status"].is_object());
        let cols: Vec<_> = v["additionalPrinterColumns"]
            .as_array()
            .expect("columns")
            .iter()
            .map(|c| c["name"].as_str().unwrap_or_default().to_owned())
            .collect();
        for c in ["Ready", "Replicas", "Pool", "Sessions", "Age"] {
            assert!(cols.contains(&c.to_owned()), "{c} in {cols:?}");
        }
        let text = crd.to_string();
        for needle in [
            "spec.sandbox.idleTimeout must be a duration",
            "secretKeyRef is not allowed",
            "at most 44 characters",
            "IfNotPresent",
        ] {
            assert!(text.contains(needle), "CRD lacks {needle}");
        }
        let props = &v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
        assert_eq!(props["replicas"]["maximum"], 50.0);
        assert_eq!(
            props["sandbox"]["properties"]["warmPoolSize"]["maximum"],
            200.0
        );
    }
}
