//! Coming from the Go operator: an instance it ran, with the children it left (made by
//! another field manager, as its controller-runtime client made them), is taken over on the
//! real API server. The Go server Deployment with its kube-rbac-proxy sidecar is replaced,
//! not merged into; the sidecar's ConfigMap and the Go-era sandbox pods go; the children of
//! the same names are adopted with this operator's content; the Go-era
//! `spec.serverContainer` still shapes the server container; the instance becomes Ready.

mod support;

use std::collections::BTreeMap;

use cli_mcp_api::names::{label, InstanceName};
use cli_mcp_e2e::testing::{cluster, wait_gone};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::Role;
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use support::*;

/// The Go operator's controller-runtime client writes with this manager name.
const GO_MANAGER: &str = "manager";

fn go_post() -> PostParams {
    PostParams {
        field_manager: Some(GO_MANAGER.into()),
        ..Default::default()
    }
}

/// Labels the Go operator put on an instance's children: only these, no managed-by.
fn go_labels(instance: &str, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (label::INSTANCE.to_string(), instance.to_string()),
        (label::COMPONENT.to_string(), component.to_string()),
    ])
}

/// A Go-era sandbox pod: held before scheduling (a scheduling gate), so no kubelet runs the
/// Go agent image this cluster does not have, and deleting it is immediate.
fn go_sandbox_pod(name: &str, instance: &str, session: Option<&str>) -> Pod {
    let mut labels = go_labels(instance, "sandbox");
    if let Some(sid) = session {
        labels.insert(label::SESSION_ID.to_string(), sid.to_string());
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels,
                     "annotations": {"cli-mcp.redhat.com/sandbox-overlay": "0123abcd"}},
        "spec": {
            "schedulingGates": [{"name": "cli-mcp.test/go-era"}],
            "containers": [{"name": "sandbox", "image": "quay.io/example/cli-mcp-sandbox:latest"}]
        }
    }))
    .expect("pod")
}

