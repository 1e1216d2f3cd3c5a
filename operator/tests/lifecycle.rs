//! The operator on the local Kubernetes, one namespace and one operator process per test.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::{annotation, label, InstanceName};
use cli_mcp_api::pod_state::{is_assigned, is_deleting, is_ready};
use cli_mcp_api::sandbox::{build_sandbox_pod, made_for_key, SandboxRole};
use cli_mcp_api::SessionId;
use cli_mcp_e2e::testing::{cluster, wait_for, wait_for_set};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Role, RoleBinding};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use support::*;

#[tokio::test]
async fn sample_becomes_ready_with_all_children() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("sample").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    let root = cli_mcp_e2e::testing::workspace_root();
    let text =
        std::fs::read_to_string(root.join("config/samples/cli-mcp_v1alpha1_climcpinstance.yaml"))
            .expect("sample CR");
    let sample: CliMcpInstance = serde_yaml::from_str(&text).expect("sample parses");
    let name = sample.name_any();
    kubeconfig_secret(&ns, &name).await;
    ns.api::<CliMcpInstance>()
        .create(&PostParams::default(), &sample)
        .await
        .expect("create sample");
    let ready = wait_ready(&ns, &name, &op).await;
    let n = InstanceName::parse(&name).expect("name");
    let st = ready.status.clone().expect("status");
    assert_eq!(
        st.endpoint.as_deref(),
        Some(format!("https://cli-mcp-{name}.{}.svc:8443/mcp", ns.name).as_str())
    );
    assert_eq!(st.warm_pool.desired, sample.spec.sandbox.warm_pool_size);
    assert!(ready
        .finalizers()
        .iter()
        .any(|f| f == "cli-mcp.redhat.com/finalizer"));

    let owned = |o: &kube::api::ObjectMeta| {
        o.owner_references.as_ref().is_some_and(|refs| {
            refs.iter()
                .any(|r| Some(&r.uid) == ready.metadata.uid.as_ref() && r.controller == Some(true))
        })
    };
    let d = ns
        .api::<Deployment>()
        .get(&n.server())
        .await
        .expect("Deployment");
    assert!(owned(&d.metadata));
    assert!(template_annotation(&d, "cli-mcp.redhat.com/hmac-version").is_some());
    assert!(owned(
        &ns.api::<Service>()
            .get(&n.server())
            .await
            .expect("Service")
            .metadata
    ));
    assert!(owned(
        &ns.api::<ServiceAccount>()
            .get(&n.server())
            .await
            .expect("server SA")
            .metadata
    ));
    let sbx_sa = ns
        .api::<ServiceAccount>()
        .get(&n.sandbox())
        .await
        .expect("sandbox SA");
    assert_eq!(sbx_sa.automount_service_account_token, Some(false));
    assert!(owned(
        &ns.api::<Role>()
            .get(&n.server())
            .await
            .expect("Role")
            .metadata
    ));
    assert!(owned(
        &ns.api::<RoleBinding>()
            .get(&n.server())
            .await
            .expect("RoleBinding")
            .metadata
    ));
    let np = ns
        .api::<NetworkPolicy>()
        .get(&n.sandbox())
        .await
        .expect("NetworkPolicy");
    assert!(owned(&np.metadata));
    // Without spec.proxy the sample runs the implied credential proxy: it alone mounts the
    // kubeconfig Secret, the sandboxes reach it (and DNS) and no API server address.
    let proxy = ns
        .api::<Deployment>()
        .get(&n.proxy())
        .await
        .expect("the implied credential proxy's Deployment");
    assert!(owned(&proxy.metadata));
    let proxy_secrets: Vec<String> = proxy
        .spec
        .template
        .spec
        .and_then(|p| p.volumes)
        .into_iter()
        .flatten()
        .filter_map(|v| v.secret.and_then(|s| s.secret_name))
        .collect();
    assert!(
        proxy_secrets.contains(&n.kubeconfig_secret()),
        "{proxy_secrets:?}"
    );
    let egress = np.spec.and_then(|s| s.egress).expect("egress");
    assert!(
        egress.iter().any(|r| r.to.iter().flatten().any(|p| p
            .pod_selector
            .as_ref()
            .and_then(|s| s.match_labels.as_ref())
            .is_some_and(|l| l.get(label::COMPONENT).map(String::as_str) == Some("proxy")))),
        "{egress:?}"
    );
    let warm = wait_pool(
        &ns,
        &name,
        usize::try_from(sample.spec.sandbox.warm_pool_size).expect("pool size"),
        &op,
    )
    .await;
    for pod in &warm {
        let spec = pod.spec.as_ref().expect("spec");
        // No Secret, and the one projected volume holds only the proxy token.
        assert!(
            spec.volumes.iter().flatten().all(|v| v.secret.is_none()
                && v.projected
                    .as_ref()
                    .is_none_or(|p| p.sources.iter().flatten().all(|s| s
                        .service_account_token
                        .is_some()
                        && s.secret.is_none()
                        && s.config_map.is_none()))),
            "a sandbox mounts no Secret: {:?}",
            spec.volumes
        );
        let kubeconfig = spec.containers[0]
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "KUBECONFIG")
            .and_then(|e| e.value.clone());
        assert_eq!(
            kubeconfig.as_deref(),
            Some("/etc/cli-mcp/proxy-client/kubeconfig"),
            "the dummy kubeconfig"
        );
    }
    assert!(owned(
        &ns.api::<Secret>()
            .get(&n.hmac_secret())
            .await
            .expect("HMAC Secret")
            .metadata
    ));
    let tls = ns
        .api::<Secret>()
        .get(&n.tls_secret())
        .await
        .expect("TLS Secret");
    assert_eq!(tls.type_.as_deref(), Some("kubernetes.io/tls"));
    let ca = ns
        .api::<ConfigMap>()
        .get(&format!("cli-mcp-{name}-ca"))
        .await
        .expect("CA ConfigMap");
    assert!(ca.data.expect("data")["ca.crt"].contains("BEGIN CERTIFICATE"));
    let crb = Api::<ClusterRoleBinding>::all(c.client.clone())
        .get(&n.auth_delegator_binding(&ns.name))
        .await
        .expect("auth-delegator ClusterRoleBinding");
    assert_eq!(crb.role_ref.name, "system:auth-delegator");
    // Operator health endpoints.
    assert_eq!(op.http("/livez").await.map(|r| r.0), Some(200));
    assert_eq!(op.http("/readyz").await.map(|r| r.0), Some(200));
    // Every transition was published as an Event on the instance.
    let events = ns
        .api::<k8s_openapi::api::events::v1::Event>()
        .list(&ListParams::default())
        .await
        .expect("events");
    let reasons: BTreeSet<String> = events
        .items
        .iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str()))
        .filter_map(|e| e.reason.clone())
        .collect();
    for r in [
        "HmacKeyGenerated",
        "CertificateGenerated",
        "ProxyCaGenerated",
        "Ready",
        "Full",
    ] {
        assert!(reasons.contains(r), "event {r} missing: {reasons:?}");
    }
    let metrics = op.http("/metrics").await.expect("metrics").1;
    assert!(
        metrics.contains("cli_mcp_operator_reconciles_total"),
        "{metrics}"
    );
    finish(ns, &name, &op).await;
}

