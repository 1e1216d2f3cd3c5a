//! The RuntimeClasses an instance's pods name (`runtimeClassName` of `spec.sandbox`,
//! `spec.server` and `spec.proxy`), checked against the cluster's. The API server's
//! RuntimeClass admission refuses every pod that names a class the cluster lacks, so:
//! - a missing sandbox class holds the warm pool back: the operator creates no pool pod the
//!   API server would refuse, instead of sending refused creates on a backoff;
//! - a missing server or proxy class marks its Deployment's pod template
//!   (`children::RUNTIME_CLASS_MISSING_ANNOTATION`), and the mark goes once the class
//!   exists: that template change wakes the ReplicaSet controller at once, which would
//!   otherwise retry the refused pods only after its own backoff (up to about 16 minutes);
//! - `Ready` is False with reason [`NOT_FOUND`], naming each class and the field naming it.
//!
//! The RuntimeClass watch (`crate::watch`) wakes every instance naming a class when that
//! class is created or deleted, so an instance goes on by itself once its class exists.
//! While the operator cannot list RuntimeClasses (before the first list, or without RBAC
//! for them) nothing is judged missing: the API server's refusal stays the only check.
//!
//! Client-free: the cache is filled by the watch and read by `crate::resolve`.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::ResourceExt;

use cli_mcp_api::crd::{CliMcpInstance, SandboxStatus};
use cli_mcp_api::names::annotation;
use cli_mcp_api::sandbox::Placement;

use crate::sandbox_pod::SandboxPod;

/// `Ready`'s reason while a RuntimeClass an instance names does not exist.
pub const NOT_FOUND: &str = "RuntimeClassNotFound";

/// The field naming the sandboxes' RuntimeClass.
pub const SANDBOX_FIELD: &str = "spec.sandbox.runtimeClassName";
const SERVER_FIELD: &str = "spec.server.runtimeClassName";
const PROXY_FIELD: &str = "spec.proxy.runtimeClassName";

/// A RuntimeClass one part of an instance names, and the field that names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub field: &'static str,
    pub class: String,
}

/// The RuntimeClasses the sandbox, server and proxy placements name, in that order.
pub fn named(sandbox: &Placement, server: &Placement, proxy: &Placement) -> Vec<Named> {
    [
        (SANDBOX_FIELD, sandbox),
        (SERVER_FIELD, server),
        (PROXY_FIELD, proxy),
    ]
    .into_iter()
    .filter_map(|(field, p)| {
        p.runtime_class_name
            .clone()
            .map(|class| Named { field, class })
    })
    .collect()
}

/// Whether instance `cr` names RuntimeClass `class` in any part, so that a change of that
/// class must wake it.
pub fn names_class(cr: &CliMcpInstance, class: &str) -> bool {
    let s = &cr.spec;
    [
        s.sandbox.placement.runtime_class_name.as_deref(),
        s.server.placement.runtime_class_name.as_deref(),
        s.proxy
            .as_ref()
            .and_then(|p| p.placement.runtime_class_name.as_deref()),
    ]
    .contains(&Some(class))
}

/// The classes of `named` the cluster lacks, as `exists` says; none while the cluster's
/// classes are not `listed` (the API server's admission still refuses the pods then).
pub fn missing(named: Vec<Named>, listed: bool, exists: impl Fn(&str) -> bool) -> Vec<Named> {
    if !listed {
        return Vec::new();
    }
    named.into_iter().filter(|n| !exists(&n.class)).collect()
}

/// What to tell the admin about the `missing` classes, each once with every field naming
/// it; `None` when nothing is missing. The phrase `RuntimeClass "<name>" not found` is the
/// API server's own refusal, so whoever met that refusal finds this too.
pub fn message(missing: &[Named]) -> Option<String> {
    if missing.is_empty() {
        return None;
    }
    let mut fields: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for n in missing {
        fields.entry(n.class.as_str()).or_default().push(n.field);
    }
    let each: Vec<String> = fields
        .iter()
        .map(|(class, fields)| {
            format!(
                "RuntimeClass \"{class}\" not found: {} names it, and this cluster has no \
                 RuntimeClass of that name",
                fields.join(" and ")
            )
        })
        .collect();
    Some(format!(
        "{}. Install the runtime on the nodes and create its RuntimeClass (kubectl get \
         runtimeclass lists the ones this cluster has), or change or remove the field; no \
         pod is created with a missing class, and the instance goes on by itself once the \
         class exists",
        each.join("; ")
    ))
}

