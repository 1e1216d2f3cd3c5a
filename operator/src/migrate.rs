//! Taking over an instance from the Go operator this design comes from. Same group, kind and
//! child names (`cli-mcp-<n>` for the server's Deployment, Service, ServiceAccount, Role and
//! RoleBinding), so most Go-era children are simply taken over by server-side apply. Three
//! kinds of leftover are not, and are removed once per instance and operator process:
//!
//! - the Go-era server Deployment: it ran the MCP server behind a `kube-rbac-proxy` sidecar.
//!   Apply only sets the fields it owns, so that container (and its volumes, owned by the Go
//!   operator's field manager) would stay and fight the new server for its port. A Deployment
//!   with a container this operator does not make is deleted and made again.
//! - the sidecar's ConfigMap `cli-mcp-<n>-krp`: nothing reads it any more.
//! - Go-era sandbox pods (`cli-mcp-sandbox-<sid>` and `cli-mcp-sandbox-<uuid>`): they run the
//!   Go agent and hold a session token from a Secret; the new server can neither use nor
//!   trust them. They carry the instance's labels but not this operator's managed-by label.
//! - the Go credential proxy's Deployment and ConfigMap `cli-mcp-<n>-proxy`. The container
//!   has the same name (`proxy`), so apply would merge into it: Go's `tcpSocket` probes beside
//!   this proxy's `httpGet` ones are two handlers in one probe, which the API server refuses
//!   (422) on every apply, and Go's `preStop` hook, volumes and mounts (the admin kubeconfig
//!   among them) would stay. The ConfigMap would keep Go's route table under its old key.
//!   Both are deleted when the instance controls them and they lack this operator's
//!   managed-by label (so never once this operator has made them), and apply makes them
//!   again. The proxy's CA Secret is kept (same instance, the proxy reads its SEC1 key);
//!   its ServiceAccount, Service and NetworkPolicies are taken over by apply (their lists
//!   are replaced whole).
//!
//! What the operator cannot do with its least-privilege RBAC is left to the admin (see
//! docs/migration.md): the per-session Secrets `cli-mcp-sandbox-auth-<sid>` (no `delete` on
//! Secrets) and the shared ClusterRoleBinding `cli-mcp-auth-delegator` (not its own).
//!
//! These objects are not in the operator's caches (those hold only what carries its
//! managed-by label), so this asks the API server: one GET of each Deployment and ConfigMap
//! and one LIST of the instance's sandbox pods, then never again for that instance in this
//! process.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{DeleteParams, ListParams};
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::{label, InstanceName};

use crate::api_call::{delete_exactly, is_status};
use crate::children::deployment::CONTAINER;
use crate::context::Context;
use crate::error::{Error, Result};

/// The name the Go operator gave every sandbox pod, of any instance.
pub const GO_SANDBOX_PREFIX: &str = "cli-mcp-sandbox-";
/// The Go operator's kube-rbac-proxy sidecar ConfigMap suffix.
pub const GO_KRP_SUFFIX: &str = "-krp";

/// Whether `d` is not the Deployment this operator makes: a container it does not make (the
/// Go operator's `kube-rbac-proxy` sidecar). `ours` names the operator's containers.
pub fn is_foreign_deployment(d: &Deployment, ours: &[&str]) -> bool {
    d.spec.template.spec.as_ref().is_some_and(|p| {
        p.containers
            .iter()
            .any(|c| !ours.contains(&c.name.as_str()))
    })
}

/// Whether `d` (named as the instance's server Deployment) is the Go operator's: a container
/// this operator does not make, and never one this operator made. With instances `x` and
/// `x-proxy` in one namespace the latter's server Deployment has the name of the former's
/// proxy Deployment, whose container is not the server's either.
pub fn is_go_server_deployment(d: &Deployment) -> bool {
    is_foreign_deployment(d, &[CONTAINER]) && !is_ours(d)
}

/// Whether `p` is a Go-era sandbox pod: named as the Go operator named them and without this
/// project's managed-by label (this operator's and this server's pods always carry it).
pub fn is_go_sandbox(p: &Pod) -> bool {
    p.name_any().starts_with(GO_SANDBOX_PREFIX)
        && p.labels().get(label::APP_MANAGED_BY).map(String::as_str) != Some(label::MANAGED_BY)
}