#[tokio::test]
async fn edited_children_are_reverted_and_deleted_children_recreated() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("drift").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "drift", json!({})).await;
    wait_ready(&ns, "drift", &op).await;
    let n = InstanceName::parse("drift").expect("name");

    // Hand edits: scale the Deployment, open the NetworkPolicy to everyone.
    ns.api::<Deployment>()
        .patch(
            &n.server(),
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 3}})),
        )
        .await
        .expect("scale by hand");
    ns.api::<NetworkPolicy>()
        .patch(
            &n.sandbox(),
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"ingress": [{}]}})),
        )
        .await
        .expect("edit NetworkPolicy by hand");
    wait_for(
        ns.api::<Deployment>(),
        &n.server(),
        "replicas reverted to 1",
        TIMEOUT,
        |d: Option<&Deployment>| d.is_some_and(|d| d.spec.replicas == Some(1)),
    )
    .await
    .expect("Deployment replicas reverted");
    wait_for(
        ns.api::<NetworkPolicy>(),
        &n.sandbox(),
        "ingress reverted",
        TIMEOUT,
        |p: Option<&NetworkPolicy>| {
            p.and_then(|p| p.spec.as_ref())
                .and_then(|s| s.ingress.as_ref())
                .is_some_and(|i| i.len() == 1 && i[0].from.is_some() && i[0].ports.is_some())
        },
    )
    .await
    .expect("NetworkPolicy reverted");

    // Deleted children come back (new uid).
    let svc_uid = ns
        .api::<Service>()
        .get(&n.server())
        .await
        .expect("svc")
        .uid();
    let role_uid = ns.api::<Role>().get(&n.server()).await.expect("role").uid();
    ns.api::<Service>()
        .delete(&n.server(), &DeleteParams::default())
        .await
        .expect("delete Service");
    ns.api::<Role>()
        .delete(&n.server(), &DeleteParams::default())
        .await
        .expect("delete Role");
    ns.api::<ServiceAccount>()
        .delete(&n.sandbox(), &DeleteParams::default())
        .await
        .expect("delete SA");
    Api::<ClusterRoleBinding>::all(c.client.clone())
        .delete(
            &n.auth_delegator_binding(&ns.name),
            &DeleteParams::default(),
        )
        .await
        .expect("delete ClusterRoleBinding");
    wait_for(
        ns.api::<Service>(),
        &n.server(),
        "Service recreated",
        TIMEOUT,
        |s: Option<&Service>| s.is_some_and(|s| s.uid() != svc_uid),
    )
    .await
    .expect("Service recreated");
    wait_for(
        ns.api::<Role>(),
        &n.server(),
        "Role recreated",
        TIMEOUT,
        |r: Option<&Role>| r.is_some_and(|r| r.uid() != role_uid),
    )
    .await
    .expect("Role recreated");
    wait_for(
        ns.api::<ServiceAccount>(),
        &n.sandbox(),
        "SA recreated",
        TIMEOUT,
        |s: Option<&ServiceAccount>| s.is_some(),
    )
    .await
    .expect("sandbox SA recreated");
    wait_for(
        Api::<ClusterRoleBinding>::all(c.client.clone()),
        &n.auth_delegator_binding(&ns.name),
        "ClusterRoleBinding recreated",
        TIMEOUT,
        |b: Option<&ClusterRoleBinding>| b.is_some(),
    )
    .await
    .expect("ClusterRoleBinding recreated");
    finish(ns, "drift", &op).await;
}

