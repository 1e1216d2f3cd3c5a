//! Coming from the Go operator: an instance it ran, with the children it left (made by
//! another field manager, as its controller-runtime client made them), is taken over on the
//! real API server. The Go server Deployment with its kube-rbac-proxy sidecar is replaced,
//! not merged into; the sidecar's ConfigMap and the Go-era sandbox pods go; so do the Go
//! credential proxy's Deployment (whose `tcpSocket` probes apply cannot merge with this
//! proxy's) and ConfigMap, made again; the children of the same names are adopted with this
//! operator's content, the proxy's CA kept; the Go-era `spec.serverContainer` still shapes
//! the server container; the instance becomes Ready with no apply refused, and a session
//! claimed afterwards outlives a second operator process.

mod support;

use std::collections::BTreeMap;

use cli_mcp_api::names::{label, InstanceName};
use cli_mcp_e2e::testing::{cluster, wait_for_set, wait_gone};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::NetworkPolicy;
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

/// The Go operator's proxy CA, as it generated one: ECDSA P-256, CN and O "CLI MCP", a CA
/// for ten years, the key in SEC1 form ("EC PRIVATE KEY"). Made with `openssl ecparam -name
/// prime256v1 -genkey -noout` and `openssl req -x509` for this test; it signs nothing else.
const GO_CA_KEY: &str = "-----BEGIN EC PRIVATE KEY-----
MHcCAQEEIG5v4GQZFNv5AXGAYMmJTod2NPpd5KDGShzzFSDWO7OBoAoGCCqGSM49
AwEHoUQDQgAE2qJOPReDLgQp2rdBcY7rIXK8Vn4cs5P/rHCmtox+joGcwzUVhkmo
n6yjDYINRuTWSkEhtA5eY6I+kPtUBgU0WA==
-----END EC PRIVATE KEY-----
";
const GO_CA_CERT: &str = "-----BEGIN CERTIFICATE-----
MIIBrDCCAVOgAwIBAgIUNHNrO7CES/bkFqSN76OJzki/bd4wCgYIKoZIzj0EAwIw
JDEQMA4GA1UEAwwHQ0xJIE1DUDEQMA4GA1UECgwHQ0xJIE1DUDAeFw0yNjEyMDcw
OTA5NTlaFw0zNjEyMDQwOTA5NTlaMCQxEDAOBgNVBAMMB0NMSSBNQ1AxEDAOBgNV
BAoMB0NMSSBNQ1AwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAATaok49F4MuBCna
t0FxjushcrxWfhyzk/+scKa2jH6OgZzDNRWGSaifrKMNgg1G5NZKQSG0Dl5joj6Q
+1QGBTRYo2MwYTAdBgNVHQ4EFgQU3sKPYZChJjIyhiaXPVoxC16c9GgwHwYDVR0j
BBgwFoAU3sKPYZChJjIyhiaXPVoxC16c9GgwDwYDVR0TAQH/BAUwAwEB/zAOBgNV
HQ8BAf8EBAMCAQYwCgYIKoZIzj0EAwIDRwAwRAIga53Cywx93qzUBcukiaRSxw4g
se+Cex4UbGXsSaEhbIICIAXZg0WIjNPKMFzvy5soJQGW/T1uhEqyQ//WuRdUDgq/
-----END CERTIFICATE-----
";

