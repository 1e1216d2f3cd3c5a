//! End to end through the operator-made instance and the real MCP server: an authorised
//! client calls the `bash` tool over TLS (the generated CA), gets a warm sandbox with a
//! persistent shell, and ends the session; the pool refills.

mod support;

use std::time::Duration;

use cli_mcp_api::names::label;
use cli_mcp_e2e::testing::{cluster, wait_for_set};
use cli_mcp_e2e::ServiceForward;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{ObjectMeta, PostParams};
use kube::ResourceExt;
use serde_json::{json, Value};

use support::*;

fn meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        ..Default::default()
    }
}

#[tokio::test]
async fn client_runs_bash_in_a_warm_sandbox_over_tls_and_ends_the_session() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("journey").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "j", json!({"sandbox": {"warmPoolSize": 1}})).await;
    wait_ready(&ns, "j", &op).await;
    let warm = wait_pool(&ns, "j", 1, &op).await;

    // A client identity allowed to use this instance (docs/operations.md).
    ns.api::<ServiceAccount>()
        .create(
            &PostParams::default(),
            &ServiceAccount {
                metadata: meta("client"),
                ..Default::default()
            },
        )
        .await
        .expect("client SA");
    let role = Role {
        metadata: meta("use-j"),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec!["cli-mcp.redhat.com".into()]),
            resources: Some(vec!["climcpinstances/mcp".into()]),
            resource_names: Some(vec!["j".into()]),
            verbs: vec!["create".into(), "get".into(), "delete".into()],
            ..Default::default()
        }]),
    };
    ns.api::<Role>()
        .create(&PostParams::default(), &role)
        .await
        .expect("role");
    let rb = RoleBinding {
        metadata: meta("use-j"),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: "use-j".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "client".into(),
            namespace: Some(ns.name.clone()),
            ..Default::default()
        }]),
    };
    ns.api::<RoleBinding>()
        .create(&PostParams::default(), &rb)
        .await
        .expect("binding");
    let token = ns
        .api::<ServiceAccount>()
        .create_token_request(
            "client",
            &PostParams::default(),
            &TokenRequest {
                spec: Some(TokenRequestSpec {
                    expiration_seconds: Some(3600),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
        .await
        .expect("token")
        .status
        .and_then(|s| s.token)
        .expect("token");

    // TLS with the CA the operator published, to the Service's DNS name.
    let ca = ns
        .api::<ConfigMap>()
        .get("cli-mcp-j-ca")
        .await
        .expect("CA ConfigMap");
    let ca_pem = ca
        .data
        .unwrap_or_default()
        .remove("ca.crt")
        .expect("ca.crt");
    let fwd = ServiceForward::start(c.client.clone(), &ns.name, "cli-mcp-j", 8443)
        .await
        .expect("forward");
    let host = format!("cli-mcp-j.{}.svc", ns.name);
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(120))
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).expect("CA"))
        .resolve(&host, fwd.local_addr())
        .build()
        .expect("client");
    let base = format!("https://{host}:{}", fwd.local_addr().port());
    let call = |command: &str, id: u64| {
        let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "bash", "arguments": {"command": command}}});
        http.post(format!("{base}/mcp"))
            .bearer_auth(&token)
            .header("x-session-id", "journey")
            .header("accept", "application/json, text/event-stream")
            .json(&body)
            .send()
    };
    let result = |text: String| -> Value {
        // JSON, or an SSE stream whose data lines carry the JSON-RPC response.
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| {
            text.lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
                .find(|v| v.get("result").is_some() || v.get("error").is_some())
                .unwrap_or(Value::Null)
        });
        v["result"].clone()
    };
    let r = call("cd /tmp && echo hello-$((6*7))", 1)
        .await
        .expect("POST /mcp");
    assert_eq!(r.status(), 200);
    let first = result(r.text().await.expect("body"));
    assert_eq!(first["isError"], false, "{first}");
    assert!(
        first["structuredContent"]["stdout"]
            .as_str()
            .unwrap_or_default()
            .contains("hello-42"),
        "{first}"
    );
    let second = result(
        call("pwd", 2)
            .await
            .expect("POST")
            .text()
            .await
            .expect("body"),
    );
    assert_eq!(
        second["structuredContent"]["stdout"]
            .as_str()
            .map(str::trim),
        Some("/tmp"),
        "state persists: {second}"
    );

    // The session runs in the former warm pod, and the pool refills.
    let pods = wait_pool(&ns, "j", 1, &op).await;
    let session: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.labels().get(label::SESSION_ID).map(String::as_str) == Some("journey"))
        .collect();
    assert_eq!(session.len(), 1);
    assert_eq!(session[0].uid(), warm[0].uid(), "the warm pod was claimed");
    assert_eq!(
        session[0].labels().get(label::LAUNCH).map(String::as_str),
        Some("warm")
    );

    // Unauthenticated callers are refused.
    let anon = http
        .post(format!("{base}/mcp"))
        .header("x-session-id", "journey")
        .json(&json!({"jsonrpc": "2.0", "id": 3, "method": "tools/list"}))
        .send()
        .await
        .expect("POST");
    assert_eq!(anon.status(), 401);

    // Ending the session deletes its sandbox.
    let del = http
        .delete(format!("{base}/sessions/journey"))
        .bearer_auth(&token)
        .send()
        .await
        .expect("DELETE");
    assert_eq!(del.status(), 204);
    wait_for_set(
        ns.api::<Pod>(),
        &sandbox_selector("j"),
        "session pod gone",
        TIMEOUT,
        |ps: &[Pod]| {
            ps.iter().all(|p| {
                !p.labels().contains_key(label::SESSION_ID)
                    || p.metadata.deletion_timestamp.is_some()
            })
        },
    )
    .await
    .expect("session deleted");
    finish(ns, "j", &op).await;
}