#[tokio::test]
async fn pool_fills_and_refills_after_claims() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("pool").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "pool", json!({"sandbox": {"warmPoolSize": 4}})).await;
    wait_ready(&ns, "pool", &op).await;
    let pods = wait_pool(&ns, "pool", 4, &op).await;
    let key = hmac_key(&ns, "pool").await;
    let api = ns.api::<Pod>();
    let free = unassigned(&pods);
    let mut claimed = Vec::new();
    for (i, p) in free.iter().take(2).enumerate() {
        let p = claim(&api, p, &format!("s{i}"), &key).await.expect("claim");
        claimed.push(p.uid());
    }
    // Refilled to 4 free pods; the 2 claimed ones are kept.
    let pods = wait_pool(&ns, "pool", 4, &op).await;
    assert_eq!(pods.len(), 6);
    for uid in &claimed {
        assert!(pods.iter().any(|p| &p.uid() == uid), "claimed pod kept");
    }
    // Ready does not flap on claims.
    let o = ns.api::<CliMcpInstance>().get("pool").await.expect("cr");
    assert!(is_true(&o, "Ready"));
    // Pool pods are named by the shared contract and carry the current hash.
    for p in unassigned(&pods) {
        assert!(
            p.name_any().starts_with("cli-mcp-pool-pool-"),
            "{}",
            p.name_any()
        );
        assert!(p.annotations().contains_key(annotation::SANDBOX_HASH));
    }
    finish(ns, "pool", &op).await;
}

#[tokio::test]
async fn pool_shrinks_without_deleting_concurrently_claimed_pods() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("shrink").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "shrink", json!({"sandbox": {"warmPoolSize": 8}})).await;
    let pods = wait_pool(&ns, "shrink", 8, &op).await;
    let key = hmac_key(&ns, "shrink").await;

    // Shrink to 0 while a claimer races for every pod with the listed resourceVersions.
    let crs = ns.api::<CliMcpInstance>();
    let pp = PatchParams::default();
    let to_zero = Patch::Merge(json!({"spec": {"sandbox": {"warmPoolSize": 0}}}));
    let shrink = crs.patch("shrink", &pp, &to_zero);
    let api = ns.api::<Pod>();
    let claims =
        futures::future::join_all(pods.iter().enumerate().filter(|(i, _)| i % 2 == 0).map(
            |(i, p)| {
                let api = api.clone();
                let key = key.clone();
                async move { claim(&api, p, &format!("race{i}"), &key).await }
            },
        ));
    let (shrunk, claims) = tokio::join!(shrink, claims);
    shrunk.expect("shrink");
    let won: Vec<_> = claims
        .into_iter()
        .filter_map(|r| r.ok())
        .map(|p| p.uid())
        .collect();
    assert!(!won.is_empty(), "at least one claim wins the race");

    // Every pod left is a successful claim; every successful claim is alive.
    let left = wait_for_set(
        api.clone(),
        &sandbox_selector("shrink"),
        "only claimed pods left",
        TIMEOUT,
        |ps: &[Pod]| ps.iter().all(is_assigned),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let left_uids: BTreeSet<_> = left.iter().map(|p| p.uid()).collect();
    for uid in &won {
        assert!(left_uids.contains(uid), "claimed pod {uid:?} was deleted");
    }
    assert!(left.iter().all(|p| !is_deleting(p)));
    finish(ns, "shrink", &op).await;
}

#[tokio::test]
async fn image_change_replaces_unassigned_pods_only() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("image").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "img", json!({"sandbox": {"warmPoolSize": 3}})).await;
    let pods = wait_pool(&ns, "img", 3, &op).await;
    let key = hmac_key(&ns, "img").await;
    let api = ns.api::<Pod>();
    let session = claim(&api, unassigned(&pods)[0], "keep", &key)
        .await
        .expect("claim");
    let old: BTreeSet<_> = pods.iter().map(|p| p.uid()).collect();

    ns.api::<CliMcpInstance>()
        .patch(
            "img",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"sandbox": {"image": "cli-mcp-agent:v2"}}})),
        )
        .await
        .expect("change image");
    let pods = wait_for_set(
        api.clone(),
        &sandbox_selector("img"),
        "pool on the new image",
        TIMEOUT,
        |ps: &[Pod]| {
            let free = unassigned(ps);
            free.len() == 3
                && free.iter().all(|p| {
                    is_ready(p)
                        && p.spec
                            .as_ref()
                            .and_then(|s| s.containers[0].image.as_deref())
                            == Some("cli-mcp-agent:v2")
                })
                && ps.iter().all(|p| !is_deleting(p))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    for p in unassigned(&pods) {
        assert!(!old.contains(&p.uid()), "unassigned pods are new");
    }
    let kept = pods
        .iter()
        .find(|p| p.uid() == session.uid())
        .expect("assigned pod kept");
    assert_eq!(
        kept.spec
            .as_ref()
            .and_then(|s| s.containers[0].image.as_deref()),
        Some("cli-mcp-agent:dev")
    );
    let o = ns.api::<CliMcpInstance>().get("img").await.expect("cr");
    assert_eq!(
        o.status.and_then(|s| s.resolved_sandbox_image).as_deref(),
        Some("cli-mcp-agent:v2")
    );
    finish(ns, "img", &op).await;
}

/// An assigned pod as the server would create it, with `last-activity` `age` ago.
async fn session_pod(
    ns: &cli_mcp_e2e::testing::TestNamespace,
    instance: &str,
    sid: &str,
    age: Duration,
) -> Pod {
    let cr = ns.api::<CliMcpInstance>().get(instance).await.expect("cr");
    let cfg = cr.sandbox_config(Some(SANDBOX_IMAGE)).expect("config");
    let key = hmac_key(ns, instance).await;
    let sid = SessionId::parse(sid).expect("sid");
    let then = k8s_openapi::jiff::Timestamp::now()
        - k8s_openapi::jiff::SignedDuration::try_from(age).expect("age");
    let pod = build_sandbox_pod(
        &cfg,
        &SandboxRole::session(
            &key,
            sid,
            cli_mcp_api::token::SandboxNonce::from_bytes(rand::random()),
            None,
        ),
        &cli_mcp_api::activity::stamp(then),
    );
    ns.api::<Pod>()
        .create(&PostParams::default(), &pod)
        .await
        .expect("create session pod")
}

#[tokio::test]
async fn idle_session_is_collected_and_active_one_is_not() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("idle").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "idle", json!({"sandbox": {"idleTimeout": "1m"}})).await;
    wait_ready(&ns, "idle", &op).await;
    let stale = session_pod(&ns, "idle", "stale", Duration::from_secs(120)).await;
    let active = session_pod(&ns, "idle", "active", Duration::from_secs(0)).await;
    wait_for(
        ns.api::<Pod>(),
        &stale.name_any(),
        "idle session collected",
        TIMEOUT,
        |p: Option<&Pod>| p.is_none_or(|p| is_deleting(p) && p.uid() == stale.uid()),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let a = ns
        .api::<Pod>()
        .get(&active.name_any())
        .await
        .expect("active session exists");
    assert!(!is_deleting(&a), "active session kept");
    let o = wait_for(
        ns.api::<CliMcpInstance>(),
        "idle",
        "one active session",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            o.and_then(|o| o.status.as_ref())
                .is_some_and(|s| s.active_sessions == 1)
        },
    )
    .await
    .expect("status counts sessions");
    assert!(o.is_some());
    finish(ns, "idle", &op).await;
}

