//! The children an instance no longer asks for, swept by label: every object of a swept
//! kind in the cache that carries the instance's label and is not in its desired set is
//! deleted, so an endpoint stops being published once `spec.server.expose` is removed or
//! switched to another kind.
//!
//! Only the expose kinds (Ingress, HTTPRoute, Route) are swept. The other optional children
//! leave the desired set only while their inputs cannot be resolved (the credential
//! proxy's, the CA ConfigMap's), and must stay in place then; the rest go with the instance
//! by garbage collection.

use k8s_openapi::api::networking::v1::Ingress;
use kube::api::DeleteParams;
use kube::ResourceExt;

use cli_mcp_api::names::label;

use crate::api_call::is_status;
use crate::apply::Owned;
use crate::children::expose::{Exposed, HttpRoute, Route};
use crate::children::{Desired, Spec};
use crate::context::Context;

/// Deletes the Ingress, HTTPRoute or Route of the instance that `desired` no longer holds.
/// Failures are logged and retried on the next reconcile.
pub async fn expose_orphans(ctx: &Context, spec: &Spec, desired: &Desired) {
    let (ingress, http_route, route) = match &desired.expose {
        Some(Exposed::Ingress(o)) => (o.metadata.name.as_deref(), None, None),
        Some(Exposed::HttpRoute(o)) => (None, o.metadata.name.as_deref(), None),
        Some(Exposed::Route(o)) => (None, None, o.metadata.name.as_deref()),
        None => (None, None, None),
    };
    let why = "spec.server.expose";
    sweep::<Ingress>(ctx, spec, ingress, why).await;
    sweep::<HttpRoute>(ctx, spec, http_route, why).await;
    sweep::<Route>(ctx, spec, route, why).await;
}

/// Deletes every `K` in the cache that belongs to the instance (its namespace and instance
/// label) except `keep`, the one it still asks for; no request when there is none. `why`
/// names the spec field whose removal made them unwanted.
async fn sweep<K: Owned>(ctx: &Context, spec: &Spec, keep: Option<&str>, why: &str) {
    let ns = spec.namespace.as_str();
    let instance = spec.name.to_string();
    let orphans = K::store(&ctx.stores).state().into_iter().filter(|o| {
        o.namespace().as_deref() == Some(ns)
            && o.labels().get(label::INSTANCE) == Some(&instance)
            && o.meta().name.as_deref() != keep
    });
    for o in orphans {
        let name = o.name_any();
        let api = K::api(ctx.client.clone(), ns);
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => ctx.metrics.api_write(K::kind(&()).as_ref(), "delete"),
            Err(e) if is_status(&e, 404) => {}
            Err(e) => tracing::warn!(
                "deleting {} {ns}/{name} of a removed {why}: {e}; retrying on the next reconcile",
                K::kind(&())
            ),
        }
    }
}
