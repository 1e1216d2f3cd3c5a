//! The finalizer's cleanup: quiesce the server, then remove every sandbox, then the
//! credential proxy (Deployment and pods) and any session slot left without an owner, then
//! the cluster-scoped binding, then release
//! the CR. What is left to garbage collection is only what a re-created instance of the
//! same name takes over by applying it again (Services, Roles, NetworkPolicies, ConfigMaps)
//! or refuses to use (the generate-once Secrets carry their owner's UID). Each step is idempotent, so an operator
//! restarted mid-teardown simply continues. Steps that wait return [`Error::Waiting`]; the
//! reconcile is retried shortly and also woken by the pod and Deployment watches.

use std::sync::Arc;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Api, Resource, ResourceExt};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::{label, FIELD_MANAGER};

use crate::api_call::is_status;
use crate::context::Context;
use crate::error::{Error, Result};

/// True once the teardown has run longer than allowed: remaining pods are left to the
/// garbage collector (they carry owner references) rather than blocking deletion forever.
fn timed_out(cr: &CliMcpInstance, ctx: &Context) -> bool {
    let Some(ts) = cr.meta().deletion_timestamp.as_ref() else {
        return false;
    };
    let age = k8s_openapi::jiff::Timestamp::now().duration_since(ts.0);
    std::time::Duration::try_from(age).is_ok_and(|d| d > ctx.config.teardown_timeout)
}

pub async fn cleanup(cr: Arc<CliMcpInstance>, ctx: &Context) -> Result<Action> {
    let ns = cr
        .namespace()
        .ok_or_else(|| Error::NoNamespace(cr.name_any()))?;
    let name = match cr.instance_name() {
        Ok(n) => n,
        // A name that never passed admission never got children.
        Err(_) => return Ok(Action::await_change()),
    };
    let give_up = timed_out(&cr, ctx);
    let oref = cr.object_ref(&());

    // 1. Scale the server to zero so nobody claims or creates sandboxes any more.
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &ns);
    if let Some(d) = deployments.get_opt(&name.server()).await? {
        if d.spec.replicas != Some(0) {
            let pp = PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..Default::default()
            };
            deployments
                .patch(
                    &name.server(),
                    &pp,
                    &Patch::Merge(serde_json::json!({"spec": {"replicas": 0}})),
                )
                .await?;
            ctx.metrics.api_write("Deployment", "patch");
            let _ = ctx
                .recorder
                .publish(
                    &Event {
                        type_: EventType::Normal,
                        reason: "TeardownStarted".into(),
                        note: Some(
                            "scaled the server to 0; sandboxes are deleted once its pods are gone"
                                .into(),
                        ),
                        action: "Teardown".into(),
                        secondary: None,
                    },
                    &oref,
                )
                .await;
        }
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let server_pods = pods
        .list_metadata(&ListParams::default().labels(&name.server_selector()))
        .await?;
    if !server_pods.items.is_empty() && !give_up {
        return Err(Error::Waiting(format!(
            "{} server pod(s) of {ns}/{name} to stop",
            server_pods.items.len()
        )));
    }

    // 2. Delete every sandbox of the instance (pool and sessions) and wait for them.
    let sandbox = ListParams::default().labels(&name.sandbox_selector());
    let left = pods.list_metadata(&sandbox).await?;
    if !left.items.is_empty() {
        if left
            .items
            .iter()
            .any(|p| p.metadata.deletion_timestamp.is_none())
        {
            pods.delete_collection(&DeleteParams::default(), &sandbox)
                .await?;
            ctx.metrics.api_write("Pod", "deletecollection");
        }
        if !give_up {
            return Err(Error::Waiting(format!(
                "{} sandbox pod(s) of {ns}/{name} to terminate",
                left.items.len()
            )));
        }
    }

    // 3. The credential proxy: its pods hold the admin's token and match the Service a
    //    re-created instance of the same name gets, so they must be gone before the CR is
    //    released (garbage collection would remove them only afterwards, at its own pace).
    if let Some(left) = remove_proxy_pods(ctx, &ns, &name).await? {
        if !give_up {
            return Err(Error::Waiting(format!(
                "{left} credential proxy pod(s) of {ns}/{name} to terminate"
            )));
        }
    }

    // 3b. Session slots (Leases). Those owned by a pod went with it; a slot a server made
    //     and crashed before binding has no owner, and with no server left to reclaim it,
    //     it would outlive the instance.
    //     One delete each: the operator holds `delete` on Leases, not `deletecollection`.
    let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), &ns);
    let slots = ListParams::default().labels(&name.slot_selector());
    for slot in leases.list_metadata(&slots).await?.items {
        match leases
            .delete(&slot.name_any(), &DeleteParams::default())
            .await
        {
            Ok(_) => ctx.metrics.api_write("Lease", "delete"),
            Err(e) if is_status(&e, 404) => {}
            Err(e) => return Err(e.into()),
        }
    }

    // 4. The cluster-scoped binding has no owner reference: remove it explicitly.
    let crbs: Api<ClusterRoleBinding> = Api::all(ctx.client.clone());
    match crbs
        .delete(&name.auth_delegator_binding(&ns), &DeleteParams::default())
        .await
    {
        Ok(_) => ctx.metrics.api_write("ClusterRoleBinding", "delete"),
        Err(e) if is_status(&e, 404) => {}
        Err(e) => return Err(e.into()),
    }

    if give_up {
        let _ = ctx
            .recorder
            .publish(
                &Event {
                    type_: EventType::Warning,
                    reason: "TeardownTimedOut".into(),
                    note: Some("pods did not terminate in time; released the instance and left them to garbage collection".into()),
                    action: "Teardown".into(),
                    secondary: None,
                },
                &oref,
            )
            .await;
    }
    // What this process kept about the instance goes with it: entries of deleted instances
    // otherwise stayed for the process's life.
    if let Some(uid) = cr.uid() {
        ctx.pool.forget(&uid);
        ctx.applied.forget_owner(&uid);
        ctx.migrated.forget(&uid);
        ctx.retries.reset(&uid);
        ctx.isolation.forget(&uid);
    }
    crate::rotation::forget(&ns, name.as_str());
    ctx.applied.forget_prefix(&format!(
        "ClusterRoleBinding//{}",
        name.auth_delegator_binding(&ns)
    ));
    tracing::info!(namespace = %ns, instance = %name, "teardown complete; releasing the finalizer");
    Ok(Action::await_change())
}

