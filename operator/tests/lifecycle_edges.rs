//! Lifecycle edges of the operator on the local Kubernetes: the serving certificate renewed
//! before it expires, a re-created instance that never uses its predecessor's Secrets, an
//! unusable HMAC key, the teardown timeout, and a finalizer that waits for the credential
//! proxy's pods.

mod support;

use std::time::SystemTime;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::{label, InstanceName};
use cli_mcp_api::pod_state::is_deleting;
use cli_mcp_api::sandbox::made_for_key;
use cli_mcp_e2e::instance::wait_instance;
use cli_mcp_e2e::testing::{cluster, wait_for, wait_for_set, TestNamespace};
use cli_mcp_operator::children::secrets;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::ByteString;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;

use support::*;

const TLS_VERSION: &str = "cli-mcp.redhat.com/tls-version";

fn value(s: &Secret, key: &str) -> String {
    secrets::secret_value(s, key)
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default()
}

async fn secret(ns: &TestNamespace, name: &str) -> Secret {
    ns.api::<Secret>().get(name).await.expect("get Secret")
}

async fn published_ca(ns: &TestNamespace, n: &InstanceName) -> String {
    let cm = ns
        .api::<ConfigMap>()
        .get(&secrets::ca_config_map_name(n))
        .await
        .expect("CA ConfigMap");
    cm.data.unwrap_or_default()["ca.crt"].clone()
}

async fn reasons(ns: &TestNamespace, name: &str) -> Vec<(String, String)> {
    let events = ns
        .api::<Event>()
        .list(&ListParams::default())
        .await
        .expect("events");
    events
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect()
}

fn ready_reason(o: &CliMcpInstance) -> Option<(String, String, String)> {
    find_condition(o, "Ready").map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

#[tokio::test]
async fn the_serving_certificate_is_renewed_from_the_same_ca_before_it_expires() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("tls-renew").await.expect("namespace");
    // 60 s, the shortest allowed: valid 66 s (6 s backdated), renewed 22 s before the end.
    let op = Operator::start_with(&c, &ns.name, "op", &[("CLI_MCP_TLS_LIFETIME", "60")]);
    create_instance(&ns, "tr", json!({})).await;
    wait_ready(&ns, "tr", &op).await;
    let n = InstanceName::parse("tr").expect("name");
    let first = secret(&ns, &n.tls_secret()).await;
    let first_crt = value(&first, secrets::TLS_CRT);
    let (_, expires) = secrets::validity(&first_crt).expect("the leaf parses");
    let ca = published_ca(&ns, &n).await;
    let ca_secret = secret(&ns, &secrets::tls_ca_secret_name(&n)).await;
    assert_eq!(value(&ca_secret, secrets::CA_CRT).trim(), ca.trim());
    assert!(!value(&ca_secret, secrets::CA_KEY).is_empty());
    let d = ns
        .api::<Deployment>()
        .get(&n.server())
        .await
        .expect("server Deployment");
    let version = template_annotation(&d, TLS_VERSION).expect("tls-version");

    let renewed = op
        .ok(wait_for(
            ns.api::<Secret>(),
            &n.tls_secret(),
            "a new serving certificate",
            TIMEOUT,
            |s: Option<&Secret>| s.is_some_and(|s| value(s, secrets::TLS_CRT) != first_crt),
        )
        .await)
        .expect("Secret");
    assert!(
        SystemTime::now() < expires,
        "renewed only after the old certificate expired"
    );
    let new_crt = value(&renewed, secrets::TLS_CRT);
    let (_, new_expires) = secrets::validity(&new_crt).expect("the new leaf parses");
    assert!(new_expires > expires);
    // The same CA: what clients pinned keeps working.
    assert_eq!(value(&renewed, secrets::CA_CRT).trim(), ca.trim());
    assert_eq!(published_ca(&ns, &n).await.trim(), ca.trim());
    wait_rolled(&ns, &n.server(), TLS_VERSION, Some(&version), &op).await;
    let events = reasons(&ns, "tr").await;
    assert!(
        events.iter().any(|(r, _)| r == "CertificateRenewed"),
        "{events:?}"
    );
    wait_ready(&ns, "tr", &op).await;
    finish(ns, "tr", &op).await;
}

