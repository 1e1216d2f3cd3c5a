//! Reading a Kubernetes API request path the way the API server will, to refuse the
//! subresources that reach into workloads.
//!
//! `exec`, `attach`, `portforward` and `proxy` run code in, or open a network path into, pods,
//! nodes and services; `pods/ephemeralcontainers` adds a container (a shell) to a running pod.
//! The proxy refuses them on every kubernetes route, whatever the credential's RBAC allows.
//!
//! A denylist is only as good as the parser in front of it, so the path is first reduced to
//! segments the API server cannot read differently: anything ambiguous (an encoded `/`, a dot
//! segment, an empty segment, a `;` parameter, a control character, double encoding) is
//! refused instead of being normalised. Then the API server's own URL grammar is applied:
//!
//! ```text
//! /api/v1[/watch][/namespaces/<ns>]/<resource>[/<name>[/<subresource>]]
//! /apis/<group>/<version>[/watch][/namespaces/<ns>]/<resource>[/<name>[/<subresource>]]
//! /api/v1/namespaces/<name>/{status,finalize}          (subresources of a namespace)
//! /api/v1/proxy/...                                     (legacy proxy: refused)
//! /api/v1/namespaces/<ns>/<resource>/<name>/proxy/...   (proxy subresource: refused)
//! ```
//!
//! The query string is not part of the path (the caller passes `Uri::path()`), so `?watch=true`
//! or `?follow=true` never affect the verdict.

use std::fmt;

/// Subresources (and the legacy top-level `proxy`) that are never forwarded.
const REFUSED_SUBRESOURCES: &[&str] = &["exec", "attach", "portforward", "proxy"];

/// Subresources of a namespace object; any other third segment after `namespaces/<ns>` names a
/// resource inside that namespace (this mirrors the API server's request-info parser).
const NAMESPACE_SUBRESOURCES: &[&str] = &["status", "finalize"];

/// What a path addresses, once it has been read unambiguously.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Outside `/api` and `/apis`: `/version`, `/healthz`, `/openapi/v3/...`, ...
    NonResource,
    /// `/api`, `/api/v1`, `/apis`, `/apis/<group>`, `/apis/<group>/<version>`.
    Discovery,
    /// A resource, a named object or one of its subresources.
    Resource(ResourcePath),
}

/// The parts of a resource path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourcePath {
    /// `None` for the core group (`/api/v1`).
    pub group: Option<String>,
    pub version: String,
    pub namespace: Option<String>,
    pub resource: String,
    pub name: Option<String>,
    pub subresource: Option<String>,
}

/// Why a path is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathRefusal {
    /// The path cannot be read unambiguously; the reason says which rule it broke.
    Malformed(&'static str),
    /// A subresource the proxy never forwards, e.g. `pods/exec`.
    Forbidden(String),
}

impl fmt::Display for PathRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathRefusal::Malformed(why) => write!(
                f,
                "the proxy refuses this path: {why}; it forwards only paths it can read \
                 exactly as the API server does"
            ),
            PathRefusal::Forbidden(what) => write!(
                f,
                "the proxy never allows {what} (exec, attach, port-forward, proxy and ephemeral \
                 containers reach into workloads), whatever the kubeconfig's RBAC says"
            ),
        }
    }
}

impl PathRefusal {
    /// A short stable label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            PathRefusal::Malformed(_) => "malformed_path",
            PathRefusal::Forbidden(_) => "forbidden_subresource",
        }
    }
}

