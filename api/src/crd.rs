//! The `CliMcpInstance` custom resource and the pure mapping from a CR to the
//! [`SandboxConfig`](crate::sandbox::SandboxConfig) both pod writers use.
//!
//! This file holds the spec types with their defaults and admission rules; the status types
//! are in `crd/status.rs`, and what an admitted spec means as values (durations, Secret
//! names, the `SandboxConfig`) in `crd/values.rs`.
//!
//! Every bound, enum and CEL rule here ends up in the generated CRD (`config/crd/`), so a bad
//! CR is rejected by `kubectl apply` with a message that says what to fix — it never reaches
//! the operator or crash-loops a pod. The operator and the server agree on the sandbox pod
//! because both get it from [`CliMcpInstance::sandbox_config`].

mod status;
mod values;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, LocalObjectReference, ResourceRequirements, Toleration,
};
use k8s_openapi::api::networking::v1::NetworkPolicyEgressRule;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[cfg(test)]
use crate::sandbox::{RESERVED_ENV, RESERVED_ENV_PREFIXES};

pub use status::{CliMcpInstanceStatus, WarmPoolStatus};
pub use values::{parse_duration, CrdError, ProxyPlan};

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
    validation = Rule::new("size(self.metadata.name) <= 44").message(
        "metadata.name must be at most 44 characters so every derived object name (cli-mcp-<name>-kubeconfig) stays a valid 63-character DNS label; choose a shorter name"
    ),
    validation = Rule::new("self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message(
        "metadata.name must be a DNS-1123 label (lowercase letters, digits and '-', no dots) because it becomes part of pod, Service and Secret names"
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

/// The Go operator's `spec.serverContainer`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServerContainerSpec {
    /// Compute resources of the server container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("!has(self.claims)").message(
        "spec.serverContainer.resources.claims is not supported; use requests and limits"
    ))]
    pub resources: Option<ResourceRequirements>,

    /// Image pull policy of the server container (Always, IfNotPresent or Never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<PullPolicy>,
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

/// How MCP clients authenticate to the server.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
pub enum AuthMode {
    /// TLS on :8443; bearer tokens checked with TokenReview and SubjectAccessReview on
    /// `climcpinstances/mcp` (verbs create, delete, get) for this instance.
    #[default]
    Kubernetes,
    /// Plain HTTP on :8080 and no authentication: only for trusted, isolated namespaces.
    None,
}

impl AuthMode {
    /// The value of the server's `--auth` flag.
    pub fn flag(self) -> &'static str {
        match self {
            AuthMode::Kubernetes => "kubernetes",
            AuthMode::None => "none",
        }
    }
}

/// The CEL rules of the placement fields `spec.sandbox` and `spec.server` share, each naming
/// the field it guards so the API server's refusal says what to fix.
mod placement_rules {
    use kube::core::{Message, Rule};

    /// A DNS-1123 subdomain, as a regular expression inside a single-quoted CEL string.
    const DNS_SUBDOMAIN: &str =
        "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";

    fn rule(cel: String, message: String) -> Rule {
        Rule::new(cel).message(Message::Message(message))
    }

    pub fn class_name(field: &str, kind: &str, plural: &str) -> Rule {
        rule(
            format!("self.matches('{DNS_SUBDOMAIN}')"),
            format!(
                "{field} must be the name of a {kind}: a DNS-1123 subdomain (lowercase letters, digits, '-' and '.'); kubectl get {plural} lists them"
            ),
        )
    }

    pub fn label_keys(field: &str) -> Rule {
        rule(
            "self.all(k, size(k) <= 317 && k.matches('^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$'))".into(),
            format!(
                "{field}: each key is a node label key such as kubernetes.io/arch: an optional DNS subdomain and '/', then at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit"
            ),
        )
    }

    pub fn label_values(field: &str) -> Rule {
        rule(
            "self.all(k, self[k].matches('^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$'))".into(),
            format!(
                "{field}: each value is a label value: at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit (or empty)"
            ),
        )
    }

    pub fn toleration_operator(field: &str) -> Rule {
        rule(
            "self.all(t, !has(t.operator) || t.operator in ['Exists', 'Equal', 'Lt', 'Gt'])".into(),
            format!("{field}[].operator must be Exists, Equal (the default), Lt or Gt"),
        )
    }

    pub fn toleration_effect(field: &str) -> Rule {
        rule(
            "self.all(t, !has(t.effect) || t.effect in ['', 'NoSchedule', 'PreferNoSchedule', 'NoExecute'])".into(),
            format!("{field}[].effect must be NoSchedule, PreferNoSchedule or NoExecute (or absent for every effect)"),
        )
    }

    pub fn toleration_exists(field: &str) -> Rule {
        rule(
            "self.all(t, !has(t.operator) || t.operator != 'Exists' || !has(t.value) || t.value == '')".into(),
            format!("{field}[]: operator Exists matches every value of the key; remove value, or use operator Equal"),
        )
    }

    pub fn toleration_keyless(field: &str) -> Rule {
        rule(
            "self.all(t, (has(t.key) && t.key != '') || (has(t.operator) && t.operator == 'Exists'))".into(),
            format!("{field}[]: a toleration without key needs operator Exists (it then tolerates every taint); set key, or operator: Exists"),
        )
    }

    pub fn toleration_seconds(field: &str) -> Rule {
        rule(
            "self.all(t, !has(t.tolerationSeconds) || (has(t.effect) && t.effect == 'NoExecute'))".into(),
            format!("{field}[].tolerationSeconds applies only to effect NoExecute; set effect: NoExecute or remove tolerationSeconds"),
        )
    }

    pub fn pull_secrets(field: &str) -> Rule {
        rule(
            format!("self.all(s, s.name.matches('{DNS_SUBDOMAIN}'))"),
            format!(
                "{field}: each entry is {{name: <Secret>}}, naming a Secret of type kubernetes.io/dockerconfigjson in the instance's namespace (a DNS-1123 subdomain, not empty)"
            ),
        )
    }
}

