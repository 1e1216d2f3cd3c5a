//! `spec.server.expose`: how the MCP endpoint is published outside the cluster (an Ingress,
//! a Gateway API HTTPRoute or an OpenShift Route).

use std::collections::BTreeMap;

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
