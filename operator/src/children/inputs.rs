//! What the builders are built from. [`Spec`] is the CR read once — the only place that reads
//! `cr.spec` — and [`Inputs`] is that spec plus what the controller resolved from the cluster
//! (Secret versions, the generated CA, the API server's addresses). Both are complete when
//! made: nothing is filled in later.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::api::networking::v1::NetworkPolicyEgressRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use cli_mcp_api::crd::{
    AuthMode, AuthorizationSpec, CliMcpInstance, ClientSubject, CrdError, ExposeSpec, ProxyPlan,
    SandboxDns, WarmPoolSizing,
};
use cli_mcp_api::names::{label, InstanceName};
use cli_mcp_api::sandbox::{Placement, SandboxConfig};

use super::{secrets, MCP_PLAIN_PORT, MCP_TLS_PORT};

/// What one `CliMcpInstance` asks for, with the operator's defaults applied.
#[derive(Debug, Clone)]
pub struct Spec {
    pub name: InstanceName,
    pub namespace: String,
    /// Controller reference to the CR, on every namespaced child and sandbox.
    pub owner: OwnerReference,
    pub replicas: i32,
    pub auth: AuthMode,
    pub server_image: String,
    pub server_pull_policy: Option<String>,
    pub server_resources: ResourceRequirements,
    /// `spec.server`'s runtime, scheduling and pull Secrets, for the server pods.
    pub server_placement: Placement,
    /// `spec.server.instructions`, for the MCP clients' models.
    pub server_instructions: Option<String>,
    /// `spec.server.briefing`: whether the server gets the generated sandbox briefing.
    pub briefing: bool,
    /// `spec.server.clients`: bound to the client Role besides the client ServiceAccount.
    pub clients: Vec<ClientSubject>,
    /// `spec.server.allowedOrigins`: one `--allowed-origin` each.
    pub allowed_origins: Vec<String>,
    /// `spec.server.authorization`: rendered as the server's OAuth flags.
    pub authorization: Option<AuthorizationSpec>,
    /// `spec.server.expose`: the Ingress or HTTPRoute that publishes the endpoint.
    pub expose: Option<ExposeSpec>,
    pub sandbox: SandboxConfig,
    /// `spec.sandbox.warmPoolSize` or `spec.sandbox.warmPool`.
    pub warm_pool: WarmPoolSizing,
    pub idle_timeout: Duration,
    pub max_sessions: i32,
    /// `spec.server.maxSessionsPerClient`.
    pub max_sessions_per_client: Option<i32>,
    /// `spec.server.newSessionsPerMinutePerClient`.
    pub new_sessions_per_minute_per_client: Option<i32>,
    pub default_timeout_secs: u64,
    pub max_timeout_secs: u64,
    pub output_budget: i64,
    /// Secret with tls.crt/tls.key (auth Kubernetes only).
    pub tls_secret: String,
    /// The admin named the TLS Secret (`spec.server.tlsSecretName`): it is only checked,
    /// never generated.
    pub custom_tls: bool,
    /// OpenShift's service CA issues the serving certificate into `tls_secret` (see
    /// [`Spec::use_service_ca`]).
    pub service_ca: bool,
    /// The credential proxy: `spec.proxy`, or the implied one (see
    /// [`CliMcpInstance::proxy_plan`]). Every instance has one.
    pub proxy: ProxyPlan,
    /// The operator's default proxy image (`RELATED_IMAGE_PROXY`).
    pub proxy_image: Option<String>,
    /// Extra egress rules of the sandbox NetworkPolicy.
    pub extra_egress: Vec<NetworkPolicyEgressRule>,
    /// Whether sandboxes may query the cluster's DNS (`spec.networkPolicy.dns`).
    pub sandbox_dns: SandboxDns,
}

impl Spec {
    /// Reads the CR. Fails only for objects that bypassed admission (or when no sandbox image
    /// is set anywhere).
    pub fn read(
        cr: &CliMcpInstance,
        server_image: &str,
        default_sandbox_image: Option<&str>,
        proxy_image: Option<&str>,
    ) -> Result<Self, CrdError> {
        let sandbox = cr.sandbox_config(default_sandbox_image)?;
        let s = &cr.spec;
        // The Go operator's spec.serverContainer, kept working (see its field docs).
        let legacy = s.server_container.as_ref();
        let (default_timeout_secs, max_timeout_secs) = s.sandbox.command_timeouts()?;
        let owner = sandbox
            .owner
            .clone()
            .ok_or(CrdError::Missing("metadata.uid"))?;
        Ok(Self {
            name: cr.instance_name()?,
            namespace: sandbox.namespace.clone(),
            owner,
            replicas: s.replicas,
            auth: s.server.auth,
            server_image: server_image.to_owned(),
            server_pull_policy: legacy
                .and_then(|c| c.image_pull_policy)
                .or(s.server.image_pull_policy)
                .map(|p| p.as_str().to_owned()),
            server_resources: legacy
                .and_then(|c| c.resources.clone())
                .unwrap_or_else(|| s.server.resources.clone()),
            server_placement: s.server.placement(),
            server_instructions: s.server.instructions.clone(),
            briefing: s.server.briefing,
            clients: s.server.clients.clone(),
            allowed_origins: s.server.allowed_origins.clone(),
            authorization: s.server.authorization.clone(),
            expose: s.server.expose.clone(),
            warm_pool: s.sandbox.warm_pool_sizing()?,
            idle_timeout: s.sandbox.idle_timeout()?,
            max_sessions: s.sandbox.max_sessions,
            max_sessions_per_client: max_sessions_per_client(s),
            new_sessions_per_minute_per_client: s.server.new_sessions_per_minute_per_client,
            default_timeout_secs,
            max_timeout_secs,
            output_budget: s.sandbox.output_budget_bytes,
            tls_secret: cr.tls_secret()?,
            custom_tls: s.server.tls_secret_name.is_some(),
            service_ca: false,
            proxy: cr.proxy_plan()?,
            proxy_image: proxy_image.filter(|i| !i.is_empty()).map(str::to_owned),
            extra_egress: s.network_policy.extra_egress.clone(),
            sandbox_dns: s.network_policy.dns,
            sandbox,
        })
    }