/// Sandbox pods of this instance.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SandboxSpec {
    /// Sandbox image (the agent plus bash, kubectl, jq, curl). Defaults to the operator's
    /// RELATED_IMAGE_SANDBOX. Changing it replaces unassigned warm pods; live sessions keep
    /// their pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub image: Option<String>,

    /// An assigned sandbox whose last activity is older than this is deleted (activity is
    /// stamped at most every sixtieth of it, 2s to 60s, so the deletion comes up to that
    /// much plus a second later). A Go-style duration (`90s`, `30m`, `1h30m`) between 1m
    /// and 168h (7 days).
    #[serde(default = "default_idle_timeout")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = Rule::new(
        "self.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$') && duration(self) >= duration('1m') && duration(self) <= duration('168h')"
    ).message(
        "spec.sandbox.idleTimeout must be a duration such as 90s, 30m or 2h (units h, m, s) between 1m and 168h (7 days)"
    ))]
    pub idle_timeout: String,

    /// Unassigned, Ready sandboxes kept waiting so a new session starts without a pod start
    /// (0..200).
    #[serde(default)]
    #[schemars(range(min = 0, max = 200))]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 200").message(
        "spec.sandbox.warmPoolSize must be between 0 and 200; each warm sandbox is a running pod"
    ))]
    pub warm_pool_size: i32,

    /// Compute resources of each sandbox container. Default: requests cpu 100m / memory
    /// 128Mi, limits cpu 500m / memory 512Mi.
    #[serde(default = "default_sandbox_resources")]
    #[x_kube(
        validation = Rule::new("!has(self.claims)").message(
            "spec.sandbox.resources.claims is not supported; use requests and limits"
        ),
        validation = Rule::new(
            "!has(self.requests) || !has(self.limits) || !('cpu' in self.requests) || !('cpu' in self.limits) || quantity(self.requests['cpu']).compareTo(quantity(self.limits['cpu'])) <= 0"
        ).message("spec.sandbox.resources: requests.cpu must not exceed limits.cpu"),
        validation = Rule::new(
            "!has(self.requests) || !has(self.limits) || !('memory' in self.requests) || !('memory' in self.limits) || quantity(self.requests['memory']).compareTo(quantity(self.limits['memory'])) <= 0"
        ).message("spec.sandbox.resources: requests.memory must not exceed limits.memory")
    )]
    pub resources: ResourceRequirements,

    /// Extra environment of the sandbox shell. `valueFrom.secretKeyRef` is rejected (Secrets
    /// must not reach bash through the CR); KUBECONFIG, HOME, POD_NAME, POD_NAMESPACE,
    /// TOKEN_SHA256 and ASSIGN_SHA256 are set by the operator and cannot be overridden;
    /// SHELLOPTS, BASHOPTS, BASH_ENV, ENV, PROMPT_COMMAND and names starting with
    /// CLI_MCP_AGENT_ or BASH_FUNC_ would change how the sandbox's bash and agent work.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[x_kube(
        validation = Rule::new(
            "self.all(e, !has(e.valueFrom) || !has(e.valueFrom.secretKeyRef))"
        ).message(
            "spec.sandbox.env: valueFrom.secretKeyRef is not allowed, because Secrets must not reach the sandbox shell through the CR; put credentials in the kubeconfig Secret or remove the variable"
        ),
        validation = Rule::new(
            "self.all(e, !(e.name in ['KUBECONFIG', 'HOME', 'POD_NAME', 'POD_NAMESPACE', 'TOKEN_SHA256', 'ASSIGN_SHA256', 'SHELLOPTS', 'BASHOPTS', 'BASH_ENV', 'ENV', 'PROMPT_COMMAND']))"
        ).message(
            "spec.sandbox.env: KUBECONFIG, HOME, POD_NAME, POD_NAMESPACE, TOKEN_SHA256 and ASSIGN_SHA256 are set by the operator, and SHELLOPTS, BASHOPTS, BASH_ENV, ENV and PROMPT_COMMAND would change the sandbox shell; remove them from env"
        ),
        validation = Rule::new(
            "self.all(e, !e.name.startsWith('CLI_MCP_AGENT_') && !e.name.startsWith('BASH_FUNC_'))"
        ).message(
            "spec.sandbox.env: names starting with CLI_MCP_AGENT_ (the agent's own settings) or BASH_FUNC_ (exported bash functions) are not allowed; rename the variable"
        )
    )]
    pub env: Vec<EnvVar>,

    /// Image pull policy of sandbox pods (Always, IfNotPresent or Never). Default: the
    /// Kubernetes default for the image's tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<PullPolicy>,

    /// Without `spec.proxy`: the kubeconfig the implied credential proxy holds (key
    /// `kubeconfig`; token users, https servers; default `cli-mcp-<name>-kubeconfig`). It is
    /// never mounted into a sandbox: the sandbox gets a kubeconfig with a placeholder token
    /// and reaches the API servers through the proxy, which injects this token. Its RBAC
    /// decides what the shell may do; see config/samples for a read-only recipe. Kept for
    /// CRs of the Go operator; `spec.proxy.targets[{type: kubernetes, secretName}]` says the
    /// same and allows more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(
        "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')"
    ).message("spec.sandbox.kubeconfigSecret must be the name of a Secret (a DNS-1123 subdomain)"))]
    pub kubeconfig_secret: Option<String>,

    /// Most sessions (assigned sandboxes) the server serves at once; past it new sessions get
    /// a clear error (1..10000).
    #[serde(default = "default_max_sessions")]
    #[schemars(range(min = 1, max = 10000))]
    pub max_sessions: i32,

    /// Per-command timeouts of the bash tool.
    #[serde(default)]
    pub command_timeout: CommandTimeout,

    /// Bytes of stdout and of stderr returned per command (head and tail are kept, the rest is
    /// spilled to a file in the sandbox). 1024..16777216, default 65536.
    #[serde(default = "default_output_budget")]
    #[schemars(range(min = 1024, max = 16777216))]
    pub output_budget_bytes: i64,

    /// RuntimeClass of sandbox pods (`runtimeClassName`), such as `gvisor` or `kata`: a stronger boundary around untrusted commands than the default runtime. The
    /// RuntimeClass must exist (`kubectl get runtimeclass`), else the pods are refused.
    /// Default: the node's default runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = placement_rules::class_name("spec.sandbox.runtimeClassName", "RuntimeClass", "runtimeclass"))]
    pub runtime_class_name: Option<String>,

    /// Node labels sandbox pods must run on (`nodeSelector`), such as
    /// `kubernetes.io/arch: amd64`. At most 32.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    #[x_kube(
        validation = placement_rules::label_keys("spec.sandbox.nodeSelector"),
        validation = placement_rules::label_values("spec.sandbox.nodeSelector")
    )]
    pub node_selector: BTreeMap<String, String>,

    /// Taints sandbox pods tolerate (standard pod `tolerations`). At most 32.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[x_kube(
        validation = placement_rules::toleration_operator("spec.sandbox.tolerations"),
        validation = placement_rules::toleration_effect("spec.sandbox.tolerations"),
        validation = placement_rules::toleration_exists("spec.sandbox.tolerations"),
        validation = placement_rules::toleration_keyless("spec.sandbox.tolerations"),
        validation = placement_rules::toleration_seconds("spec.sandbox.tolerations")
    )]
    pub tolerations: Vec<Toleration>,

    /// Node affinity and pod (anti-)affinity of sandbox pods (standard pod `affinity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,

    /// PriorityClass of sandbox pods (`priorityClassName`), so sandboxes preempt or yield to other workloads as the cluster decides. It must exist
    /// (`kubectl get priorityclass`), else the pods are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = placement_rules::class_name("spec.sandbox.priorityClassName", "PriorityClass", "priorityclass"))]
    pub priority_class_name: Option<String>,

    /// Secrets (type kubernetes.io/dockerconfigjson, in the instance's namespace) the
    /// kubelet pulls the image of sandbox pods with (`imagePullSecrets`). At most 16.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    // The item schema is LocalObjectReference's with the name bounded: CEL's cost estimate
    // of an unbounded name does not fit the CRD's budget.
    #[schemars(
        length(max = 16),
        extend("items" = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}}})
    )]
    #[x_kube(validation = placement_rules::pull_secrets("spec.sandbox.imagePullSecrets"))]
    pub image_pull_secrets: Vec<LocalObjectReference>,
}

