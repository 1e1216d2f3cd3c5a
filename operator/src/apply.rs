//! Server-side apply of desired children, with one field manager, skipping requests that
//! cannot change anything (see [`crate::context::ApplyCache`]). [`apply_all`] applies the
//! whole desired set of an instance.

use std::fmt::Debug;

use futures::future::BoxFuture;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::{Ingress, NetworkPolicy};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

use cli_mcp_api::names::FIELD_MANAGER;

use crate::children::expose::{Exposed, HttpRoute, Route};
use crate::children::Desired;
use crate::context::{Context, Stores};
use crate::error::{Error, Result};

/// Cache key of an object: `Kind/namespace/name`.
pub fn cache_key<K: Resource<DynamicType = ()>>(namespace: Option<&str>, name: &str) -> String {
    format!("{}/{}/{}", K::kind(&()), namespace.unwrap_or(""), name)
}

/// What a child object must be to be applied: a typed, static-kind Kubernetes resource.
pub trait Child:
    Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned + Send + Sync + 'static
{
}
impl<K> Child for K where
    K: Resource<DynamicType = ()>
        + Clone
        + Debug
        + Serialize
        + DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// Applies `desired` unless the store shows the object unchanged since our last apply of the
/// same desired state. `api` must address the object's scope (namespace or cluster; kube's
/// types check which constructor fits the kind). Returns true when a request was sent.
pub async fn apply<K: Child>(
    ctx: &Context,
    api: &Api<K>,
    store: &Store<K>,
    desired: &K,
) -> Result<bool> {
    let name = desired.name_any();
    let ns = desired.namespace();
    let json = serde_json::to_vec(desired).map_err(|source| Error::Json {
        what: format!("{} {name}", K::kind(&())),
        source,
    })?;
    let hash = hex::encode(Sha256::digest(json));
    let key = cache_key::<K>(ns.as_deref(), &name);
    let mut oref = ObjectRef::<K>::new(&name);
    if let Some(ns) = &ns {
        oref = oref.within(ns);
    }
    let observed = store.get(&oref);
    let observed_rv = observed.as_ref().and_then(|o| o.resource_version());
    if ctx.applied.is_current(&key, &hash, observed_rv.as_deref()) {
        return Ok(false);
    }

    let params = PatchParams::apply(FIELD_MANAGER).force();
    let applied = api
        .patch(&name, &params, &Patch::Apply(desired))
        .await
        .map_err(|source| Error::Apply {
            kind: K::kind(&()).into_owned(),
            name: name.clone(),
            source,
        })?;
    ctx.metrics.api_write(K::kind(&()).as_ref(), "apply");
    if let Some(rv) = applied.resource_version() {
        let owner = desired
            .owner_references()
            .iter()
            .find(|o| o.controller == Some(true))
            .map(|o| o.uid.clone());
        ctx.applied.record(key, hash, rv, owner);
    }
    Ok(true)
}

/// A kind of child the operator owns: where its reflector store is and how it is addressed.
pub trait Owned: Child {
    fn store(stores: &Stores) -> &Store<Self>;
    fn api(client: Client, namespace: &str) -> Api<Self>;
}

macro_rules! namespaced {
    ($($kind:ty => $store:ident),* $(,)?) => {$(
        impl Owned for $kind {
            fn store(stores: &Stores) -> &Store<Self> {
                &stores.$store
            }
            fn api(client: Client, namespace: &str) -> Api<Self> {
                Api::namespaced(client, namespace)
            }
        }
    )*};
}

namespaced! {
    ServiceAccount => service_accounts,
    Role => roles,
    RoleBinding => role_bindings,
    Service => services,
    NetworkPolicy => network_policies,
    PodDisruptionBudget => pod_disruption_budgets,
    ConfigMap => config_maps,
    Deployment => deployments,
    Ingress => ingresses,
    HttpRoute => http_routes,
    Route => routes,
}

impl Owned for ClusterRoleBinding {
    fn store(stores: &Stores) -> &Store<Self> {
        &stores.cluster_role_bindings
    }
    fn api(client: Client, _namespace: &str) -> Api<Self> {
        Api::all(client)
    }
}

/// One desired child of any kind, so the whole desired set can be applied in one loop.
pub trait Applicable: Send + Sync {
    /// `Kind name`.
    fn describe(&self) -> String;
    /// [`apply`] with the kind's store and scope; `namespace` is the instance's.
    fn apply<'a>(&'a self, ctx: &'a Context, namespace: &'a str) -> BoxFuture<'a, Result<bool>>;
}

impl<K: Owned> Applicable for K {
    fn describe(&self) -> String {
        format!("{} {}", K::kind(&()), self.name_any())
    }

    fn apply<'a>(&'a self, ctx: &'a Context, namespace: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let api = K::api(ctx.client.clone(), namespace);
            apply(ctx, &api, K::store(&ctx.stores), self).await
        })
    }
}

/// The apply order lives here, with the applying: the pure builders in [`crate::children`]
/// know nothing of it.
impl Desired {
    /// The children in apply order: the Deployment last, so its pods find their
    /// ServiceAccount, permissions and Secrets in place.
    pub fn children(&self) -> Vec<&dyn Applicable> {
        let mut out: Vec<&dyn Applicable> = vec![
            &self.server_service_account,
            &self.sandbox_service_account,
            &self.server_role,
            &self.server_role_binding,
            &self.auth_delegator_binding,
            &self.client_service_account,
            &self.client_role,
            &self.client_role_binding,
            &self.service,
            &self.network_policy,
        ];
        if let Some(cm) = &self.service_ca_config_map {
            out.push(cm);
        }
        if let Some(cm) = &self.ca_config_map {
            out.push(cm);
        }
        // Before the server: a sandbox it creates finds its proxy in place.
        if let Some(p) = &self.proxy {
            out.push(&p.service_account);
            out.push(&p.role);
            out.push(&p.role_binding);
            out.push(&p.auth_delegator_binding);
            out.push(&p.config_map);
            out.push(&p.service);
            out.push(&p.network_policy);
            out.push(&p.pod_disruption_budget);
            out.push(&p.deployment);
        }
        match &self.expose {
            Some(Exposed::Ingress(i)) => out.push(i),
            Some(Exposed::HttpRoute(r)) => out.push(r),
            Some(Exposed::Route(r)) => out.push(r),
            None => {}
        }
        out.push(&self.deployment);
        out
    }
}

/// Applies every desired child in order. A failure does not stop the others; the first one
/// is returned (`applying Kind name: error`) for the status.
pub async fn apply_all(ctx: &Context, namespace: &str, desired: &Desired) -> Option<String> {
    let mut first = None;
    for child in desired.children() {
        if let Err(e) = child.apply(ctx, namespace).await {
            first.get_or_insert_with(|| e.to_string());
        }
    }
    first
}