#[tokio::test]
async fn deleting_the_instance_removes_everything_including_sessions() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("teardown").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "td", json!({"sandbox": {"warmPoolSize": 2}})).await;
    wait_ready(&ns, "td", &op).await;
    wait_pool(&ns, "td", 2, &op).await;
    session_pod(&ns, "td", "live", Duration::from_secs(0)).await;
    // A session slot a server made and never bound to a pod (it crashed in between): no
    // owner, so garbage collection would never remove it, and no server is left to reclaim it.
    let n = InstanceName::parse("td").expect("name");
    let orphan: Lease = serde_json::from_value(json!({
        "metadata": {
            "name": format!("{}0", n.slot_prefix()),
            "labels": {
                label::INSTANCE: "td",
                label::COMPONENT: label::COMPONENT_SLOT,
                label::SESSION_ID: "crashed",
            },
        },
        "spec": {"holderIdentity": "crashed"},
    }))
    .expect("lease");
    ns.api::<Lease>()
        .create(&PostParams::default(), &orphan)
        .await
        .expect("create orphan slot");
    delete_released(&ns, "td", &op).await;
    assert_nothing_left(&c, &ns, "td").await;
    ns.delete().await.expect("delete namespace");
}

async fn assert_nothing_left(
    c: &cli_mcp_e2e::testing::TestCluster,
    ns: &cli_mcp_e2e::testing::TestNamespace,
    name: &str,
) {
    let n = InstanceName::parse(name).expect("name");
    let pods = ns
        .api::<Pod>()
        .list(&ListParams::default().labels(&format!("{}={name}", label::INSTANCE)))
        .await
        .expect("list pods");
    assert!(
        pods.items.is_empty(),
        "pods left: {:?}",
        pods.items.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
    let slots = ns
        .api::<Lease>()
        .list(&ListParams::default().labels(&n.slot_selector()))
        .await
        .expect("list slots");
    assert!(
        slots.items.is_empty(),
        "session slots left: {:?}",
        slots.items.iter().map(|l| l.name_any()).collect::<Vec<_>>()
    );
    assert!(
        Api::<ClusterRoleBinding>::all(c.client.clone())
            .get_opt(&n.auth_delegator_binding(&ns.name))
            .await
            .expect("get crb")
            .is_none(),
        "ClusterRoleBinding removed"
    );
    // Owned Secrets go with the CR (garbage collector).
    for s in [n.hmac_secret(), n.tls_secret()] {
        wait_for(
            ns.api::<Secret>(),
            &s,
            "owned Secret collected",
            TIMEOUT,
            |o: Option<&Secret>| o.is_none(),
        )
        .await
        .expect("Secret garbage-collected");
    }
    // The admin's kubeconfig Secret is never touched.
    assert!(ns
        .api::<Secret>()
        .get_opt(&n.kubeconfig_secret())
        .await
        .expect("get")
        .is_some());
}

/// A new operator process (a restart, a new leader) judges an instance only once its caches
/// have listed: its first reconciles leave a Ready instance Ready. (They saw no Deployment,
/// warm pod or NetworkPolicy yet, wrote Ready=False, and Ready then waited for a full pool.)
#[tokio::test]
async fn a_restarted_operator_leaves_a_ready_instance_ready() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("restart-ready").await.expect("namespace");
    let mut op = Operator::start(&c, &ns.name, "op1");
    create_instance(&ns, "rr", json!({"sandbox": {"warmPoolSize": 1}})).await;
    wait_ready(&ns, "rr", &op).await;
    wait_pool(&ns, "rr", 1, &op).await;
    let crs = ns.api::<CliMcpInstance>();
    let ready = |o: &CliMcpInstance| {
        find_condition(o, "Ready").map(|c| (c.status.clone(), c.last_transition_time.clone()))
    };
    let before = ready(&crs.get("rr").await.expect("instance")).expect("Ready");
    assert_eq!(before.0, "True");
    op.kill();
    for round in 2..5 {
        let mut next = Operator::start(&c, &ns.name, &format!("op{round}"));
        let reconciled = tokio::time::timeout(TIMEOUT, async {
            while next.reconciles().await == 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        next.ok(reconciled.map_err(|_| "no reconcile of the new operator"));
        let after = ready(&crs.get("rr").await.expect("instance")).expect("Ready");
        assert_eq!(after, before, "round {round}: {}", next.log_tail());
        next.kill();
    }
    let op = Operator::start(&c, &ns.name, "op-last");
    finish(ns, "rr", &op).await;
}

#[tokio::test]
async fn teardown_survives_an_operator_restart() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("restart").await.expect("namespace");
    let mut op = Operator::start(&c, &ns.name, "op1");
    create_instance(&ns, "rs", json!({"sandbox": {"warmPoolSize": 1}})).await;
    wait_ready(&ns, "rs", &op).await;
    // A session pod that cannot go away yet (a foreign finalizer) holds the teardown.
    let held = session_pod(&ns, "rs", "held", Duration::from_secs(0)).await;
    hold(ns.api::<Pod>(), &held.name_any(), true).await;
    let crs = ns.api::<CliMcpInstance>();
    crs.delete("rs", &DeleteParams::default())
        .await
        .expect("delete CR");
    // Teardown has started: the server is scaled down and the held pod is terminating.
    wait_for(
        ns.api::<Pod>(),
        &held.name_any(),
        "held pod terminating",
        TIMEOUT,
        |p: Option<&Pod>| p.is_some_and(is_deleting),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let d = ns
        .api::<Deployment>()
        .get("cli-mcp-rs")
        .await
        .expect("deployment");
    assert_eq!(d.spec.replicas, Some(0));
    op.kill();
    let o = crs.get("rs").await.expect("CR still there");
    assert!(o.metadata.deletion_timestamp.is_some());
    // A new operator process continues where the old one stopped.
    let op2 = Operator::start(&c, &ns.name, "op2");
    hold(ns.api::<Pod>(), &held.name_any(), false).await;
    wait_released(&ns, "rs", &op2).await;
    assert_nothing_left(&c, &ns, "rs").await;
    ns.delete().await.expect("delete namespace");
}

#[tokio::test]
async fn deleted_hmac_secret_gives_a_new_key_rolls_the_server_and_replaces_the_pool() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("hmac").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "hk", json!({"sandbox": {"warmPoolSize": 2}})).await;
    wait_ready(&ns, "hk", &op).await;
    let pods = wait_pool(&ns, "hk", 2, &op).await;
    let old_key = hmac_key(&ns, "hk").await.to_hex();
    let old_pods: BTreeSet<_> = pods.iter().map(|p| p.uid()).collect();
    let d = ns
        .api::<Deployment>()
        .get("cli-mcp-hk")
        .await
        .expect("deployment");
    let old_version =
        template_annotation(&d, "cli-mcp.redhat.com/hmac-version").expect("annotation");
    let secret_uid = ns
        .api::<Secret>()
        .get("cli-mcp-hk-hmac")
        .await
        .expect("secret")
        .uid();
    // A live session under the old key: its token can no longer be derived, so it is reset.
    let live = session_pod(&ns, "hk", "live", Duration::from_secs(0)).await;

    ns.api::<Secret>()
        .delete("cli-mcp-hk-hmac", &DeleteParams::default())
        .await
        .expect("delete key");
    wait_for(
        ns.api::<Secret>(),
        "cli-mcp-hk-hmac",
        "new HMAC Secret",
        TIMEOUT,
        |s: Option<&Secret>| s.is_some_and(|s| s.uid() != secret_uid),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    assert_ne!(hmac_key(&ns, "hk").await.to_hex(), old_key, "a new key");
    wait_rolled(
        &ns,
        "cli-mcp-hk",
        "cli-mcp.redhat.com/hmac-version",
        Some(&old_version),
        &op,
    )
    .await;
    // The template rolls in the same reconcile that replaces the pool, just before it: wait
    // for a full pool of the new key, not for any full pool (the old one still is, briefly).
    let new_key = hmac_key(&ns, "hk").await;
    let pods = wait_for_set(
        ns.api::<Pod>(),
        &sandbox_selector("hk"),
        "a full pool made for the new key",
        TIMEOUT,
        |pods: &[Pod]| {
            let free = unassigned(pods);
            free.len() == 2
                && free
                    .iter()
                    .all(|p| is_ready(p) && made_for_key(p, &new_key))
                && !pods.iter().any(is_deleting)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    assert!(
        unassigned(&pods)
            .iter()
            .all(|p| !old_pods.contains(&p.uid())),
        "pool replaced"
    );
    wait_for(
        ns.api::<Pod>(),
        &live.name_any(),
        "old-key session collected",
        TIMEOUT,
        |p: Option<&Pod>| p.is_none_or(is_deleting),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    assert_eq!(
        op.metric("cli_mcp_operator_sessions_collected_total").await,
        1.0
    );
    wait_ready(&ns, "hk", &op).await;
    finish(ns, "hk", &op).await;
}

#[tokio::test]
async fn standby_operator_takes_over_when_the_leader_dies() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("leader").await.expect("namespace");
    let mut a = Operator::start(&c, &ns.name, "leader-a");
    create_instance(&ns, "le", json!({})).await;
    wait_ready(&ns, "le", &a).await;
    let leases = ns.api::<Lease>();
    let holder = |l: Option<&Lease>| {
        l.and_then(|l| l.spec.as_ref())
            .and_then(|s| s.holder_identity.clone())
    };
    wait_for(
        leases.clone(),
        "cli-mcp-operator",
        "a holds the lease",
        TIMEOUT,
        move |l: Option<&Lease>| holder(l).as_deref() == Some("leader-a"),
    )
    .await
    .expect("a leads");
    let b = Operator::start(&c, &ns.name, "leader-b");
    // b is a healthy standby and does not take the lease while a renews it.
    // Poll the HTTP endpoint until the process listens (there is nothing to watch).
    let mut standby = None;
    for _ in 0..300 {
        standby = b.http("/readyz").await;
        if standby.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let standby = standby.expect("b serves /readyz");
    assert_eq!(standby, (200, "standby".to_string()));
    a.kill();
    wait_for(
        leases,
        "cli-mcp-operator",
        "b holds the lease",
        TIMEOUT,
        move |l: Option<&Lease>| holder(l).as_deref() == Some("leader-b"),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", b.log_tail()));
    // b reconciles: a deleted child comes back.
    let np = ns.api::<NetworkPolicy>();
    let uid = np.get("cli-mcp-le-sandbox").await.expect("np").uid();
    np.delete("cli-mcp-le-sandbox", &DeleteParams::default())
        .await
        .expect("delete np");
    wait_for(
        np,
        "cli-mcp-le-sandbox",
        "recreated by b",
        TIMEOUT,
        |p: Option<&NetworkPolicy>| p.is_some_and(|p| p.uid() != uid),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", b.log_tail()));
    finish(ns, "le", &b).await;
}

#[tokio::test]
async fn steady_state_makes_no_writes() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("steady").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "st", json!({"sandbox": {"warmPoolSize": 3}})).await;
    wait_ready(&ns, "st", &op).await;
    wait_pool(&ns, "st", 3, &op).await;
    // Let the last status write and its echo settle: wait until the operator's write
    // counter stops moving between two metric reads around a no-op watch window.
    let before = op.writes().await;
    let selector = format!("{}=st", label::INSTANCE);
    let rv = |list: Vec<(String, String)>| {
        list.into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    async fn rvs<K>(api: Api<K>, sel: &str) -> Vec<(String, String)>
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        api.list(&ListParams::default().labels(sel))
            .await
            .expect("list")
            .items
            .into_iter()
            .map(|o| (o.name_any(), o.resource_version().unwrap_or_default()))
            .collect()
    }
    let snapshot = |ns: &cli_mcp_e2e::testing::TestNamespace| {
        let (ns, selector) = (ns.clone(), selector.clone());
        async move {
            let mut all = Vec::new();
            all.extend(rvs(ns.api::<Deployment>(), &selector).await);
            all.extend(rvs(ns.api::<Service>(), &selector).await);
            all.extend(rvs(ns.api::<ServiceAccount>(), &selector).await);
            all.extend(rvs(ns.api::<Role>(), &selector).await);
            all.extend(rvs(ns.api::<RoleBinding>(), &selector).await);
            all.extend(rvs(ns.api::<NetworkPolicy>(), &selector).await);
            all.extend(rvs(ns.api::<Secret>(), &selector).await);
            all.extend(rvs(ns.api::<ConfigMap>(), &selector).await);
            all.extend(rvs(ns.api::<Pod>(), &selector).await);
            let cr = ns.api::<CliMcpInstance>().get("st").await.expect("cr");
            all.push(("cr".into(), cr.resource_version().unwrap_or_default()));
            all
        }
    };
    let first = rv(snapshot(&ns).await);
    // The measurement window itself: 30 s of nothing happening (not a synchronisation).
    tokio::time::sleep(Duration::from_secs(30)).await;
    let second = rv(snapshot(&ns).await);
    let after = op.writes().await;
    assert_eq!(
        after,
        before,
        "operator sent {} writes in a steady state\n{}",
        after - before,
        op.log_tail()
    );
    let changed: Vec<_> = first
        .iter()
        .filter(|(k, v)| second.get(*k) != Some(*v))
        .collect();
    assert!(
        changed.is_empty(),
        "objects changed in a steady state: {changed:?}"
    );
    assert_eq!(first.len(), second.len());
    finish(ns, "st", &op).await;
}

#[tokio::test]
async fn bad_image_backs_off_instead_of_churning_and_recovers() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("badimg").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(
        &ns,
        "bad",
        json!({"sandbox": {"warmPoolSize": 2, "image": "registry.example.invalid/no-such-sandbox:1"}}),
    )
    .await;
    let o = wait_for(
        ns.api::<CliMcpInstance>(),
        "bad",
        "PodsFailing",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            // Ready reports the pool once the server is available.
            o.is_some_and(|o| {
                condition(o, "WarmPoolReady") == Some(("False".into(), "PodsFailing".into()))
                    && condition(o, "Ready") == Some(("False".into(), "WarmPoolUnhealthy".into()))
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()))
    .expect("instance");
    assert_eq!(
        condition(&o, "Ready"),
        Some(("False".into(), "WarmPoolUnhealthy".into()))
    );
    assert_eq!(
        condition(&o, "Degraded"),
        Some(("True".into(), "PoolPodsFailing".into()))
    );
    // The kubelet retries the pull (ErrImagePull -> ImagePullBackOff) on the same pods.
    let pods = wait_for_set(
        ns.api::<Pod>(),
        &sandbox_selector("bad"),
        "pods in ImagePullBackOff",
        TIMEOUT,
        |ps: &[Pod]| {
            ps.len() == 2
                && ps.iter().all(|p| {
                    cli_mcp_operator::pool::failing_state(p)
                        .is_some_and(|(r, _)| r == "ImagePullBackOff")
                })
        },
    )
    .await
    .expect("backoff");
    assert_eq!(
        op.metric("cli_mcp_operator_pool_pods_created_total").await,
        2.0,
        "no churn"
    );
    assert_eq!(
        op.metric("cli_mcp_operator_pool_pods_deleted_total").await,
        0.0,
        "no churn"
    );

    // Fixing the image replaces the failing pods and the instance becomes Ready.
    ns.api::<CliMcpInstance>()
        .patch(
            "bad",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"sandbox": {"image": SANDBOX_IMAGE}}})),
        )
        .await
        .expect("fix image");
    let fixed = wait_pool(&ns, "bad", 2, &op).await;
    assert!(fixed
        .iter()
        .all(|p| !pods.iter().any(|old| old.uid() == p.uid())));
    wait_ready(&ns, "bad", &op).await;
    finish(ns, "bad", &op).await;
}

