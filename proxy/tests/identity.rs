//! The proxy's sandbox identity against the test run's real kube-apiserver: real
//! TokenRequests bound to real pod objects, real TokenReviews, the real pod watch.
//!
//! The pods are never scheduled (the API server alone is enough for what the proxy checks);
//! their status says their IP is 127.0.0.1, where the test's connections come from, unless a test
//! wants a pod elsewhere. Each refusal is tried the way an attacker would: a pod with copied
//! labels, another ServiceAccount's token, another instance's token, a token from the wrong
//! address, a session that ended.

mod support;

use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ServiceAccount};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::Api;
use kube::ResourceExt;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use cli_mcp_api::kubeconfig;
use cli_mcp_api::names::{annotation, label, InstanceName};
use cli_mcp_api::proxy::{sandbox_token_audience, Injector, Route, RouteIdentity};
use cli_mcp_api::seal::seal;
use cli_mcp_api::token::HmacKey;
use cli_mcp_e2e::testing::{self, TestCluster, TestNamespace};
use cli_mcp_proxy::SandboxCheck;
use support::cluster::{admin_kubeconfig, admin_token, cluster_ca};
use support::*;

const INSTANCE: &str = "demo";

struct World {
    _cluster: TestCluster,
    ns: TestNamespace,
    key: HmacKey,
    up: Upstream,
    inputs: Inputs,
    proxy: Running,
}

async fn world(prefix: &str) -> World {
    world_with(prefix, false).await
}

/// With `impersonating`: the route is the test run's API server, `impersonateCaller`, with
/// an admin kubeconfig whose user may impersonate.
async fn world_with(prefix: &str, impersonating: bool) -> World {
    let c = testing::cluster()
        .await
        .expect("the local cluster must come up (see docs/local-kubernetes.md)");
    let ns = c.namespace(prefix).await.expect("a test namespace");
    for sa in [format!("cli-mcp-{INSTANCE}-sandbox"), "tenant".to_owned()] {
        let sa = ServiceAccount {
            metadata: ObjectMeta {
                name: Some(sa),
                ..Default::default()
            },
            ..Default::default()
        };
        ns.api::<ServiceAccount>()
            .create(&PostParams::default(), &sa)
            .await
            .expect("a ServiceAccount");
    }
    let key = HmacKey::from_bytes(rand_key());
    let up = Upstream::start().await;
    let inputs = if impersonating {
        let admin = impersonator(&c, &ns).await;
        let kc = kubeconfig::validate(&admin).expect("a valid admin kubeconfig");
        let routes = kc
            .routes()
            .into_iter()
            .map(|r| Route {
                identity: RouteIdentity::ImpersonateCaller,
                ..r
            })
            .collect();
        let inputs = Inputs::new(routes);
        inputs.publish_kubeconfig(&admin);
        inputs
    } else {
        Inputs::new(vec![up.route(Injector::None)])
    };
    let key_file = inputs.dir.path().join("hmac-key");
    std::fs::write(&key_file, key.to_hex()).expect("the key file");
    let mut config = inputs.config();
    if !impersonating {
        config.kubeconfig = None;
    }
    config.sandboxes = SandboxCheck::Verified {
        namespace: ns.name.clone(),
        instance: InstanceName::parse(INSTANCE).expect("a name"),
        hmac_key_file: key_file,
    };
    let proxy = Running::start_with(config, Some(c.client.clone())).await;
    wait_ready(&proxy).await;
    World {
        _cluster: c,
        ns,
        key,
        up,
        inputs,
        proxy,
    }
}

/// An admin kubeconfig whose user (a ServiceAccount, cluster-admin in the namespace) may
/// also impersonate users, groups and the session extra cluster-wide, as an admin grants
/// the proxy's identity for `impersonateCaller`.
async fn impersonator(c: &TestCluster, ns: &TestNamespace) -> String {
    let token = admin_token(ns, "admin").await;
    let name = format!("cli-mcp-test-impersonator-{}", ns.name);
    let role = ClusterRole {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new(), "authentication.k8s.io".into()]),
            resources: Some(vec![
                "users".into(),
                "groups".into(),
                "userextras/cli-mcp.redhat.com/session".into(),
            ]),
            verbs: vec!["impersonate".into()],
            ..Default::default()
        }]),
        ..Default::default()
    };
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: name.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "admin".into(),
            namespace: Some(ns.name.clone()),
            ..Default::default()
        }]),
    };
    let pp = PostParams::default();
    Api::<ClusterRole>::all(c.client.clone())
        .create(&pp, &role)
        .await
        .expect("the impersonator ClusterRole");
    Api::<ClusterRoleBinding>::all(c.client.clone())
        .create(&pp, &binding)
        .await
        .expect("the impersonator ClusterRoleBinding");
    admin_kubeconfig(
        &c.info.apiserver,
        &cluster_ca(&c.info.kubeconfig),
        &token,
        &ns.name,
    )
}