#[tokio::test]
async fn a_recreated_instance_never_uses_its_predecessors_secrets() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("recreate").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    let spec = json!({"sandbox": {"warmPoolSize": 1}});
    create_instance(&ns, "rc", spec.clone()).await;
    wait_ready(&ns, "rc", &op).await;
    wait_pool(&ns, "rc", 1, &op).await;
    let n = InstanceName::parse("rc").expect("name");
    let old_key = hmac_key(&ns, "rc").await;
    let old_crt = value(&secret(&ns, &n.tls_secret()).await, secrets::TLS_CRT);
    let old_ca = published_ca(&ns, &n).await;
    // Garbage collection of the old HMAC Secret cannot finish while this is on it, so the
    // re-created instance surely finds it.
    hold(ns.api::<Secret>(), &n.hmac_secret(), true).await;

    delete_released(&ns, "rc", &op).await;
    let crs = ns.api::<CliMcpInstance>();
    crs.create(&Default::default(), &instance("rc", spec))
        .await
        .expect("re-create");
    let waiting = op.ok(wait_instance(
        crs,
        "rc",
        "Ready=False naming the predecessor's Secret",
        TIMEOUT,
        |o| {
            ready_reason(o).is_some_and(|(s, _, m)| {
                s == "False" && m.contains("deleted instance of the same name")
            })
        },
    )
    .await);
    let (_, reason, message) = ready_reason(&waiting).expect("Ready");
    assert!(message.contains(&n.hmac_secret()), "{reason}: {message}");
    // No sandbox was made with the old key while it waited.
    let pods = ns
        .api::<Pod>()
        .list(&ListParams::default().labels(&sandbox_selector("rc")))
        .await
        .expect("pods");
    assert!(
        pods.items.iter().all(|p| !made_for_key(p, &old_key)),
        "a sandbox for the old key"
    );

    hold(ns.api::<Secret>(), &n.hmac_secret(), false).await;
    wait_ready(&ns, "rc", &op).await;
    let new_key = hmac_key(&ns, "rc").await;
    assert_ne!(new_key.to_hex(), old_key.to_hex(), "the predecessor's key");
    let new_crt = value(&secret(&ns, &n.tls_secret()).await, secrets::TLS_CRT);
    assert_ne!(new_crt, old_crt, "the predecessor's certificate");
    assert_ne!(
        published_ca(&ns, &n).await.trim(),
        old_ca.trim(),
        "the predecessor's CA"
    );
    // The new pool is made for the new key only: the old instance's session tokens open
    // none of its sandboxes.
    let pool = wait_pool(&ns, "rc", 1, &op).await;
    for p in unassigned(&pool) {
        assert!(made_for_key(p, &new_key));
        assert!(!made_for_key(p, &old_key));
    }
    finish(ns, "rc", &op).await;
}