/// Reads `path` (no query string) and refuses what a kubernetes route must not forward.
pub fn classify(path: &str) -> Result<Target, PathRefusal> {
    let segments = segments(path)?;
    let segs: Vec<&str> = segments.iter().map(String::as_str).collect();
    let (group, version, rest) = match segs.as_slice() {
        [] => return Ok(Target::NonResource),
        ["api"] | ["api", _] | ["apis"] | ["apis", _] | ["apis", _, _] => {
            return Ok(Target::Discovery)
        }
        ["api", version, rest @ ..] => (None, *version, rest),
        ["apis", group, version, rest @ ..] => (Some(*group), *version, rest),
        _ => return Ok(Target::NonResource),
    };
    let mut rest = rest;
    if let ["watch", tail @ ..] = rest {
        if tail.is_empty() {
            return Err(PathRefusal::Malformed(
                "a watch prefix with nothing after it",
            ));
        }
        rest = tail;
    }
    if let [first, ..] = rest {
        if first.eq_ignore_ascii_case("proxy") {
            return Err(PathRefusal::Forbidden(format!(
                "the legacy proxy path /{}/proxy/...",
                prefix(group, version)
            )));
        }
    }
    let (namespace, rest): (Option<&str>, &[&str]) = match rest {
        ["namespaces", ns, inner @ ..]
            if !inner.is_empty() && !NAMESPACE_SUBRESOURCES.contains(&inner[0]) =>
        {
            (Some(*ns), inner)
        }
        _ => (None, rest),
    };
    let (resource, name, subresource) = match rest {
        [resource] => (*resource, None, None),
        [resource, name] => (*resource, Some(*name), None),
        [resource, name, sub] => (*resource, Some(*name), Some(*sub)),
        [resource, _name, sub, ..] => {
            // Only the proxy subresource takes a tail; refuse it by name, anything else is not
            // a path the API server serves.
            if is_refused(sub) {
                return Err(forbidden(resource, sub));
            }
            return Err(PathRefusal::Malformed("segments after the subresource"));
        }
        [] => return Err(PathRefusal::Malformed("a namespace with no resource")),
    };
    if is_refused(resource) {
        return Err(PathRefusal::Forbidden(format!(
            "the resource path .../{resource}"
        )));
    }
    if let Some(sub) = subresource {
        if is_refused(sub)
            || (resource.eq_ignore_ascii_case("pods")
                && sub.eq_ignore_ascii_case("ephemeralcontainers"))
        {
            return Err(forbidden(resource, sub));
        }
    }
    Ok(Target::Resource(ResourcePath {
        group: group.map(str::to_string),
        version: version.to_string(),
        namespace: namespace.map(str::to_string),
        resource: resource.to_string(),
        name: name.map(str::to_string),
        subresource: subresource.map(str::to_string),
    }))
}

fn prefix(group: Option<&str>, version: &str) -> String {
    match group {
        None => format!("api/{version}"),
        Some(g) => format!("apis/{g}/{version}"),
    }
}

fn is_refused(segment: &str) -> bool {
    REFUSED_SUBRESOURCES
        .iter()
        .any(|r| segment.eq_ignore_ascii_case(r))
}

fn forbidden(resource: &str, sub: &str) -> PathRefusal {
    PathRefusal::Forbidden(format!("{resource}/{sub}"))
}

/// Splits and percent-decodes a path, refusing every form two parsers could read differently.
fn segments(path: &str) -> Result<Vec<String>, PathRefusal> {
    let Some(rest) = path.strip_prefix('/') else {
        return Err(PathRefusal::Malformed("the path does not start with '/'"));
    };
    // One trailing '/' adds nothing to read (the service proxy is often written with one);
    // any other empty segment is refused.
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.is_empty() {
        return Ok(Vec::new());
    }
    rest.split('/').map(decode_segment).collect()
}

fn decode_segment(raw: &str) -> Result<String, PathRefusal> {
    if raw.is_empty() {
        return Err(PathRefusal::Malformed("an empty path segment ('//')"));
    }
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match hex {
                Some(d) => {
                    check_decoded(d)?;
                    out.push(d);
                    i += 3;
                }
                None => return Err(PathRefusal::Malformed("an invalid percent-encoding")),
            }
        } else {
            check_raw(b)?;
            out.push(b);
            i += 1;
        }
    }
    let segment = String::from_utf8(out)
        .map_err(|_| PathRefusal::Malformed("a path segment that is not UTF-8 once decoded"))?;
    if segment == "." || segment == ".." {
        return Err(PathRefusal::Malformed("a dot segment ('.' or '..')"));
    }
    Ok(segment)
}