fn rand_key() -> [u8; 32] {
    let mut k = [0u8; 32];
    for (i, b) in k.iter_mut().enumerate() {
        *b = (std::process::id() as u8)
            .wrapping_add(i as u8)
            .wrapping_mul(31);
    }
    k
}

async fn wait_ready(proxy: &Running) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if proxy.health_get("/readyz").await.status() == 200 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the proxy did not list the sandbox pods in time"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A sandbox-looking pod: `session` labelled, sealed when `sealed`, at `ip`.
async fn pod(
    w: &World,
    name: &str,
    sa: &str,
    session: Option<&str>,
    sealed: bool,
    ip: &str,
) -> Pod {
    pod_of(w, name, sa, session, sealed, ip, "alice@example.com").await
}

/// [`pod`] serving `caller`.
async fn pod_of(
    w: &World,
    name: &str,
    sa: &str,
    session: Option<&str>,
    sealed: bool,
    ip: &str,
    caller: &str,
) -> Pod {
    let api = w.ns.api::<Pod>();
    let mut labels = std::collections::BTreeMap::from([
        (label::INSTANCE.to_owned(), INSTANCE.to_owned()),
        (
            label::COMPONENT.to_owned(),
            label::COMPONENT_SANDBOX.to_owned(),
        ),
    ]);
    if let Some(s) = session {
        labels.insert(label::SESSION_ID.to_owned(), s.to_owned());
    }
    let p = Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(labels),
            annotations: Some(std::collections::BTreeMap::from([(
                annotation::CALLER.to_owned(),
                json!({"user": caller, "groups": ["dev", "system:authenticated"]}).to_string(),
            )])),
            ..Default::default()
        },
        spec: Some(PodSpec {
            service_account_name: Some(sa.into()),
            automount_service_account_token: Some(false),
            // Never scheduled: no kubelet rewrites the IP the test gives it.
            node_selector: Some(std::collections::BTreeMap::from([(
                "cli-mcp.test/nowhere".to_owned(),
                "true".to_owned(),
            )])),
            containers: vec![Container {
                name: "agent".into(),
                image: Some("example.invalid/agent:1".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let created = api.create(&PostParams::default(), &p).await.expect("a pod");
    let uid = created.uid().expect("a uid");
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"podIP": ip, "podIPs": [{"ip": ip}]}})),
    )
    .await
    .expect("the pod's IP");
    if sealed {
        let s = seal(&w.key, &w.ns.name, name, &uid);
        api.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {annotation::SEAL: s}}})),
        )
        .await
        .expect("the seal");
    }
    api.get(name).await.expect("the pod")
}