/// What the Go operator's credential proxy left, made as its controller-runtime client made
/// it (field manager `manager`, only the instance and component labels, owned by the CR):
/// the Deployment `cli-mcp-<n>-proxy` (container `proxy`, `tcpSocket` probes on 8080, a
/// `preStop` sleep, its ConfigMap, CA Secret, the admin kubeconfig and an emptyDir mounted),
/// its ServiceAccount and Service, the ConfigMap (`proxy-config.json` and the dummy
/// `kubeconfig`), the CA Secret, and the NetworkPolicies of the proxy (ingress only, from the
/// instance's sandboxes) and of the sandboxes. Shapes follow the Go operator's behaviour as
/// documented (prior-art notes, items 31 and 32); where those are silent (volume names, the
/// Service's target port, the route table's JSON) this picks what a controller-runtime
/// operator plausibly wrote.
async fn go_proxy_children(
    ns: &cli_mcp_e2e::testing::TestNamespace,
    n: &InstanceName,
    owner: &serde_json::Value,
) {
    let name = n.as_str();
    let proxy = n.proxy();
    let meta = |obj_name: &str, component: &str| json!({"name": obj_name, "labels": go_labels(name, component), "ownerReferences": owner});
    // One replica, as Go ran it. This cluster has not Go's image, so its pod never serves;
    // what matters is the Deployment's shape, which apply meets, and that its pod goes.
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": meta(&proxy, "proxy"),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "selector": {"matchLabels": go_labels(name, "proxy")},
            "template": {
                "metadata": {"labels": go_labels(name, "proxy"),
                             "annotations": {"cli-mcp.redhat.com/proxy-routes-resource-version": "1",
                                             "cli-mcp.redhat.com/proxy-ca-resource-version": "1"}},
                "spec": {
                    "serviceAccountName": proxy,
                    "automountServiceAccountToken": false,
                    "terminationGracePeriodSeconds": 30,
                    "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": "proxy",
                        "image": "quay.io/codeready-toolchain/cli-mcp-proxy:latest",
                        "args": ["--config=/etc/cli-mcp/proxy/proxy-config.json",
                                 "--ca-cert=/etc/cli-mcp/proxy-ca/ca.crt",
                                 "--ca-key=/etc/cli-mcp/proxy-ca/ca.key", "--listen=:8080"],
                        "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 10},
                        "livenessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 10},
                        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
                        "resources": {"requests": {"cpu": "20m", "memory": "64Mi"},
                                      "limits": {"cpu": "200m", "memory": "256Mi"}},
                        "securityContext": {"allowPrivilegeEscalation": false,
                                            "capabilities": {"drop": ["ALL"]}},
                        "volumeMounts": [
                            {"name": "config", "mountPath": "/etc/cli-mcp/proxy", "readOnly": true},
                            {"name": "proxy-ca", "mountPath": "/etc/cli-mcp/proxy-ca", "readOnly": true},
                            {"name": "tmp", "mountPath": "/tmp"},
                            {"name": "kubeconfig", "mountPath": "/etc/kube", "readOnly": true}
                        ]
                    }],
                    "volumes": [
                        {"name": "config", "configMap": {"name": proxy}},
                        {"name": "proxy-ca", "secret": {"secretName": n.proxy_ca_secret()}},
                        {"name": "tmp", "emptyDir": {}},
                        {"name": "kubeconfig", "secret": {"secretName": format!("{}-kubeconfig", n.server()),
                                                          "items": [{"key": "kubeconfig", "path": "config"}]}}
                    ]
                }
            }
        }
    }))
    .expect("proxy deployment");
    ns.api::<Deployment>()
        .create(&go_post(), &deployment)
        .await
        .expect("create the Go proxy Deployment");
    let sa: ServiceAccount = serde_json::from_value(json!({
        "metadata": meta(&proxy, "proxy"), "automountServiceAccountToken": false
    }))
    .expect("service account");
    ns.api::<ServiceAccount>()
        .create(&go_post(), &sa)
        .await
        .expect("create the Go proxy ServiceAccount");
    let service: Service = serde_json::from_value(json!({
        "metadata": meta(&proxy, "proxy"),
        "spec": {"type": "ClusterIP", "selector": go_labels(name, "proxy"),
                 "ports": [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]}
    }))
    .expect("service");
    ns.api::<Service>()
        .create(&go_post(), &service)
        .await
        .expect("create the Go proxy Service");
    let config: ConfigMap = serde_json::from_value(json!({
        "metadata": meta(&proxy, "proxy"),
        "data": {
            "proxy-config.json": r#"{"routes":[{"domain":"kubernetes.default.svc:443","type":"kubernetes"}]}"#,
            "kubeconfig": cli_mcp_e2e::instance::DUMMY_KUBECONFIG,
        }
    }))
    .expect("proxy configmap");
    ns.api::<ConfigMap>()
        .create(&go_post(), &config)
        .await
        .expect("create the Go proxy ConfigMap");
    let ca: Secret = serde_json::from_value(json!({
        "metadata": meta(&n.proxy_ca_secret(), "proxy"),
        "type": "Opaque",
        "stringData": {"ca.crt": GO_CA_CERT, "ca.key": GO_CA_KEY}
    }))
    .expect("ca secret");
    ns.api::<Secret>()
        .create(&go_post(), &ca)
        .await
        .expect("create the Go proxy CA Secret");
    let sandbox_peer = json!({"podSelector": {"matchLabels": go_labels(name, "sandbox")}});
    let dns = json!({"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                             "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
                     "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]});
    for policy in [
        json!({"metadata": meta(&proxy, "proxy"),
               "spec": {"podSelector": {"matchLabels": go_labels(name, "proxy")},
                        "policyTypes": ["Ingress"],
                        "ingress": [{"from": [sandbox_peer], "ports": [{"protocol": "TCP", "port": 8080}]}]}}),
        json!({"metadata": meta(&n.sandbox(), "sandbox"),
               "spec": {"podSelector": {"matchLabels": go_labels(name, "sandbox")},
                        "policyTypes": ["Ingress", "Egress"],
                        "ingress": [{"from": [{"podSelector": {"matchLabels": go_labels(name, "server")}}],
                                     "ports": [{"protocol": "TCP", "port": 8090}]}],
                        "egress": [{"to": [{"podSelector": {"matchLabels": go_labels(name, "proxy")}}],
                                    "ports": [{"protocol": "TCP", "port": 8080}]}, dns]}}),
    ] {
        let policy: NetworkPolicy = serde_json::from_value(policy).expect("network policy");
        ns.api::<NetworkPolicy>()
            .create(&go_post(), &policy)
            .await
            .expect("create a Go NetworkPolicy");
    }
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
               "serverContainer": {"resources": server_resources, "imagePullPolicy": "IfNotPresent"},
               "proxy": {"targets": [{"type": "kubernetes"}]}}),
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
    go_proxy_children(&ns, &n, &owner).await;
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

    proxy_taken_over(&ns, &n, &op).await;

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
        "credential proxy",
        "cli-mcp-sandbox-auth-",
        "cli-mcp-auth-delegator",
    ] {
        assert!(note.contains(part), "{part:?} not in {note:?}");
    }
    // Server-side apply met nothing it could not merge: no 422 on the way to Ready.
    let log = std::fs::read_to_string(&op.log).expect("operator log");
    assert!(
        !log.contains("code: 422"),
        "an apply was refused as invalid:\n{}",
        op.log_tail()
    );

    // A live session of the new server survives another takeover pass: a new operator
    // process (leader change, upgrade) looks for Go leftovers again and must find none in
    // what it made itself.
    let session = claim(
        &pods,
        &pool[0],
        "after-takeover",
        &hmac_key(&ns, name).await,
    )
    .await
    .expect("claim a warm pod");
    let proxy_uid = ns
        .api::<Deployment>()
        .get(&n.proxy())
        .await
        .expect("proxy Deployment")
        .uid();
    drop(op);
    let op = Operator::start(&c, &ns.name, "op2");
    wait_pool(&ns, name, 1, &op).await;
    wait_ready(&ns, name, &op).await;
    let kept = pods
        .get(&session.name_any())
        .await
        .expect("the session pod");
    assert_eq!(kept.uid(), session.uid(), "the session pod was replaced");
    assert!(kept.metadata.deletion_timestamp.is_none(), "{kept:?}");
    let restarts: i32 = kept
        .status
        .iter()
        .flat_map(|s| s.container_statuses.iter().flatten())
        .map(|c| c.restart_count)
        .sum();
    assert_eq!(restarts, 0, "the session's shell was restarted: {kept:?}");
    let again = ns
        .api::<Deployment>()
        .get(&n.proxy())
        .await
        .expect("proxy Deployment");
    assert_eq!(again.uid(), proxy_uid, "this operator's proxy was replaced");
    finish(ns, name, &op).await;
}

