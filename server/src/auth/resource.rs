//! OAuth 2.0 Protected Resource Metadata (RFC 9728) and the `WWW-Authenticate` challenge
//! of a 401, as the MCP authorization spec asks of a resource server.
//!
//! The metadata names the authorization servers (`--authorization-server`) whose tokens the
//! Kubernetes API accepts (it is configured to trust them as JWT issuers); tokens are still
//! checked with TokenReview, so the server itself never talks to them. Without
//! `--authorization-server` the document lists none (RFC 9728 makes the member optional): a
//! Kubernetes-token deployment has no authorization server, and its clients are configured
//! with a token issued beforehand (`kubectl create token`).
//!
//! `resource` is `--resource-url` when set. Without it, it is derived from the request's
//! `Host` (or HTTP/2 `:authority`) and this listener's scheme: the client compares it with
//! the URL it used (RFC 9728 §3.3), so a derived value is right exactly when nothing rewrites
//! `Host` on the way, and it is never used for an authorisation decision (audiences come
//! from the flags only). Behind a proxy that rewrites `Host`, set `--resource-url`.

use http::header::{self, HeaderMap, HeaderValue};
use reqwest::Url;
use serde_json::{json, Map, Value};

/// The well-known path of the metadata (RFC 9728 §3).
pub const WELL_KNOWN: &str = "/.well-known/oauth-protected-resource";
/// The MCP endpoint's path on this listener.
pub const MCP_PATH: &str = "/mcp";
/// How long clients and caches may keep the metadata (it changes only with the flags).
const MAX_AGE_SECONDS: u32 = 3600;
/// Longest `Host` a derived URL is made from (DNS names are at most 253 characters).
const MAX_HOST_LEN: usize = 300;

/// What the metadata says, validated at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtectedResource {
    /// Issuer identifiers of the authorization servers, as given.
    pub authorization_servers: Vec<String>,
    /// `--resource-url`.
    pub resource_url: Option<Url>,
    /// Scopes a client asks for (advertised only: access is decided by RBAC).
    pub scopes: Vec<String>,
    /// Whether this listener serves TLS (the scheme of a derived resource URL).
    pub tls: bool,
}