/// Removes the Go-era leftovers of `cr` once per process (see the module docs); publishes an
/// Event naming what went. A failure is returned (the reconcile retries); nothing is marked
/// done until everything succeeded.
pub async fn go_leftovers(
    ctx: &Context,
    cr: &CliMcpInstance,
    name: &InstanceName,
    ns: &str,
) -> Result<()> {
    let uid = cr.uid().unwrap_or_default();
    if ctx.migrated.contains(&uid) {
        return Ok(());
    }
    // One call per leftover, each asking the API server (these are not in the caches).
    let removed: Vec<String> = [
        go_server_deployment(ctx, name, ns).await?,
        go_sidecar_config_map(ctx, name, ns).await?,
        go_sandbox_pods(ctx, name, ns).await?,
        go_proxy::<Deployment>(ctx, cr, &name.proxy(), ns).await?,
        go_proxy::<ConfigMap>(ctx, cr, &name.proxy(), ns).await?,
    ]
    .into_iter()
    .flatten()
    .collect();
    if !removed.is_empty() {
        let note = format!(
            "took over from the Go operator: deleted {}; delete its per-session Secrets \
             (cli-mcp-sandbox-auth-*) and, once no Go-era instance is left, the shared \
             ClusterRoleBinding cli-mcp-auth-delegator (see docs/migration.md)",
            removed.join(", ")
        );
        tracing::info!(namespace = ns, instance = %name.as_str(), "{note}");
        ctx.publish(cr, EventType::Normal, "MigratedFromGoOperator", note)
            .await;
    }
    ctx.migrated.insert(&uid);
    Ok(())
}

/// The Go-era server Deployment (with the kube-rbac-proxy sidecar), deleted; what went.
async fn go_server_deployment(
    ctx: &Context,
    name: &InstanceName,
    ns: &str,
) -> Result<Option<String>> {
    let what = format!("Deployment {ns}/{}", name.server());
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    let found = deployments
        .get_opt(&name.server())
        .await
        .map_err(Error::migrating(&what))?;
    let Some(d) = found.filter(is_go_server_deployment) else {
        return Ok(None);
    };
    delete_exact(&deployments, &d, &what).await?;
    Ok(Some(format!(
        "Deployment {} (kube-rbac-proxy sidecar)",
        d.name_any()
    )))
}

/// The sidecar's ConfigMap `cli-mcp-<n>-krp`, deleted; what went.
async fn go_sidecar_config_map(
    ctx: &Context,
    name: &InstanceName,
    ns: &str,
) -> Result<Option<String>> {
    let krp = format!("{}{GO_KRP_SUFFIX}", name.server());
    let what = format!("ConfigMap {ns}/{krp}");
    let config_maps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), ns);
    let Some(cm) = config_maps
        .get_opt(&krp)
        .await
        .map_err(Error::migrating(&what))?
    else {
        return Ok(None);
    };
    delete_exact(&config_maps, &cm, &what).await?;
    Ok(Some(format!("ConfigMap {krp}")))
}

/// Whether `obj` is the Go operator's child of `cr` rather than this operator's: controlled
/// by the instance and without this operator's managed-by label, which everything this
/// operator applies carries.
pub fn is_go_child<K: kube::Resource>(obj: &K, cr: &CliMcpInstance) -> bool {
    let controlled = obj
        .meta()
        .owner_references
        .iter()
        .flatten()
        .any(|r| r.controller == Some(true) && Some(&r.uid) == cr.metadata.uid.as_ref());
    controlled && !is_ours(obj)
}

/// Whether this operator made `obj`: everything it applies carries its managed-by label.
pub fn is_ours<K: kube::Resource>(obj: &K) -> bool {
    obj.meta()
        .labels
        .as_ref()
        .and_then(|l| l.get(label::APP_MANAGED_BY))
        .is_some_and(|v| v == label::MANAGED_BY)
}

/// The Go credential proxy's `K` named `proxy` (its Deployment or its ConfigMap), deleted
/// when it is the Go operator's (see the module docs); what went.
async fn go_proxy<K>(
    ctx: &Context,
    cr: &CliMcpInstance,
    proxy: &str,
    ns: &str,
) -> Result<Option<String>>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let kind = K::kind(&());
    let what = format!("{kind} {ns}/{proxy}");
    let api: Api<K> = Api::namespaced(ctx.client.clone(), ns);
    let found = api.get_opt(proxy).await.map_err(Error::migrating(&what))?;
    let Some(obj) = found.filter(|o| is_go_child(o, cr)) else {
        return Ok(None);
    };
    delete_exact(&api, &obj, &what).await?;
    Ok(Some(format!("{kind} {proxy} (the Go credential proxy's)")))
}

