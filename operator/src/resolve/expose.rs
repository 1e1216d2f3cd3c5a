//! Whether the cluster can store the object `spec.server.expose` asks for: an HTTPRoute
//! needs the Gateway API CRDs, a Route needs OpenShift. One the cluster cannot store is left
//! out of the desired set, and the status says why; applying it would only fail with a bare
//! 404.

use std::time::Duration;

use crate::children::Spec;
use crate::context::Context;

/// How long a reconcile waits for the HTTPRoute watch's first answer (right after start).
const HTTP_ROUTE_DISCOVERY: Duration = Duration::from_secs(10);

/// Why the object `spec.server.expose` asks for cannot be published here, or `None` when it
/// can (or nothing is asked for). An Ingress is always served; a Route is asked for before
/// an HTTPRoute, as [`crate::children::expose::build`] builds them.
pub(super) async fn expose_unavailable(ctx: &Context, spec: &Spec) -> Option<String> {
    let e = spec.expose.as_ref()?;
    if e.ingress.is_some() {
        return None;
    }
    if e.route.is_some() {
        let why = match ctx.stores.routes_served(HTTP_ROUTE_DISCOVERY).await {
            Some(true) => return None,
            Some(false) => "this cluster serves no route.openshift.io/v1 Route (it is not OpenShift)",
            None => "the operator could not find out yet whether this cluster serves route.openshift.io/v1 Routes",
        };
        return Some(format!(
            "spec.server.expose.route is not published: {why}; use expose.ingress or expose.httpRoute here"
        ));
    }
    e.http_route.as_ref()?;
    let why = match ctx.stores.http_routes_served(HTTP_ROUTE_DISCOVERY).await {
        Some(true) => return None,
        Some(false) => "this cluster serves no gateway.networking.k8s.io/v1 HTTPRoute (the Gateway API CRDs are not installed)",
        None => "the operator could not find out yet whether this cluster serves gateway.networking.k8s.io/v1 HTTPRoutes",
    };
    Some(format!(
        "spec.server.expose.httpRoute is not published: {why}; install the Gateway API CRDs (picked up without an operator restart) or use expose.ingress"
    ))
}