/// Checks one `--authorization-server`: an issuer identifier (RFC 8414 §2) is an https URL
/// with a host and without query or fragment.
pub fn parse_authorization_server(text: &str) -> Result<String, String> {
    let url = Url::parse(text).map_err(|e| {
        format!("{text:?} is not a URL ({e}); give the issuer URL, such as https://idp.example.com/realms/dev")
    })?;
    if url.scheme() != "https" {
        return Err(format!(
            "{text:?} is not an https URL; an authorization server's issuer identifier must use https"
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{text:?} has no host"));
    }
    if url.fragment().is_some() || text.contains('#') {
        return Err(format!(
            "{text:?} has a fragment (#...); an issuer identifier has none: remove it"
        ));
    }
    if url.query().is_some() {
        return Err(format!(
            "{text:?} has a query (?...); an issuer identifier has none: remove it"
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!("{text:?} has user information (user@); remove it"));
    }
    // As given, not as re-serialised: the issuer is compared to tokens' `iss` exactly, so a
    // trailing slash the URL parser would add must not appear here.
    Ok(text.to_owned())
}

/// Checks `--resource-url`: the absolute URL clients use for `/mcp` (https, or http on a
/// loopback host), without fragment.
pub fn parse_resource_url(text: &str) -> Result<Url, String> {
    let url = Url::parse(text).map_err(|e| {
        format!("{text:?} is not an absolute URL ({e}); give the URL clients use, such as https://mcp.example.com/mcp")
    })?;
    let Some(host) = url.host_str().filter(|h| !h.is_empty()) else {
        return Err(format!("{text:?} has no host"));
    };
    let loopback = host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    match url.scheme() {
        "https" => {}
        "http" if loopback => {}
        _ => {
            return Err(format!(
                "{text:?} must be an https URL (http only on a loopback host): bearer tokens \
                 must not travel in clear"
            ))
        }
    }
    if url.fragment().is_some() || text.contains('#') {
        return Err(format!("{text:?} has a fragment (#...); remove it"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!("{text:?} has user information (user@); remove it"));
    }
    Ok(url)
}

/// The `Host` of a request, if it is a plain `host[:port]` fit to build a URL from.
fn request_host(uri: &http::Uri, headers: &HeaderMap) -> Option<String> {
    let host = match uri.authority() {
        Some(a) => a.as_str().to_owned(),
        None => headers.get(header::HOST)?.to_str().ok()?.to_owned(),
    };
    if host.is_empty() || host.len() > MAX_HOST_LEN || host.contains('@') {
        return None;
    }
    let authority: http::uri::Authority = host.parse().ok()?;
    Some(authority.as_str().to_ascii_lowercase())
}

impl ProtectedResource {
    /// The resource identifier for a request to this listener.
    pub fn resource(&self, uri: &http::Uri, headers: &HeaderMap) -> Option<String> {
        match &self.resource_url {
            Some(url) => Some(url.as_str().to_owned()),
            None => {
                let scheme = if self.tls { "https" } else { "http" };
                Some(format!(
                    "{scheme}://{}{MCP_PATH}",
                    request_host(uri, headers)?
                ))
            }
        }
    }

    /// Where the metadata of [`Self::resource`] is (RFC 9728 §3.1: the well-known path goes
    /// between the host and the resource's path).
    pub fn metadata_url(&self, uri: &http::Uri, headers: &HeaderMap) -> Option<String> {
        let resource = Url::parse(&self.resource(uri, headers)?).ok()?;
        let path = resource.path().trim_end_matches('/');
        Some(format!(
            "{}{WELL_KNOWN}{path}",
            resource.origin().ascii_serialization()
        ))
    }

    /// Paths under [`WELL_KNOWN`] this listener answers: the bare one, `/mcp`, and the path
    /// of `--resource-url` (a gateway may forward it unchanged).
    pub fn serves(&self, path: &str) -> bool {
        let Some(rest) = path.strip_prefix(WELL_KNOWN) else {
            return false;
        };
        let rest = rest.trim_end_matches('/');
        rest.is_empty()
            || rest == MCP_PATH
            || self
                .resource_url
                .as_ref()
                .is_some_and(|u| u.path().trim_end_matches('/') == rest)
    }

    /// The metadata document (RFC 9728 §2).
    pub fn document(&self, uri: &http::Uri, headers: &HeaderMap) -> Value {
        let mut doc = Map::new();
        if let Some(resource) = self.resource(uri, headers) {
            doc.insert("resource".into(), json!(resource));
        }
        if !self.authorization_servers.is_empty() {
            doc.insert(
                "authorization_servers".into(),
                json!(self.authorization_servers),
            );
        }
        doc.insert("bearer_methods_supported".into(), json!(["header"]));
        if !self.scopes.is_empty() {
            doc.insert("scopes_supported".into(), json!(self.scopes));
        }
        doc.insert("resource_name".into(), json!("cli-mcp"));
        Value::Object(doc)
    }

    /// Response headers of the metadata: cacheable, readable by browser clients (it is
    /// public), and varying by `Host` when the resource is derived from it.
    pub fn document_headers(&self) -> Vec<(header::HeaderName, HeaderValue)> {
        let mut h = vec![
            (
                header::CACHE_CONTROL,
                HeaderValue::from_str(&format!("public, max-age={MAX_AGE_SECONDS}"))
                    .unwrap_or(HeaderValue::from_static("no-cache")),
            ),
            (
                header::ACCESS_CONTROL_ALLOW_ORIGIN,
                HeaderValue::from_static("*"),
            ),
        ];
        if self.resource_url.is_none() {
            h.push((header::VARY, HeaderValue::from_static("Host")));
        }
        h
    }

    /// The `WWW-Authenticate` value of a 401 (RFC 6750 §3): `error` only when a token was
    /// sent (`invalid_token`) or the request was malformed (`invalid_request`).
    pub fn challenge(
        &self,
        uri: &http::Uri,
        headers: &HeaderMap,
        error: Option<&str>,
    ) -> HeaderValue {
        challenge(self.metadata_url(uri, headers).as_deref(), error)
    }
}

/// `Bearer realm="cli-mcp"[, resource_metadata="…"][, error="…"]`. Every value is a URL or a
/// fixed token, so none needs escaping; one that would is left out.
pub fn challenge(metadata_url: Option<&str>, error: Option<&str>) -> HeaderValue {
    let mut text = String::from("Bearer realm=\"cli-mcp\"");
    if let Some(url) = metadata_url.filter(|u| quotable(u)) {
        text.push_str(&format!(", resource_metadata=\"{url}\""));
    }
    if let Some(error) = error.filter(|e| quotable(e)) {
        text.push_str(&format!(", error=\"{error}\""));
    }
    HeaderValue::from_str(&text).unwrap_or(HeaderValue::from_static("Bearer realm=\"cli-mcp\""))
}

/// Fits in a quoted-string without escapes (RFC 6750 §3 restricts values to these).
fn quotable(s: &str) -> bool {
    s.bytes()
        .all(|b| (0x20..=0x7e).contains(&b) && b != b'"' && b != b'\\')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(h: &str) -> HeaderMap {
        let mut m = HeaderMap::new();
        m.insert(header::HOST, HeaderValue::from_str(h).expect("host"));
        m
    }

    fn derived() -> ProtectedResource {
        ProtectedResource {
            authorization_servers: vec!["https://idp.example/realms/a".into()],
            resource_url: None,
            scopes: vec![],
            tls: true,
        }
    }

    #[test]
    fn authorization_servers_are_https_issuers() {
        assert_eq!(
            parse_authorization_server("https://idp.example/realms/a"),
            Ok("https://idp.example/realms/a".into())
        );
        for (bad, needle) in [
            ("http://idp.example", "not an https URL"),
            ("https://idp.example/#x", "fragment"),
            ("https://idp.example/?a=b", "query"),
            ("https://u@idp.example", "user information"),
            ("idp.example", "not a URL"),
        ] {
            let e = parse_authorization_server(bad).expect_err(bad);
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn resource_urls_are_https_or_loopback_http() {
        assert!(parse_resource_url("https://mcp.example/mcp").is_ok());
        assert!(parse_resource_url("http://127.0.0.1:8080/mcp").is_ok());
        assert!(parse_resource_url("http://localhost:8080/mcp").is_ok());
        for (bad, needle) in [
            ("http://mcp.example/mcp", "https"),
            ("https://mcp.example/mcp#f", "fragment"),
            ("/mcp", "absolute"),
        ] {
            let e = parse_resource_url(bad).expect_err(bad);
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn the_resource_is_derived_from_host_or_configured() {
        let uri: http::Uri = "/mcp".parse().expect("uri");
        let r = derived();
        assert_eq!(
            r.resource(&uri, &host("MCP.example:8443")).as_deref(),
            Some("https://mcp.example:8443/mcp")
        );
        assert_eq!(
            r.metadata_url(&uri, &host("mcp.example:8443")).as_deref(),
            Some("https://mcp.example:8443/.well-known/oauth-protected-resource/mcp")
        );
        for bad in ["a@evil", "a b", ""] {
            let mut m = HeaderMap::new();
            if let Ok(v) = HeaderValue::from_str(bad) {
                m.insert(header::HOST, v);
            }
            assert_eq!(r.resource(&uri, &m), None, "{bad:?}");
        }
        let fixed = ProtectedResource {
            resource_url: parse_resource_url("https://gw.example/team/mcp").ok(),
            ..derived()
        };
        assert_eq!(
            fixed.metadata_url(&uri, &host("ignored")).as_deref(),
            Some("https://gw.example/.well-known/oauth-protected-resource/team/mcp")
        );
        assert!(fixed.serves("/.well-known/oauth-protected-resource/team/mcp"));
        assert!(fixed.serves("/.well-known/oauth-protected-resource/mcp"));
        assert!(fixed.serves("/.well-known/oauth-protected-resource"));
        assert!(!fixed.serves("/.well-known/oauth-protected-resource/other"));
    }

    #[test]
    fn the_document_lists_what_is_configured() {
        let uri: http::Uri = "/".parse().expect("uri");
        let doc = derived().document(&uri, &host("h:1"));
        assert_eq!(doc["resource"], "https://h:1/mcp");
        assert_eq!(
            doc["authorization_servers"],
            json!(["https://idp.example/realms/a"])
        );
        assert_eq!(doc["bearer_methods_supported"], json!(["header"]));
        assert!(doc.get("scopes_supported").is_none());
        let none = ProtectedResource {
            authorization_servers: vec![],
            scopes: vec!["openid".into()],
            ..derived()
        };
        let doc = none.document(&uri, &host("h:1"));
        assert!(doc.get("authorization_servers").is_none(), "{doc}");
        assert_eq!(doc["scopes_supported"], json!(["openid"]));
    }

    #[test]
    fn challenges_follow_rfc_6750() {
        let url = "https://h/.well-known/oauth-protected-resource/mcp";
        assert_eq!(
            challenge(Some(url), None),
            "Bearer realm=\"cli-mcp\", resource_metadata=\"https://h/.well-known/oauth-protected-resource/mcp\""
        );
        assert_eq!(
            challenge(Some(url), Some("invalid_token")),
            "Bearer realm=\"cli-mcp\", resource_metadata=\"https://h/.well-known/oauth-protected-resource/mcp\", error=\"invalid_token\""
        );
        assert_eq!(challenge(Some("a\"b"), None), "Bearer realm=\"cli-mcp\"");
    }
}
