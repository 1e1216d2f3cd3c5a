//! The finalizer's cleanup: quiesce the server, then remove every sandbox, then the
//! credential proxy (Deployment and pods) and any session slot left without an owner, then
//! the cluster-scoped bindings (the server's and the proxy's), then release
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
use cli_mcp_api::names::{label, InstanceName, FIELD_MANAGER};

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

/// The finalizer's cleanup, one call per step (each idempotent). A step that waits returns
/// [`Error::Waiting`] unless the teardown timed out.
pub async fn cleanup(cr: Arc<CliMcpInstance>, ctx: &Context) -> Result<Action> {
    let ns = cr
        .namespace()
        .ok_or_else(|| Error::NoNamespace(cr.name_any()))?;
    let name = match cr.instance_name() {
        Ok(n) => n,
        // A name that never passed admission never got children.
        Err(_) => return Ok(Action::await_change()),
    };
    let t = Teardown {
        ctx,
        cr: &cr,
        ns: &ns,
        name: &name,
        give_up: timed_out(&cr, ctx),
    };
    // 1. Scale the server to zero and wait for its pods (client).
    t.quiesce_server().await?;
    // 2. Delete every sandbox and wait for them (client).
    t.remove_sandboxes().await?;
    // 3. Delete the credential proxy and wait for its pods (client).
    t.remove_proxy().await?;
    // 3b. Delete the session slots no pod owns (client).
    t.remove_slots().await?;
    // 4. Delete the cluster-scoped bindings, the server's and the proxy's (client).
    t.remove_cluster_bindings().await?;
    // 5. Release: what this process kept about the instance goes (client for the Event).
    t.release().await;
    Ok(Action::await_change())
}

/// One teardown of one instance: what its steps share.
struct Teardown<'a> {
    ctx: &'a Context,
    cr: &'a CliMcpInstance,
    ns: &'a str,
    name: &'a InstanceName,
    /// The teardown ran longer than allowed: steps stop waiting.
    give_up: bool,
}

