//! `CliMcpInstance`s for tests: the object (with requests small enough for the 2-core test
//! node), its status conditions, waits on it, the Secrets around it, and its pool pods,
//! claimed the way the server claims them.
//!
//! Shared by the operator's tests (operator as a host process), the journeys (operator
//! installed as a pod) and the benches, so each of these means the same thing everywhere.

use std::collections::BTreeMap;
use std::time::Duration;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::{annotation, label, InstanceName};
use cli_mcp_api::pod_state::{is_assigned, is_deleting};
use cli_mcp_api::token::HmacKey;
use cli_mcp_api::SessionId;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::ByteString;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{json, Value};

use crate::error::{Error, Result};
// The image names the tests' instances use; they live with the names the real node tags
// its imported images under.
pub use crate::project_images::{PROXY_IMAGE, SANDBOX_IMAGE, SERVER_IMAGE};
use crate::testing::TestNamespace;
use crate::wait::{wait_for, wait_gone};

/// The kubeconfig the proxy of an instance whose sandboxes never call the API holds: valid
/// (a token user, an https server), as the proxy refuses anything else, but its token
/// opens nothing.
pub const DUMMY_KUBECONFIG: &str = "apiVersion: v1\nkind: Config\n\
clusters: [{name: c, cluster: {server: 'https://kubernetes.default.svc'}}]\n\
users: [{name: u, user: {token: e2e-placeholder-token-opens-nothing}}]\n\
contexts: [{name: c, context: {cluster: c, user: u}}]\n\
current-context: c\n";

/// Small requests (a sandbox's defaults, for the server too): the local node's allocatable
/// CPU is the host's (2 cores) and tests run in parallel.
pub fn small_resources() -> Value {
    json!({"requests": {"cpu": "5m", "memory": "16Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}})
}

/// A CliMcpInstance; sandbox and server get [`small_resources`] unless the spec sets them.
pub fn instance(name: &str, mut spec: Value) -> CliMcpInstance {
    if let Some(obj) = spec.as_object_mut() {
        for part in ["sandbox", "server"] {
            let entry = obj.entry(part).or_insert_with(|| json!({}));
            if let Some(o) = entry.as_object_mut() {
                o.entry("resources").or_insert_with(small_resources);
            }
        }
    }
    serde_json::from_value(json!({
        "apiVersion": "cli-mcp.redhat.com/v1alpha1",
        "kind": "CliMcpInstance",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .expect("valid CliMcpInstance")
}

fn instance_name(instance: &str) -> InstanceName {
    InstanceName::parse(instance).unwrap_or_else(|e| panic!("instance name: {e}"))
}

/// Status and reason of condition `ty`.
pub fn condition(o: &CliMcpInstance, ty: &str) -> Option<(String, String)> {
    o.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == ty)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

/// Condition `ty` is `True`.
pub fn is_true(o: &CliMcpInstance, ty: &str) -> bool {
    condition(o, ty).is_some_and(|(s, _)| s == "True")
}

/// `Ready=True`, observed for the current generation (the status speaks of this spec).
pub fn is_ready_for_generation(o: &CliMcpInstance) -> bool {
    is_true(o, "Ready")
        && o.status.as_ref().and_then(|s| s.observed_generation) == o.metadata.generation
}

/// Watches instance `name` until `ok` holds, at most `timeout`; returns it then.
pub async fn wait_instance(
    api: Api<CliMcpInstance>,
    name: &str,
    what: &str,
    timeout: Duration,
    ok: impl Fn(&CliMcpInstance) -> bool,
) -> Result<CliMcpInstance> {
    wait_for(api, name, what, timeout, |o: Option<&CliMcpInstance>| {
        o.is_some_and(&ok)
    })
    .await?
    .ok_or_else(|| Error::Other(format!("instance {name} is gone while waiting for {what}")))
}

/// Deletes instance `name` (whatever the answer: it may be gone already) and waits until it
/// is gone, that is until its finalizer is released, at most `timeout`.
pub async fn delete_instance(
    api: Api<CliMcpInstance>,
    name: &str,
    timeout: Duration,
) -> Result<()> {
    let _ = api.delete(name, &DeleteParams::default()).await;
    wait_gone(api, name, "instance deleted", timeout).await
}

/// Creates the kubeconfig Secret every instance's credential proxy holds, with `kubeconfig`
/// in it.
pub async fn kubeconfig_secret(ns: &TestNamespace, instance: &str, kubeconfig: &str) {
    let s = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(instance_name(instance).kubeconfig_secret()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            "kubeconfig".to_owned(),
            ByteString(kubeconfig.as_bytes().to_vec()),
        )])),
        ..Default::default()
    };
    ns.api::<Secret>()
        .create(&PostParams::default(), &s)
        .await
        .expect("create the kubeconfig Secret");
}

/// The instance's HMAC key, from the Secret the operator made.
pub async fn hmac_key(ns: &TestNamespace, instance: &str) -> HmacKey {
    let s = ns
        .api::<Secret>()
        .get(&instance_name(instance).hmac_secret())
        .await
        .expect("HMAC Secret");
    let bytes = s.data.and_then(|d| d.get("key").cloned()).expect("key").0;
    HmacKey::from_hex(&String::from_utf8_lossy(&bytes)).expect("valid key")
}

/// The pool's pods among `pods`: no session, not going away.
pub fn unassigned(pods: &[Pod]) -> Vec<&Pod> {
    pods.iter()
        .filter(|p| !is_assigned(p) && !is_deleting(p))
        .collect()
}

/// Claims a warm pod the way the server does: a merge patch of the session's labels and
/// token commitment, guarded by the listed resourceVersion.
pub async fn claim(api: &Api<Pod>, pod: &Pod, sid: &str, key: &HmacKey) -> kube::Result<Pod> {
    let sid = SessionId::parse(sid).expect("valid sid");
    let nonce = cli_mcp_api::token::SandboxNonce::from_bytes(rand::random());
    let commitment = key.session_token(&sid, &nonce).commitment().to_hex();
    let now = cli_mcp_api::activity::stamp_now();
    let patch = json!({"metadata": {
        "resourceVersion": pod.resource_version(),
        "labels": {label::SESSION_ID: sid.as_str(), label::LAUNCH: label::LAUNCH_WARM},
        "annotations": {
            annotation::TOKEN_SHA256: commitment,
            annotation::SANDBOX_NONCE: nonce.to_hex(),
            annotation::LAST_ACTIVITY: now,
        },
    }});
    api.patch(
        &pod.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
}