#[tokio::test]
async fn scale_subresource_scales_the_server() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("scale").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "sc", json!({})).await;
    wait_ready(&ns, "sc", &op).await;
    let crs = ns.api::<CliMcpInstance>();
    // What `kubectl scale cmi/sc --replicas=2` does.
    crs.patch_scale(
        "sc",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": 2}})),
    )
    .await
    .expect("scale");
    wait_for(
        ns.api::<Deployment>(),
        "cli-mcp-sc",
        "2 ready server replicas",
        TIMEOUT,
        |d: Option<&Deployment>| {
            d.is_some_and(|d| {
                d.spec.replicas == Some(2)
                    && d.status.as_ref().and_then(|s| s.ready_replicas) == Some(2)
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let o = wait_for(
        crs.clone(),
        "sc",
        "status.replicas = 2",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            o.and_then(|o| o.status.as_ref())
                .is_some_and(|s| s.replicas == 2 && s.ready_replicas == 2)
        },
    )
    .await
    .expect("status follows");
    assert!(o.is_some());
    let scale = crs.get_scale("sc").await.expect("scale subresource");
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(2));
    let st = scale.status.expect("scale status");
    assert_eq!(st.replicas, 2);
    assert_eq!(
        st.selector.as_deref(),
        Some("cli-mcp.redhat.com/instance=sc,cli-mcp.redhat.com/component=server")
    );
    finish(ns, "sc", &op).await;
}

#[tokio::test]
async fn auth_none_serves_plain_http_without_tls_material() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("authnone").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "plain", json!({"server": {"auth": "None"}})).await;
    let o = wait_ready(&ns, "plain", &op).await;
    let st = o.status.expect("status");
    assert_eq!(
        st.endpoint.as_deref(),
        Some(format!("http://cli-mcp-plain.{}.svc:8080/mcp", ns.name).as_str())
    );
    assert_eq!(st.ca_config_map, None);
    assert!(ns
        .api::<Secret>()
        .get_opt("cli-mcp-plain-tls")
        .await
        .expect("get")
        .is_none());
    let svc = ns.api::<Service>().get("cli-mcp-plain").await.expect("svc");
    let ports = svc.spec.and_then(|s| s.ports).expect("ports");
    assert_eq!(ports[0].port, 8080);
    assert_eq!(ports[0].name.as_deref(), Some("http"));
    finish(ns, "plain", &op).await;
}