fn default_idle_timeout() -> String {
    "30m".into()
}
fn default_max_sessions() -> i32 {
    100
}
fn default_output_budget() -> i64 {
    65536
}

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

fn default_sandbox_resources() -> ResourceRequirements {
    resources("100m", "128Mi", "500m", "512Mi")
}

fn default_server_resources() -> ResourceRequirements {
    resources("50m", "64Mi", "1", "256Mi")
}

impl Default for SandboxSpec {
    fn default() -> Self {
        Self {
            image: None,
            idle_timeout: default_idle_timeout(),
            warm_pool_size: 0,
            resources: default_sandbox_resources(),
            env: Vec::new(),
            image_pull_policy: None,
            kubeconfig_secret: None,
            max_sessions: default_max_sessions(),
            command_timeout: CommandTimeout::default(),
            output_budget_bytes: default_output_budget(),
            runtime_class_name: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            affinity: None,
            priority_class_name: None,
            image_pull_secrets: Vec::new(),
        }
    }
}

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

fn default_proxy_replicas() -> i32 {
    2
}

fn default_proxy_resources() -> ResourceRequirements {
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

/// Timeouts of one bash command, as Go-style durations between 1s and 300s.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "!self.default.matches('^([0-9]+(ms|s|m))+$') || !self.max.matches('^([0-9]+(ms|s|m))+$') || duration(self.default) <= duration(self.max)"
).message("spec.sandbox.commandTimeout.default must not exceed commandTimeout.max"))]
pub struct CommandTimeout {
    /// Timeout of a command whose caller gives none (default 60s).
    #[serde(default = "default_command_timeout")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new(
        "self.matches('^([0-9]+(ms|s|m))+$') && duration(self) >= duration('1s') && duration(self) <= duration('300s')"
    ).message("spec.sandbox.commandTimeout.default must be a duration such as 60s or 2m between 1s and 300s"))]
    pub default: String,
    /// Longest timeout a caller may ask for (default 300s).
    #[serde(default = "default_command_max")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new(
        "self.matches('^([0-9]+(ms|s|m))+$') && duration(self) >= duration('1s') && duration(self) <= duration('300s')"
    ).message("spec.sandbox.commandTimeout.max must be a duration such as 300s or 5m between 1s and 300s"))]
    pub max: String,
}

fn default_command_timeout() -> String {
    "60s".into()
}
fn default_command_max() -> String {
    "300s".into()
}

impl Default for CommandTimeout {
    fn default() -> Self {
        Self {
            default: default_command_timeout(),
            max: default_command_max(),
        }
    }
}

/// Most entries of `spec.server.allowedOrigins`.
pub const MAX_ALLOWED_ORIGINS: usize = 16;

/// What the server's `--allowed-origin` accepts, or less: `scheme://host[:port]` with scheme
/// http or https in any case, a host of DNS name characters or a bracketed IPv6 address, a
/// port number or `*`. No comma may pass: the server splits its values on commas.
const ALLOWED_ORIGIN_RULE: &str = r"self.all(o, o.matches('^(?i:https?)://(\\[[0-9A-Fa-f:.]+\\]|[A-Za-z0-9._-]+)(:(\\*|6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4}))?$'))";