/// A token of ServiceAccount `sa` for `audience`, bound to `pod`.
async fn token(w: &World, sa: &str, audience: &str, pod: &Pod) -> String {
    let tr = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(vec![audience.to_owned()]),
            expiration_seconds: Some(600),
            bound_object_ref: Some(BoundObjectReference {
                kind: Some("Pod".into()),
                api_version: Some("v1".into()),
                name: Some(pod.name_any()),
                uid: pod.uid(),
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    w.ns.api::<ServiceAccount>()
        .create_token_request(sa, &PostParams::default(), &tr)
        .await
        .expect("a TokenRequest")
        .status
        .and_then(|s| s.token)
        .expect("a token")
}

fn audience(w: &World) -> String {
    sandbox_token_audience(&w.ns.name, INSTANCE)
}

/// The CONNECT's answer head, with `auth` as Proxy-Authorization (none when empty).
async fn connect_answer(w: &World, auth: &str) -> String {
    let target = w.up.domain().to_string();
    let mut tcp = TcpStream::connect(w.proxy.addr).await.expect("connect");
    let auth = if auth.is_empty() {
        String::new()
    } else {
        format!("Proxy-Authorization: {auth}\r\n")
    };
    tcp.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n").as_bytes())
        .await
        .expect("write");
    read_to_close_or_head(&mut tcp).await
}

async fn read_to_close_or_head(tcp: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(20), tcp.read(&mut buf))
            .await
            .expect("an answer in time")
            .unwrap_or(0);
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if out.starts_with(b"HTTP/1.1 200") && out.ends_with(b"\r\n\r\n") {
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn only_a_serving_sandbox_of_this_instance_gets_through() {
    let w = world("proxy-identity").await;
    let aud = audience(&w);
    let sandbox = format!("cli-mcp-{INSTANCE}-sandbox");

    let a = connect_answer(&w, "").await;
    assert!(a.starts_with("HTTP/1.1 407"), "{a}");
    assert!(
        a.to_lowercase().contains("proxy-authenticate: bearer"),
        "{a}"
    );
    let a = connect_answer(&w, "Bearer not-a-token").await;
    assert!(a.starts_with("HTTP/1.1 407"), "{a}");

    // A pod made by a tenant with every label copied, its own ServiceAccount's token for the
    // proxy's audience: not the instance's sandbox identity.
    let plant = pod(&w, "plant", "tenant", Some("s1"), false, "127.0.0.1").await;
    let t = token(&w, "tenant", &aud, &plant).await;
    let a = connect_answer(&w, &format!("Bearer {t}")).await;
    assert!(
        a.starts_with("HTTP/1.1 403") && a.contains("not to a sandbox pod"),
        "{a}"
    );
    // Even running as the sandbox ServiceAccount (where no admission policy stops that):
    // unsealed.
    let plant = pod(&w, "plant-sa", &sandbox, Some("s1"), false, "127.0.0.1").await;
    let t = token(&w, &sandbox, &aud, &plant).await;
    let a = connect_answer(&w, &format!("Bearer {t}")).await;
    assert!(
        a.starts_with("HTTP/1.1 403") && a.contains("not sealed"),
        "{a}"
    );

    let good = pod(&w, "good", &sandbox, Some("s1"), true, "127.0.0.1").await;
    // Another instance's audience, and the API server's own: the review refuses them.
    for other in [
        sandbox_token_audience(&w.ns.name, "other"),
        "https://kubernetes.default.svc".to_owned(),
    ] {
        let t = token(&w, &sandbox, &other, &good).await;
        let a = connect_answer(&w, &format!("Bearer {t}")).await;
        assert!(a.starts_with("HTTP/1.1 407"), "audience {other}: {a}");
    }
    // A real sandbox's token used from elsewhere than its pod.
    let far = pod(&w, "far", &sandbox, Some("s2"), true, "10.250.0.9").await;
    let t = token(&w, &sandbox, &aud, &far).await;
    let a = connect_answer(&w, &format!("Bearer {t}")).await;
    assert!(
        a.starts_with("HTTP/1.1 403") && a.contains("does not come from it"),
        "{a}"
    );
    // A warm pod serves no session.
    let warm = pod(&w, "warm", &sandbox, None, true, "127.0.0.1").await;
    let t = token(&w, &sandbox, &aud, &warm).await;
    let a = connect_answer(&w, &format!("Bearer {t}")).await;
    assert!(a.starts_with("HTTP/1.1 403") && a.contains("warm"), "{a}");
    assert_eq!(
        w.up.accepted.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "nothing refused was dialled"
    );

    // The sandbox itself: through, and audited with its session and caller.
    let t = token(&w, &sandbox, &aud, &good).await;
    let a = connect_answer(&w, &format!("Bearer {t}")).await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    let target = w.up.domain().to_string();
    let mut tls = tunnel_as(
        w.proxy.addr,
        &target,
        None,
        &w.inputs.ca,
        &format!("Proxy-Authorization: Bearer {t}\r\n"),
    )
    .await
    .expect("a tunnel");
    tls.write_all(
        format!("GET /api/v1/pods?watch=1 HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes(),
    )
    .await
    .expect("write");
    let (head, _) = read_response(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    drop(tls);
    let line = wait_audit(&w.inputs, 1).await.pop().expect("a line");
    assert_eq!(line["session"], "s1", "{line}");
    assert_eq!(line["pod"], "good", "{line}");
    assert_eq!(line["caller"]["user"], "alice@example.com", "{line}");
    assert_eq!(line["caller"]["groups"][0], "dev", "{line}");
    assert_eq!(line["instance"], INSTANCE, "{line}");
    assert_eq!(line["method"], "GET", "{line}");
    assert_eq!(line["path"], "/api/v1/pods", "{line}");
    assert_eq!(line["watch"], true, "{line}");
    assert_eq!(line["status"], 200, "{line}");
    assert!(
        !line.to_string().contains(&t),
        "the audit line never carries the token"
    );
}

/// The audit lines once there are at least `n`.
async fn wait_audit(inputs: &Inputs, n: usize) -> Vec<serde_json::Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let lines = inputs.audit_lines();
        if lines.len() >= n {
            return lines;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} audit lines in time: {lines:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_session_that_ends_is_cut_on_its_open_tunnel_and_refused_after() {
    let w = world("proxy-revoke").await;
    let sandbox = format!("cli-mcp-{INSTANCE}-sandbox");
    let p = pod(&w, "ending", &sandbox, Some("s9"), true, "127.0.0.1").await;
    let t = token(&w, &sandbox, &audience(&w), &p).await;
    let target = w.up.domain().to_string();
    let auth = format!("Proxy-Authorization: Bearer {t}\r\n");
    let mut tls = tunnel_as(w.proxy.addr, &target, None, &w.inputs.ca, &auth)
        .await
        .expect("a tunnel");
    // `/stream` sends a first chunk and holds the rest: an open watch.
    tls.write_all(format!("GET /stream HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let head = read_head(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    w.up.wait_seen(1).await;

    let ended = std::time::Instant::now();
    w.ns.api::<Pod>()
        .delete("ending", &DeleteParams::default())
        .await
        .expect("the session's pod deleted");
    // The open stream ends (EOF or reset) within 2 s of the deletion.
    let mut rest = Vec::new();
    let cut = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut rest)).await;
    assert!(cut.is_ok(), "the open stream was not cut");
    let took = ended.elapsed();
    assert!(took < Duration::from_secs(2), "cut after {took:?}");
    let line = wait_audit(&w.inputs, 1).await.pop().expect("a line");
    assert_eq!(line["path"], "/stream", "{line}");
    assert_eq!(
        line["complete"], false,
        "the cut stream is audited as cut: {line}"
    );

    let a = connect_answer(&w, &format!("Bearer {t}")).await;
    assert!(
        a.starts_with("HTTP/1.1 403") || a.starts_with("HTTP/1.1 407"),
        "a new CONNECT of the ended session: {a}"
    );
    w.up.release();
}

/// One request in a fresh tunnel of the sandbox holding `token`: status and body.
async fn request_as(w: &World, token: &str, host: &str, request: &str) -> (String, String) {
    let auth = format!("Proxy-Authorization: Bearer {token}\r\n");
    let mut tls = tunnel_as(w.proxy.addr, host, None, &w.inputs.ca, &auth)
        .await
        .expect("a tunnel");
    tls.write_all(request.as_bytes()).await.expect("write");
    let (head, body) = read_response(&mut tls).await;
    (head, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn impersonating_targets_let_the_clusters_rbac_judge_each_caller() {
    let w = world_with("proxy-impersonate", true).await;
    let sandbox = format!("cli-mcp-{INSTANCE}-sandbox");
    let aud = audience(&w);
    // alice may list the namespace's secrets; bob may not.
    let role = Role {
        metadata: ObjectMeta {
            name: Some("secret-reader".into()),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["secrets".into()]),
            verbs: vec!["list".into()],
            ..Default::default()
        }]),
    };
    let binding = RoleBinding {
        metadata: ObjectMeta {
            name: Some("alice-reads-secrets".into()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: "secret-reader".into(),
        },
        subjects: Some(vec![Subject {
            kind: "User".into(),
            name: "alice@example.com".into(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        }]),
    };
    let pp = PostParams::default();
    w.ns.api::<Role>().create(&pp, &role).await.expect("a Role");
    w.ns.api::<RoleBinding>()
        .create(&pp, &binding)
        .await
        .expect("a RoleBinding");
    let alice = pod_of(
        &w,
        "alice",
        &sandbox,
        Some("s-alice"),
        true,
        "127.0.0.1",
        "alice@example.com",
    )
    .await;
    let bob = pod_of(
        &w,
        "bob",
        &sandbox,
        Some("s-bob"),
        true,
        "127.0.0.1",
        "bob@example.com",
    )
    .await;
    let alice_t = token(&w, &sandbox, &aud, &alice).await;
    let bob_t = token(&w, &sandbox, &aud, &bob).await;
    let c = testing::cluster().await.expect("the cluster");
    let host = c
        .info
        .apiserver
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .to_owned();
    let list = format!(
        "GET /api/v1/namespaces/{}/secrets HTTP/1.1\r\nHost: {host}\r\n\r\n",
        w.ns.name
    );
    let (head, body) = request_as(&w, &alice_t, &host, &list).await;
    assert!(head.starts_with("HTTP/1.1 200"), "alice: {head}{body}");
    let (head, body) = request_as(&w, &bob_t, &host, &list).await;
    assert!(head.starts_with("HTTP/1.1 403"), "bob: {head}{body}");
    assert!(
        body.contains("bob@example.com"),
        "the cluster judged bob: {body}"
    );

    // What the API server sees (kubectl auth whoami): the caller, and the session.
    let review = r#"{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}"#;
    let whoami = format!(
        "POST /apis/authentication.k8s.io/v1/selfsubjectreviews HTTP/1.1\r\nHost: {host}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{review}",
        review.len()
    );
    let (head, body) = request_as(&w, &alice_t, &host, &whoami).await;
    assert!(head.starts_with("HTTP/1.1 201"), "{head}{body}");
    let seen: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let user = &seen["status"]["userInfo"];
    assert_eq!(user["username"], "alice@example.com", "{seen}");
    assert_eq!(
        user["extra"]["cli-mcp.redhat.com/session"][0], "s-alice",
        "{seen}"
    );
    assert!(
        user["groups"]
            .as_array()
            .is_some_and(|g| g.iter().any(|x| x == "dev")),
        "{seen}"
    );
}
