//! The children an instance no longer asks for, swept by label: every object of a swept
//! kind in the cache that carries the instance's label, is owned (as controller) by this
//! instance and is not what its spec asks for is deleted, so an endpoint stops being
//! published once `spec.server.expose` is removed or switched to another kind.
//!
//! What the spec asks for, not the desired set, decides what stays: an HTTPRoute or Route
//! leaves the desired set while the cluster seems not to serve its kind (a 404 from a
//! just-restarted apiserver whose custom-resource handlers are not ready yet), and a live
//! endpoint must not be deleted for that. The owner reference, checked by uid and sent as a
//! delete precondition, keeps a copy a user made of the operator's object (labels and all),
//! or an object someone labelled to have the operator delete it, out of the sweep.
//!
//! Only the expose kinds (Ingress, HTTPRoute, Route) are swept. The other optional children
//! leave the desired set only while their inputs cannot be resolved (the credential
//! proxy's, the CA ConfigMap's), and must stay in place then; the rest go with the instance
//! by garbage collection.

use k8s_openapi::api::networking::v1::Ingress;
use kube::ResourceExt;

use cli_mcp_api::names::label;

use crate::api_call::{delete_exactly, is_status};
use crate::apply::Owned;
use crate::children::expose::{self, Exposed, HttpRoute, Route};
use crate::children::{Inputs, Spec};
use crate::context::Context;

/// Deletes the Ingress, HTTPRoute or Route of the instance that its spec no longer asks
/// for. Failures are logged and retried on the next reconcile.
pub async fn expose_orphans(ctx: &Context, inputs: &Inputs) {
    let keep = Kept::asked(inputs);
    let (spec, why) = (&inputs.spec, "spec.server.expose");
    sweep::<Ingress>(ctx, spec, keep.ingress.as_deref(), why).await;
    sweep::<HttpRoute>(ctx, spec, keep.http_route.as_deref(), why).await;
    sweep::<Route>(ctx, spec, keep.route.as_deref(), why).await;
}

/// The name of each expose kind the spec asks for.
#[derive(Debug, Default, PartialEq, Eq)]
struct Kept {
    ingress: Option<String>,
    http_route: Option<String>,
    route: Option<String>,
}

impl Kept {
    /// Built whether or not the cluster serves the kind right now (see the module docs).
    fn asked(inputs: &Inputs) -> Kept {
        match expose::build(inputs) {
            Some(Exposed::Ingress(o)) => Kept {
                ingress: o.metadata.name,
                ..Kept::default()
            },
            Some(Exposed::HttpRoute(o)) => Kept {
                http_route: o.metadata.name,
                ..Kept::default()
            },
            Some(Exposed::Route(o)) => Kept {
                route: o.metadata.name,
                ..Kept::default()
            },
            None => Kept::default(),
        }
    }
}

/// Whether `o` is one of the instance's own children of a swept kind: in its namespace,
/// with its instance label, controlled by it (by uid), and not the one `keep` names.
fn is_orphan<K: ResourceExt>(o: &K, spec: &Spec, keep: Option<&str>) -> bool {
    let owned = o
        .owner_references()
        .iter()
        .any(|r| r.controller == Some(true) && r.uid == spec.owner.uid);
    o.namespace().as_deref() == Some(spec.namespace.as_str())
        && o.labels().get(label::INSTANCE) == Some(&spec.name.to_string())
        && owned
        && o.meta().name.as_deref() != keep
}

/// Deletes every `K` in the cache that belongs to the instance (its namespace and instance
/// label) except `keep`, the one it still asks for; no request when there is none. `why`
/// names the spec field whose removal made them unwanted.
async fn sweep<K: Owned>(ctx: &Context, spec: &Spec, keep: Option<&str>, why: &str) {
    let ns = spec.namespace.as_str();
    let cached = K::store(&ctx.stores).state();
    for o in cached.iter().filter(|o| is_orphan(o.as_ref(), spec, keep)) {
        let name = o.name_any();
        let api = K::api(ctx.client.clone(), ns);
        // Exactly the object judged: one recreated under the name since is not deleted.
        match api.delete(&name, &delete_exactly(o.as_ref(), false)).await {
            Ok(_) => ctx.metrics.api_write(K::kind(&()).as_ref(), "delete"),
            Err(e) if is_status(&e, 404) || is_status(&e, 409) => {}
            Err(e) => tracing::warn!(
                "deleting {} {ns}/{name} of a removed {why}: {e}; retrying on the next reconcile",
                K::kind(&())
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::children::test_support::inputs;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    fn ingress(name: &str, owner_uid: Option<&str>, controller: bool) -> Ingress {
        Ingress {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns1".into()),
                labels: Some([(label::INSTANCE.to_string(), "demo".to_string())].into()),
                owner_references: owner_uid.map(|uid| {
                    vec![OwnerReference {
                        api_version: "cli-mcp.redhat.com/v1alpha1".into(),
                        kind: "CliMcpInstance".into(),
                        name: "demo".into(),
                        uid: uid.into(),
                        controller: Some(controller),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn only_the_instances_own_children_that_the_spec_no_longer_asks_for_are_swept() {
        let inp = inputs(serde_json::json!({}));
        let spec = &inp.spec;
        let own = spec.owner.uid.as_str();
        assert!(is_orphan(
            &ingress("cli-mcp-demo", Some(own), true),
            spec,
            None
        ));
        // Still asked for.
        assert!(!is_orphan(
            &ingress("cli-mcp-demo", Some(own), true),
            spec,
            Some("cli-mcp-demo")
        ));
        // A user's copy with the operator's labels, and an object labelled to have the
        // operator delete it: not the instance's.
        assert!(!is_orphan(&ingress("copy", None, false), spec, None));
        assert!(!is_orphan(
            &ingress("copy", Some("other-uid"), true),
            spec,
            None
        ));
        // Owned, but not as controller (someone added a reference to the instance).
        assert!(!is_orphan(&ingress("copy", Some(own), false), spec, None));
    }

    #[test]
    fn a_route_the_cluster_seems_not_to_serve_is_still_kept() {
        let mut inp = inputs(serde_json::json!({"server": {"expose": {"httpRoute": {
            "host": "mcp.example.com",
            "parentRefs": [{"name": "gw"}]
        }}}}));
        let served = Kept::asked(&inp);
        assert!(served.http_route.is_some(), "{served:?}");
        // A 404 from an apiserver whose custom-resource handlers are not ready yet.
        inp.expose_unavailable = Some("no Gateway API".into());
        assert_eq!(Kept::asked(&inp), served);
        assert_eq!(Kept::asked(&inputs(serde_json::json!({}))), Kept::default());
    }
}