/// The MCP server Deployment.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.authorization) || !has(self.auth) || self.auth == 'Kubernetes'").message(
        "spec.server.authorization needs auth: Kubernetes (with auth None the server checks no token); remove authorization or set auth: Kubernetes"
    ),
    validation = Rule::new("!has(self.expose) || !has(self.auth) || self.auth == 'Kubernetes'").message(
        "spec.server.expose needs auth: Kubernetes: an endpoint without authentication must not be published outside the cluster"
    ),
    validation = Rule::new(
        "!has(self.authorization) || has(self.authorization.resourceUrl) || (has(self.authorization.audiences) && size(self.authorization.audiences) > 0) || has(self.expose)"
    ).message(
        "spec.server.authorization needs resourceUrl (the public https URL of /mcp, such as https://mcp.example.com/mcp), audiences, or spec.server.expose (its host gives https://<host>/mcp): an authorization server's token is accepted only when its aud names this server"
    )
)]
pub struct ServerSpec {
    /// Compute resources of the server container. Default: requests cpu 50m / memory 64Mi,
    /// limits cpu 1 / memory 256Mi.
    #[serde(default = "default_server_resources")]
    #[x_kube(validation = Rule::new("!has(self.claims)").message(
        "spec.server.resources.claims is not supported; use requests and limits"
    ))]
    pub resources: ResourceRequirements,

    /// Image pull policy of the server container (Always, IfNotPresent or Never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<PullPolicy>,

    /// Client authentication: `Kubernetes` (TLS, TokenReview + SubjectAccessReview on
    /// `climcpinstances/mcp`) or `None` (plain HTTP, no auth; trusted namespaces only).
    #[serde(default)]
    pub auth: AuthMode,

    /// Secret of type kubernetes.io/tls (keys tls.crt, tls.key) with the serving certificate.
    /// When absent the operator generates a CA and a serving certificate once into
    /// `cli-mcp-<name>-tls` and publishes the CA in ConfigMap `cli-mcp-<name>-ca`; on
    /// OpenShift the service CA issues it into `cli-mcp-<name>-service-tls` instead, and
    /// that ConfigMap carries the service CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(
        "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')"
    ).message("spec.server.tlsSecretName must be the name of a Secret (a DNS-1123 subdomain)"))]
    pub tls_secret_name: Option<String>,

    /// Text for the MCP clients' models, sent after the server's own instructions in the
    /// MCP `initialize` (and `server/discover`) result: what the sandbox has and is for, e.g.
    /// "kubectl with context prod-readonly (read-only), oc, jq, yq; investigate, never
    /// change". At most 8192 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 8192))]
    pub instructions: Option<String>,

    /// Most sessions one client identity (a Kubernetes username) may hold at once, counted
    /// exactly across every server replica; past it that client's new sessions get a clear
    /// error. Default: half of `spec.sandbox.maxSessions` (rounded up), so one identity
    /// cannot take every place; with `auth: None` (every caller anonymous) no default
    /// (1..10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub max_sessions_per_client: Option<i32>,

    /// Most new sessions one client identity may start per minute on each server replica (a
    /// burst of this many, then one every 60/N seconds); past it the error says when to
    /// retry. Default: no rate limit (1..10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub new_sessions_per_minute_per_client: Option<i32>,

    /// Who may use the MCP endpoint besides the instance's own client ServiceAccount
    /// `cli-mcp-<name>-client`: users, groups and ServiceAccounts bound by the operator to
    /// the instance's client Role (verbs create, get, delete on `climcpinstances/mcp` for
    /// this instance only). At most 64.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub clients: Vec<ClientSubject>,

    /// Browser origins whose web pages may call the MCP endpoint (0..16), each
    /// `scheme://host[:port]`: scheme http or https, a DNS name, IPv4 address or `[IPv6]`
    /// address, and optionally a port (a number up to 65535, or `*` for any port; default 80
    /// for http, 443 for https), such as `https://app.example.com` or `http://localhost:*`. The server answers their
    /// CORS preflights and lets their requests through its Origin check; a request with any
    /// other Origin gets 403, one without Origin (every non-browser client) is not affected.
    /// Authentication still applies to every request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(min = 8, max = 512)))]
    #[x_kube(
        merge_strategy = ListMerge::Set,
        validation = Rule::new(ALLOWED_ORIGIN_RULE).message(
            "spec.server.allowedOrigins: each entry is a browser origin scheme://host[:port], such as https://app.example.com or http://localhost:3000: scheme http or https, a DNS name, IPv4 or [IPv6] address, an optional port (a number up to 65535, or * for any); no path, trailing slash, query, user@, spaces or commas"
        )
    )]
    pub allowed_origins: Vec<String>,

    /// MCP authorization: OAuth authorization servers whose tokens the server accepts (the
    /// API server must trust each as a JWT issuer) and what the server advertises to MCP
    /// clients in its protected resource metadata. Needs `auth: Kubernetes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authorization: Option<AuthorizationSpec>,

    /// Publishes the MCP endpoint outside the cluster through an Ingress, a Gateway API
    /// HTTPRoute or an OpenShift Route named `cli-mcp-<name>`. TLS stays end to end: the
    /// server serves TLS itself, so the Ingress controller, Gateway or router must
    /// re-encrypt to it (see docs/operations.md).
    /// Needs `auth: Kubernetes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expose: Option<ExposeSpec>,

    /// RuntimeClass of the server pods (`runtimeClassName`), such as `gvisor` or `kata` (the server runs no untrusted code; this is for clusters that require one). The
    /// RuntimeClass must exist (`kubectl get runtimeclass`), else the pods are refused.
    /// Default: the node's default runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = placement_rules::class_name("spec.server.runtimeClassName", "RuntimeClass", "runtimeclass"))]
    pub runtime_class_name: Option<String>,

    /// Node labels the server pods must run on (`nodeSelector`), such as
    /// `kubernetes.io/arch: amd64`. At most 32.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    #[x_kube(
        validation = placement_rules::label_keys("spec.server.nodeSelector"),
        validation = placement_rules::label_values("spec.server.nodeSelector")
    )]
    pub node_selector: BTreeMap<String, String>,

    /// Taints the server pods tolerate (standard pod `tolerations`). At most 32.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[x_kube(
        validation = placement_rules::toleration_operator("spec.server.tolerations"),
        validation = placement_rules::toleration_effect("spec.server.tolerations"),
        validation = placement_rules::toleration_exists("spec.server.tolerations"),
        validation = placement_rules::toleration_keyless("spec.server.tolerations"),
        validation = placement_rules::toleration_seconds("spec.server.tolerations")
    )]
    pub tolerations: Vec<Toleration>,

    /// Node affinity and pod (anti-)affinity of the server pods (standard pod `affinity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,

    /// PriorityClass of the server pods (`priorityClassName`). It must exist
    /// (`kubectl get priorityclass`), else the pods are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = placement_rules::class_name("spec.server.priorityClassName", "PriorityClass", "priorityclass"))]
    pub priority_class_name: Option<String>,

    /// Secrets (type kubernetes.io/dockerconfigjson, in the instance's namespace) the
    /// kubelet pulls the image of the server pods with (`imagePullSecrets`). At most 16.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    // The item schema is LocalObjectReference's with the name bounded: CEL's cost estimate
    // of an unbounded name does not fit the CRD's budget.
    #[schemars(
        length(max = 16),
        extend("items" = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}}})
    )]
    #[x_kube(validation = placement_rules::pull_secrets("spec.server.imagePullSecrets"))]
    pub image_pull_secrets: Vec<LocalObjectReference>,
}