/// The Go-era sandbox pods of the instance, deleted; how many went.
async fn go_sandbox_pods(ctx: &Context, name: &InstanceName, ns: &str) -> Result<Option<String>> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let lp = ListParams::default().labels(&name.sandbox_selector());
    let go_pods: Vec<Pod> = pods
        .list(&lp)
        .await
        .map_err(Error::migrating(format!(
            "listing the sandbox pods of {ns}/{name}"
        )))?
        .items
        .into_iter()
        .filter(is_go_sandbox)
        .collect();
    for p in &go_pods {
        delete_exact(&pods, p, &format!("Pod {ns}/{}", p.name_any())).await?;
    }
    Ok((!go_pods.is_empty()).then(|| format!("{} Go-era sandbox pod(s)", go_pods.len())))
}

/// Deletes exactly the object that was read (UID precondition), so a new object of the same
/// name made in between is never removed. Gone already is fine.
async fn delete_exact<K>(api: &Api<K>, obj: &K, what: &str) -> Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let dp = DeleteParams {
        propagation_policy: DeleteParams::background().propagation_policy,
        ..delete_exactly(obj, false)
    };
    match api.delete(&obj.name_any(), &dp).await {
        Ok(_) => Ok(()),
        Err(e) if is_status(&e, 404) || is_status(&e, 409) => Ok(()),
        Err(e) => Err(Error::migrating(format!("deleting {what}"))(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::DeploymentSpec;
    use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};
    use kube::api::ObjectMeta;
    use std::collections::BTreeMap;

    fn deployment(containers: &[&str]) -> Deployment {
        Deployment {
            spec: DeploymentSpec {
                template: PodTemplateSpec {
                    spec: Some(PodSpec {
                        containers: containers
                            .iter()
                            .map(|n| Container {
                                name: n.to_string(),
                                ..Default::default()
                            })
                            .collect(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn pod(name: &str, managed: bool) -> Pod {
        let mut labels = BTreeMap::new();
        if managed {
            labels.insert(
                label::APP_MANAGED_BY.to_string(),
                label::MANAGED_BY.to_string(),
            );
        }
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(labels),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_deployment_this_operator_made_is_never_the_go_server_deployment() {
        // Instance `x-proxy`'s server Deployment is named like instance `x`'s proxy
        // Deployment, whose container is `proxy`: foreign to a server, but ours.
        let mut proxy = deployment(&["proxy"]);
        proxy.metadata.labels = pod("x", true).metadata.labels;
        assert!(is_foreign_deployment(&proxy, &[CONTAINER]));
        assert!(!is_go_server_deployment(&proxy));
        assert!(is_go_server_deployment(&deployment(&[
            "mcp",
            "kube-rbac-proxy"
        ])));
    }

    #[test]
    fn the_go_server_deployment_is_recognised_by_its_sidecar() {
        assert!(is_foreign_deployment(
            &deployment(&["mcp", "kube-rbac-proxy"]),
            &["server"]
        ));
        assert!(!is_foreign_deployment(
            &deployment(&["server"]),
            &["server"]
        ));
        assert!(!is_foreign_deployment(&Deployment::default(), &["server"]));
    }

    #[test]
    fn a_go_proxy_child_is_the_instances_and_never_labelled_ours() {
        let cr: CliMcpInstance = serde_json::from_value(serde_json::json!({
            "apiVersion": "cli-mcp.redhat.com/v1alpha1", "kind": "CliMcpInstance",
            "metadata": {"name": "legacy", "uid": "cr-uid"}, "spec": {}
        }))
        .expect("instance");
        let child = |owner: &str, ours: bool| {
            let mut cm = ConfigMap::default();
            cm.metadata.owner_references = Some(vec![
                k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                    uid: owner.into(),
                    controller: Some(true),
                    ..Default::default()
                },
            ]);
            cm.metadata.labels = Some(pod("x", ours).metadata.labels.unwrap_or_default());
            cm
        };
        assert!(is_go_child(&child("cr-uid", false), &cr));
        // Once applied by this operator it is ours: a later pass never deletes it.
        assert!(!is_go_child(&child("cr-uid", true), &cr));
        // Not the instance's (an admin's object of that name, another instance's): left alone.
        assert!(!is_go_child(&child("other", false), &cr));
        assert!(!is_go_child(&ConfigMap::default(), &cr));
    }

    #[test]
    fn go_sandbox_pods_but_never_ours_even_for_an_instance_named_sandbox() {
        assert!(is_go_sandbox(&pod("cli-mcp-sandbox-3f2a", false)));
        // Instance `sandbox`: this operator's pool pod has the Go prefix but its label.
        assert!(!is_go_sandbox(&pod("cli-mcp-sandbox-pool-abc", true)));
        assert!(!is_go_sandbox(&pod("cli-mcp-demo-pool-abc", false)));
    }
}
