//! `spec.sandbox`: the sandbox pods' image, idle collection, warm pool, resources,
//! environment, command timeouts and placement.

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
use kube::KubeSchema;
use schemars::Schema;
use serde::{Deserialize, Serialize};

use super::placement::{PlacementPart, PlacementSpec};
use super::warm_pool::WarmPoolBounds;
use super::{resources, PullPolicy};

/// What the placement fields of `spec.sandbox` say in the CRD.
const PLACEMENT: PlacementPart = PlacementPart {
    path: "spec.sandbox",
    runtime_class_name:
        "RuntimeClass of sandbox pods (`runtimeClassName`), such as `gvisor` or `kata`: a \
        stronger boundary around untrusted commands than the default runtime. The \
        RuntimeClass must exist (`kubectl get runtimeclass`): until it does, no sandbox is \
        created and the instance is Ready=False with reason RuntimeClassNotFound. \
        status.sandbox reports the class the sandboxes run with. Default: the node's \
        default runtime.",
    node_selector:
        "Node labels sandbox pods must run on (`nodeSelector`), such as `kubernetes.io/arch: \
        amd64`. At most 32.",
    tolerations: "Taints sandbox pods tolerate (standard pod `tolerations`). At most 32.",
    affinity: "Node affinity and pod (anti-)affinity of sandbox pods (standard pod \
        `affinity`).",
    priority_class_name:
        "PriorityClass of sandbox pods (`priorityClassName`), so sandboxes preempt or yield \
        to other workloads as the cluster decides. It must exist (`kubectl get \
        priorityclass`), else the pods are refused.",
    image_pull_secrets:
        "Secrets (type kubernetes.io/dockerconfigjson, in the instance's namespace) the \
        kubelet pulls the image of sandbox pods with (`imagePullSecrets`). At most 16.",
};

/// Gives the placement fields of this part's schema their descriptions and CEL rules.
fn placement_schema(schema: &mut Schema) {
    PLACEMENT.apply(schema);
}

/// Sandbox pods of this instance.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = placement_schema)]
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

    /// A warm pool the operator sizes by demand instead of a fixed `warmPoolSize`: between
    /// `min` and `max` warm sandboxes, growing at once with the rate of new sessions and
    /// shrinking after `scaleDownDelay` of calm (status.warmPool.desired is the size it aims
    /// at). Set either this or warmPoolSize.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_pool: Option<WarmPoolBounds>,

    /// Compute resources of each sandbox container. Default: requests cpu 5m / memory
    /// 16Mi (what an idle sandbox holds, so a node holds as many idle sessions as its
    /// memory allows), limits cpu 500m / memory 512Mi (what a busy one may take).
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

    /// Runtime, scheduling and pull Secrets of sandbox pods: `runtimeClassName`,
    /// `nodeSelector`, `tolerations`, `affinity`, `priorityClassName` and
    /// `imagePullSecrets`, beside the fields above. Their descriptions in the CRD are
    /// `PLACEMENT`'s.
    #[serde(flatten)]
    pub placement: PlacementSpec,
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

/// The requests are sized from an idle sandbox on a real node: its pod cgroup (agent, bash,
/// pause) holds about 3 MiB and uses no CPU while the shell waits (docs/benchmarks.md,
/// "Density"). 16Mi leaves room for a session's page cache; 5m keeps CPU from being what
/// fills a node first (100m did: a 2-core node refused its 16th idle session). The limits
/// bound a busy session.
fn default_sandbox_resources() -> ResourceRequirements {
    resources(
        DEFAULT_SANDBOX_REQUESTS.0,
        DEFAULT_SANDBOX_REQUESTS.1,
        "500m",
        "512Mi",
    )
}

/// The default requests of a sandbox container: cpu and memory.
pub const DEFAULT_SANDBOX_REQUESTS: (&str, &str) = ("5m", "16Mi");

impl Default for SandboxSpec {
    fn default() -> Self {
        Self {
            image: None,
            idle_timeout: default_idle_timeout(),
            warm_pool_size: 0,
            warm_pool: None,
            resources: default_sandbox_resources(),
            env: Vec::new(),
            image_pull_policy: None,
            kubeconfig_secret: None,
            max_sessions: default_max_sessions(),
            command_timeout: CommandTimeout::default(),
            output_budget_bytes: default_output_budget(),
            placement: PlacementSpec::default(),
        }
    }
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

#[cfg(test)]
mod tests {
    use crate::crd::CliMcpInstance;
    use crate::sandbox::{RESERVED_ENV, RESERVED_ENV_PREFIXES};
    use kube::CustomResourceExt;

    /// A small node (2 CPUs, 4 GiB for pods) fits at least as many idle sandboxes with the
    /// default requests as a kubelet runs pods (110 by default): neither CPU nor memory
    /// requests fill it first. The 100m CPU request did, at about 15 on such a node.
    #[test]
    fn a_small_node_fits_a_full_node_of_idle_sandboxes_by_default() {
        use crate::sandbox::limits::quantity_bytes;
        use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
        let (cpu, memory) = super::DEFAULT_SANDBOX_REQUESTS;
        let millicores: u128 = match cpu.strip_suffix('m') {
            Some(m) => m.parse().expect("millicores"),
            None => cpu.parse::<u128>().expect("cores") * 1000,
        };
        let bytes = quantity_bytes(&Quantity(memory.into())).expect("memory");
        let by_cpu = 2000 / millicores;
        let by_memory = (4u128 << 30) / bytes;
        assert!(
            by_cpu >= 110 && by_memory >= 110,
            "a 2-CPU, 4 GiB node fits {by_cpu} sandboxes by CPU, {by_memory} by memory"
        );
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
