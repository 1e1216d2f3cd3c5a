//! Pure builders of every object an instance owns. Each takes [`Inputs`] and returns the
//! desired object with only the fields the operator owns set, ready for server-side apply.

pub mod deployment;
pub mod networkpolicy;
pub mod rbac;
pub mod secrets;
pub mod service;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use cli_mcp_api::crd::{AuthMode, CliMcpInstance};
use cli_mcp_api::names::{label, InstanceName};
use cli_mcp_api::sandbox::SandboxConfig;

/// Pod-template annotation carrying a hash of the HMAC key: a new key rolls the server.
pub const HMAC_VERSION_ANNOTATION: &str = "cli-mcp.redhat.com/hmac-version";
/// Pod-template annotation carrying a hash of the serving certificate.
pub const TLS_VERSION_ANNOTATION: &str = "cli-mcp.redhat.com/tls-version";
/// Label on the cluster-scoped ClusterRoleBinding naming the instance's namespace (the
/// instance label alone is ambiguous across namespaces).
pub const INSTANCE_NAMESPACE_LABEL: &str = "cli-mcp.redhat.com/instance-namespace";

/// Server container ports.
pub const MCP_TLS_PORT: i32 = 8443;
pub const MCP_PLAIN_PORT: i32 = 8080;
pub const HEALTH_PORT: i32 = 8081;
/// Where the server finds its mounted Secrets.
pub const HMAC_DIR: &str = "/var/run/cli-mcp/hmac";
pub const TLS_DIR: &str = "/var/run/cli-mcp/tls";

/// Everything the builders need, resolved by the controller.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub name: InstanceName,
    pub namespace: String,
    pub owner: OwnerReference,
    pub replicas: i32,
    pub auth: AuthMode,
    pub server_image: String,
    pub server_pull_policy: Option<String>,
    pub server_resources: k8s_openapi::api::core::v1::ResourceRequirements,
    pub sandbox: SandboxConfig,
    pub max_sessions: i32,
    pub default_timeout_secs: u64,
    pub max_timeout_secs: u64,
    pub output_budget: i64,
    /// Secret with tls.crt/tls.key (auth Kubernetes only).
    pub tls_secret: String,
    /// Hash of the HMAC key; stamped on the pod template.
    pub hmac_version: String,
    /// Hash of the serving certificate, when there is one.
    pub tls_version: Option<String>,
    /// Extra egress rules of the sandbox NetworkPolicy.
    pub extra_egress: Vec<k8s_openapi::api::networking::v1::NetworkPolicyEgressRule>,
    /// Addresses and ports of the Kubernetes API server (for sandbox egress).
    pub api_server: ApiServerPeers,
}

/// Where the Kubernetes API server is, as the sandbox network sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiServerPeers {
    /// IPs (endpoint addresses and the `kubernetes` Service IP).
    pub ips: Vec<String>,
    /// TCP ports (endpoint ports and the Service port).
    pub ports: Vec<i32>,
}

impl Inputs {
    /// Resolves the inputs from the CR and what the controller looked up.
    pub fn from_cr(
        cr: &CliMcpInstance,
        server_image: &str,
        default_sandbox_image: Option<&str>,
        hmac_version: String,
        tls_version: Option<String>,
        api_server: ApiServerPeers,
    ) -> Result<Self, cli_mcp_api::crd::CrdError> {
        let sandbox = cr.sandbox_config(default_sandbox_image)?;
        let (default_timeout_secs, max_timeout_secs) = cr.spec.sandbox.command_timeouts()?;
        let owner = sandbox
            .owner
            .clone()
            .ok_or(cli_mcp_api::crd::CrdError::Missing("metadata.uid"))?;
        Ok(Self {
            name: cr.instance_name()?,
            namespace: sandbox.namespace.clone(),
            owner,
            replicas: cr.spec.replicas,
            auth: cr.spec.server.auth,
            server_image: server_image.to_owned(),
            server_pull_policy: cr
                .spec
                .server
                .image_pull_policy
                .map(|p| p.as_str().to_owned()),
            server_resources: cr.spec.server.resources.clone(),
            sandbox,
            max_sessions: cr.spec.sandbox.max_sessions,
            default_timeout_secs,
            max_timeout_secs,
            output_budget: cr.spec.sandbox.output_budget_bytes,
            tls_secret: cr.tls_secret()?,
            hmac_version,
            tls_version,
            extra_egress: cr.spec.network_policy.extra_egress.clone(),
            api_server,
        })
    }

    /// Common labels of every object of this instance, plus the component.
    pub fn labels(&self, component: &str) -> BTreeMap<String, String> {
        let n = self.name.to_string();
        BTreeMap::from([
            (label::INSTANCE.to_owned(), n.clone()),
            (label::COMPONENT.to_owned(), component.to_owned()),
            (label::APP_NAME.to_owned(), format!("cli-mcp-{component}")),
            (label::APP_INSTANCE.to_owned(), n),
            (label::APP_COMPONENT.to_owned(), component.to_owned()),
            (label::APP_PART_OF.to_owned(), label::PART_OF.to_owned()),
            (
                label::APP_MANAGED_BY.to_owned(),
                label::MANAGED_BY.to_owned(),
            ),
        ])
    }

    /// The two labels that select this instance's pods of `component` (stable: selectors are
    /// immutable on Deployments).
    pub fn selector(&self, component: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            (label::INSTANCE.to_owned(), self.name.to_string()),
            (label::COMPONENT.to_owned(), component.to_owned()),
        ])
    }

    /// Metadata of a namespaced child owned by the CR.
    pub fn meta(&self, name: String, component: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name),
            namespace: Some(self.namespace.clone()),
            labels: Some(self.labels(component)),
            owner_references: Some(vec![self.owner.clone()]),
            ..Default::default()
        }
    }

    /// Port the MCP endpoint listens on.
    pub fn mcp_port(&self) -> i32 {
        match self.auth {
            AuthMode::Kubernetes => MCP_TLS_PORT,
            AuthMode::None => MCP_PLAIN_PORT,
        }
    }

    /// The in-cluster URL of the MCP endpoint.
    pub fn endpoint(&self) -> String {
        let scheme = match self.auth {
            AuthMode::Kubernetes => "https",
            AuthMode::None => "http",
        };
        format!(
            "{scheme}://{}.{}.svc:{}/mcp",
            self.name.server(),
            self.namespace,
            self.mcp_port()
        )
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    pub fn cr(spec: serde_json::Value) -> CliMcpInstance {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "cli-mcp.redhat.com/v1alpha1",
            "kind": "CliMcpInstance",
            "metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1", "generation": 1},
            "spec": spec,
        }))
        .expect("valid CR")
    }

    pub fn inputs(spec: serde_json::Value) -> Inputs {
        Inputs::from_cr(
            &cr(spec),
            "cli-mcp-server:dev",
            Some("cli-mcp-agent:dev"),
            "hv1".into(),
            Some("tv1".into()),
            ApiServerPeers {
                ips: vec!["10.0.0.1".into()],
                ports: vec![6443],
            },
        )
        .expect("inputs")
    }
}
