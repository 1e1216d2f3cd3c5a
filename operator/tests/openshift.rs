//! On OpenShift (detected by its `route.openshift.io` API group):
//! - sandbox pods fix no user, group or fsGroup: the `restricted-v2` SCC assigns a UID from
//!   the namespace's range and refuses a pod that names another;
//! - the service CA issues the server's certificate (the Service's
//!   `serving-cert-secret-name` annotation) and its bundle is what clients get in the CA
//!   ConfigMap (through a ConfigMap with the `inject-cabundle` annotation);
//! - `spec.server.expose.route` is a re-encrypting Route whose admitted host is published.
//!
//! Elsewhere none of this appears. The test owns a private cluster: the Route CRD it installs
//! (a stand-in, enough for discovery and for storing Routes) would make every other test's
//! operator take the cluster for OpenShift. OpenShift's controllers are not there, so the
//! test plays them: the service CA (issuing the Secret, injecting the bundle) and the router
//! (writing the Route's status).

mod support;

use std::collections::BTreeMap;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::InstanceName;
use cli_mcp_api::sandbox::{SandboxConfig, SANDBOX_UID};
use cli_mcp_e2e::instance::wait_instance;
use cli_mcp_e2e::testing::{private_cluster, wait_for, wait_for_set, wait_gone, TestNamespace};
use cli_mcp_operator::children::secrets::{
    self, INJECT_CABUNDLE_ANNOTATION, SERVICE_CA_KEY, SERVING_CERT_ANNOTATION,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::ByteString;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use support::*;

fn pod_ids(p: &Pod) -> (Option<i64>, Option<i64>, Option<i64>) {
    let sc = p
        .spec
        .as_ref()
        .and_then(|s| s.security_context.clone())
        .unwrap_or_default();
    assert_eq!(sc.run_as_non_root, Some(true), "{p:?}");
    (sc.run_as_user, sc.run_as_group, sc.fs_group)
}

/// The SandboxConfig the operator hands the server (its on-demand pods are built from it).
async fn server_sandbox_config(
    ns: &cli_mcp_e2e::testing::TestNamespace,
    n: &InstanceName,
    assigns: bool,
) {
    let d = wait_for(
        ns.api::<Deployment>(),
        &n.server(),
        "the server's sandbox config",
        TIMEOUT,
        |d: Option<&Deployment>| {
            d.and_then(|d| d.spec.template.spec.as_ref())
                .and_then(|p| p.containers[0].env.clone())
                .into_iter()
                .flatten()
                .find(|e| e.name == cli_mcp_operator::children::deployment::SANDBOX_CONFIG_ENV)
                .and_then(|e| e.value)
                .and_then(|v| serde_json::from_str::<SandboxConfig>(&v).ok())
                .is_some_and(|c| c.platform_assigns_uid == assigns)
        },
    )
    .await;
    assert!(
        d.is_ok(),
        "server Deployment never carried platformAssignsUid={assigns}: {d:?}"
    );
}

/// Names of the Secrets the server Deployment mounts.
fn mounted_secrets(d: &Deployment) -> Vec<String> {
    d.spec
        .template
        .spec
        .as_ref()
        .and_then(|p| p.volumes.clone())
        .into_iter()
        .flatten()
        .filter_map(|v| v.secret?.secret_name)
        .collect()
}

fn annotation(meta: &ObjectMeta, key: &str) -> Option<String> {
    meta.annotations.as_ref()?.get(key).cloned()
}

/// Waits until the instance satisfies `ok`, and returns it.
async fn wait_cr(
    ns: &TestNamespace,
    name: &str,
    what: &str,
    op: &Operator,
    ok: impl Fn(&CliMcpInstance) -> bool,
) -> CliMcpInstance {
    op.ok(wait_instance(ns.api::<CliMcpInstance>(), name, what, TIMEOUT, ok).await)
}

#[tokio::test]
async fn on_openshift_uids_the_serving_certificate_and_the_route_come_from_the_platform() {
    let pc = private_cluster("openshift").await.expect("private cluster");
    let c = &pc.test;
    install_crd(c).await;
    let ns = c.namespace("openshift").await.expect("namespace");
    let name = "oc";
    let n = InstanceName::parse(name).expect("name");
    create_instance(&ns, name, json!({"sandbox": {"warmPoolSize": 1}})).await;

    // Plain Kubernetes: the fixed UID, and the instance's own CA.
    let mut op = Operator::start(c, &ns.name, "k8s");
    let pool = wait_pool(&ns, name, 1, &op).await;
    let fixed = Some(SANDBOX_UID);
    assert_eq!(pod_ids(&pool[0]), (fixed, fixed, fixed));
    server_sandbox_config(&ns, &n, false).await;
    elsewhere_the_instance_ca_serves(&ns, &n, &op).await;
    // The Route watch found no Route API once and backs off: it does not list again every
    // second, flipping between served and not, for as long as the operator runs.
    let log = std::fs::read_to_string(&op.log).expect("operator log");
    assert_eq!(
        log.matches("serves no route.openshift.io/v1 Route").count(),
        1,
        "{log}"
    );
    assert!(!log.contains("watching OpenShift Routes"), "{log}");
    op.kill();

    // The cluster now serves route.openshift.io: a restarted operator detects OpenShift, and
    // the pool is replaced by pods without a fixed UID (the sandbox config's hash changed).
    apply_crd(
        c,
        serde_yaml::from_str(include_str!("fixtures/route-crd.yaml")).expect("fixture"),
    )
    .await;
    let op = Operator::start(c, &ns.name, "openshift");
    let replaced = wait_for_set(
        ns.api::<Pod>(),
        &n.unassigned_selector(),
        "pool pods without a fixed UID",
        TIMEOUT,
        |pods: &[Pod]| {
            !pods.is_empty()
                && pods.iter().all(|p| {
                    p.metadata.deletion_timestamp.is_none() && pod_ids(p) == (None, None, None)
                })
        },
    )
    .await;
    assert!(replaced.is_ok(), "{replaced:?}\n{}", op.log_tail());
    server_sandbox_config(&ns, &n, true).await;
    assert!(
        op.log_tail().contains("OpenShift"),
        "the operator did not say it detected OpenShift:\n{}",
        op.log_tail()
    );

    the_service_ca_serves(&ns, &n, &op).await;
    a_route_publishes_the_endpoint(&c.client, &ns, &n, &op).await;
    finish(ns, name, &op).await;
}

/// Off OpenShift: no service CA annotation anywhere; the generated certificate is mounted and
/// its CA is in the CA ConfigMap.
async fn elsewhere_the_instance_ca_serves(ns: &TestNamespace, n: &InstanceName, op: &Operator) {
    wait_ready(ns, n.as_str(), op).await;
    let svc = ns.api::<Service>().get(&n.server()).await.expect("Service");
    assert_eq!(annotation(&svc.metadata, SERVING_CERT_ANNOTATION), None);
    let d = ns
        .api::<Deployment>()
        .get(&n.server())
        .await
        .expect("Deployment");
    assert_eq!(mounted_secrets(&d), [n.hmac_secret(), n.tls_secret()]);
    let ca = ns
        .api::<ConfigMap>()
        .get(&secrets::ca_config_map_name(n))
        .await
        .expect("CA ConfigMap");
    assert_eq!(annotation(&ca.metadata, INJECT_CABUNDLE_ANNOTATION), None);
    assert!(ca.data.is_some_and(|d| d.contains_key(secrets::CA_CRT)));
    let injected = ns
        .api::<ConfigMap>()
        .get_opt(&secrets::service_ca_config_map_name(n))
        .await
        .expect("read");
    assert!(injected.is_none(), "{injected:?}");
}

/// The service CA's side, played by the test: it issues (or renews) the Secret from `ca`,
/// a chain with its CA as OpenShift's carries an intermediate.
async fn issue_as_service_ca(
    ns: &TestNamespace,
    n: &InstanceName,
    svc: &Service,
    ca: &secrets::CaMaterial,
) {
    let m = secrets::issue_serving_cert(
        ca,
        &n.server(),
        &ns.name,
        &[],
        std::time::Duration::from_secs(3600),
    )
    .expect("certificate");
    let secret_name = secrets::service_tls_secret_name(n);
    let b = |s: &str| ByteString(s.as_bytes().to_vec());
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(secret_name.clone()),
            annotations: Some(BTreeMap::from([
                (
                    "service.beta.openshift.io/originating-service-name".to_owned(),
                    svc.name_any(),
                ),
                (
                    "service.beta.openshift.io/originating-service-uid".to_owned(),
                    svc.uid().unwrap_or_default(),
                ),
            ])),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Service".into(),
                name: svc.name_any(),
                uid: svc.uid().unwrap_or_default(),
                ..Default::default()
            }]),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            (
                "tls.crt".to_owned(),
                b(&format!("{}{}", m.cert_pem, m.ca_pem)),
            ),
            ("tls.key".to_owned(), b(&m.key_pem)),
        ])),
        ..Default::default()
    };
    let secrets_api = ns.api::<Secret>();
    match secrets_api.get_opt(&secret_name).await.expect("read") {
        None => {
            secrets_api
                .create(&PostParams::default(), &secret)
                .await
                .expect("issue the certificate");
        }
        Some(old) => {
            let mut renewed = secret;
            renewed.metadata.resource_version = old.resource_version();
            secrets_api
                .replace(&secret_name, &PostParams::default(), &renewed)
                .await
                .expect("renew the certificate");
        }
    }
}