#[tokio::test]
async fn an_unusable_hmac_key_is_secret_keys_invalid_until_the_secret_is_deleted() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("badkey").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "bk", json!({})).await;
    wait_ready(&ns, "bk", &op).await;
    let n = InstanceName::parse("bk").expect("name");
    let crs = ns.api::<CliMcpInstance>();
    let old_uid = secret(&ns, &n.hmac_secret()).await.uid();
    for bad in ["not-hex-at-all", "  \n"] {
        ns.api::<Secret>()
            .patch(
                &n.hmac_secret(),
                &PatchParams::default(),
                &Patch::Merge(json!({"data": {"key": ByteString(bad.as_bytes().to_vec())}})),
            )
            .await
            .expect("spoil the key");
        let o = wait_instance(
            crs.clone(),
            "bk",
            "Ready=False SecretKeysInvalid",
            TIMEOUT,
            |o| {
                ready_reason(o).is_some_and(|(s, r, m)| {
                    s == "False" && r == "SecretKeysInvalid" && m.contains(&n.hmac_secret())
                })
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{bad:?}: {e}\noperator log:\n{}", op.log_tail()));
        let (_, _, message) = ready_reason(&o).expect("Ready");
        assert!(
            message.contains("delete the Secret and the operator generates a new one"),
            "{bad:?}: {message}"
        );
    }
    ns.api::<Secret>()
        .delete(&n.hmac_secret(), &DeleteParams::default())
        .await
        .expect("delete the Secret");
    wait_ready(&ns, "bk", &op).await;
    let fresh = secret(&ns, &n.hmac_secret()).await;
    assert_ne!(fresh.uid(), old_uid);
    assert!(cli_mcp_api::token::HmacKey::from_hex(&value(&fresh, secrets::HMAC_KEY)).is_ok());
    finish(ns, "bk", &op).await;
}

#[tokio::test]
async fn the_teardown_timeout_releases_an_instance_whose_pod_cannot_go() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("td-timeout").await.expect("namespace");
    let op = Operator::start_with(&c, &ns.name, "op", &[("CLI_MCP_TEARDOWN_TIMEOUT", "5")]);
    create_instance(&ns, "tt", json!({"sandbox": {"warmPoolSize": 1}})).await;
    wait_ready(&ns, "tt", &op).await;
    let pool = wait_pool(&ns, "tt", 1, &op).await;
    let held = pool[0].name_any();
    hold(ns.api::<Pod>(), &held, true).await;
    delete_released(&ns, "tt", &op).await;
    // Released although the pod is still there: only the timeout does that.
    let pod = ns.api::<Pod>().get_opt(&held).await.expect("get pod");
    assert!(pod.as_ref().is_some_and(is_deleting), "{pod:?}");
    let events = reasons(&ns, "tt").await;
    let timed_out = events
        .iter()
        .find(|(r, _)| r == "TeardownTimedOut")
        .unwrap_or_else(|| panic!("no TeardownTimedOut event: {events:?}"));
    assert!(
        timed_out.1.contains("did not terminate in time"),
        "{timed_out:?}"
    );
    hold(ns.api::<Pod>(), &held, false).await;
    ns.delete().await.expect("delete namespace");
}

#[tokio::test]
async fn the_finalizer_waits_for_the_credential_proxy_pods() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("td-proxy").await.expect("namespace");
    let op = Operator::start_with(
        &c,
        &ns.name,
        "op",
        &[("RELATED_IMAGE_PROXY", "cli-mcp-proxy:test")],
    );
    create_instance(
        &ns,
        "tp",
        json!({"proxy": {"replicas": 1, "targets": [{"type": "allowlist", "domains": ["example.com"]}]}}),
    )
    .await;
    let n = InstanceName::parse("tp").expect("name");
    let selector = format!(
        "{}=tp,{}={}",
        label::INSTANCE,
        label::COMPONENT,
        label::COMPONENT_PROXY
    );
    // Running or not: a proxy pod exists, and this one cannot go away yet.
    let proxies = op.ok(wait_for_set(
        ns.api::<Pod>(),
        &selector,
        "a proxy pod",
        TIMEOUT,
        |pods: &[Pod]| !pods.is_empty(),
    )
    .await);
    let held = proxies[0].name_any();
    hold(ns.api::<Pod>(), &held, true).await;

    let crs = ns.api::<CliMcpInstance>();
    crs.delete("tp", &DeleteParams::default())
        .await
        .expect("delete CR");
    op.ok(wait_for(
        ns.api::<Pod>(),
        &held,
        "proxy pod terminating",
        TIMEOUT,
        |p: Option<&Pod>| p.is_some_and(is_deleting),
    )
    .await);
    // The teardown deleted the proxy (the garbage collector would only have started once
    // the instance was gone) and waits for its pod.
    let o = crs.get_opt("tp").await.expect("get CR");
    assert!(
        o.as_ref()
            .is_some_and(|o| o.metadata.deletion_timestamp.is_some()),
        "the instance was released while a proxy pod still exists"
    );
    assert!(ns
        .api::<Deployment>()
        .get_opt(&n.proxy())
        .await
        .expect("get")
        .is_none_or(|d| d.metadata.deletion_timestamp.is_some()));

    hold(ns.api::<Pod>(), &held, false).await;
    wait_released(&ns, "tp", &op).await;
    let left = ns
        .api::<Pod>()
        .list(&ListParams::default().labels(&selector))
        .await
        .expect("list");
    assert!(left.items.is_empty(), "proxy pods left");
    ns.delete().await.expect("delete namespace");
}

