//! What an identity may do, from the `SelfSubjectRulesReview`s of some namespaces, summed up
//! for a model: per API group, the resources it may only read and those it may write, with
//! the namespaces that all allow the same thing collapsed into one line.
//!
//! The summary is short on purpose (it is sent on every MCP connection) and says when it is
//! not the whole truth: a review the authorizer could not complete (`incomplete`), lists
//! that were cut, namespaces that were not checked.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::authorization::v1::ResourceRule;

/// Verbs that only read.
const READ_VERBS: &[&str] = &["get", "list", "watch"];
/// Verbs that change something.
const WRITE_VERBS: &[&str] = &["create", "update", "patch", "delete", "deletecollection"];
/// Rules every authenticated identity has by default (`system:basic-user`): asking who it is
/// and what it may do. They change nothing, and listing them would hide "may do nothing".
const SELF_REVIEWS: &[(&str, &str)] = &[
    ("authorization.k8s.io", "selfsubjectaccessreviews"),
    ("authorization.k8s.io", "selfsubjectrulesreviews"),
    ("authentication.k8s.io", "selfsubjectreviews"),
];
/// Resources every authenticated identity may read by default: the cluster's public CA
/// bundles. Reading them is no right of the identity's own; writing them would be.
const PUBLIC_READS: &[(&str, &str)] = &[("certificates.k8s.io", "clustertrustbundles")];
/// Most API groups named per kind of access; the rest are counted.
const MAX_GROUPS: usize = 10;
/// Most resources named per API group; the rest are counted.
const MAX_RESOURCES: usize = 16;
/// Most groups of namespaces with rights of their own; the rest are counted.
const MAX_NAMESPACE_GROUPS: usize = 4;
/// Most namespaces named in one group.
const MAX_NAMESPACES_NAMED: usize = 6;

/// How an identity may use one resource.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verbs {
    /// Only `get`, `list`, `watch`.
    Read,
    /// At least one verb that changes something (or `*`).
    Write,
    /// A verb that is neither, such as `impersonate`, `bind` or `escalate`.
    Verb(String),
}

/// One right: `access` on `resource` of API group `group` (`""` is the core group, `*`
/// every group).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Grant {
    pub access: Verbs,
    pub group: String,
    /// The resource, with ` (some names)` when the rule names the objects.
    pub resource: String,
}

/// The rights one namespace's review found.
pub type Grants = BTreeSet<Grant>;

/// The grants of a review's resource rules: each (group, resource) once per kind of access,
/// a resource that may be written not also listed as read.
pub fn grants(rules: &[ResourceRule]) -> Grants {
    let mut out = Grants::new();
    for rule in rules {
        let named = rule.resource_names.as_ref().is_some_and(|n| !n.is_empty());
        let verbs: Vec<&str> = rule.verbs.iter().map(String::as_str).collect();
        let mut kinds = Vec::new();
        if verbs.iter().any(|v| *v == "*" || WRITE_VERBS.contains(v)) {
            kinds.push(Verbs::Write);
        } else if verbs.iter().any(|v| READ_VERBS.contains(v)) {
            kinds.push(Verbs::Read);
        }
        for v in &verbs {
            if *v != "*" && !READ_VERBS.contains(v) && !WRITE_VERBS.contains(v) {
                kinds.push(Verbs::Verb((*v).to_owned()));
            }
        }
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                if SELF_REVIEWS.contains(&(group.as_str(), resource.as_str())) {
                    continue;
                }
                let resource = if named {
                    format!("{resource} (some names)")
                } else {
                    resource.clone()
                };
                for access in &kinds {
                    if *access == Verbs::Read
                        && PUBLIC_READS.contains(&(group.as_str(), resource.as_str()))
                    {
                        continue;
                    }
                    out.insert(Grant {
                        access: access.clone(),
                        group: group.clone(),
                        resource: resource.clone(),
                    });
                }
            }
        }
    }
    // Written implies more than read: keep the stronger one only.
    let written: BTreeSet<(String, String)> = out
        .iter()
        .filter(|g| g.access == Verbs::Write)
        .map(|g| (g.group.clone(), g.resource.clone()))
        .collect();
    out.retain(|g| {
        g.access != Verbs::Read || !written.contains(&(g.group.clone(), g.resource.clone()))
    });
    out
}

/// Which namespaces were reviewed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checked {
    /// Every namespace the identity may list (`total` of them; the first `reviewed` were
    /// reviewed when there are more than the operator reviews).
    Listed { reviewed: usize, total: usize },
    /// Only this one: the identity may not list namespaces.
    Only(String),
}