/// [`message`] for the sandboxes' class alone: why the warm pool creates no pod.
pub fn sandbox_message(missing: &[Named]) -> Option<String> {
    let sandbox: Vec<Named> = missing
        .iter()
        .filter(|n| n.field == SANDBOX_FIELD)
        .cloned()
        .collect();
    message(&sandbox)
}

/// The RuntimeClass the current warm sandboxes carry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Carried {
    /// No current warm sandbox: none yet, a pool of 0, every one claimed or being replaced.
    #[default]
    NoPods,
    /// What most current warm sandboxes carry (`None`: no class, the nodes' default).
    Class(Option<String>),
}

/// What the warm sandboxes among `pods` that are built from the current config (`hash`)
/// and not being deleted carry as their RuntimeClass: what the API server stored, after any
/// admission webhook set or changed it. Pods that disagree (a webhook that acts on some
/// only) are counted, and the class most carry wins (on a tie, the first by name).
pub fn carried(pods: &[Arc<SandboxPod>], hash: &str) -> Carried {
    let mut counts: BTreeMap<Option<&str>, usize> = BTreeMap::new();
    for p in pods {
        let Some(pod) = p.unassigned() else { continue };
        let current = pod
            .annotations()
            .get(annotation::SANDBOX_HASH)
            .map(String::as_str);
        if p.is_deleting() || current != Some(hash) {
            continue;
        }
        let class = pod
            .spec
            .as_ref()
            .and_then(|s| s.runtime_class_name.as_deref());
        *counts.entry(class).or_default() += 1;
    }
    // `max_by_key` keeps the last of equal counts; the reversed order makes it the first.
    counts
        .into_iter()
        .rev()
        .max_by_key(|(_, n)| *n)
        .map_or(Carried::NoPods, |(class, _)| {
            Carried::Class(class.map(str::to_owned))
        })
}