/// OAuth authorization servers and the metadata MCP clients discover after a 401.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AuthorizationSpec {
    /// Issuer URLs (1..8) of the authorization servers, listed in the protected resource
    /// metadata. Each must equal, byte for byte, the `jwt[].issuer.url` of the API server's
    /// AuthenticationConfiguration (a trailing slash counts), because tokens are matched by
    /// their `iss`.
    #[schemars(length(min = 1, max = 8), inner(length(min = 9, max = 512)))]
    #[x_kube(
        merge_strategy = ListMerge::Set,
        validation = Rule::new(
            "self.all(s, s.matches('^https://[^/?#@\\\\s,]+(/[^?#\\\\s,]*)?$') && isURL(s) && url(s).getHostname() != '')"
        ).message(
            "spec.server.authorization.servers: each entry is an issuer URL such as https://idp.example.com/realms/dev: https, a host, no user@, query (?), fragment (#), spaces or commas; it must equal the API server's jwt[].issuer.url exactly"
        )
    )]
    pub servers: Vec<String>,

    /// The public https URL of the MCP endpoint (for example https://mcp.example.com/mcp),
    /// without fragment: the `resource` of the protected resource metadata, and the audience
    /// an authorization server's token must name. Default with `spec.server.expose`:
    /// `https://<host>/mcp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 9, max = 512))]
    #[x_kube(validation = Rule::new(
        "self.matches('^https://[^/?#@\\\\s]+([/?][^#\\\\s]*)?$') && isURL(self) && url(self).getHostname() != ''"
    ).message(
        "spec.server.authorization.resourceUrl must be the public https URL of /mcp, such as https://mcp.example.com/mcp: https, a host, no user@, fragment (#) or spaces"
    ))]
    pub resource_url: Option<String>,

    /// Further audiences (0..8) an authorization server's token may name instead of
    /// `resourceUrl`. They are also sent as `spec.audiences` of the TokenReview of every
    /// Kubernetes token, so ServiceAccount tokens must then be created with one of them
    /// (`kubectl create token <sa> --audience <aud>`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), inner(length(min = 1, max = 512)))]
    #[x_kube(
        merge_strategy = ListMerge::Set,
        validation = Rule::new("self.all(a, a.matches('^[^,\\\\s]+$'))").message(
            "spec.server.authorization.audiences: each entry is one audience, without spaces or commas"
        )
    )]
    pub audiences: Vec<String>,

    /// Scopes (0..16) MCP clients ask the authorization server for (`scopes_supported` of
    /// the metadata). Advertised only: access is decided by RBAC on `climcpinstances/mcp`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(min = 1, max = 128)))]
    #[x_kube(
        merge_strategy = ListMerge::Set,
        validation = Rule::new("self.all(s, s.matches('^[\\\\x21\\\\x23-\\\\x2b\\\\x2d-\\\\x5b\\\\x5d-\\\\x7e]+$'))").message(
            "spec.server.authorization.scopes: each entry is an OAuth scope: visible ASCII without spaces, quotes, backslashes or commas"
        )
    )]
    pub scopes: Vec<String>,
}

/// How the MCP endpoint is published outside the cluster: exactly one of `ingress`,
/// `httpRoute` and `route`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.ingress) || has(self.httpRoute) || has(self.route)").message(
        "spec.server.expose needs ingress, httpRoute or route; remove expose to keep the endpoint inside the cluster"
    ),
    validation = Rule::new("!(has(self.ingress) && has(self.httpRoute))").message(
        "spec.server.expose: set either ingress or httpRoute, not both"
    ),
    validation = Rule::new("!has(self.route) || !(has(self.ingress) || has(self.httpRoute))").message(
        "spec.server.expose: set route alone, without ingress or httpRoute (one object publishes the endpoint)"
    )
)]
pub struct ExposeSpec {
    /// A `networking.k8s.io/v1` Ingress to the server's Service (port https).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress: Option<IngressExpose>,
    /// A Gateway API `gateway.networking.k8s.io/v1` HTTPRoute to the server's Service (port
    /// https); the Gateway needs a BackendTLSPolicy to reach it (see docs/operations.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_route: Option<HttpRouteExpose>,
    /// An OpenShift `route.openshift.io/v1` Route to the server's Service (port https),
    /// re-encrypting to the server. Its host, given or assigned by the router, is published
    /// in `status.externalEndpoint`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<RouteExpose>,
}

impl ExposeSpec {
    /// The public host name as the spec gives it, whichever object publishes it (a Route
    /// without `host` gets one from the router: `None` here).
    pub fn host(&self) -> Option<&str> {
        self.ingress
            .as_ref()
            .map(|i| i.host.as_str())
            .or_else(|| self.http_route.as_ref().map(|r| r.host.as_str()))
            .or_else(|| self.route.as_ref().and_then(|r| r.host.as_deref()))
    }
}