/// What an identity may do, namespaces collapsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rights {
    pub checked: Checked,
    /// What every reviewed namespace allows (cluster-wide bindings show up here).
    pub everywhere: Grants,
    /// Namespaces that allow more, grouped by what they add, largest group first.
    pub more: Vec<(Vec<String>, Grants)>,
    /// The authorizer could not list every rule (a webhook authorizer, an evaluation error):
    /// the identity may be allowed more than this says.
    pub incomplete: bool,
}

/// Collapses per-namespace grants: what all share, and what some add.
pub fn collapse(
    checked: Checked,
    per_namespace: BTreeMap<String, Grants>,
    incomplete: bool,
) -> Rights {
    let mut everywhere: Option<Grants> = None;
    for g in per_namespace.values() {
        everywhere = Some(match everywhere {
            None => g.clone(),
            Some(e) => e.intersection(g).cloned().collect(),
        });
    }
    let everywhere = everywhere.unwrap_or_default();
    let mut by_extra: BTreeMap<Grants, Vec<String>> = BTreeMap::new();
    for (ns, g) in per_namespace {
        let extra: Grants = g.difference(&everywhere).cloned().collect();
        if !extra.is_empty() {
            by_extra.entry(extra).or_default().push(ns);
        }
    }
    let mut more: Vec<(Vec<String>, Grants)> =
        by_extra.into_iter().map(|(g, ns)| (ns, g)).collect();
    // Largest group first, then by the first namespace: a stable order, so an unchanged
    // cluster renders the same text (a new text rolls the server).
    more.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
    Rights {
        checked,
        everywhere,
        more,
        incomplete,
    }
}

/// `a, b, c and N more`, at most `max` named.
fn list(items: &[String], max: usize) -> String {
    let mut text = items
        .iter()
        .take(max)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > max {
        text.push_str(&format!(" and {} more", items.len() - max));
    }
    text
}

fn group_name(group: &str) -> &str {
    match group {
        "" => "core",
        "*" => "every API group",
        g => g,
    }
}

/// `core (pods, services); apps (deployments)` for the grants of one kind of access.
fn by_group<'a>(grants: impl Iterator<Item = &'a Grant>) -> String {
    let mut groups: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for g in grants {
        let r = if g.resource == "*" {
            "everything".to_owned()
        } else {
            g.resource.clone()
        };
        groups.entry(g.group.as_str()).or_default().push(r);
    }
    let mut parts: Vec<String> = groups
        .iter()
        .take(MAX_GROUPS)
        .map(|(group, resources)| {
            format!("{} ({})", group_name(group), list(resources, MAX_RESOURCES))
        })
        .collect();
    if groups.len() > MAX_GROUPS {
        parts.push(format!("{} more API groups", groups.len() - MAX_GROUPS));
    }
    parts.join("; ")
}

/// One set of grants as a sentence: `read-only: …. Write: …. Also: impersonate (…).`
pub fn describe(grants: &Grants) -> String {
    if grants.is_empty() {
        return "nothing".into();
    }
    let mut parts = Vec::new();
    let read: Vec<&Grant> = grants.iter().filter(|g| g.access == Verbs::Read).collect();
    let write: Vec<&Grant> = grants.iter().filter(|g| g.access == Verbs::Write).collect();
    if !read.is_empty() {
        parts.push(format!("read-only {}", by_group(read.into_iter())));
    }
    if !write.is_empty() {
        parts.push(format!("write {}", by_group(write.into_iter())));
    }
    let mut verbs: BTreeMap<&str, Vec<&Grant>> = BTreeMap::new();
    for g in grants {
        if let Verbs::Verb(v) = &g.access {
            verbs.entry(v.as_str()).or_default().push(g);
        }
    }
    for (verb, gs) in verbs {
        parts.push(format!("{verb} {}", by_group(gs.into_iter())));
    }
    parts.join(". ")
}

