//! `spec.server.expose` and `spec.server.authorization` on the real API server: the operator
//! publishes the endpoint through an Ingress or a Gateway API HTTPRoute, renders the OAuth
//! flags, names the host in the generated certificate, and deletes what is no longer asked
//! for. The HTTPRoute CRD is a minimal stand-in (`fixtures/httproute-crd.yaml`): the shape of
//! the object is what is checked, not a Gateway implementation.

mod support;

use cli_mcp_api::crd::{CliMcpInstance, CliMcpInstanceStatus};
use cli_mcp_api::names::InstanceName;
use cli_mcp_e2e::instance::wait_instance;
use cli_mcp_e2e::testing::{cluster, wait_for, wait_gone, TestCluster, TestNamespace};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::networking::v1::Ingress;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::Api;
use serde_json::json;

use support::*;

const ROUTE_CRD: &str = "httproutes.gateway.networking.k8s.io";

fn server_args(d: &Deployment) -> Vec<String> {
    d.spec
        .template
        .spec
        .as_ref()
        .and_then(|p| p.containers.first())
        .and_then(|c| c.args.clone())
        .unwrap_or_default()
}

fn flag_values(args: &[String], flag: &str) -> Vec<String> {
    args.windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].clone())
        .collect()
}

async fn patch_server(ns: &TestNamespace, name: &str, server: serde_json::Value) {
    ns.api::<CliMcpInstance>()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"server": server}})),
        )
        .await
        .expect("patch spec.server");
}

#[tokio::test]
async fn an_ingress_publishes_the_endpoint_and_goes_when_expose_is_removed() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("expose-ingress").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    let name = "pub";
    let n = InstanceName::parse(name).expect("name");
    create_instance(
        &ns,
        name,
        json!({"server": {
            "authorization": {"servers": ["https://idp.example.com/realms/dev"], "scopes": ["mcp"]},
            "expose": {"ingress": {"host": "mcp.example.com", "className": "nginx",
                "annotations": {"example.com/owner": "team-a"}}}
        }}),
    )
    .await;

    let ingress = wait_exists(ns.api::<Ingress>(), &n.server(), "the Ingress", &op).await;
    let ann = ingress.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        ann.get("nginx.ingress.kubernetes.io/backend-protocol")
            .map(String::as_str),
        Some("HTTPS"),
        "the controller re-encrypts to the TLS-only server"
    );
    assert_eq!(
        ann.get("example.com/owner").map(String::as_str),
        Some("team-a")
    );
    let spec = ingress.spec.clone().expect("Ingress spec");
    assert_eq!(spec.ingress_class_name.as_deref(), Some("nginx"));
    let rule = &spec.rules.expect("rules")[0];
    assert_eq!(rule.host.as_deref(), Some("mcp.example.com"));
    let backend = rule.http.as_ref().expect("http").paths[0]
        .backend
        .service
        .clone()
        .expect("service backend");
    assert_eq!(backend.name, n.server());
    assert_eq!(backend.port.and_then(|p| p.name).as_deref(), Some("https"));
    assert_eq!(
        spec.tls.expect("tls")[0].hosts.as_deref(),
        Some(&["mcp.example.com".to_owned()][..])
    );

    // The server is told who issues tokens and its public URL (from the host).
    let d = ns
        .api::<Deployment>()
        .get(&n.server())
        .await
        .expect("Deployment");
    let args = server_args(&d);
    assert_eq!(
        flag_values(&args, "--authorization-server"),
        ["https://idp.example.com/realms/dev"]
    );
    assert_eq!(
        flag_values(&args, "--resource-url"),
        ["https://mcp.example.com/mcp"]
    );
    assert_eq!(flag_values(&args, "--scope"), ["mcp"]);

    // The generated certificate was made for the host.
    let tls = ns
        .api::<Secret>()
        .get(&n.tls_secret())
        .await
        .expect("TLS Secret");
    assert_eq!(
        tls.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("cli-mcp.redhat.com/tls-hosts"))
            .map(String::as_str),
        Some("mcp.example.com")
    );

    let st = wait_instance_status(&ns, name, "the external endpoint", &op, |s| {
        s.external_endpoint.as_deref() == Some("https://mcp.example.com/mcp")
    })
    .await;
    assert_eq!(
        st.endpoint.as_deref(),
        Some(format!("https://cli-mcp-{name}.{}.svc:8443/mcp", ns.name).as_str())
    );

    // A new host: the generated certificate is regenerated for it, the server rolls.
    let before = template_annotation(&d, "cli-mcp.redhat.com/tls-version");
    patch_server(
        &ns,
        name,
        json!({"expose": {"ingress": {"host": "mcp2.example.com"}}}),
    )
    .await;
    op.ok(wait_for(
        ns.api::<Secret>(),
        &n.tls_secret(),
        "the certificate for the new host",
        TIMEOUT,
        |o: Option<&Secret>| {
            o.and_then(|s| s.metadata.annotations.as_ref())
                .and_then(|a| a.get("cli-mcp.redhat.com/tls-hosts"))
                .is_some_and(|h| h == "mcp2.example.com")
        },
    )
    .await);
    wait_rolled(
        &ns,
        &n.server(),
        "cli-mcp.redhat.com/tls-version",
        before.as_deref(),
        &op,
    )
    .await;

    // Removing expose deletes the Ingress and the external endpoint.
    patch_server(
        &ns,
        name,
        json!({"expose": null, "authorization": {"resourceUrl": "https://mcp.example.com/mcp"}}),
    )
    .await;
    op.ok(wait_gone(
        ns.api::<Ingress>(),
        &n.server(),
        "the Ingress deleted",
        TIMEOUT,
    )
    .await);
    wait_instance_status(&ns, name, "no external endpoint", &op, |s| {
        s.external_endpoint.is_none()
    })
    .await;
    finish(ns, name, &op).await;
}