/// `spec.server.allowedOrigins` reach the server as `--allowed-origin` flags it accepts: it
/// starts (an origin it could not parse would stop it), a browser request from a listed
/// origin passes its Origin check, and one from any other origin gets 403.
#[tokio::test]
async fn allowed_origins_reach_the_server_and_only_they_pass() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("origins").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    let origins = [
        "https://app.example.com",
        "HTTP://LocalHost:*",
        "http://[::1]:3000",
    ];
    create_instance(
        &ns,
        "orig",
        json!({"server": {"auth": "None", "allowedOrigins": origins}}),
    )
    .await;
    wait_ready(&ns, "orig", &op).await;
    let n = InstanceName::parse("orig").expect("name");
    // The flags themselves are the builder's unit test's; here what they do.
    let pods = ns
        .api::<Pod>()
        .list(&ListParams::default().labels(&n.server_selector()))
        .await
        .expect("server pods");
    let ip = pods
        .items
        .iter()
        .filter(|p| is_ready(p))
        .find_map(cli_mcp_e2e::testing::pod_ip)
        .expect("a ready server pod with an IP");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("HTTP client");
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "origin-test", "version": "0"}}});
    for (origin, allowed) in [
        ("https://app.example.com", true),
        ("http://localhost:5173", true),
        ("https://evil.example", false),
        ("http://app.example.com", false),
    ] {
        let res = http
            .post(format!("http://{ip}:8080/mcp"))
            .header("Origin", origin)
            .header("Accept", "application/json, text/event-stream")
            .json(&initialize)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST /mcp from {origin}: {e}"));
        let status = res.status();
        let body = res.text().await.unwrap_or_default();
        if allowed {
            assert!(status.is_success(), "{origin}: {status} {body}");
        } else {
            assert_eq!(status, reqwest::StatusCode::FORBIDDEN, "{origin}: {body}");
        }
    }
    finish(ns, "orig", &op).await;
}