/// The service CA's injector, played by the test: it replaces the ConfigMap's data with its
/// bundle.
async fn inject_as_service_ca(ns: &TestNamespace, n: &InstanceName, bundle: &str) {
    let cms = ns.api::<ConfigMap>();
    let mut cm = cms
        .get(&secrets::service_ca_config_map_name(n))
        .await
        .expect("the ConfigMap to inject into");
    cm.data = Some(BTreeMap::from([(
        SERVICE_CA_KEY.to_owned(),
        bundle.to_owned(),
    )]));
    cms.replace(&cm.name_any(), &PostParams::default(), &cm)
        .await
        .expect("inject the bundle");
}

async fn the_service_ca_serves(ns: &TestNamespace, n: &InstanceName, op: &Operator) {
    let name = n.as_str();
    let service_tls = secrets::service_tls_secret_name(n);
    let svc = op.ok(wait_for(
        ns.api::<Service>(),
        &n.server(),
        "the Service asking the service CA for a certificate",
        TIMEOUT,
        |s: Option<&Service>| {
            s.and_then(|s| annotation(&s.metadata, SERVING_CERT_ANNOTATION))
                .as_deref()
                == Some(service_tls.as_str())
        },
    )
    .await);
    let svc = svc.expect("Service");
    let injected = ns
        .api::<ConfigMap>()
        .get(&secrets::service_ca_config_map_name(n))
        .await
        .expect("the ConfigMap for the service CA bundle");
    assert_eq!(
        annotation(&injected.metadata, INJECT_CABUNDLE_ANNOTATION).as_deref(),
        Some("true")
    );
    assert_eq!(injected.data, None, "the injector owns the data");

    // Until the service CA has answered, the instance says what it waits for.
    let cr = wait_cr(ns, name, "Ready ServingCertificatePending", op, |cr| {
        find_condition(cr, "Ready").is_some_and(|c| c.reason == "ServingCertificatePending")
    })
    .await;
    let msg = find_condition(&cr, "Ready")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        msg.contains(&service_tls) && msg.contains(&secrets::service_ca_config_map_name(n)),
        "{msg}"
    );

    // The one part a real cluster would do here and this one cannot: OpenShift's service CA
    // controller issuing the Secret and injecting its bundle.
    let service_ca = secrets::generate_tls_ca("openshift-service-serving-signer", "openshift")
        .expect("a service CA");
    issue_as_service_ca(ns, n, &svc, &service_ca).await;
    inject_as_service_ca(ns, n, &service_ca.cert_pem).await;
    let ca = service_ca.cert_pem.clone();
    let d = op.ok(wait_for(
        ns.api::<Deployment>(),
        &n.server(),
        "the server on the service CA's certificate",
        TIMEOUT,
        |d: Option<&Deployment>| {
            d.is_some_and(|d| {
                mounted_secrets(d) == [n.hmac_secret(), service_tls.clone()]
                    && template_annotation(d, "cli-mcp.redhat.com/tls-version").is_some()
            })
        },
    )
    .await);
    // The server starts with it: the instance becomes Ready.
    let cr = wait_ready(ns, name, op).await;
    let published = cr.status.and_then(|s| s.ca_config_map);
    assert_eq!(published, Some(secrets::ca_config_map_name(n)));
    let ca_cm = ns
        .api::<ConfigMap>()
        .get(&secrets::ca_config_map_name(n))
        .await
        .expect("CA ConfigMap");
    let data = ca_cm.data.unwrap_or_default();
    assert_eq!(
        data.get(secrets::CA_CRT),
        Some(&ca),
        "clients read the service CA under ca.crt, as everywhere"
    );

    // The service CA renews the certificate from the same CA (only the Secret changes): the
    // server rolls onto the new one. (That the Secret's own change wakes the instance, when
    // nothing else does, is `watch::tests::a_renewed_service_ca_certificate_wakes_its_instance`.)
    let before = d
        .as_ref()
        .and_then(|d| template_annotation(d, "cli-mcp.redhat.com/tls-version"));
    issue_as_service_ca(ns, n, &svc, &service_ca).await;
    wait_rolled(
        ns,
        &n.server(),
        "cli-mcp.redhat.com/tls-version",
        before.as_deref(),
        op,
    )
    .await;
    wait_ready(ns, name, op).await;

    // It rotates itself: the injected bundle (both CAs, as OpenShift's during a rotation)
    // reaches clients under ca.crt.
    let next = secrets::generate_tls_ca("openshift-service-serving-signer", "openshift")
        .expect("the next service CA");
    let both = format!("{}{}", service_ca.cert_pem, next.cert_pem);
    inject_as_service_ca(ns, n, &both).await;
    op.ok(wait_for(
        ns.api::<ConfigMap>(),
        &secrets::ca_config_map_name(n),
        "the rotated bundle in the CA ConfigMap",
        TIMEOUT,
        |cm: Option<&ConfigMap>| {
            cm.and_then(|c| c.data.as_ref()?.get(secrets::CA_CRT).cloned())
                .as_ref()
                == Some(&both)
        },
    )
    .await);
}

