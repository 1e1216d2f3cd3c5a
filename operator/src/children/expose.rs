//! The object that publishes the MCP endpoint outside the cluster (`spec.server.expose`):
//! a `networking.k8s.io/v1` Ingress, a Gateway API `gateway.networking.k8s.io/v1`
//! HTTPRoute or an OpenShift `route.openshift.io/v1` Route, named like the server's Service.
//!
//! TLS stays end to end. The server serves TLS itself (auth Kubernetes, which admission
//! requires with expose), so the edge must re-encrypt to it: the Ingress carries
//! ingress-nginx's `backend-protocol: HTTPS` annotation (other controllers need their own
//! equivalent), an HTTPRoute needs a BackendTLSPolicy the user adds (it names the CA
//! ConfigMap, whose lifetime the operator does not own), and a Route says `reencrypt`
//! (OpenShift's router trusts the service CA that issues the server's certificate there;
//! any other CA is given to it as the Route's `destinationCACertificate`). Either way a
//! missing piece fails closed: a plain-HTTP hop to the TLS port gets no answer, never a
//! clear-text one.
//!
//! The exposed host is also a DNS name of the generated serving certificate (for edges
//! that pass TLS through); [`tls_covers`] tells whether an existing certificate still
//! covers the desired hosts.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::networking::v1::{
    HTTPIngressPath, HTTPIngressRuleValue, Ingress, IngressBackend, IngressRule,
    IngressServiceBackend, IngressSpec, IngressTLS, ServiceBackendPort,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use cli_mcp_api::crd::{HttpRouteExpose, IngressExpose, RouteExpose};
use cli_mcp_api::names::label;

use super::{Inputs, Spec, MCP_TLS_PORT};

/// ingress-nginx's annotation for the protocol it speaks to the backend.
pub const BACKEND_PROTOCOL_ANNOTATION: &str = "nginx.ingress.kubernetes.io/backend-protocol";
/// Annotation on a generated TLS Secret: the exposed hosts its certificate was made for
/// (sorted, comma-separated), so a changed host is seen without parsing the certificate.
pub const TLS_HOSTS_ANNOTATION: &str = "cli-mcp.redhat.com/tls-hosts";
/// The Service port the edge forwards to (the server's TLS port, named `https`).
const BACKEND_PORT_NAME: &str = "https";
/// OpenShift router's per-route timeout for a response to start (its default, 30 s, would
/// cut the answer of a longer command: the server answers a call in one JSON response).
pub const ROUTE_TIMEOUT_ANNOTATION: &str = "haproxy.router.openshift.io/timeout";
/// Slack over the longest command timeout, for the server's own work around the command.
const ROUTE_TIMEOUT_SLACK_SECS: u64 = 30;