/// Whether the API server's RBAC lets `user` (in `groups`) use `verb` on instance
/// `instance`'s MCP endpoint — the very check the server makes with a SubjectAccessReview.
async fn may_use(
    c: &cli_mcp_e2e::testing::TestCluster,
    ns: &str,
    instance: &str,
    user: &str,
    groups: &[&str],
    verb: &str,
) -> bool {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.into()),
            groups: Some(groups.iter().map(|g| (*g).to_owned()).collect()),
            resource_attributes: Some(ResourceAttributes {
                group: Some("cli-mcp.redhat.com".into()),
                resource: Some("climcpinstances".into()),
                subresource: Some("mcp".into()),
                name: Some(instance.into()),
                namespace: Some(ns.into()),
                verb: Some(verb.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<SubjectAccessReview>::all(c.client.clone())
        .create(&PostParams::default(), &review)
        .await
        .expect("SubjectAccessReview")
        .status
        .is_some_and(|s| s.allowed)
}

/// The operator provisions who may use an instance: its client ServiceAccount and the
/// subjects of `spec.server.clients`, with exactly the verbs the server checks, on this
/// instance only; an edit of the list is followed both ways.
#[tokio::test]
async fn the_client_identity_may_use_its_instance_and_nothing_else() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("clients").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(
        &ns,
        "cl",
        json!({"server": {"clients": [
            {"kind": "ServiceAccount", "name": "bot"},
            {"kind": "User", "name": "alice"},
            {"kind": "Group", "name": "sre"},
        ]}}),
    )
    .await;
    wait_ready(&ns, "cl", &op).await;
    let n = &ns.name;
    let sa = |name: &str| format!("system:serviceaccount:{n}:{name}");
    let client = sa("cli-mcp-cl-client");
    assert!(ns
        .api::<ServiceAccount>()
        .get("cli-mcp-cl-client")
        .await
        .is_ok());
    for verb in ["create", "get", "delete"] {
        assert!(may_use(&c, n, "cl", &client, &[], verb).await, "{verb}");
    }
    for (who, groups) in [
        (sa("bot"), vec![]),
        ("alice".into(), vec![]),
        ("bob".to_string(), vec!["sre"]),
    ] {
        assert!(
            may_use(&c, n, "cl", &who, &groups, "create").await,
            "{who} {groups:?}"
        );
    }
    // Not another verb, not another instance, not anyone else.
    assert!(!may_use(&c, n, "cl", &client, &[], "update").await);
    assert!(!may_use(&c, n, "other", &client, &[], "create").await);
    assert!(!may_use(&c, n, "cl", "mallory", &[], "create").await);
    assert!(!may_use(&c, n, "cl", &sa("default"), &[], "create").await);

    // Dropping a subject from the list takes its access away.
    ns.api::<CliMcpInstance>()
        .patch(
            "cl",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"server": {"clients": [{"kind": "User", "name": "alice"}]}}}),
            ),
        )
        .await
        .expect("patch clients");
    wait_for(
        ns.api::<RoleBinding>(),
        "cli-mcp-cl-client",
        "the client RoleBinding follows spec.server.clients",
        Duration::from_secs(60),
        |b: Option<&RoleBinding>| {
            b.and_then(|b| b.subjects.as_ref())
                .is_some_and(|s| s.len() == 2 && s.iter().all(|s| s.name != "bot"))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    assert!(!may_use(&c, n, "cl", &sa("bot"), &[], "create").await);
    assert!(may_use(&c, n, "cl", "alice", &[], "create").await);
    assert!(may_use(&c, n, "cl", &client, &[], "create").await);
    finish(ns, "cl", &op).await;
}

/// The implied proxy (no `spec.proxy`) holds `spec.sandbox.kubeconfigSecret`; naming a Secret
/// the operator made (here another instance's HMAC key: admission refuses only the
/// instance's own names) makes the instance `KubeconfigInvalid` with what to fix, and no
/// sandbox starts. Naming the admin's kubeconfig instead makes it Ready.
#[tokio::test]
async fn the_implied_proxy_never_holds_a_secret_of_the_operators() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("implied").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    // Another instance's HMAC Secret, as the operator labels it.
    let stolen = "cli-mcp-other-hmac";
    ns.api::<Secret>()
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": stolen, "labels": {label::APP_MANAGED_BY: label::MANAGED_BY}},
                "stringData": {"kubeconfig": cli_mcp_e2e::instance::DUMMY_KUBECONFIG, "key": "00"},
            }))
            .expect("Secret"),
        )
        .await
        .expect("create the look-alike Secret");
    ns.api::<CliMcpInstance>()
        .create(
            &PostParams::default(),
            &instance(
                "im",
                json!({"sandbox": {"warmPoolSize": 1, "kubeconfigSecret": stolen}}),
            ),
        )
        .await
        .expect("create instance");
    let refused = op.ok(cli_mcp_e2e::instance::wait_instance(
        ns.api::<CliMcpInstance>(),
        "im",
        "Ready=False KubeconfigInvalid",
        TIMEOUT,
        |o| condition(o, "Ready").is_some_and(|(s, r)| s == "False" && r == "KubeconfigInvalid"),
    )
    .await);
    let message = find_condition(&refused, "Ready")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        message.contains(stolen)
            && message.contains("managed by the cli-mcp operator")
            && message.contains("name the Secret holding the admin kubeconfig"),
        "{message}"
    );
    let pods = ns
        .api::<Pod>()
        .list(&ListParams::default().labels(&sandbox_selector("im")))
        .await
        .expect("list sandboxes");
    assert!(pods.items.is_empty(), "no sandbox starts: {:?}", pods.items);
    assert!(
        ns.api::<Deployment>()
            .get_opt("cli-mcp-im-proxy")
            .await
            .expect("get")
            .is_none(),
        "no proxy holds the operator's Secret"
    );

    // What the message says to do.
    kubeconfig_secret(&ns, "im").await;
    ns.api::<CliMcpInstance>()
        .patch(
            "im",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"sandbox": {"kubeconfigSecret": "cli-mcp-im-kubeconfig"}}}),
            ),
        )
        .await
        .expect("patch instance");
    wait_ready(&ns, "im", &op).await;
    wait_pool(&ns, "im", 1, &op).await;
    finish(ns, "im", &op).await;
}
