//! Header rewriting between the sandbox and the upstream.
//!
//! A sandbox must not be able to present a credential of its own choosing (its kubeconfig's
//! placeholder, a token it found somewhere, an impersonation request) nor reveal where it sits
//! (`Via`, `X-Forwarded-For`, `Forwarded`). Hop-by-hop headers belong to one connection and are
//! never forwarded (RFC 9110 section 7.6.1): the fixed set, plus every header the `Connection`
//! header names.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use cli_mcp_api::proxy::SessionCaller;

/// Connection-specific headers, never forwarded in either direction. `Transfer-Encoding` and
/// `Content-Length` framing is redone by the HTTP library on each side. `Keep-Alive` and
/// `Proxy-Connection` are obsolete but still sent by some clients.
static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

/// Credentials a sandbox could present (the route's injector alone decides the credential),
/// and headers that reveal the sandbox's address or the proxy chain.
static CREDENTIALS_AND_FORWARDING: [HeaderName; 6] = [
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    HeaderName::from_static("x-api-key"),
    header::VIA,
    header::FORWARDED,
    HeaderName::from_static("x-forwarded-for"),
];

/// Prefixes of credential-bearing headers: Kubernetes impersonation (`Impersonate-User`,
/// `-Group`, `-Uid`, `-Extra-*`) and the authenticating-proxy headers an API server trusts
/// from its front proxy (`X-Remote-User`, `-Group`, `-Extra-*`).
const CREDENTIAL_PREFIXES: &[&str] = &["impersonate-", "x-remote-"];

/// Removes hop-by-hop headers, including those listed in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(&HOP_BY_HOP) {
        headers.remove(name);
    }
}

/// Removes every credential and forwarding header a sandbox may have set. `HeaderName`s are
/// lowercase, so the comparison is case-insensitive by construction.
pub fn strip_credentials(headers: &mut HeaderMap) {
    for name in &CREDENTIALS_AND_FORWARDING {
        headers.remove(name);
    }
    let prefixed: Vec<HeaderName> = headers
        .keys()
        .filter(|k| {
            CREDENTIAL_PREFIXES
                .iter()
                .any(|p| k.as_str().starts_with(p))
        })
        .cloned()
        .collect();
    for name in prefixed {
        headers.remove(name);
    }
}

/// Whether a request asks to switch protocols (WebSocket, SPDY): an `Upgrade` header, or
/// `upgrade` among the `Connection` options.
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        || headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|o| o.trim().eq_ignore_ascii_case("upgrade"))
}

/// The extra naming the session in an impersonated request: the API server's audit log
/// shows it under `user.extra["cli-mcp.redhat.com/session"]`. The key is percent-encoded in
/// the header name (`/` is not allowed there).
pub const SESSION_EXTRA_HEADER: &str = "impersonate-extra-cli-mcp.redhat.com%2fsession";

/// Sets the impersonation headers for `caller` in `session` (after [`strip_credentials`]
/// removed whatever the sandbox sent): `Impersonate-User`, one `Impersonate-Group` per
/// group and the session extra. `Err` when a value cannot be a header value.
pub fn impersonate(
    headers: &mut HeaderMap,
    caller: &SessionCaller,
    session: &str,
) -> Result<(), http::header::InvalidHeaderValue> {
    headers.insert(
        HeaderName::from_static("impersonate-user"),
        HeaderValue::from_str(&caller.user)?,
    );
    for group in &caller.groups {
        headers.append(
            HeaderName::from_static("impersonate-group"),
            HeaderValue::from_str(group)?,
        );
    }
    headers.insert(
        HeaderName::from_static(SESSION_EXTRA_HEADER),
        HeaderValue::from_str(session)?,
    );
    Ok(())
}

/// A header map from literal pairs, for unit tests of header handling.
#[cfg(test)]
pub(crate) fn test_map(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            HeaderName::from_bytes(k.as_bytes()).expect("a valid test header name"),
            http::HeaderValue::from_str(v).expect("a valid test header value"),
        );
    }
    h
}

#[cfg(test)]
mod tests {
    use super::test_map as map;
    use super::*;

    /// The header names left, sorted.
    fn names(h: &HeaderMap) -> Vec<&str> {
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort();
        left
    }

    #[test]
    fn credentials_are_stripped_in_any_case() {
        let mut h = map(&[
            ("Authorization", "Bearer stolen"),
            ("authorization", "Bearer second"),
            ("PROXY-AUTHORIZATION", "Basic x"),
            ("X-Api-Key", "k"),
            ("Impersonate-User", "admin"),
            ("impersonate-group", "system:masters"),
            ("Impersonate-Uid", "1"),
            ("Impersonate-Extra-Scopes", "all"),
            ("X-Remote-User", "admin"),
            ("X-Remote-Extra-Foo", "bar"),
            ("Via", "1.1 somewhere"),
            ("X-Forwarded-For", "10.0.0.1"),
            ("Forwarded", "for=10.0.0.1"),
            ("Accept", "application/json"),
            ("X-Goog-Api-Key", "kept: not a header any route here uses"),
        ]);
        strip_credentials(&mut h);
        assert_eq!(names(&h), ["accept", "x-goog-api-key"]);
    }

    #[test]
    fn hop_by_hop_headers_and_those_named_by_connection_are_removed() {
        let mut h = map(&[
            ("Connection", "keep-alive, X-Secret-Hop"),
            ("Connection", "other"),
            ("Keep-Alive", "timeout=5"),
            ("Proxy-Connection", "keep-alive"),
            ("X-Secret-Hop", "1"),
            ("Other", "2"),
            ("TE", "trailers"),
            ("Trailer", "x"),
            ("Transfer-Encoding", "chunked"),
            ("Upgrade", "websocket"),
            ("Accept", "*/*"),
            ("Content-Length", "3"),
        ]);
        strip_hop_by_hop(&mut h);
        assert_eq!(names(&h), ["accept", "content-length"]);
    }

    #[test]
    fn a_caller_is_impersonated_with_its_groups_and_the_session() {
        let mut h = test_map(&[("impersonate-user", "evil"), ("accept", "x")]);
        strip_credentials(&mut h);
        let caller = SessionCaller {
            user: "alice".into(),
            groups: vec!["dev".into(), "system:authenticated".into()],
        };
        impersonate(&mut h, &caller, "s-1").unwrap();
        let all =
            |n: &str| -> Vec<&str> { h.get_all(n).iter().map(|v| v.to_str().unwrap()).collect() };
        assert_eq!(all("impersonate-user"), ["alice"]);
        assert_eq!(all("impersonate-group"), ["dev", "system:authenticated"]);
        assert_eq!(all(SESSION_EXTRA_HEADER), ["s-1"]);
        let bad = SessionCaller {
            user: "a\nb".into(),
            groups: vec![],
        };
        assert!(impersonate(&mut h, &bad, "s").is_err());
    }

    #[test]
    fn upgrade_requests_are_recognised() {
        assert!(is_upgrade(&map(&[("Upgrade", "SPDY/3.1")])));
        assert!(is_upgrade(&map(&[("Connection", "keep-alive, Upgrade")])));
        assert!(!is_upgrade(&map(&[("Connection", "keep-alive")])));
        assert!(!is_upgrade(&map(&[])));
    }
}