fn check_raw(b: u8) -> Result<(), PathRefusal> {
    match b {
        b';' => Err(PathRefusal::Malformed("a ';' parameter in the path")),
        b'\\' => Err(PathRefusal::Malformed("a backslash in the path")),
        b'?' | b'#' => Err(PathRefusal::Malformed("a '?' or '#' inside the path")),
        0..=0x20 | 0x7f => Err(PathRefusal::Malformed(
            "a control character or space in the path",
        )),
        _ => Ok(()),
    }
}

fn check_decoded(b: u8) -> Result<(), PathRefusal> {
    match b {
        b'/' => Err(PathRefusal::Malformed(
            "an encoded '/' (%2F) inside a path segment",
        )),
        b'%' => Err(PathRefusal::Malformed("double percent-encoding (%25)")),
        b'.' => Err(PathRefusal::Malformed("an encoded '.' (%2E)")),
        _ => check_raw(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(path: &str) -> PathRefusal {
        match classify(path) {
            Err(r) => r,
            Ok(t) => panic!("{path} was allowed as {t:?}"),
        }
    }

    fn forbidden_what(path: &str) -> String {
        match refused(path) {
            PathRefusal::Forbidden(what) => what,
            other => panic!("{path}: expected Forbidden, got {other:?}"),
        }
    }

    fn resource(path: &str) -> ResourcePath {
        match classify(path) {
            Ok(Target::Resource(r)) => r,
            other => panic!("{path}: expected a resource, got {other:?}"),
        }
    }

    #[test]
    fn ordinary_reads_are_allowed() {
        let r = resource("/api/v1/namespaces/default/pods");
        assert_eq!(r.namespace.as_deref(), Some("default"));
        assert_eq!(r.resource, "pods");
        assert_eq!(r.name, None);
        let r = resource("/api/v1/namespaces/default/pods/web-0/log");
        assert_eq!(r.name.as_deref(), Some("web-0"));
        assert_eq!(r.subresource.as_deref(), Some("log"));
        let r = resource("/apis/apps/v1/namespaces/x/deployments/d/scale");
        assert_eq!(r.group.as_deref(), Some("apps"));
        assert_eq!(r.subresource.as_deref(), Some("scale"));
        let r = resource("/api/v1/nodes");
        assert_eq!(r.namespace, None);
        assert_eq!(r.resource, "nodes");
        let r = resource("/api/v1/watch/namespaces/default/pods");
        assert_eq!(r.resource, "pods");
        let r = resource("/api/v1/pods/status");
        assert_eq!(r.resource, "pods");
    }

    #[test]
    fn namespace_subresources_follow_the_api_server() {
        let r = resource("/api/v1/namespaces/kube-system/status");
        assert_eq!(r.resource, "namespaces");
        assert_eq!(r.name.as_deref(), Some("kube-system"));
        assert_eq!(r.subresource.as_deref(), Some("status"));
        let r = resource("/api/v1/namespaces/kube-system/finalize");
        assert_eq!(r.subresource.as_deref(), Some("finalize"));
        let r = resource("/api/v1/namespaces/kube-system");
        assert_eq!(r.resource, "namespaces");
        let r = resource("/api/v1/namespaces");
        assert_eq!(r.name, None);
        let r = resource("/api/v1/namespaces/ns/configmaps");
        assert_eq!(r.namespace.as_deref(), Some("ns"));
        assert_eq!(r.resource, "configmaps");
    }

    #[test]
    fn discovery_and_non_resource_paths_are_allowed() {
        for p in ["/api", "/api/v1", "/apis", "/apis/apps", "/apis/apps/v1"] {
            assert_eq!(classify(p), Ok(Target::Discovery), "{p}");
        }
        for p in ["/", "/version", "/healthz", "/openapi/v3/api/v1", "/livez"] {
            assert_eq!(classify(p), Ok(Target::NonResource), "{p}");
        }
    }

    #[test]
    fn workload_subresources_are_forbidden() {
        assert_eq!(
            forbidden_what("/api/v1/namespaces/default/pods/web-0/exec"),
            "pods/exec"
        );
        assert_eq!(
            forbidden_what("/api/v1/namespaces/default/pods/web-0/attach"),
            "pods/attach"
        );
        assert_eq!(
            forbidden_what("/api/v1/namespaces/default/pods/web-0/portforward"),
            "pods/portforward"
        );
        assert_eq!(
            forbidden_what("/api/v1/namespaces/default/pods/web-0/ephemeralcontainers"),
            "pods/ephemeralcontainers"
        );
        assert_eq!(
            forbidden_what("/api/v1/namespaces/default/pods/web-0/proxy"),
            "pods/proxy"
        );
        assert_eq!(
            forbidden_what("/api/v1/namespaces/default/pods/web-0/proxy/metrics"),
            "pods/proxy"
        );
        assert_eq!(
            forbidden_what("/api/v1/namespaces/d/services/https:web:443/proxy/x/y"),
            "services/proxy"
        );
        assert_eq!(
            forbidden_what("/api/v1/nodes/n1/proxy/run/a/b/c"),
            "nodes/proxy"
        );
        assert_eq!(forbidden_what("/api/v1/nodes/n1/proxy"), "nodes/proxy");
        assert!(forbidden_what("/api/v1/proxy/namespaces/d/pods/p").contains("legacy proxy"));
        assert!(forbidden_what("/api/v1/proxy/nodes/n1").contains("legacy proxy"));
        assert!(forbidden_what("/api/v1/proxy/nodes/n1/").contains("legacy proxy"));
        assert_eq!(
            forbidden_what("/api/v1/namespaces/d/pods/p/exec/"),
            "pods/exec"
        );
        assert_eq!(resource("/api/v1/namespaces/d/pods/").resource, "pods");
        assert!(forbidden_what("/api/v1/watch/proxy/x").contains("legacy proxy"));
        assert_eq!(
            forbidden_what("/api/v1/watch/namespaces/d/pods/p/exec"),
            "pods/exec"
        );
        // Any group: an aggregated API server could implement the same verbs.
        assert_eq!(
            forbidden_what("/apis/example.com/v1/namespaces/d/things/t/exec"),
            "things/exec"
        );
    }

    #[test]
    fn the_denylist_is_case_insensitive() {
        assert_eq!(
            forbidden_what("/api/v1/namespaces/d/pods/p/EXEC"),
            "pods/EXEC"
        );
        assert_eq!(
            forbidden_what("/api/v1/namespaces/d/Pods/p/EphemeralContainers"),
            "Pods/EphemeralContainers"
        );
    }

    #[test]
    fn percent_encoding_is_decoded_before_the_check() {
        assert_eq!(
            forbidden_what("/api/v1/namespaces/d/pods/p/%65xec"),
            "pods/exec"
        );
        assert_eq!(
            forbidden_what("/api/v1/namespaces/d/pods/p/%61%74%74%61%63%68"),
            "pods/attach"
        );
        let r = resource("/api/v1/namespaces/d/configmaps/a%3Ab");
        assert_eq!(r.name.as_deref(), Some("a:b"));
    }

    #[test]
    fn ambiguous_paths_are_malformed() {
        let cases = [
            ("/api/v1/namespaces/d/pods/p%2Fexec", "%2F"),
            ("/api/v1/namespaces/d/pods/p%2fexec", "%2F"),
            ("/api/v1/namespaces/d/pods/p/./exec", "dot"),
            ("/api/v1/namespaces/d/pods/x/../p/exec", "dot"),
            ("/api/v1/namespaces/d/pods/p/%2e%2e/exec", "'.'"),
            ("/api/v1/namespaces/d/pods/p//exec", "empty"),
            ("//api/v1/namespaces/d/pods/p/exec", "empty"),
            ("/api/v1/namespaces/d/pods//", "empty"),
            ("/api/v1/namespaces/d/pods/p/exec//", "empty"),
            ("/api/v1/namespaces/d/pods/p/exec;x=y", "';'"),
            ("/api/v1/namespaces/d/pods/p;x/exec", "';'"),
            ("/api/v1/namespaces/d/pods/p/exec%3Bx", "';'"),
            ("/api/v1/namespaces/d/pods/p/%252Fexec", "double"),
            ("/api/v1/namespaces/d/pods/p/%zzexec", "invalid percent"),
            ("/api/v1/namespaces/d/pods/p/exec%", "invalid percent"),
            ("/api/v1/namespaces/d/pods/p/exec%4", "invalid percent"),
            ("/api/v1/namespaces/d/pods/p\\exec", "backslash"),
            ("/api/v1/namespaces/d/pods/p%5Cexec", "backslash"),
            ("/api/v1/namespaces/d/pods/p/%00exec", "control"),
            ("/api/v1/namespaces/d/pods/p/%FFexec", "UTF-8"),
            (
                "/api/v1/namespaces/d/pods/p/log/extra",
                "after the subresource",
            ),
            ("/api/v1/namespaces/d/pods/p%3Fx/exec", "'?'"),
            ("/api/v1/watch", "watch prefix"),
            ("api/v1/pods", "start with '/'"),
        ];
        for (path, needle) in cases {
            match refused(path) {
                PathRefusal::Malformed(why) => {
                    assert!(why.contains(needle), "{path}: {why:?} lacks {needle:?}")
                }
                other => panic!("{path}: expected Malformed, got {other:?}"),
            }
        }
    }

    #[test]
    fn messages_name_what_was_refused() {
        let msg = refused("/api/v1/namespaces/d/pods/p/exec").to_string();
        assert!(msg.contains("pods/exec"), "{msg}");
        assert!(msg.contains("never allows"), "{msg}");
        assert!(msg.contains("RBAC"), "{msg}");
        let msg = refused("/api/v1/namespaces/d/pods/p%2Fexec").to_string();
        assert!(msg.contains("%2F"), "{msg}");
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        fn name() -> impl Strategy<Value = String> {
            "[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?"
        }

        /// Percent-encodes a random subset of the bytes of `s`, in upper or lower case hex.
        fn encode_some(s: &str, mask: &[bool], lower: bool) -> String {
            s.bytes()
                .zip(mask.iter().cycle())
                .map(|(b, &enc)| match (enc, lower) {
                    (true, true) => format!("%{b:02x}"),
                    (true, false) => format!("%{b:02X}"),
                    (false, _) => (b as char).to_string(),
                })
                .collect()
        }

        proptest! {
            #[test]
            fn never_panics(path in "\\PC{0,64}") {
                let _ = classify(&path);
            }

            #[test]
            fn never_panics_on_slashes_dots_and_escapes(path in "[/.%;a-f0-9pexcod]{0,40}") {
                let _ = classify(&path);
            }

            #[test]
            fn refused_subresources_stay_refused_whatever_the_encoding(
                ns in name(),
                pod in name(),
                sub in prop::sample::select(vec!["exec", "attach", "portforward", "proxy", "ephemeralcontainers"]),
                mask in prop::collection::vec(any::<bool>(), 1..8),
                lower in any::<bool>(),
                watch in any::<bool>(),
                upper_case in any::<bool>(),
            ) {
                let sub = if upper_case { sub.to_uppercase() } else { sub.to_string() };
                let sub = encode_some(&sub, &mask, lower);
                let w = if watch { "watch/" } else { "" };
                let path = format!("/api/v1/{w}namespaces/{ns}/pods/{pod}/{sub}");
                prop_assert!(matches!(classify(&path), Err(PathRefusal::Forbidden(_))), "{}", path);
            }

            /// Whatever is allowed, decoded, has no refused word in the subresource position and
            /// no ambiguity left: re-joining the decoded segments gives a path that reads the same.
            #[test]
            fn allowed_paths_read_the_same_after_decoding(
                segs in prop::collection::vec("[a-z%0-9.;:-]{1,8}", 0..8),
            ) {
                let path = format!("/{}", segs.join("/"));
                if let Ok(target) = classify(&path) {
                    let decoded: Vec<String> = segs.iter().map(|s| decode_segment(s).unwrap()).collect();
                    let again = format!("/{}", decoded.join("/"));
                    prop_assert_eq!(classify(&again), Ok(target.clone()));
                    if let Target::Resource(r) = target {
                        if let Some(sub) = r.subresource {
                            prop_assert!(!is_refused(&sub));
                        }
                        prop_assert!(!is_refused(&r.resource));
                    }
                }
            }
        }
    }
}
