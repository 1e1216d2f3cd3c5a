//! The status of a `CliMcpInstance`: written by the operator only, computed from the
//! objects it observes.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Observed state, computed by the operator from the objects it owns.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CliMcpInstanceStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// `Ready` (the aggregate: Secrets present, server available, pool healthy; it does not
    /// flap when a session claims a warm pod), `WarmPoolReady` (the pool is full) and
    /// `Degraded` (something needs attention; see its reason).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,

    /// Server replicas that exist.
    #[serde(default)]
    pub replicas: i32,

    /// Server replicas that are ready.
    #[serde(default)]
    pub ready_replicas: i32,

    /// Warm pool: Ready unassigned sandboxes and the desired size.
    #[serde(default)]
    pub warm_pool: WarmPoolStatus,

    /// Sandboxes assigned to a session.
    #[serde(default)]
    pub active_sessions: i32,

    /// Image sandboxes run (spec.sandbox.image or the operator default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_sandbox_image: Option<String>,

    /// URL of the MCP endpoint inside the cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,

    /// URL of the MCP endpoint outside the cluster (`https://<host>/mcp`), while
    /// `spec.server.expose` publishes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_endpoint: Option<String>,

    /// ConfigMap (key ca.crt) holding the CA that signed the server certificate, when the
    /// operator generated it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_config_map: Option<String>,

    /// Label selector of the server pods (for the scale subresource, e.g. an HPA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,

    /// The runtime the sandboxes run with, as the operator observes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxStatus>,
}

/// The runtime of the sandboxes, as the operator observes it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    /// RuntimeClass the sandboxes run with: the one the current warm sandboxes carry (an
    /// admission webhook may have set or changed it), or spec.sandbox.runtimeClassName while
    /// there is no current warm sandbox. Absent: none, so the nodes' default runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_class_name: Option<String>,
    /// Handler of that RuntimeClass as the cluster's RuntimeClass object names it (the
    /// runtime the nodes' container runtime uses for it, such as runsc for gVisor). Absent
    /// without a RuntimeClass, or while the operator cannot read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_handler: Option<String>,
}

/// Warm pool counts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WarmPoolStatus {
    /// Unassigned sandboxes that are Ready and current.
    #[serde(default)]
    pub ready: i32,
    /// The size the pool aims at: spec.sandbox.warmPoolSize, or with spec.sandbox.warmPool
    /// the size the operator chose from the demand, within its bounds.
    #[serde(default)]
    pub desired: i32,
    /// With spec.sandbox.warmPool: new sessions (warm claims and cold starts) in the last
    /// minute, the demand the pool follows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions_last_minute: Option<i32>,
}