impl Teardown<'_> {
    /// Waits (retried shortly) for what `waiting` says, unless the teardown timed out.
    fn wait(&self, waiting: String) -> Result<()> {
        if self.give_up {
            return Ok(());
        }
        Err(Error::Waiting(waiting))
    }

    /// Publishes a teardown Event; best effort.
    async fn publish(&self, type_: EventType, reason: &str, note: &str) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note.into()),
            action: "Teardown".into(),
            secondary: None,
        };
        let _ = self
            .ctx
            .recorder
            .publish(&ev, &self.cr.object_ref(&()))
            .await;
    }

    /// Scales the server to zero so nobody claims or creates sandboxes any more, and waits
    /// until none of its pods is left.
    async fn quiesce_server(&self) -> Result<()> {
        let (ctx, ns, name) = (self.ctx, self.ns, self.name);
        let what = format!("Deployment {ns}/{}", name.server());
        let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
        let found = deployments
            .get_opt(&name.server())
            .await
            .map_err(Error::teardown(&what))?;
        if found.is_some_and(|d| d.spec.replicas != Some(0)) {
            let pp = PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..Default::default()
            };
            let zero = Patch::Merge(serde_json::json!({"spec": {"replicas": 0}}));
            deployments
                .patch(&name.server(), &pp, &zero)
                .await
                .map_err(Error::teardown(format!("scaling {what} to 0")))?;
            ctx.metrics.api_write("Deployment", "patch");
            self.publish(
                EventType::Normal,
                "TeardownStarted",
                "scaled the server to 0; sandboxes are deleted once its pods are gone",
            )
            .await;
        }
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
        let server_pods = pods
            .list_metadata(&ListParams::default().labels(&name.server_selector()))
            .await
            .map_err(Error::teardown(format!(
                "listing the server pods of {ns}/{name}"
            )))?;
        if server_pods.items.is_empty() {
            return Ok(());
        }
        self.wait(format!(
            "{} server pod(s) of {ns}/{name} to stop",
            server_pods.items.len()
        ))
    }

    /// Deletes every sandbox of the instance (pool and sessions) and waits for them.
    async fn remove_sandboxes(&self) -> Result<()> {
        let (ctx, ns, name) = (self.ctx, self.ns, self.name);
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
        let sandbox = ListParams::default().labels(&name.sandbox_selector());
        let left = pods
            .list_metadata(&sandbox)
            .await
            .map_err(Error::teardown(format!(
                "listing the sandboxes of {ns}/{name}"
            )))?;
        if left.items.is_empty() {
            return Ok(());
        }
        if left
            .items
            .iter()
            .any(|p| p.metadata.deletion_timestamp.is_none())
        {
            pods.delete_collection(&DeleteParams::default(), &sandbox)
                .await
                .map_err(Error::teardown(format!(
                    "deleting the sandboxes of {ns}/{name}"
                )))?;
            ctx.metrics.api_write("Pod", "deletecollection");
        }
        self.wait(format!(
            "{} sandbox pod(s) of {ns}/{name} to terminate",
            left.items.len()
        ))
    }

    /// The credential proxy: its pods hold the admin's token and match the Service a
    /// re-created instance of the same name gets, so they must be gone before the CR is
    /// released (garbage collection would remove them only afterwards, at its own pace).
    async fn remove_proxy(&self) -> Result<()> {
        let (ns, name) = (self.ns, self.name);
        match remove_proxy_pods(self.ctx, ns, name).await? {
            Some(left) => self.wait(format!(
                "{left} credential proxy pod(s) of {ns}/{name} to terminate"
            )),
            None => Ok(()),
        }
    }

    /// Session slots (Leases). Those owned by a pod went with it; a slot a server made and
    /// crashed before binding has no owner, and with no server left to reclaim it, it would
    /// outlive the instance.
    /// One delete each: the operator holds `delete` on Leases, not `deletecollection`.
    async fn remove_slots(&self) -> Result<()> {
        let (ctx, ns, name) = (self.ctx, self.ns, self.name);
        let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), ns);
        let slots = ListParams::default().labels(&name.slot_selector());
        let listed = leases
            .list_metadata(&slots)
            .await
            .map_err(Error::teardown(format!(
                "listing the session slots of {ns}/{name}"
            )))?;
        for slot in listed.items {
            match leases
                .delete(&slot.name_any(), &DeleteParams::default())
                .await
            {
                Ok(_) => ctx.metrics.api_write("Lease", "delete"),
                Err(e) if is_status(&e, 404) => {}
                Err(e) => {
                    let what = format!("deleting Lease {ns}/{}", slot.name_any());
                    return Err(Error::teardown(what)(e));
                }
            }
        }
        Ok(())
    }

    /// The cluster-scoped bindings have no owner reference: removed explicitly.
    async fn remove_cluster_bindings(&self) -> Result<()> {
        let crbs: Api<ClusterRoleBinding> = Api::all(self.ctx.client.clone());
        for binding in cluster_bindings(self.name, self.ns) {
            match crbs.delete(&binding, &DeleteParams::default()).await {
                Ok(_) => self.ctx.metrics.api_write("ClusterRoleBinding", "delete"),
                Err(e) if is_status(&e, 404) => {}
                Err(e) => {
                    let what = format!("deleting ClusterRoleBinding {binding}");
                    return Err(Error::teardown(what)(e));
                }
            }
        }
        Ok(())
    }

    /// Says so when the teardown timed out, and forgets what this process kept about the
    /// instance: entries of deleted instances otherwise stayed for the process's life.
    async fn release(&self) {
        let (ctx, ns, name) = (self.ctx, self.ns, self.name);
        if self.give_up {
            self.publish(
                EventType::Warning,
                "TeardownTimedOut",
                "pods did not terminate in time; released the instance and left them to garbage collection",
            )
            .await;
        }
        if let Some(uid) = self.cr.uid() {
            ctx.pool.forget(&uid);
            ctx.applied.forget_owner(&uid);
            ctx.migrated.forget(&uid);
            ctx.retries.reset(&uid);
            ctx.isolation.forget(&uid);
            ctx.briefings.forget(&uid);
        }
        crate::rotation::forget(ns, name.as_str());
        ctx.stores.session_starts.forget(ns, name.as_str());
        for binding in cluster_bindings(name, ns) {
            ctx.applied
                .forget_prefix(&format!("ClusterRoleBinding//{binding}"));
        }
        tracing::info!(namespace = %ns, instance = %name, "teardown complete; releasing the finalizer");
    }
}

/// The instance's cluster-scoped bindings to `system:auth-delegator`: the server's and the
/// credential proxy's.
fn cluster_bindings(name: &InstanceName, ns: &str) -> [String; 2] {
    [
        name.auth_delegator_binding(ns),
        crate::children::rbac::proxy_auth_delegator_binding_name(name, ns),
    ]
}

/// Deletes the proxy Deployment (if any) and reports how many of its pods still exist
/// (`None`: none). The pods are found by label, so a Deployment already gone does not hide
/// pods still terminating.
async fn remove_proxy_pods(ctx: &Context, ns: &str, name: &InstanceName) -> Result<Option<usize>> {
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
            Err(e) => {
                let what = format!("deleting Deployment {ns}/{}", name.proxy());
                return Err(Error::teardown(what)(e));
            }
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
        .await
        .map_err(Error::teardown(format!(
            "listing the credential proxy pods of {ns}/{name}"
        )))?;
    if left.items.is_empty() {
        return Ok(None);
    }
    Ok(Some(left.items.len()))
}