/// A Gateway API HTTPRoute, with only the fields the operator sets. k8s-openapi has no
/// Gateway API types, and a typed struct keeps it an ordinary [`crate::apply::Child`].
/// Fields the API server defaults are ignored when read back.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRoute {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: HttpRouteSpec,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteSpec {
    #[serde(default)]
    pub parent_refs: Vec<RouteParentRef>,
    #[serde(default)]
    pub hostnames: Vec<String>,
    #[serde(default)]
    pub rules: Vec<RouteRule>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteParentRef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub section_name: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteRule {
    #[serde(default)]
    pub matches: Vec<RouteMatch>,
    #[serde(default)]
    pub backend_refs: Vec<RouteBackendRef>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteMatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<RoutePath>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoutePath {
    #[serde(rename = "type")]
    pub type_: String,
    pub value: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteBackendRef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
}

impl k8s_openapi::Resource for HttpRoute {
    const API_VERSION: &'static str = "gateway.networking.k8s.io/v1";
    const GROUP: &'static str = "gateway.networking.k8s.io";
    const KIND: &'static str = "HTTPRoute";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "httproutes";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for HttpRoute {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// An OpenShift Route, with the fields the operator sets and the status it reads (the
/// host the router admitted). Like [`HttpRoute`], a typed struct so it is an ordinary
/// [`crate::apply::Child`]; what the API server or the router add is ignored when read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Route {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: RouteSpec,
    /// Written by the routers; never sent by the operator.
    #[serde(default, skip_serializing)]
    pub status: Option<RouteStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteSpec {
    /// Left out for the router's default host (OpenShift's API server then fills it in,
    /// owned by no field manager of ours).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default)]
    pub to: RouteTarget,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<RoutePort>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<RouteTls>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteTarget {
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RoutePort {
    /// The Service port's name.
    #[serde(default)]
    pub target_port: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteTls {
    #[serde(default)]
    pub termination: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub insecure_edge_termination_policy: Option<String>,
    /// The CA the router verifies the server's certificate with; absent when the service
    /// CA issued it (the router trusts that one by itself).
    #[serde(
        rename = "destinationCACertificate",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub destination_ca_certificate: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteStatus {
    #[serde(default)]
    pub ingress: Vec<RouteIngress>,
}

/// One router's view of the Route.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteIngress {
    #[serde(default)]
    pub host: Option<String>,
    #[serde(default)]
    pub router_name: Option<String>,
    #[serde(default)]
    pub conditions: Vec<RouteIngressCondition>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteIngressCondition {
    #[serde(rename = "type", default)]
    pub type_: String,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
}

impl k8s_openapi::Resource for Route {
    const API_VERSION: &'static str = "route.openshift.io/v1";
    const GROUP: &'static str = "route.openshift.io";
    const KIND: &'static str = "Route";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "routes";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for Route {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The desired publishing object of an instance.
#[derive(Debug, Clone)]
pub enum Exposed {
    Ingress(Ingress),
    HttpRoute(HttpRoute),
    Route(Route),
}

/// The Ingress, HTTPRoute or Route `spec.server.expose` asks for, if any. Pure.
pub fn build(inp: &Inputs) -> Option<Exposed> {
    let e = inp.spec.expose.as_ref()?;
    if let Some(i) = &e.ingress {
        return Some(Exposed::Ingress(ingress(&inp.spec, i)));
    }
    if let Some(r) = &e.route {
        return Some(Exposed::Route(route(inp, r)));
    }
    e.http_route
        .as_ref()
        .map(|r| Exposed::HttpRoute(http_route(&inp.spec, r)))
}

fn route(inp: &Inputs, r: &RouteExpose) -> Route {
    use k8s_openapi::Resource as _;
    let spec = &inp.spec;
    let mut meta = spec.meta(spec.name.server(), label::COMPONENT_SERVER);
    let timeout = spec
        .max_timeout_secs
        .saturating_add(ROUTE_TIMEOUT_SLACK_SECS);
    let mut annotations =
        BTreeMap::from([(ROUTE_TIMEOUT_ANNOTATION.to_owned(), format!("{timeout}s"))]);
    annotations.extend(r.annotations.clone());
    meta.annotations = Some(annotations);
    Route {
        api_version: Route::API_VERSION.into(),
        kind: Route::KIND.into(),
        metadata: meta,
        spec: RouteSpec {
            host: r.host.clone(),
            to: RouteTarget {
                kind: "Service".into(),
                name: spec.name.server(),
            },
            port: Some(RoutePort {
                target_port: BACKEND_PORT_NAME.into(),
            }),
            tls: Some(RouteTls {
                termination: "reencrypt".into(),
                insecure_edge_termination_policy: Some(
                    r.insecure_edge_termination_policy.as_str().into(),
                ),
                destination_ca_certificate: inp.backend_ca.clone(),
            }),
        },
        status: None,
    }
}

/// What the routers say about a Route: the host one of them admitted, and why a router
/// refused it (a host another namespace holds, an invalid generated host), if one did.
pub fn route_admission(r: &Route) -> (Option<String>, Option<String>) {
    let ingress = r
        .status
        .as_ref()
        .map(|s| s.ingress.as_slice())
        .unwrap_or(&[]);
    let admitted = |i: &&RouteIngress, status: &str| {
        i.conditions
            .iter()
            .any(|c| c.type_ == "Admitted" && c.status == status)
    };
    let host = ingress
        .iter()
        .filter(|i| admitted(i, "True"))
        .find_map(|i| i.host.clone().filter(|h| !h.is_empty()));
    // One router admitting it is enough: the endpoint is reachable through that one.
    let refused = ingress
        .iter()
        .find(|i| host.is_none() && admitted(i, "False"))
        .map(|i| {
            let c = i.conditions.iter().find(|c| c.type_ == "Admitted");
            format!(
                "router {} did not admit Route {} for host {}: {}: {}; set another spec.server.expose.route.host, or leave it out for the router's default",
                i.router_name.as_deref().unwrap_or("?"),
                r.metadata.name.as_deref().unwrap_or("?"),
                i.host.as_deref().unwrap_or("?"),
                c.and_then(|c| c.reason.as_deref()).unwrap_or("no reason"),
                c.and_then(|c| c.message.as_deref()).unwrap_or("no message"),
            )
        });
    (host, refused)
}

fn ingress(spec: &Spec, i: &IngressExpose) -> Ingress {
    let mut meta = spec.meta(spec.name.server(), label::COMPONENT_SERVER);
    let mut annotations =
        BTreeMap::from([(BACKEND_PROTOCOL_ANNOTATION.to_owned(), "HTTPS".to_owned())]);
    // The user's annotations win: they may switch to TLS pass-through or add what their
    // controller needs instead.
    annotations.extend(i.annotations.clone());
    meta.annotations = Some(annotations);
    Ingress {
        metadata: meta,
        spec: Some(IngressSpec {
            ingress_class_name: i.class_name.clone(),
            // Listed even without a Secret: the host is then served with the controller's
            // default certificate, and controllers redirect plain HTTP for TLS hosts.
            tls: Some(vec![IngressTLS {
                hosts: Some(vec![i.host.clone()]),
                secret_name: i.tls_secret_name.clone(),
            }]),
            rules: Some(vec![IngressRule {
                host: Some(i.host.clone()),
                http: Some(HTTPIngressRuleValue {
                    paths: vec![HTTPIngressPath {
                        // All of it: /mcp and the OAuth metadata under /.well-known.
                        path: Some("/".into()),
                        path_type: "Prefix".into(),
                        backend: IngressBackend {
                            service: Some(IngressServiceBackend {
                                name: spec.name.server(),
                                port: Some(ServiceBackendPort {
                                    name: Some(BACKEND_PORT_NAME.into()),
                                    number: None,
                                }),
                            }),
                            resource: None,
                        },
                    }],
                }),
            }]),
            default_backend: None,
        }),
        status: None,
    }
}

fn http_route(spec: &Spec, r: &HttpRouteExpose) -> HttpRoute {
    use k8s_openapi::Resource as _;
    HttpRoute {
        api_version: HttpRoute::API_VERSION.into(),
        kind: HttpRoute::KIND.into(),
        metadata: spec.meta(spec.name.server(), label::COMPONENT_SERVER),
        spec: HttpRouteSpec {
            parent_refs: r
                .parent_refs
                .iter()
                .map(|p| RouteParentRef {
                    name: p.name.clone(),
                    namespace: p.namespace.clone(),
                    section_name: p.section_name.clone(),
                })
                .collect(),
            hostnames: vec![r.host.clone()],
            rules: vec![RouteRule {
                matches: vec![RouteMatch {
                    path: Some(RoutePath {
                        type_: "PathPrefix".into(),
                        value: "/".into(),
                    }),
                }],
                backend_refs: vec![RouteBackendRef {
                    name: spec.name.server(),
                    port: Some(MCP_TLS_PORT),
                }],
            }],
        },
    }
}

/// The exposed hosts the serving certificate must name besides the Service's names.
pub fn tls_hosts(spec: &Spec) -> Vec<String> {
    spec.expose_host().map(str::to_owned).into_iter().collect()
}

/// The [`TLS_HOSTS_ANNOTATION`] value for `hosts`.
pub fn tls_hosts_value(hosts: &[String]) -> String {
    let mut h: Vec<&str> = hosts.iter().map(String::as_str).collect();
    h.sort_unstable();
    h.dedup();
    h.join(",")
}

/// True when a generated TLS Secret's certificate names every one of `hosts`. A Secret
/// from before this annotation existed has none, which counts as no exposed host: upgrading
/// the operator regenerates nothing, and neither does removing `expose` (a certificate that
/// names one host too many is harmless; a new one would also be a new CA for every client).
pub fn tls_covers(secret: &Secret, hosts: &[String]) -> bool {
    let made_for = secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(TLS_HOSTS_ANNOTATION))
        .map(String::as_str)
        .unwrap_or_default();
    hosts
        .iter()
        .all(|h| made_for.split(',').any(|m| m == h.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::children::test_support::inputs;

    fn built(expose: serde_json::Value) -> Option<Exposed> {
        build(&inputs(serde_json::json!({"server": {"expose": expose}})))
    }

    #[test]
    fn no_expose_builds_nothing() {
        assert!(build(&inputs(serde_json::json!({}))).is_none());
    }

    #[test]
    fn the_ingress_re_encrypts_to_the_servers_tls_port() {
        let Some(Exposed::Ingress(i)) = built(serde_json::json!({"ingress": {
            "host": "mcp.example.com", "className": "nginx", "tlsSecretName": "public-cert",
            "annotations": {"example.com/team": "a"}
        }})) else {
            panic!("an Ingress");
        };
        assert_eq!(i.metadata.name.as_deref(), Some("cli-mcp-demo"));
        assert_eq!(i.metadata.namespace.as_deref(), Some("ns1"));
        let owner = &i.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(owner.uid, "uid-1");
        let labels = i.metadata.labels.as_ref().expect("labels");
        assert_eq!(labels[label::APP_MANAGED_BY], label::MANAGED_BY);
        let ann = i.metadata.annotations.as_ref().expect("annotations");
        assert_eq!(ann[BACKEND_PROTOCOL_ANNOTATION], "HTTPS");
        assert_eq!(ann["example.com/team"], "a");

        let spec = i.spec.as_ref().expect("spec");
        assert_eq!(spec.ingress_class_name.as_deref(), Some("nginx"));
        let tls = &spec.tls.as_ref().expect("tls")[0];
        assert_eq!(
            tls.hosts.as_deref(),
            Some(&["mcp.example.com".to_owned()][..])
        );
        assert_eq!(tls.secret_name.as_deref(), Some("public-cert"));
        let rule = &spec.rules.as_ref().expect("rules")[0];
        assert_eq!(rule.host.as_deref(), Some("mcp.example.com"));
        let path = &rule.http.as_ref().expect("http").paths[0];
        assert_eq!(
            (path.path.as_deref(), path.path_type.as_str()),
            (Some("/"), "Prefix")
        );
        let svc = path.backend.service.as_ref().expect("service backend");
        assert_eq!(svc.name, "cli-mcp-demo");
        assert_eq!(
            svc.port.as_ref().and_then(|p| p.name.as_deref()),
            Some("https")
        );
    }

    #[test]
    fn user_annotations_override_the_backend_protocol() {
        let Some(Exposed::Ingress(i)) = built(serde_json::json!({"ingress": {
            "host": "mcp.example.com",
            "annotations": {"nginx.ingress.kubernetes.io/backend-protocol": "GRPCS"}
        }})) else {
            panic!("an Ingress");
        };
        let ann = i.metadata.annotations.expect("annotations");
        assert_eq!(ann[BACKEND_PROTOCOL_ANNOTATION], "GRPCS");
        let tls = &i.spec.and_then(|s| s.tls).expect("tls")[0];
        assert_eq!(
            tls.secret_name, None,
            "the controller's default certificate"
        );
    }

    #[test]
    fn the_http_route_attaches_to_its_gateways_and_targets_the_tls_port() {
        let Some(Exposed::HttpRoute(r)) = built(serde_json::json!({"httpRoute": {
            "host": "mcp.example.org",
            "parentRefs": [{"name": "gw", "namespace": "infra", "sectionName": "https"}, {"name": "local"}]
        }})) else {
            panic!("an HTTPRoute");
        };
        let v = serde_json::to_value(&r).expect("json");
        assert_eq!(v["apiVersion"], "gateway.networking.k8s.io/v1");
        assert_eq!(v["kind"], "HTTPRoute");
        assert_eq!(v["metadata"]["name"], "cli-mcp-demo");
        assert_eq!(
            v["spec"]["parentRefs"],
            serde_json::json!([{"name": "gw", "namespace": "infra", "sectionName": "https"}, {"name": "local"}])
        );
        assert_eq!(
            v["spec"]["hostnames"],
            serde_json::json!(["mcp.example.org"])
        );
        assert_eq!(
            v["spec"]["rules"],
            serde_json::json!([{
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"name": "cli-mcp-demo", "port": 8443}]
            }])
        );
        // What the API server returns (defaults added) reads back.
        let back: HttpRoute = serde_json::from_value(serde_json::json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": "cli-mcp-demo"},
            "spec": {"rules": [{"backendRefs": [{"group": "", "kind": "Service", "name": "x", "port": 8443, "weight": 1}]}]},
            "status": {"parents": []}
        }))
        .expect("reads back");
        assert_eq!(back.spec.rules[0].backend_refs[0].name, "x");
    }

    #[test]
    fn the_route_re_encrypts_to_the_servers_tls_port() {
        let Some(Exposed::Route(r)) = built(serde_json::json!({"route": {}})) else {
            panic!("a Route");
        };
        let v = serde_json::to_value(&r).expect("json");
        assert_eq!(v["apiVersion"], "route.openshift.io/v1");
        assert_eq!(v["kind"], "Route");
        assert_eq!(v["metadata"]["name"], "cli-mcp-demo");
        assert_eq!(v["metadata"]["ownerReferences"][0]["uid"], "uid-1");
        // No host: the router assigns one. No status is ever sent.
        assert_eq!(
            v["spec"],
            serde_json::json!({
                "to": {"kind": "Service", "name": "cli-mcp-demo"},
                "port": {"targetPort": "https"},
                "tls": {
                    "termination": "reencrypt",
                    "insecureEdgeTerminationPolicy": "Redirect",
                    "destinationCACertificate": "-----BEGIN CERTIFICATE-----\nca\n"
                }
            })
        );
        assert!(v.get("status").is_none());
        // The longest command (default 300 s) plus slack, so the router does not cut it.
        assert_eq!(
            v["metadata"]["annotations"][ROUTE_TIMEOUT_ANNOTATION],
            "330s"
        );

        // With the service CA the router needs no CA: it trusts that one.
        let mut inp = inputs(serde_json::json!({"server": {"expose": {"route": {
            "host": "mcp.apps.example.com", "insecureEdgeTerminationPolicy": "None",
            "annotations": {"haproxy.router.openshift.io/timeout": "2h", "example.com/team": "a"}
        }}}}));
        inp.backend_ca = None;
        let Some(Exposed::Route(r)) = build(&inp) else {
            panic!("a Route");
        };
        assert_eq!(r.spec.host.as_deref(), Some("mcp.apps.example.com"));
        let tls = r.spec.tls.expect("tls");
        assert_eq!(
            tls.insecure_edge_termination_policy.as_deref(),
            Some("None")
        );
        assert_eq!(tls.destination_ca_certificate, None);
        let ann = r.metadata.annotations.expect("annotations");
        assert_eq!(
            ann[ROUTE_TIMEOUT_ANNOTATION], "2h",
            "the user's annotations win"
        );
        assert_eq!(ann["example.com/team"], "a");
    }

    fn observed_route(status: serde_json::Value) -> Route {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "route.openshift.io/v1", "kind": "Route",
            "metadata": {"name": "cli-mcp-demo"},
            "spec": {"host": "cli-mcp-demo-ns1.apps.example.com", "to": {"kind": "Service", "name": "cli-mcp-demo", "weight": 100}, "wildcardPolicy": "None"},
            "status": status
        }))
        .expect("a Route as the API server returns it")
    }

    #[test]
    fn the_published_host_is_the_one_a_router_admitted() {
        let (host, refused) = route_admission(&observed_route(serde_json::json!({})));
        assert_eq!((host, refused), (None, None), "no router has seen it yet");

        let admitted = observed_route(serde_json::json!({"ingress": [{
            "host": "cli-mcp-demo-ns1.apps.example.com", "routerName": "default",
            "wildcardPolicy": "None", "routerCanonicalHostname": "router-default.apps.example.com",
            "conditions": [{"type": "Admitted", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]
        }]}));
        let (host, refused) = route_admission(&admitted);
        assert_eq!(host.as_deref(), Some("cli-mcp-demo-ns1.apps.example.com"));
        assert_eq!(refused, None);

        let taken = observed_route(serde_json::json!({"ingress": [{
            "host": "mcp.example.com", "routerName": "default",
            "conditions": [{"type": "Admitted", "status": "False", "reason": "HostAlreadyClaimed",
                "message": "route x already exposes mcp.example.com and is older"}]
        }]}));
        let (host, refused) = route_admission(&taken);
        assert_eq!(host, None);
        let refused = refused.expect("why");
        assert!(
            refused.contains("HostAlreadyClaimed") && refused.contains("already exposes"),
            "{refused}"
        );
        assert!(
            refused.contains("spec.server.expose.route.host"),
            "{refused}"
        );

        // One router admitting it is enough (another shard refusing is not a problem).
        let mut both = admitted.clone();
        let st = both.status.as_mut().expect("status");
        st.ingress
            .push(taken.status.expect("status").ingress[0].clone());
        let (host, refused) = route_admission(&both);
        assert!(host.is_some());
        assert_eq!(refused, None);
    }

    #[test]
    fn the_certificate_is_regenerated_only_when_the_hosts_change() {
        let spec = inputs(
            serde_json::json!({"server": {"expose": {"ingress": {"host": "mcp.example.com"}}}}),
        )
        .spec;
        let hosts = tls_hosts(&spec);
        assert_eq!(hosts, ["mcp.example.com"]);
        let mut s = Secret::default();
        assert!(!tls_covers(&s, &hosts), "made before the host was set");
        assert!(tls_covers(&s, &[]), "an old Secret without expose stays");
        s.metadata.annotations = Some(BTreeMap::from([(
            TLS_HOSTS_ANNOTATION.to_owned(),
            tls_hosts_value(&hosts),
        )]));
        assert!(tls_covers(&s, &hosts));
        assert!(!tls_covers(&s, &["other.example.com".to_owned()]));
        assert!(
            tls_covers(&s, &[]),
            "removing expose keeps the certificate (and its CA)"
        );
    }
}