/// The OpenShift Route that publishes the endpoint.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RouteExpose {
    /// Public DNS name of the endpoint (no wildcard). Default: the name the cluster's
    /// router assigns (`cli-mcp-<name>-<namespace>.<apps domain>`). Changing it later
    /// needs `update` on `routes/custom-host`, which the operator's RBAC holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(
        "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')"
    ).message("spec.server.expose.route.host must be a lowercase DNS name such as mcp.apps.example.com (no wildcard, port or scheme); leave it out to get the router's default"))]
    pub host: Option<String>,
    /// What the router does with plain HTTP to the host: `Redirect` (to HTTPS, the
    /// default) or `None` (refused).
    #[serde(default)]
    pub insecure_edge_termination_policy: InsecureEdgePolicy,
    /// Annotations of the Route, over the operator's `haproxy.router.openshift.io/timeout`
    /// (the longest command timeout plus a margin, so a long command's answer is not cut at
    /// the router's default 30 s). At most 32.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32))]
    pub annotations: BTreeMap<String, String>,
}

/// A Route's `tls.insecureEdgeTerminationPolicy`. `Allow` is not offered: bearer tokens
/// must not cross the edge in clear text.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
pub enum InsecureEdgePolicy {
    #[default]
    Redirect,
    None,
}

impl InsecureEdgePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            InsecureEdgePolicy::Redirect => "Redirect",
            InsecureEdgePolicy::None => "None",
        }
    }
}

/// The Ingress that publishes the endpoint.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct IngressExpose {
    /// Public DNS name of the endpoint (no wildcard): the Ingress rule's host, a name of the
    /// generated serving certificate, and the default `resourceUrl` (`https://<host>/mcp`).
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(
        "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')"
    ).message("spec.server.expose.ingress.host must be a lowercase DNS name such as mcp.example.com (no wildcard, port or scheme)"))]
    pub host: String,
    /// The IngressClass (`spec.ingressClassName`). Default: the cluster's default class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub class_name: Option<String>,
    /// Secret (kubernetes.io/tls) with the certificate the Ingress controller presents to
    /// clients for `host`. Default: the controller's default certificate. The host is listed
    /// under the Ingress's `tls` either way, so controllers redirect plain HTTP to HTTPS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(
        "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')"
    ).message("spec.server.expose.ingress.tlsSecretName must be the name of a Secret (a DNS-1123 subdomain)"))]
    pub tls_secret_name: Option<String>,
    /// Annotations of the Ingress, over the operator's
    /// `nginx.ingress.kubernetes.io/backend-protocol: HTTPS` (other controllers need their own
    /// equivalent: the backend speaks TLS only). At most 32.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32))]
    pub annotations: BTreeMap<String, String>,
}

/// The Gateway API HTTPRoute that publishes the endpoint.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteExpose {
    /// Public DNS name of the endpoint (no wildcard): the route's hostname, a name of the
    /// generated serving certificate, and the default `resourceUrl` (`https://<host>/mcp`).
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(
        "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')"
    ).message("spec.server.expose.httpRoute.host must be a lowercase DNS name such as mcp.example.com (no wildcard, port or scheme)"))]
    pub host: String,
    /// The Gateways (listeners) the route attaches to (1..8).
    #[schemars(length(min = 1, max = 8))]
    pub parent_refs: Vec<GatewayParentRef>,
}

/// A Gateway the HTTPRoute attaches to.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GatewayParentRef {
    /// Name of the Gateway.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Namespace of the Gateway. Default: the instance's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub namespace: Option<String>,
    /// A listener of the Gateway, by name. Default: every listener that accepts the route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub section_name: Option<String>,
}

/// One identity allowed to use the MCP endpoint.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.__namespace__) || self.kind == 'ServiceAccount'")
    .message("spec.server.clients[].namespace is only for kind ServiceAccount (users and groups are cluster-wide)"))]
pub struct ClientSubject {
    /// `User`, `Group` or `ServiceAccount`.
    pub kind: ClientKind,
    /// The user name, group name or ServiceAccount name, as the API server authenticates it
    /// (for an OIDC user, with the issuer's prefix if the API server adds one).
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// ServiceAccount only: its namespace. Default: the instance's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub namespace: Option<String>,
}

/// The kind of a [`ClientSubject`] (the RBAC subject kinds).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ClientKind {
    User,
    Group,
    ServiceAccount,
}

impl ClientKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ClientKind::User => "User",
            ClientKind::Group => "Group",
            ClientKind::ServiceAccount => "ServiceAccount",
        }
    }
}

