//! Token rotation without a restart: when the admin's kubeconfig changes, every proxy pod gets
//! an annotation with the new version. The proxy re-reads its kubeconfig file on each
//! request, but the kubelet refreshes a Secret volume only when it syncs the pod — every
//! minute or so, or at once when the pod object changes. Touching the pod (not the template,
//! which would roll the proxy and drop open watches) makes the next request see the new token
//! within seconds.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};

use cli_mcp_api::names::{label, FIELD_MANAGER};

use crate::children::Inputs;
use crate::context::Context;

/// Annotation on each proxy pod: the version of the kubeconfig it was last told about.
pub const KUBECONFIG_VERSION_ANNOTATION: &str = "cli-mcp.redhat.com/kubeconfig-version";

/// `namespace/instance` → the version every proxy pod was annotated with. Process-local: after
/// an operator restart each instance's pods are looked at once more, which is harmless.
static NUDGED: LazyLock<Mutex<HashMap<String, String>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// `NUDGED`'s key of instance `namespace/name`.
fn nudged_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// The instance `namespace/name` is gone (its teardown is complete): its entry goes.
pub fn forget(namespace: &str, name: &str) {
    if let Ok(mut m) = NUDGED.lock() {
        m.remove(&nudged_key(namespace, name));
    }
}

/// Annotates the proxy pods whose kubeconfig version is not the resolved one (nothing while
/// the proxy's inputs are not usable). Failures are logged and retried on the next
/// reconcile: the kubelet's periodic sync refreshes the file anyway.
pub async fn nudge_proxy_pods(ctx: &Context, inputs: &Inputs) {
    let proxy = inputs.proxy.as_ref();
    let Some(version) = proxy.and_then(|p| p.kubeconfig_version.as_ref()) else {
        return;
    };
    let spec = &inputs.spec;
    let key = nudged_key(&spec.namespace, spec.name.as_str());
    if NUDGED
        .lock()
        .ok()
        .and_then(|m| m.get(&key).cloned())
        .as_deref()
        == Some(version.as_str())
    {
        return;
    }
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &spec.namespace);
    let selector = format!(
        "{}={},{}={}",
        label::INSTANCE,
        spec.name,
        label::COMPONENT,
        label::COMPONENT_PROXY
    );
    let pods = match api.list(&ListParams::default().labels(&selector)).await {
        Ok(l) => l.items,
        Err(e) => {
            tracing::warn!(instance = %key, "listing proxy pods to pass on a new kubeconfig: {e}");
            return;
        }
    };
    let patch = serde_json::json!({"metadata": {"annotations": {
        KUBECONFIG_VERSION_ANNOTATION: version,
    }}});
    let mut all = true;
    for pod in pods.iter().filter(|p| {
        p.metadata.deletion_timestamp.is_none()
            && p.annotations().get(KUBECONFIG_VERSION_ANNOTATION) != Some(version)
    }) {
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        match api.patch(&pod.name_any(), &pp, &Patch::Merge(&patch)).await {
            Ok(_) => ctx.metrics.api_write("Pod", "patch"),
            Err(e) => {
                all = false;
                tracing::warn!(instance = %key, pod = %pod.name_any(),
                    "annotating a proxy pod with the new kubeconfig version: {e}");
            }
        }
    }
    if all {
        if let Ok(mut m) = NUDGED.lock() {
            m.insert(key, version.clone());
        }
    }
}