/// The Go proxy's children are this operator's: the Deployment has this proxy's probes and
/// volumes only (none of Go's `tcpSocket` probes, `preStop` sleep or mounts), the ConfigMap
/// only this operator's keys, the NetworkPolicies this operator's rules; the Go CA is kept
/// (same instance, same key), and the proxy serves.
async fn proxy_taken_over(
    ns: &cli_mcp_e2e::testing::TestNamespace,
    n: &InstanceName,
    op: &Operator,
) {
    let d = ns
        .api::<Deployment>()
        .get(&n.proxy())
        .await
        .expect("proxy Deployment");
    let pod = d.spec.template.spec.as_ref().expect("pod spec");
    let names: Vec<&str> = pod.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["proxy"], "{d:?}");
    let proxy = &pod.containers[0];
    for probe in [&proxy.readiness_probe, &proxy.liveness_probe] {
        let probe = probe.as_ref().expect("probe");
        assert!(
            probe.tcp_socket.is_none() && probe.http_get.is_some(),
            "Go's probe left in: {probe:?}"
        );
    }
    assert!(proxy.lifecycle.is_none(), "Go's preStop left: {proxy:?}");
    // Go's proxy pod goes with its Deployment; only this operator's proxy pods are left.
    wait_for_set(
        ns.api::<Pod>(),
        &format!(
            "{}={},{}=proxy",
            label::INSTANCE,
            n.as_str(),
            label::COMPONENT
        ),
        "only this operator's proxy pods",
        TIMEOUT,
        |ps: &[Pod]| {
            !ps.is_empty()
                && ps.iter().all(|p| {
                    p.spec.as_ref().is_some_and(|s| {
                        s.containers
                            .iter()
                            .all(|c| c.image.as_deref() == Some(cli_mcp_e2e::instance::PROXY_IMAGE))
                    })
                })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let volumes: Vec<&str> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    for go in ["config", "kubeconfig"] {
        assert!(!volumes.contains(&go), "Go's volume {go}: {volumes:?}");
    }
    assert_eq!(pod.automount_service_account_token, Some(true));
    assert!(
        d.labels().get(label::APP_MANAGED_BY).map(String::as_str) == Some(label::MANAGED_BY),
        "{d:?}"
    );
    let available = d
        .status
        .as_ref()
        .and_then(|s| s.available_replicas)
        .unwrap_or(0);
    assert!(
        available >= 1,
        "the proxy does not serve: {d:?}\n{}",
        op.log_tail()
    );

    let cm = ns
        .api::<ConfigMap>()
        .get(&n.proxy())
        .await
        .expect("proxy ConfigMap");
    let keys: Vec<&String> = cm.data.iter().flatten().map(|(k, _)| k).collect();
    assert!(
        !keys.iter().any(|k| *k == "proxy-config.json"),
        "Go's route table left in the ConfigMap: {keys:?}"
    );
    // The Go CA is adopted, not regenerated: the same instance made it.
    let ca = ns
        .api::<Secret>()
        .get(&n.proxy_ca_secret())
        .await
        .expect("proxy CA Secret");
    let crt = ca
        .data
        .as_ref()
        .and_then(|d| d.get("ca.crt"))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned());
    assert_eq!(crt.as_deref(), Some(GO_CA_CERT));

    let np = ns
        .api::<NetworkPolicy>()
        .get(&n.proxy())
        .await
        .expect("proxy NetworkPolicy");
    let types = np.spec.as_ref().and_then(|s| s.policy_types.clone());
    assert_eq!(
        types,
        Some(vec!["Ingress".to_owned(), "Egress".to_owned()]),
        "{np:?}"
    );
}