#[tokio::test]
async fn a_go_era_instance_and_its_children_are_taken_over() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("migrate").await.expect("namespace");
    let name = "legacy";
    let n = InstanceName::parse(name).expect("name");
    // The Go operator's CR shape: spec.sandbox as it wrote it and spec.serverContainer, its
    // name for the server container's settings.
    let server_resources = json!({"requests": {"cpu": "70m", "memory": "80Mi"},
                                  "limits": {"cpu": "700m", "memory": "300Mi"}});
    let cr = create_instance(
        &ns,
        name,
        json!({"sandbox": {"warmPoolSize": 1, "idleTimeout": "30m",
                            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}},
               "serverContainer": {"resources": server_resources, "imagePullPolicy": "IfNotPresent"}}),
    )
    .await;
    // Kept, not pruned as an unknown field.
    assert!(cr.spec.server_container.is_some(), "{:?}", cr.spec);
    let owner = json!([{
        "apiVersion": "cli-mcp.redhat.com/v1alpha1", "kind": "CliMcpInstance",
        "name": name, "uid": cr.uid().expect("uid"), "controller": true
    }]);

    // What the Go operator left: the server Deployment with its sidecar (no replicas, so no
    // pod tries to run its images), the sidecar's ConfigMap, a Role with its rules, and a
    // pool pod and a session pod named as it named them.
    let go_deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": n.server(), "labels": go_labels(name, "server"), "ownerReferences": owner},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": go_labels(name, "server")},
            "template": {
                "metadata": {"labels": go_labels(name, "server")},
                "spec": {
                    "containers": [
                        {"name": "mcp", "image": "quay.io/example/cli-mcp-server:latest"},
                        {"name": "kube-rbac-proxy", "image": "quay.io/brancz/kube-rbac-proxy:v0.19.1",
                         "args": ["--secure-listen-address=0.0.0.0:8443"],
                         "volumeMounts": [{"name": "kube-rbac-proxy-config", "mountPath": "/etc/kube-rbac-proxy"}]}
                    ],
                    "volumes": [{"name": "kube-rbac-proxy-config",
                                 "configMap": {"name": format!("{}-krp", n.server())}}]
                }
            }
        }
    }))
    .expect("deployment");
    let go_deployment = ns
        .api::<Deployment>()
        .create(&go_post(), &go_deployment)
        .await
        .expect("create the Go server Deployment");
    let krp: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": format!("{}-krp", n.server()), "labels": go_labels(name, "server"),
                     "ownerReferences": owner},
        "data": {"config.yaml": "authorization:\n  resourceAttributes: {resource: climcpinstances, subresource: mcp}\n"}
    }))
    .expect("configmap");
    ns.api::<ConfigMap>()
        .create(&go_post(), &krp)
        .await
        .expect("create the krp ConfigMap");
    let go_role: Role = serde_json::from_value(json!({
        "metadata": {"name": n.server(), "labels": {label::INSTANCE: name}, "ownerReferences": owner},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "delete"]}]
    }))
    .expect("role");
    ns.api::<Role>()
        .create(&go_post(), &go_role)
        .await
        .expect("create the Go Role");
    let pods = ns.api::<Pod>();
    for p in [
        go_sandbox_pod(
            "cli-mcp-sandbox-9b2e4c1d-5f6a-4b7c-8d9e-0f1a2b3c4d5e",
            name,
            None,
        ),
        go_sandbox_pod("cli-mcp-sandbox-s1", name, Some("s1")),
    ] {
        pods.create(&go_post(), &p).await.expect("create a Go pod");
    }

    let op = Operator::start(&c, &ns.name, "op");
    wait_ready(&ns, name, &op).await;

    // The server Deployment is this operator's, made again: one container, no sidecar.
    let d = ns
        .api::<Deployment>()
        .get(&n.server())
        .await
        .expect("server Deployment");
    assert_ne!(
        d.uid(),
        go_deployment.uid(),
        "the Go Deployment was merged into"
    );
    let spec = d.spec.template.spec.as_ref().expect("pod spec");
    let containers: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(containers, ["server"], "{d:?}");
    // spec.serverContainer still shapes the server container.
    let server = &spec.containers[0];
    assert_eq!(
        serde_json::to_value(&server.resources).expect("resources"),
        server_resources
    );
    assert_eq!(server.image_pull_policy.as_deref(), Some("IfNotPresent"));
    let volumes: Vec<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert!(!volumes.contains(&"kube-rbac-proxy-config"), "{volumes:?}");

    // The sidecar's ConfigMap and every Go-era sandbox pod are gone; the pool is ours.
    wait_gone(
        ns.api::<ConfigMap>(),
        &format!("{}-krp", n.server()),
        "krp ConfigMap gone",
        TIMEOUT,
    )
    .await
    .unwrap_or_else(|e| panic!("krp ConfigMap: {e}\n{}", op.log_tail()));
    for p in [
        "cli-mcp-sandbox-9b2e4c1d-5f6a-4b7c-8d9e-0f1a2b3c4d5e",
        "cli-mcp-sandbox-s1",
    ] {
        wait_gone(pods.clone(), p, "Go-era pod gone", TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("Go pod {p}: {e}\n{}", op.log_tail()));
    }
    let pool = wait_pool(&ns, name, 1, &op).await;
    assert!(pool
        .iter()
        .all(|p| !p.name_any().starts_with("cli-mcp-sandbox-")));

    // The Role of the same name is adopted with this operator's rules (apply took them over).
    let role = ns.api::<Role>().get(&n.server()).await.expect("Role");
    assert_eq!(
        role.labels().get(label::APP_MANAGED_BY).map(String::as_str),
        Some(label::MANAGED_BY)
    );
    let secrets_rule = role
        .rules
        .iter()
        .flatten()
        .any(|r| r.resources.iter().flatten().any(|x| x == "secrets"));
    let go_rule_kept = role.rules.iter().flatten().any(|r| {
        r.resources.iter().flatten().any(|x| x == "secrets")
            && r.verbs.iter().any(|v| v == "delete")
    });
    assert!(
        !go_rule_kept,
        "the Go Role's secrets rule survived: {role:?} ({secrets_rule})"
    );

    // One Event says what went and what is left to the admin.
    let events: Api<Event> = ns.api();
    let migrated: Vec<Event> = events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("MigratedFromGoOperator"))
        .collect();
    assert_eq!(migrated.len(), 1, "{migrated:?}");
    let note = migrated[0].note.clone().unwrap_or_default();
    for part in [
        "kube-rbac-proxy",
        "-krp",
        "2 Go-era sandbox pod",
        "cli-mcp-sandbox-auth-",
        "cli-mcp-auth-delegator",
    ] {
        assert!(note.contains(part), "{part:?} not in {note:?}");
    }
    finish(ns, name, &op).await;
}