    /// Refused when one of the instance's ServiceAccounts (server, proxy, sandbox, client)
    /// would be the operator's own (`own`: its namespace and ServiceAccount): an instance
    /// named `operator` in `cli-mcp-system` would apply its server over the operator's
    /// Deployment and run it with the operator's rights. The admission policies refuse such
    /// a name too; this holds where they are not installed.
    pub fn not_the_operators(&self, own: Option<&(String, String)>) -> Result<(), CrdError> {
        let Some((namespace, account)) = own else {
            return Ok(());
        };
        let n = &self.name;
        let ours = [n.server(), n.proxy(), n.sandbox(), n.client()];
        if self.namespace == *namespace && ours.contains(account) {
            return Err(CrdError::OperatorsAccount {
                account: account.clone(),
            });
        }
        Ok(())
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

impl Spec {
    /// On OpenShift: the service CA issues the serving certificate (the Service asks for it
    /// by annotation) instead of the instance's own CA — unless the admin named one, which
    /// always wins, or the endpoint is plain HTTP.
    pub fn use_service_ca(&mut self) {
        if self.auth == AuthMode::Kubernetes && !self.custom_tls {
            self.service_ca = true;
            self.tls_secret = secrets::service_tls_secret_name(&self.name);
        }
    }

    /// The public host of `spec.server.expose`, if any.
    pub fn expose_host(&self) -> Option<&str> {
        self.expose.as_ref().and_then(ExposeSpec::host)
    }

    /// The URL of the MCP endpoint outside the cluster, while `spec.server.expose` is set.
    pub fn external_endpoint(&self) -> Option<String> {
        self.expose_host().map(|h| format!("https://{h}/mcp"))
    }

    /// The server's `--resource-url`: `authorization.resourceUrl`, else the external
    /// endpoint. Without either the server derives it from each request's Host.
    pub fn resource_url(&self) -> Option<String> {
        self.authorization
            .as_ref()
            .and_then(|a| a.resource_url.clone())
            .or_else(|| self.external_endpoint())
    }
}

/// Where the Kubernetes API server is, as the sandbox network sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiServerPeers {
    /// IPs (endpoint addresses and the `kubernetes` Service IP).
    pub ips: Vec<String>,
    /// TCP ports (endpoint ports and the Service port).
    pub ports: Vec<i32>,
    /// Why the addresses may be incomplete (a read the operator was refused); shown in the
    /// `Degraded` condition, because the sandbox NetworkPolicy then lacks the API rule.
    pub problem: Option<String>,
}

/// Everything the builders need.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub spec: Spec,
    /// Hash of the HMAC key; stamped on the pod template so a new key rolls the server.
    pub hmac_version: String,
    /// Hash of the serving certificate, when there is one.
    pub tls_version: Option<String>,
    /// The CA clients trust (PEM), published in the CA ConfigMap: the generated one, or
    /// OpenShift's service CA bundle once it is injected.
    pub ca_pem: Option<String>,
    /// The CA an edge (a Route) verifies the server's certificate with, when the platform
    /// does not know it: the generated CA, or `ca.crt` of the admin's TLS Secret. `None`
    /// with the service CA, which OpenShift's router trusts by itself.
    pub backend_ca: Option<String>,
    /// Addresses and ports of the Kubernetes API server (for the proxy's egress).
    pub api_server: ApiServerPeers,
    /// What the proxy children are built from; `None` while its CA, kubeconfig or image is
    /// not usable (then no proxy children change and no sandbox starts).
    pub proxy: Option<ProxyInputs>,
    /// Why the cluster cannot store the object `spec.server.expose` asks for (no Gateway API
    /// CRDs, not OpenShift): it is then left out of the desired set, and the status says so.
    pub expose_unavailable: Option<String>,
    /// The sandbox briefing for the server's instructions (`crate::briefing`); `None` when
    /// `spec.server.briefing` is false.
    pub briefing: Option<String>,
    /// RuntimeClasses the spec names that the cluster lacks: a Deployment whose pods name one
    /// says so on its pod template ([`super::RUNTIME_CLASS_MISSING_ANNOTATION`]).
    pub missing_runtime_classes: BTreeSet<String>,
}