/// The rights as the briefing says them.
pub fn render(r: &Rights) -> String {
    let scope = match &r.checked {
        Checked::Listed { reviewed, total } if reviewed < total => {
            format!("In the {reviewed} namespaces checked (of {total})")
        }
        Checked::Listed { total, .. } => format!("In all {total} namespaces"),
        Checked::Only(ns) => {
            format!("In namespace {ns} (it may not list namespaces, so no other was checked)")
        }
    };
    let mut text = if r.everywhere.is_empty() && r.more.is_empty() {
        format!("{scope}: may do nothing (no RBAC rights of its own).")
    } else if r.everywhere.is_empty() {
        format!("{scope}: nothing everywhere.")
    } else {
        let writes = r.everywhere.iter().any(|g| g.access == Verbs::Write);
        let none = if writes { "" } else { " May write nothing." };
        format!("{scope}: {}.{none}", describe(&r.everywhere))
    };
    for (namespaces, extra) in r.more.iter().take(MAX_NAMESPACE_GROUPS) {
        text.push_str(&format!(
            " Also in {}: {}.",
            list(namespaces, MAX_NAMESPACES_NAMED),
            describe(extra)
        ));
    }
    if r.more.len() > MAX_NAMESPACE_GROUPS {
        let rest: usize = r.more[MAX_NAMESPACE_GROUPS..]
            .iter()
            .map(|m| m.0.len())
            .sum();
        text.push_str(&format!(" {rest} more namespaces allow other things."));
    }
    if r.incomplete {
        text.push_str(" The cluster could not list every rule: more may be allowed.");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> ResourceRule {
        let v = |s: &[&str]| s.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        ResourceRule {
            api_groups: Some(v(groups)),
            resources: Some(v(resources)),
            verbs: v(verbs),
            resource_names: None,
        }
    }

    /// What every authenticated identity gets: asking who it is and what it may do.
    fn basic_user() -> Vec<ResourceRule> {
        vec![
            rule(
                &["authorization.k8s.io"],
                &["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
                &["create"],
            ),
            rule(
                &["authentication.k8s.io"],
                &["selfsubjectreviews"],
                &["create"],
            ),
            rule(
                &["certificates.k8s.io"],
                &["clustertrustbundles"],
                &["get", "list", "watch"],
            ),
        ]
    }

    #[test]
    fn reads_and_writes_are_told_apart_and_self_reviews_are_not_rights() {
        let mut rules = basic_user();
        rules.push(rule(
            &["", "apps"],
            &["pods", "deployments"],
            &["get", "list"],
        ));
        rules.push(rule(&[""], &["configmaps"], &["get"]));
        rules.push(rule(&[""], &["configmaps"], &["update"]));
        rules.push(rule(&[""], &["serviceaccounts"], &["impersonate"]));
        let g = grants(&rules);
        let text = describe(&g);
        assert_eq!(
            text,
            "read-only core (deployments, pods); apps (deployments, pods). \
             write core (configmaps). impersonate core (serviceaccounts)"
        );
        assert!(describe(&grants(&basic_user())) == "nothing");
    }

    #[test]
    fn namespaces_alike_are_one_line_and_the_odd_ones_say_what_they_add() {
        let base = grants(&[rule(&[""], &["pods"], &["get", "list", "watch"])]);
        let mut extra = base.clone();
        extra.extend(grants(&[rule(
            &[""],
            &["configmaps"],
            &["create", "delete"],
        )]));
        let per: BTreeMap<String, Grants> = [
            ("a".to_owned(), base.clone()),
            ("b".to_owned(), extra.clone()),
            ("c".to_owned(), base.clone()),
            ("d".to_owned(), extra),
        ]
        .into();
        let r = collapse(
            Checked::Listed {
                reviewed: 4,
                total: 4,
            },
            per,
            false,
        );
        assert_eq!(
            render(&r),
            "In all 4 namespaces: read-only core (pods). May write nothing. \
             Also in b, d: write core (configmaps)."
        );
        let alike: BTreeMap<String, Grants> =
            [("a".to_owned(), base.clone()), ("b".to_owned(), base)].into();
        let r = collapse(
            Checked::Listed {
                reviewed: 2,
                total: 9,
            },
            alike,
            true,
        );
        assert_eq!(
            render(&r),
            "In the 2 namespaces checked (of 9): read-only core (pods). May write nothing. \
             The cluster could not list every rule: more may be allowed."
        );
    }

    #[test]
    fn an_identity_without_rights_is_said_to_may_do_nothing() {
        let per: BTreeMap<String, Grants> = [("team".to_owned(), grants(&basic_user()))].into();
        let r = collapse(Checked::Only("team".into()), per, false);
        assert_eq!(
            render(&r),
            "In namespace team (it may not list namespaces, so no other was checked): \
             may do nothing (no RBAC rights of its own)."
        );
    }

    #[test]
    fn wildcards_and_named_objects_are_said_plainly() {
        let mut named = rule(&[""], &["secrets"], &["get"]);
        named.resource_names = Some(vec!["one".into()]);
        let g = grants(&[rule(&["*"], &["*"], &["*"]), named]);
        assert_eq!(
            describe(&g),
            "read-only core (secrets (some names)). write every API group (everything)"
        );
    }

    #[test]
    fn long_lists_are_cut_and_counted() {
        let resources: Vec<String> = (0..20).map(|i| format!("r{i:02}")).collect();
        let refs: Vec<&str> = resources.iter().map(String::as_str).collect();
        let g = grants(&[rule(&[""], &refs, &["get"])]);
        let text = describe(&g);
        assert!(text.ends_with("r15 and 4 more)"), "{text}");
    }
}