/// Deletes the proxy Deployment (if any) and reports how many of its pods still exist
/// (`None`: none). The pods are found by label, so a Deployment already gone does not hide
/// pods still terminating.
async fn remove_proxy_pods(
    ctx: &Context,
    ns: &str,
    name: &cli_mcp_api::names::InstanceName,
) -> Result<Option<usize>> {
    let live = crate::context::cached(&ctx.stores.deployments, ns, &name.proxy())
        .is_some_and(|d| d.metadata.deletion_timestamp.is_none());
    if live {
        let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
        match deployments
            .delete(&name.proxy(), &DeleteParams::background())
            .await
        {
            Ok(_) => ctx.metrics.api_write("Deployment", "delete"),
            Err(e) if is_status(&e, 404) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let selector = format!(
        "{}={name},{}={}",
        label::INSTANCE,
        label::COMPONENT,
        label::COMPONENT_PROXY
    );
    // The garbage collector removes the ReplicaSet and then the pods; deleting the pods
    // here would only race the ReplicaSet into making new ones.
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let left = pods
        .list_metadata(&ListParams::default().labels(&selector))
        .await?;
    if left.items.is_empty() {
        return Ok(None);
    }
    Ok(Some(left.items.len()))
}

/// Deletes the child `name` of kind `K` when the store shows it (no request otherwise);
/// failures are logged and retried on the next reconcile. `why` names the spec field whose
/// removal made it unwanted.
async fn delete_cached<K: crate::apply::Owned>(ctx: &Context, ns: &str, name: &str, why: &str) {
    if crate::context::cached(K::store(&ctx.stores), ns, name).is_none() {
        return;
    }
    let api = K::api(ctx.client.clone(), ns);
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => ctx.metrics.api_write(K::kind(&()).as_ref(), "delete"),
        Err(e) if is_status(&e, 404) => {}
        Err(e) => tracing::warn!(
            "deleting {} {ns}/{name} of a removed {why}: {e}; retrying on the next reconcile",
            K::kind(&())
        ),
    }
}

/// The Ingress, HTTPRoute or Route an instance no longer asks for (`spec.server.expose`
/// removed or switched to another kind), so the endpoint stops being published.
pub async fn remove_expose(ctx: &Context, spec: &crate::children::Spec) {
    use crate::children::expose::{HttpRoute, Route};
    use k8s_openapi::api::networking::v1::Ingress;

    let (ns, name, why) = (
        spec.namespace.as_str(),
        spec.name.server(),
        "spec.server.expose",
    );
    let expose = spec.expose.as_ref();
    if expose.and_then(|e| e.ingress.as_ref()).is_none() {
        delete_cached::<Ingress>(ctx, ns, &name, why).await;
    }
    if expose.and_then(|e| e.http_route.as_ref()).is_none() {
        delete_cached::<HttpRoute>(ctx, ns, &name, why).await;
    }
    if expose.and_then(|e| e.route.as_ref()).is_none() {
        delete_cached::<Route>(ctx, ns, &name, why).await;
    }
}
