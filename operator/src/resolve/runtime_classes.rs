//! Which RuntimeClasses the instance's pods name that the cluster lacks, from the cache the
//! RuntimeClass watch fills ([`crate::runtime_class`] says what follows from it).

use std::time::Duration;

use kube::runtime::reflector::ObjectRef;

use crate::children::Spec;
use crate::context::Context;
use crate::runtime_class::{self, Named};

/// How long a reconcile waits for the RuntimeClass watch's first answer (right after start).
const RUNTIME_CLASS_DISCOVERY: Duration = Duration::from_secs(10);

/// The classes `spec` names that the cluster has no RuntimeClass of; none when it names
/// none, or while the operator cannot list RuntimeClasses.
pub(super) async fn missing(ctx: &Context, spec: &Spec) -> Vec<Named> {
    let named = runtime_class::named(
        &spec.sandbox.placement,
        &spec.server_placement,
        &spec.proxy.placement,
    );
    if named.is_empty() {
        return named;
    }
    let stores = &ctx.stores;
    let listed = stores.runtime_classes_listed(RUNTIME_CLASS_DISCOVERY).await;
    runtime_class::missing(named, listed, |class| {
        stores.runtime_classes.get(&ObjectRef::new(class)).is_some()
    })
}
