//! `spec.server`: the MCP server Deployment, how clients authenticate and who they are, and
//! the Go operator's older `spec.serverContainer`.

use k8s_openapi::api::core::v1::ResourceRequirements;
use kube::KubeSchema;
use schemars::{JsonSchema, Schema};
use serde::{Deserialize, Serialize};

use super::placement::{PlacementPart, PlacementSpec};
use super::{resources, ExposeSpec, PullPolicy};

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

/// Most entries of `spec.server.allowedOrigins`.
pub const MAX_ALLOWED_ORIGINS: usize = 16;

/// What the server's `--allowed-origin` accepts, or less: `scheme://host[:port]` with scheme
/// http or https in any case, a host of DNS name characters or a bracketed IPv6 address, a
/// port number or `*`. No comma may pass: the server splits its values on commas.
const ALLOWED_ORIGIN_RULE: &str = r"self.all(o, o.matches('^(?i:https?)://(\\[[0-9A-Fa-f:.]+\\]|[A-Za-z0-9._-]+)(:(\\*|6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4}))?$'))";

/// What the placement fields of `spec.server` say in the CRD.
const PLACEMENT: PlacementPart = PlacementPart {
    path: "spec.server",
    runtime_class_name:
        "RuntimeClass of the server pods (`runtimeClassName`), such as `gvisor` or `kata` \
        (the server runs no untrusted code; this is for clusters that require one). The \
        RuntimeClass must exist (`kubectl get runtimeclass`), else the pods are refused \
        and the instance is Ready=False with reason RuntimeClassNotFound. Default: the \
        node's default runtime.",
    node_selector: "Node labels the server pods must run on (`nodeSelector`), such as \
        `kubernetes.io/arch: amd64`. At most 32.",
    tolerations: "Taints the server pods tolerate (standard pod `tolerations`). At most 32.",
    affinity: "Node affinity and pod (anti-)affinity of the server pods (standard pod \
        `affinity`).",
    priority_class_name:
        "PriorityClass of the server pods (`priorityClassName`). It must exist (`kubectl get \
        priorityclass`), else the pods are refused.",
    image_pull_secrets:
        "Secrets (type kubernetes.io/dockerconfigjson, in the instance's namespace) the \
        kubelet pulls the image of the server pods with (`imagePullSecrets`). At most 16.",
};

/// Gives the placement fields of this part's schema their descriptions and CEL rules.
fn placement_schema(schema: &mut Schema) {
    PLACEMENT.apply(schema);
}

/// The MCP server Deployment.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = placement_schema)]
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

    /// Whether the MCP clients' models get the sandbox briefing the operator generates,
    /// between the server's own instructions and `instructions`: the sandbox image's tools
    /// and versions, each Kubernetes context of the proxy with its identity and what that
    /// identity may do (from a SelfSubjectRulesReview, rechecked every few minutes), the
    /// allow-listed domains, and the command timeout and output limits. Default true.
    #[serde(default = "default_briefing")]
    pub briefing: bool,

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

    /// Runtime, scheduling and pull Secrets of the server pods: `runtimeClassName`,
    /// `nodeSelector`, `tolerations`, `affinity`, `priorityClassName` and
    /// `imagePullSecrets`, beside the fields above. Their descriptions in the CRD are
    /// `PLACEMENT`'s.
    #[serde(flatten)]
    pub placement: PlacementSpec,
}

fn default_briefing() -> bool {
    true
}

fn default_server_resources() -> ResourceRequirements {
    resources("50m", "64Mi", "1", "256Mi")
}

impl Default for ServerSpec {
    fn default() -> Self {
        Self {
            resources: default_server_resources(),
            image_pull_policy: None,
            auth: AuthMode::Kubernetes,
            tls_secret_name: None,
            instructions: None,
            briefing: true,
            max_sessions_per_client: None,
            new_sessions_per_minute_per_client: None,
            clients: Vec::new(),
            allowed_origins: Vec::new(),
            authorization: None,
            expose: None,
            placement: PlacementSpec::default(),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::tests::cr;
    use crate::crd::{CliMcpInstance, InsecureEdgePolicy};
    use kube::CustomResourceExt;

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
}