/// Waits until the instance's status satisfies `ok`, and returns it.
async fn wait_instance_status(
    ns: &TestNamespace,
    name: &str,
    what: &str,
    op: &Operator,
    ok: impl Fn(&CliMcpInstanceStatus) -> bool,
) -> CliMcpInstanceStatus {
    let cr = op.ok(
        wait_instance(ns.api::<CliMcpInstance>(), name, what, TIMEOUT, |cr| {
            cr.status.as_ref().is_some_and(&ok)
        })
        .await,
    );
    cr.status.unwrap_or_default()
}

/// Waits until the instance says `Degraded=True ExposeUnavailable`; returns it and the
/// condition's message.
async fn expose_unavailable(
    ns: &TestNamespace,
    name: &str,
    op: &Operator,
) -> (CliMcpInstance, String) {
    let cr = op.ok(wait_instance(
        ns.api::<CliMcpInstance>(),
        name,
        "Degraded ExposeUnavailable",
        TIMEOUT,
        |cr| {
            find_condition(cr, "Degraded")
                .is_some_and(|c| c.status == "True" && c.reason == "ExposeUnavailable")
        },
    )
    .await);
    let msg = find_condition(&cr, "Degraded")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    (cr, msg)
}

/// Waits until object `name` exists, and returns it.
async fn wait_exists<K>(api: Api<K>, name: &str, what: &str, op: &Operator) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let o = op.ok(wait_for(api, name, what, TIMEOUT, |o: Option<&K>| o.is_some()).await);
    o.expect("it exists")
}

/// Installs the stand-in HTTPRoute CRD and waits until it is Established.
async fn install_route_crd(c: &TestCluster) {
    let text = include_str!("fixtures/httproute-crd.yaml");
    apply_crd(c, serde_yaml::from_str(text).expect("fixture parses")).await;
}

/// Deletes the stand-in HTTPRoute CRD (a previous run's) and waits until it is gone.
async fn remove_route_crd(c: &TestCluster) {
    let api: Api<CustomResourceDefinition> = Api::all(c.client.clone());
    match api.delete(ROUTE_CRD, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return,
        Err(e) => panic!("delete HTTPRoute CRD: {e}"),
    }
    wait_gone(api, ROUTE_CRD, "HTTPRoute CRD gone", TIMEOUT)
        .await
        .expect("HTTPRoute CRD deleted");
}

