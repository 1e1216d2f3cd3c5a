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
//!
//! What the operator cannot do with its least-privilege RBAC is left to the admin (see
//! docs/migration.md): the per-session Secrets `cli-mcp-sandbox-auth-<sid>` (no `delete` on
//! Secrets) and the shared ClusterRoleBinding `cli-mcp-auth-delegator` (not its own).
//!
//! These objects are not in the operator's caches (those hold only what carries its
//! managed-by label), so this asks the API server: one GET of the Deployment, one of the
//! ConfigMap and one LIST of the instance's sandbox pods, then never again for that instance
//! in this process.

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
    let Some(d) = found.filter(|d| is_foreign_deployment(d, &[CONTAINER])) else {
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
    fn go_sandbox_pods_but_never_ours_even_for_an_instance_named_sandbox() {
        assert!(is_go_sandbox(&pod("cli-mcp-sandbox-3f2a", false)));
        // Instance `sandbox`: this operator's pool pod has the Go prefix but its label.
        assert!(!is_go_sandbox(&pod("cli-mcp-sandbox-pool-abc", true)));
        assert!(!is_go_sandbox(&pod("cli-mcp-demo-pool-abc", false)));
    }
}