impl Default for ServerSpec {
    fn default() -> Self {
        Self {
            resources: default_server_resources(),
            image_pull_policy: None,
            auth: AuthMode::Kubernetes,
            tls_secret_name: None,
            instructions: None,
            max_sessions_per_client: None,
            new_sessions_per_minute_per_client: None,
            clients: Vec::new(),
            allowed_origins: Vec::new(),
            authorization: None,
            expose: None,
            runtime_class_name: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            affinity: None,
            priority_class_name: None,
            image_pull_secrets: Vec::new(),
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;
    use std::time::Duration;

    fn cr(yaml_spec: serde_json::Value) -> CliMcpInstance {
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
    fn a_proxy_is_planned_from_spec_proxy_or_the_older_kubeconfig_secret() {
        use crate::crd::values::ProxyPlan;
        // Without spec.proxy: the implied proxy, holding the older kubeconfigSecret (or
        // the default name), with the proxy defaults; the sandbox uses it like any other.
        for (spec, secret) in [
            (serde_json::json!({}), "cli-mcp-demo-kubeconfig"),
            (
                serde_json::json!({"sandbox": {"kubeconfigSecret": "go-era-kubeconfig"}}),
                "go-era-kubeconfig",
            ),
        ] {
            let o = cr(spec);
            let plan: ProxyPlan = o.proxy_plan().expect("plan");
            assert_eq!(plan.kubeconfig_secret.as_deref(), Some(secret));
            assert!(plan.allowlist.is_empty() && plan.allowlist_cas.is_empty());
            assert_eq!(plan.replicas, 2);
            assert_eq!(plan.resources, default_proxy_resources());
            assert!(plan.placement.is_empty());
            assert_eq!(
                o.proxy_spec(),
                ProxySpec::implied(o.spec.sandbox.kubeconfig_secret.clone())
            );
            let p = o
                .sandbox_config(Some("img:1"))
                .expect("config")
                .proxy
                .expect("every sandbox uses a proxy");
            assert_eq!(p.url, "http://cli-mcp-demo-proxy.ns1.svc:8080");
            assert_eq!(p.config_map, "cli-mcp-demo-proxy");
            assert!(p.kubeconfig, "the sandbox gets the dummy kubeconfig");
        }
        // The implied proxy is exactly what spec.proxy with one kubernetes target says.
        assert_eq!(
            cr(serde_json::json!({"sandbox": {"kubeconfigSecret": "kc"}})).proxy_plan(),
            cr(serde_json::json!({"proxy": {"targets": [{"type": "kubernetes", "secretName": "kc"}]}}))
                .proxy_plan()
        );

        let o = cr(serde_json::json!({"proxy": {"targets": [
            {"type": "kubernetes"},
            {"type": "allowlist", "domains": ["Example.com", "b.example:8443", "example.com:443"]}
        ]}}));
        let plan: ProxyPlan = o.proxy_plan().expect("plan");
        assert_eq!(
            plan.kubeconfig_secret.as_deref(),
            Some("cli-mcp-demo-kubeconfig")
        );
        let domains: Vec<_> = plan.allowlist.iter().map(|d| d.as_str()).collect();
        assert_eq!(domains, ["b.example:8443", "example.com:443"]);
        assert_eq!(plan.replicas, 2, "two replicas unless told otherwise");
        let cfg = o.sandbox_config(Some("img:1")).expect("config");
        let p = cfg.proxy.expect("sandbox uses the proxy");
        assert_eq!(p.url, "http://cli-mcp-demo-proxy.ns1.svc:8080");
        assert_eq!(p.config_map, "cli-mcp-demo-proxy");
        assert!(p.kubeconfig);

        // An allow-list only: the proxy, but no kubeconfig.
        let o = cr(serde_json::json!({"proxy": {"targets": [
            {"type": "allowlist", "domains": ["pypi.org"]}
        ]}}));
        let plan = o.proxy_plan().expect("plan");
        assert_eq!(plan.kubeconfig_secret, None);
        assert!(
            !o.sandbox_config(Some("i"))
                .expect("config")
                .proxy
                .expect("proxy")
                .kubeconfig
        );

        // A CA of its own for an allow-list target's domains.
        let o = cr(serde_json::json!({"proxy": {"targets": [
            {"type": "allowlist", "domains": ["web.example:8443", "a.example"], "caConfigMap": "web-ca"},
            {"type": "allowlist", "domains": ["pypi.org", "a.example:443"]}
        ]}}));
        let e = o
            .proxy_plan()
            .expect_err("two CAs for one domain")
            .to_string();
        assert!(
            e.contains("a.example:443") && e.contains("caConfigMap"),
            "{e}"
        );
        let o = cr(serde_json::json!({"proxy": {"targets": [
            {"type": "allowlist", "domains": ["web.example:8443"], "caConfigMap": "web-ca"},
            {"type": "allowlist", "domains": ["pypi.org"]}
        ]}}));
        let plan = o.proxy_plan().expect("plan");
        let pinned: Vec<_> = plan
            .allowlist_cas
            .iter()
            .map(|(d, cm)| (d.as_str(), cm.as_str()))
            .collect();
        assert_eq!(pinned, [("web.example:8443", "web-ca")]);

        // A domain admission would refuse, from an object stored before the rule.
        let o = cr(serde_json::json!({"proxy": {"targets": [
            {"type": "allowlist", "domains": ["*.example.com"]}
        ]}}));
        let e = o.proxy_plan().expect_err("bad domain").to_string();
        assert!(
            e.contains("*.example.com") && e.contains("without '*'"),
            "{e}"
        );
    }

    #[test]
    fn sandbox_config_is_built_from_the_cr() {
        let o = cr(serde_json::json!({"sandbox": {
            "image": "img:1", "imagePullPolicy": "Never",
            "env": [{"name": "FOO", "value": "bar"}, {"name": "HOME", "value": "/evil"}]
        }}));
        let cfg = o.sandbox_config(Some("default:1")).expect("config");
        assert_eq!(cfg.image, "img:1");
        assert_eq!(cfg.image_pull_policy.as_deref(), Some("Never"));
        assert_eq!(cfg.namespace, "ns1");
        assert!(cfg.proxy.is_some(), "a proxy even when not asked for");
        assert_eq!(cfg.env.len(), 1);
        let owner = cfg.owner.expect("owner");
        assert_eq!(owner.uid, "u-1");
        assert_eq!(owner.controller, Some(true));
        assert_eq!(owner.kind, "CliMcpInstance");

        assert_eq!(cfg.output_budget, None, "the agent's default budget");
        let big = cr(serde_json::json!({"sandbox": {"outputBudgetBytes": 1048576}}));
        let big = big.sandbox_config(Some("default:1")).expect("config");
        assert_eq!(
            big.output_budget,
            Some(1 << 20),
            "the agent is told the budget"
        );

        let d = cr(serde_json::json!({}));
        assert_eq!(
            d.sandbox_config(Some("default:1")).expect("config").image,
            "default:1"
        );
        assert_eq!(d.sandbox_config(None), Err(CrdError::NoImage));
        let mut no_uid = d.clone();
        no_uid.metadata.uid = None;
        assert_eq!(
            no_uid.sandbox_config(Some("x")),
            Err(CrdError::Missing("metadata.uid"))
        );
    }

    #[test]
    fn each_part_gets_its_own_placement() {
        let o = cr(serde_json::json!({
            "sandbox": {"runtimeClassName": "gvisor", "nodeSelector": {"pool": "sandboxes"},
                        "imagePullSecrets": [{"name": "sandbox-pull"}]},
            "server": {"priorityClassName": "critical", "tolerations": [{"operator": "Exists"}]}
        }));
        let cfg = o.sandbox_config(Some("i")).expect("config");
        assert_eq!(cfg.placement, o.spec.sandbox.placement());
        assert_eq!(cfg.placement.runtime_class_name.as_deref(), Some("gvisor"));
        assert_eq!(cfg.placement.node_selector["pool"], "sandboxes");
        assert_eq!(cfg.placement.image_pull_secrets[0].name, "sandbox-pull");
        assert_eq!(
            cfg.placement.priority_class_name, None,
            "the server's PriorityClass is not the sandboxes'"
        );
        assert!(cfg.placement.tolerations.is_empty());
        let server = o.spec.server.placement();
        assert_eq!(server.priority_class_name.as_deref(), Some("critical"));
        assert_eq!(server.tolerations.len(), 1);
        assert_eq!(server.runtime_class_name, None);

        let proxied = cr(serde_json::json!({"proxy": {
            "targets": [{"type": "kubernetes"}],
            "runtimeClassName": "kata", "tolerations": [{"operator": "Exists"}]
        }}));
        let plan = proxied.proxy_plan().expect("plan");
        assert_eq!(plan.placement.runtime_class_name.as_deref(), Some("kata"));
        assert_eq!(plan.placement.tolerations.len(), 1);
        assert!(
            proxied
                .sandbox_config(Some("i"))
                .expect("config")
                .placement
                .is_empty(),
            "the proxy's placement is not the sandboxes'"
        );

        let plain = cr(serde_json::json!({}));
        assert!(plain
            .sandbox_config(Some("i"))
            .expect("config")
            .placement
            .is_empty());
        assert!(plain.spec.server.placement().is_empty());
    }

    #[test]
    fn durations_parse_like_go() {
        assert_eq!(parse_duration("90s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1.5h"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        for bad in ["", "banana", "10", "5d", "m", "1x", "-1s"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
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

    #[test]
    fn allowed_origins_are_a_bounded_set_checked_at_admission() {
        let crd = serde_json::to_value(CliMcpInstance::crd()).expect("json");
        let o = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["server"]["properties"]["allowedOrigins"];
        assert_eq!(o["maxItems"], MAX_ALLOWED_ORIGINS as u64);
        assert_eq!(o["items"]["maxLength"], 512);
        assert_eq!(o["x-kubernetes-list-type"], "set");
        let rule = &o["x-kubernetes-validations"][0];
        assert_eq!(rule["rule"], ALLOWED_ORIGIN_RULE);
        assert!(rule["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("spec.server.allowedOrigins: each entry")));
        let c = cr(serde_json::json!({"server": {"allowedOrigins": ["https://a.example"]}}));
        assert_eq!(c.spec.server.allowed_origins, ["https://a.example"]);
        assert!(cr(serde_json::json!({}))
            .spec
            .server
            .allowed_origins
            .is_empty());
    }

    #[test]
    fn authorization_and_expose_read_from_the_cr() {
        let o = cr(serde_json::json!({"server": {
            "authorization": {"servers": ["https://idp.example/realms/dev"], "scopes": ["mcp"]},
            "expose": {"ingress": {"host": "mcp.example.com", "className": "nginx"}}
        }}));
        let a = o.spec.server.authorization.as_ref().expect("authorization");
        assert_eq!(a.servers, ["https://idp.example/realms/dev"]);
        assert!(a.audiences.is_empty() && a.resource_url.is_none());
        let e = o.spec.server.expose.as_ref().expect("expose");
        assert_eq!(e.host(), Some("mcp.example.com"));
        let r = cr(serde_json::json!({"server": {"expose": {"httpRoute": {
            "host": "mcp.example.org", "parentRefs": [{"name": "gw", "namespace": "infra"}]
        }}}}));
        assert_eq!(
            r.spec.server.expose.as_ref().and_then(|e| e.host()),
            Some("mcp.example.org")
        );
        // A Route may leave its host to the router.
        let o = cr(serde_json::json!({"server": {"expose": {"route": {}}}}));
        let route = o.spec.server.expose.as_ref().expect("expose");
        assert_eq!(route.host(), None);
        let policy = route
            .route
            .as_ref()
            .map(|r| r.insecure_edge_termination_policy);
        assert_eq!(policy, Some(InsecureEdgePolicy::Redirect));
        let o = cr(serde_json::json!({"server": {"expose": {"route": {
            "host": "mcp.apps.example.com", "insecureEdgeTerminationPolicy": "None"
        }}}}));
        assert_eq!(
            o.spec.server.expose.as_ref().and_then(|e| e.host()),
            Some("mcp.apps.example.com")
        );
        // The CEL rules that refuse what the server would refuse at start are in the CRD.
        let text = serde_json::to_string(&CliMcpInstance::crd()).expect("json");
        for needle in [
            "spec.server.authorization needs resourceUrl",
            "spec.server.authorization needs auth: Kubernetes",
            "set either ingress or httpRoute, not both",
            "set route alone, without ingress or httpRoute",
        ] {
            assert!(text.contains(needle), "CRD lacks {needle}");
        }
    }

    #[test]
    fn reserved_env_list_matches_the_builder() {
        // The CEL rule spells the reserved names out; keep it in step with the builder.
        let crd = serde_json::to_string(&CliMcpInstance::crd()).expect("json");
        for name in RESERVED_ENV.iter().chain(RESERVED_ENV_PREFIXES) {
            assert!(crd.contains(&format!("'{name}'")), "CEL rule lacks {name}");
        }
    }
}