/// The resolved inputs of the credential proxy.
#[derive(Debug, Clone)]
pub struct ProxyInputs {
    pub image: String,
    pub replicas: i32,
    pub resources: ResourceRequirements,
    /// `spec.proxy`'s runtime, scheduling and pull Secrets.
    pub placement: Placement,
    /// Every route, kubernetes and allow-list.
    pub routes: cli_mcp_api::proxy::RouteTable,
    /// The sandboxes' kubeconfig (placeholder token, proxy CA), with a kubernetes target.
    pub dummy_kubeconfig: Option<String>,
    /// The admin Secret the proxy mounts (key `kubeconfig` only), with a kubernetes target.
    pub kubeconfig_secret: Option<String>,
    /// The proxy CA certificate (public), for the sandboxes' trust.
    pub ca_pem: String,
    /// Hash of the CA Secret: a new CA rolls the proxy.
    pub ca_version: String,
    /// Hash of the kubeconfig's servers and tokens, with a kubernetes target: a rotated
    /// token is passed on to the running proxy pods ([`crate::rotation`]), never rolled.
    pub kubeconfig_version: Option<String>,
}

impl Inputs {
    /// Name of the ConfigMap that publishes the CA, when there is a CA to publish.
    pub fn ca_config_map_name(&self) -> Option<String> {
        self.ca_pem
            .as_ref()
            .map(|_| secrets::ca_config_map_name(&self.spec.name))
    }
}

/// The per-client session limit: the spec's, else half of `maxSessions` (rounded up) when
/// callers have identities, so one identity cannot take every place of the instance (and of
/// its nodes) and another always finds room. Without authentication every caller is the
/// same anonymous one, so no default applies there.
pub fn max_sessions_per_client(s: &cli_mcp_api::crd::CliMcpInstanceSpec) -> Option<i32> {
    s.server.max_sessions_per_client.or_else(|| {
        (s.server.auth == AuthMode::Kubernetes).then(|| (s.sandbox.max_sessions + 1) / 2)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli_mcp_api::crd::CliMcpInstanceSpec;

    fn spec(v: serde_json::Value) -> CliMcpInstanceSpec {
        serde_json::from_value(v).expect("spec")
    }

    #[test]
    fn one_identity_holds_at_most_half_the_sessions_unless_the_spec_says() {
        let default = spec(serde_json::json!({}));
        assert_eq!(default.sandbox.max_sessions, 100);
        assert_eq!(max_sessions_per_client(&default), Some(50));
        let odd = spec(serde_json::json!({"sandbox": {"maxSessions": 3}}));
        assert_eq!(max_sessions_per_client(&odd), Some(2));
        let one = spec(serde_json::json!({"sandbox": {"maxSessions": 1}}));
        assert_eq!(max_sessions_per_client(&one), Some(1));
        let given = spec(serde_json::json!({"server": {"maxSessionsPerClient": 80}}));
        assert_eq!(max_sessions_per_client(&given), Some(80));
        // Without authentication every caller is the same anonymous one.
        let anonymous = spec(serde_json::json!({"server": {"auth": "None"}}));
        assert_eq!(max_sessions_per_client(&anonymous), None);
    }

    fn read(name: &str, namespace: &str) -> Spec {
        let cr: CliMcpInstance = serde_json::from_value(serde_json::json!({
            "apiVersion": "cli-mcp.redhat.com/v1alpha1", "kind": "CliMcpInstance",
            "metadata": {"name": name, "namespace": namespace, "uid": "u1"},
            "spec": {}
        }))
        .expect("cr");
        Spec::read(&cr, "server:1", Some("sandbox:1"), Some("proxy:1")).expect("spec")
    }

    #[test]
    fn an_instance_whose_account_is_the_operators_is_refused() {
        let own = ("cli-mcp-system".to_owned(), "cli-mcp-operator".to_owned());
        for name in ["operator", "op"] {
            let s = read(name, "cli-mcp-system");
            let r = s.not_the_operators(Some(&own));
            if name == "operator" {
                let e = r.expect_err("the operator's own account").to_string();
                assert!(e.contains("cli-mcp-operator is the operator's own"), "{e}");
            } else {
                assert!(r.is_ok());
            }
        }
        // Another namespace, or an operator that was not told its account: no clash.
        assert!(read("operator", "team")
            .not_the_operators(Some(&own))
            .is_ok());
        assert!(read("operator", "cli-mcp-system")
            .not_the_operators(None)
            .is_ok());
        // Through the proxy's, the sandboxes' or the clients' account as well.
        let own = ("t".to_owned(), "cli-mcp-x-sandbox".to_owned());
        assert!(read("x", "t").not_the_operators(Some(&own)).is_err());
    }
}