async fn a_route_publishes_the_endpoint(
    client: &kube::Client,
    ns: &TestNamespace,
    n: &InstanceName,
    op: &Operator,
) {
    let name = n.as_str();
    let ar = ApiResource {
        group: "route.openshift.io".into(),
        version: "v1".into(),
        api_version: "route.openshift.io/v1".into(),
        kind: "Route".into(),
        plural: "routes".into(),
    };
    let routes: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns.name, &ar);
    ns.api::<CliMcpInstance>()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"server": {"expose": {"route": {}}}}})),
        )
        .await
        .expect("ask for a Route");
    let route = op.ok(wait_for(
        routes.clone(),
        &n.server(),
        "the Route",
        TIMEOUT,
        |r: Option<&DynamicObject>| r.is_some(),
    )
    .await);
    let route = route.expect("Route");
    assert_eq!(
        route.data["spec"],
        json!({
            "to": {"kind": "Service", "name": n.server()},
            "port": {"targetPort": "https"},
            // No destinationCACertificate: the router trusts the service CA by itself.
            "tls": {"termination": "reencrypt", "insecureEdgeTerminationPolicy": "Redirect"}
        })
    );
    assert_eq!(
        annotation(&route.metadata, "haproxy.router.openshift.io/timeout").as_deref(),
        Some("330s")
    );
    assert_eq!(
        route
            .metadata
            .owner_references
            .as_ref()
            .map(|o| o[0].kind.as_str()),
        Some("CliMcpInstance")
    );

    // The router admits it under the host it assigned: that host is published.
    let host = format!("{}-{}.apps.example.test", n.server(), ns.name);
    let status = |admitted: &str, reason: Option<&str>| {
        json!({"status": {"ingress": [{
            "host": host, "routerName": "default", "wildcardPolicy": "None",
            "conditions": [{"type": "Admitted", "status": admitted, "reason": reason,
                "message": reason.map(|_| "a route in another namespace holds this host"),
                "lastTransitionTime": "2026-01-01T00:00:00Z"}]
        }]}})
    };
    routes
        .patch_status(
            &n.server(),
            &PatchParams::default(),
            &Patch::Merge(status("True", None)),
        )
        .await
        .expect("the router's status");
    let endpoint = format!("https://{host}/mcp");
    wait_cr(ns, name, "the Route's host published", op, |cr| {
        cr.status
            .as_ref()
            .and_then(|s| s.external_endpoint.as_deref())
            == Some(endpoint.as_str())
    })
    .await;

    // A router refusing it: said where an admin looks, and nothing is published.
    routes
        .patch_status(
            &n.server(),
            &PatchParams::default(),
            &Patch::Merge(status("False", Some("HostAlreadyClaimed"))),
        )
        .await
        .expect("the router's status");
    let cr = wait_cr(ns, name, "Degraded ExposeUnavailable", op, |cr| {
        find_condition(cr, "Degraded").is_some_and(|c| c.reason == "ExposeUnavailable")
    })
    .await;
    let msg = find_condition(&cr, "Degraded")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        msg.contains("HostAlreadyClaimed") && msg.contains(&host),
        "{msg}"
    );
    assert_eq!(cr.status.and_then(|s| s.external_endpoint), None);

    // Removing expose deletes the Route.
    ns.api::<CliMcpInstance>()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"server": {"expose": null}}})),
        )
        .await
        .expect("remove expose");
    op.ok(wait_gone(routes, &n.server(), "the Route deleted", TIMEOUT).await);
    wait_cr(ns, name, "no external endpoint", op, |cr| {
        cr.status
            .as_ref()
            .is_some_and(|s| s.external_endpoint.is_none())
            && find_condition(cr, "Degraded").is_some_and(|c| c.status == "False")
    })
    .await;
}