/// Only this test binary installs the HTTPRoute CRD, so it may remove it first to see the
/// operator in a cluster without the Gateway API.
#[tokio::test]
async fn an_http_route_waits_for_the_gateway_api_and_then_attaches_to_its_gateway() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    remove_route_crd(&c).await;
    let ns = c.namespace("expose-route").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    let name = "routed";
    let n = InstanceName::parse(name).expect("name");
    create_instance(
        &ns,
        name,
        json!({"server": {"expose": {"httpRoute": {
            "host": "mcp.example.org",
            "parentRefs": [{"name": "public", "namespace": "gateways", "sectionName": "https"}]
        }}}}),
    )
    .await;

    // No Gateway API: a clear condition, not a crash or a bare 404.
    let (cr, msg) = expose_unavailable(&ns, name, &op).await;
    assert!(
        msg.contains("gateway.networking.k8s.io/v1 HTTPRoute")
            && msg.contains("install the Gateway API CRDs"),
        "{msg}"
    );
    assert_eq!(cr.status.and_then(|s| s.external_endpoint), None);

    // Installed later: picked up without a restart.
    install_route_crd(&c).await;
    let ar = ApiResource {
        group: "gateway.networking.k8s.io".into(),
        version: "v1".into(),
        api_version: "gateway.networking.k8s.io/v1".into(),
        kind: "HTTPRoute".into(),
        plural: "httproutes".into(),
    };
    let routes: Api<DynamicObject> = Api::namespaced_with(c.client.clone(), &ns.name, &ar);
    let route = wait_exists(routes.clone(), &n.server(), "the HTTPRoute", &op).await;
    let spec = &route.data["spec"];
    assert_eq!(
        spec["parentRefs"],
        json!([{"name": "public", "namespace": "gateways", "sectionName": "https"}])
    );
    assert_eq!(spec["hostnames"], json!(["mcp.example.org"]));
    assert_eq!(
        spec["rules"][0]["backendRefs"],
        json!([{"name": n.server(), "port": 8443}])
    );
    let owner = &route.metadata.owner_references.as_ref().expect("owner")[0];
    assert_eq!(owner.kind, "CliMcpInstance");
    wait_instance_status(&ns, name, "the external endpoint", &op, |s| {
        s.external_endpoint.as_deref() == Some("https://mcp.example.org/mcp")
    })
    .await;

    // Switching to an Ingress replaces the route.
    patch_server(
        &ns,
        name,
        json!({"expose": {"httpRoute": null, "ingress": {"host": "mcp.example.org"}}}),
    )
    .await;
    op.ok(wait_gone(routes, &n.server(), "the HTTPRoute deleted", TIMEOUT).await);
    wait_exists(ns.api::<Ingress>(), &n.server(), "the Ingress", &op).await;
    finish(ns, name, &op).await;
    remove_route_crd(&c).await;
}

/// Off OpenShift (this shared cluster serves no route.openshift.io), a Route is not made: a
/// clear condition says so, and nothing of OpenShift's service CA appears.
#[tokio::test]
async fn a_route_off_openshift_is_reported_and_nothing_of_the_service_ca_appears() {
    use k8s_openapi::api::core::v1::{ConfigMap, Service};

    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("expose-ocp-route").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    let name = "ocroute";
    let n = InstanceName::parse(name).expect("name");
    create_instance(
        &ns,
        name,
        json!({"server": {"expose": {"route": {"host": "mcp.apps.example.com"}}}}),
    )
    .await;
    let (cr, msg) = expose_unavailable(&ns, name, &op).await;
    assert!(
        msg.contains("route.openshift.io/v1 Route") && msg.contains("use expose.ingress"),
        "{msg}"
    );
    assert_eq!(cr.status.and_then(|s| s.external_endpoint), None);

    let svc = ns.api::<Service>().get(&n.server()).await.expect("Service");
    let ann = svc.metadata.annotations.unwrap_or_default();
    assert!(
        !ann.contains_key("service.beta.openshift.io/serving-cert-secret-name"),
        "{ann:?}"
    );
    let injected = ns
        .api::<ConfigMap>()
        .get_opt(&format!("{}-service-ca", n.server()))
        .await
        .expect("read");
    assert!(injected.is_none(), "{injected:?}");
    finish(ns, name, &op).await;
}