/// A pool pod create that the API server fails (a webhook it cannot call answers 500, which
/// is no refusal of the pod) does not end the reconcile before the status: the pool's
/// condition says what failed, and the pool fills again once the webhook is gone.
#[tokio::test]
async fn a_failing_pod_webhook_is_said_in_the_pool_condition_and_the_pool_recovers() {
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;

    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("podhook").await.expect("namespace");
    let op = Operator::start(&c, &ns.name, "op");
    create_instance(&ns, "ph", json!({"sandbox": {"warmPoolSize": 1}})).await;
    wait_ready(&ns, "ph", &op).await;
    let first = wait_pool(&ns, "ph", 1, &op).await;

    // Only this namespace's sandbox pods: other tests share the API server.
    let hooks = kube::Api::<ValidatingWebhookConfiguration>::all(c.client.clone());
    let hook_name = format!("{}-sandbox-pods", ns.name);
    let hook: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": hook_name},
        "webhooks": [{
            "name": "sandbox-pods.cli-mcp.test",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "timeoutSeconds": 2,
            "clientConfig": {"service": {
                "namespace": ns.name, "name": "no-such-webhook", "port": 443
            }},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns.name}},
            "objectSelector": {"matchLabels": {label::COMPONENT: label::COMPONENT_SANDBOX}},
            "rules": [{
                "apiGroups": [""], "apiVersions": ["v1"],
                "operations": ["CREATE"], "resources": ["pods"]
            }]
        }]
    }))
    .expect("webhook configuration");
    hooks
        .create(&Default::default(), &hook)
        .await
        .expect("create the webhook configuration");
    ns.api::<Pod>()
        .delete(&first[0].name_any(), &DeleteParams::default())
        .await
        .expect("delete the warm pod");

    let o = wait_instance(
        ns.api::<CliMcpInstance>(),
        "ph",
        "WarmPoolReady=False ApiError",
        TIMEOUT,
        |o| {
            find_condition(o, "WarmPoolReady").is_some_and(|c| {
                c.status == "False"
                    && c.reason == "ApiError"
                    && c.message.contains("failed calling webhook")
            })
        },
    )
    .await;
    let removed = hooks.delete(&hook_name, &DeleteParams::default()).await;
    let o = o.unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", op.log_tail()));
    removed.expect("delete the webhook configuration");
    let message = &find_condition(&o, "WarmPoolReady")
        .expect("condition")
        .message;
    assert!(message.contains("the next create in"), "{message}");

    wait_pool(&ns, "ph", 1, &op).await;
    wait_instance(
        ns.api::<CliMcpInstance>(),
        "ph",
        "WarmPoolReady=True",
        TIMEOUT,
        |o| find_condition(o, "WarmPoolReady").is_some_and(|c| c.status == "True"),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", op.log_tail()));
    finish(ns, "ph", &op).await;
}

/// Where the admission policies are not installed, the operator itself refuses an instance
/// in its own namespace whose server would run as the operator's ServiceAccount (here the
/// operator's account is `cli-mcp-op`, so instance `op` is that one): nothing of it is
/// applied, and the status says why.
#[tokio::test]
async fn an_instance_named_after_the_operators_account_is_refused_by_the_operator() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("self-name").await.expect("namespace");
    let op = Operator::start_with(&c, &ns.name, "op", &[("POD_SERVICE_ACCOUNT", "cli-mcp-op")]);
    create_instance(&ns, "op", json!({})).await;
    let refused = wait_for(
        ns.api::<CliMcpInstance>(),
        "op",
        "instance op refused",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            o.and_then(|o| find_condition(o, "Ready"))
                .is_some_and(|c| c.status == "False" && c.reason == "InvalidSpec")
        },
    )
    .await;
    let o = op.ok(refused).expect("instance");
    let ready = find_condition(&o, "Ready").expect("Ready");
    assert!(
        ready.message.contains("cli-mcp-op is the operator's own"),
        "{}",
        ready.message
    );
    // Nothing was applied under the operator's name.
    assert!(ns
        .api::<Deployment>()
        .get_opt("cli-mcp-op")
        .await
        .expect("get")
        .is_none());
    // Another name in the same namespace is served as usual.
    create_instance(&ns, "other", json!({})).await;
    wait_ready(&ns, "other", &op).await;
    delete_released(&ns, "op", &op).await;
    finish(ns, "other", &op).await;
}
