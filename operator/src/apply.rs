//! Server-side apply of desired children, with one field manager, skipping requests that
//! cannot change anything (see [`crate::context::ApplyCache`]).

use std::fmt::Debug;

use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

use cli_mcp_api::names::FIELD_MANAGER;

use crate::context::Context;
use crate::error::Result;

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
    let hash = hex::encode(Sha256::digest(serde_json::to_vec(desired)?));
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
    let applied = api.patch(&name, &params, &Patch::Apply(desired)).await?;
    ctx.metrics.api_write(K::kind(&()).as_ref(), "apply");
    if let Some(rv) = applied.resource_version() {
        ctx.applied.record(key, hash, rv);
    }
    Ok(true)
}

/// Applies `desired` and, on failure, adds `Kind name: error` to `errors` (so the other
/// children are still tried and the first failure is reported).
pub async fn apply_noting<K: Child>(
    ctx: &Context,
    api: &Api<K>,
    store: &Store<K>,
    desired: &K,
    errors: &mut Vec<String>,
) {
    if let Err(e) = apply(ctx, api, store, desired).await {
        errors.push(format!("{} {}: {e}", K::kind(&()), desired.name_any()));
    }
}