/// `status.sandbox`: the class the current warm sandboxes carry, else `spec_class` (what the
/// next sandbox is built with), and that class's handler as `handler_of` finds it in the
/// cluster.
pub fn sandbox_status(
    carried: &Carried,
    spec_class: Option<&str>,
    handler_of: impl Fn(&str) -> Option<String>,
) -> SandboxStatus {
    let class = match carried {
        Carried::Class(c) => c.clone(),
        Carried::NoPods => spec_class.map(str::to_owned),
    };
    SandboxStatus {
        runtime_handler: class.as_deref().and_then(handler_of),
        runtime_class_name: class,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli_mcp_api::names::label;

    fn placement(class: Option<&str>) -> Placement {
        Placement {
            runtime_class_name: class.map(str::to_owned),
            ..Default::default()
        }
    }

    fn n(field: &'static str, class: &str) -> Named {
        Named {
            field,
            class: class.into(),
        }
    }

    #[test]
    fn each_part_naming_a_class_is_listed_with_its_field() {
        let all = named(
            &placement(Some("gvisor")),
            &placement(None),
            &placement(Some("kata")),
        );
        assert_eq!(all, [n(SANDBOX_FIELD, "gvisor"), n(PROXY_FIELD, "kata")]);
        assert!(named(&placement(None), &placement(None), &placement(None)).is_empty());
    }

    #[test]
    fn an_instance_is_woken_by_the_classes_any_of_its_parts_names() {
        let cr: CliMcpInstance = serde_json::from_value(serde_json::json!({
            "apiVersion": "cli-mcp.redhat.com/v1alpha1", "kind": "CliMcpInstance",
            "metadata": {"name": "demo", "namespace": "ns1"},
            "spec": {"sandbox": {"runtimeClassName": "gvisor"},
                     "proxy": {"runtimeClassName": "kata", "targets": []}}
        }))
        .expect("instance");
        assert!(names_class(&cr, "gvisor") && names_class(&cr, "kata"));
        assert!(!names_class(&cr, "runc"));
    }

    #[test]
    fn only_listed_classes_are_judged_and_only_the_absent_ones_are_missing() {
        let both = || vec![n(SANDBOX_FIELD, "gvisor"), n(SERVER_FIELD, "runc")];
        let gone = missing(both(), true, |c| c == "runc");
        assert_eq!(gone, [n(SANDBOX_FIELD, "gvisor")]);
        // The cluster's classes are not known (not listed yet, or no RBAC for them).
        assert!(missing(both(), false, |_| false).is_empty());
        assert!(missing(both(), true, |_| true).is_empty());
    }

    #[test]
    fn the_message_names_each_class_once_with_its_fields_and_the_fix() {
        assert_eq!(message(&[]), None);
        let m = message(&[
            n(SANDBOX_FIELD, "gvisor"),
            n(SERVER_FIELD, "gvisor"),
            n(PROXY_FIELD, "kata"),
        ])
        .expect("message");
        assert!(
            m.starts_with(
                "RuntimeClass \"gvisor\" not found: spec.sandbox.runtimeClassName and \
                 spec.server.runtimeClassName names it"
            ),
            "{m}"
        );
        assert!(
            m.contains("RuntimeClass \"kata\" not found: spec.proxy"),
            "{m}"
        );
        assert!(
            m.contains("create its RuntimeClass") && m.contains("change or remove"),
            "{m}"
        );
        // The pool's reason is the sandboxes' class alone.
        let s = sandbox_message(&[n(SERVER_FIELD, "kata")]);
        assert_eq!(s, None);
        let s = sandbox_message(&[n(SANDBOX_FIELD, "gvisor"), n(SERVER_FIELD, "kata")]);
        assert!(s.is_some_and(|s| s.contains("\"gvisor\"") && !s.contains("kata")));
    }

    fn pool_pod(name: &str, hash: &str, class: Option<&str>, deleting: bool) -> Arc<SandboxPod> {
        let mut pod = serde_json::json!({
            "metadata": {"name": name, "uid": name,
                "labels": {label::INSTANCE: "demo"},
                "annotations": {annotation::SANDBOX_HASH: hash}},
            "spec": {"containers": [{"name": "agent"}]},
        });
        if let Some(c) = class {
            pod["spec"]["runtimeClassName"] = c.into();
        }
        if deleting {
            pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
        }
        Arc::new(serde_json::from_value(pod).expect("pod"))
    }

    #[test]
    fn the_class_is_what_most_current_warm_pods_carry() {
        assert_eq!(carried(&[], "h"), Carried::NoPods);
        let pods = [
            pool_pod("a", "h", Some("gvisor"), false),
            pool_pod("b", "h", Some("gvisor"), false),
            pool_pod("c", "h", None, false),
            // Built from an older config, or on its way out: not counted.
            pool_pod("d", "old", Some("runc"), false),
            pool_pod("e", "old", Some("runc"), false),
            pool_pod("f", "h", Some("runc"), true),
            pool_pod("g", "h", Some("runc"), true),
        ];
        assert_eq!(carried(&pods, "h"), Carried::Class(Some("gvisor".into())));
        assert_eq!(carried(&pods[2..3], "h"), Carried::Class(None));
        assert_eq!(carried(&pods[3..], "h"), Carried::NoPods);
        // A tie goes to the first by name (no class sorts first).
        assert_eq!(carried(&pods[1..3], "h"), Carried::Class(None));
    }

    #[test]
    fn the_status_reports_the_pods_class_else_the_specs_with_its_handler() {
        let handler = |c: &str| (c == "gvisor").then(|| "runsc".to_owned());
        let s = sandbox_status(
            &Carried::Class(Some("gvisor".into())),
            Some("kata"),
            handler,
        );
        assert_eq!(s.runtime_class_name.as_deref(), Some("gvisor"));
        assert_eq!(s.runtime_handler.as_deref(), Some("runsc"));
        // A webhook stripped the class: the pods run on the nodes' default runtime.
        let s = sandbox_status(&Carried::Class(None), Some("gvisor"), handler);
        assert_eq!(s, SandboxStatus::default());
        let s = sandbox_status(&Carried::NoPods, Some("kata"), handler);
        assert_eq!(
            (s.runtime_class_name.as_deref(), s.runtime_handler),
            (Some("kata"), None)
        );
        assert_eq!(
            sandbox_status(&Carried::NoPods, None, handler),
            SandboxStatus::default()
        );
    }
}
