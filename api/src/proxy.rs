//! The credential proxy's contract: where its inputs are mounted, its ports, and the route
//! table the operator renders (ConfigMap `cli-mcp-<n>-proxy`, key [`ROUTES_KEY`]) and the
//! proxy reads.
//!
//! A route is one upstream `host:port` a sandbox may reach through the proxy. Every route is
//! TLS-terminated by the proxy; a `kubernetes` route additionally gets the admin's token
//! injected (from the kubeconfig the proxy alone mounts), an allow-list route (`none`) gets
//! nothing but the header scrubbing. Anything not in the table gets no tunnel at all.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The forward proxy (HTTP `CONNECT`).
pub const PROXY_PORT: u16 = 8080;
/// `GET /healthz`, `/readyz`, `/metrics`.
pub const PROXY_HEALTH_PORT: u16 = 8081;
/// Where the route table ConfigMap is mounted, and its key.
pub const ROUTES_DIR: &str = "/etc/cli-mcp/proxy";
pub const ROUTES_KEY: &str = "routes.json";
/// Where the proxy CA Secret (`cli-mcp-<n>-proxy-ca`) is mounted, and its keys (PEM).
pub const CA_DIR: &str = "/etc/cli-mcp/proxy-ca";
pub const CA_CERT_KEY: &str = "ca.crt";
pub const CA_KEY_KEY: &str = "ca.key";
/// Where only the `kubeconfig` key of the admin's Secret is mounted, in the proxy pod alone.
pub const ADMIN_KUBECONFIG_DIR: &str = "/etc/cli-mcp/admin-kubeconfig";
/// The token every user of a sandbox's kubeconfig carries: it authenticates nothing, the
/// proxy strips it and injects the real one.
pub const PLACEHOLDER_TOKEN: &str = "cli-mcp-proxy-managed";
/// Where a sandbox's agent takes its clients' proxy connections (`HTTPS_PROXY` points here):
/// it forwards each to the instance's proxy with the sandbox's proof of identity added as
/// `Proxy-Authorization`, so the tools in the sandbox need no credential of their own.
pub const RELAY_LISTEN: &str = "127.0.0.1:3128";
/// Where a sandbox pod's projected ServiceAccount token for the proxy is mounted, and its key.
pub const SANDBOX_TOKEN_DIR: &str = "/var/run/secrets/cli-mcp/proxy";
pub const SANDBOX_TOKEN_KEY: &str = "token";
/// The projected token's lifetime: the shortest the API server allows. The kubelet renews it
/// at 80% of that, and it dies with the pod whatever its expiry.
pub const SANDBOX_TOKEN_EXPIRATION_SECONDS: i64 = 600;
/// The name of the sandbox pod's projected token volume.
pub const SANDBOX_TOKEN_VOLUME: &str = "proxy-token";

/// The audience of a sandbox's proxy token: only the proxy of this one instance accepts it,
/// and the API server (whose audience it is not) refuses it.
pub fn sandbox_token_audience(namespace: &str, instance: &str) -> String {
    format!("cli-mcp-proxy:{namespace}:{instance}")
}

/// Most routes one table may hold (one kubernetes target with a few servers plus allow-list
/// domains); bounds the ConfigMap and the proxy's lookup table.
pub const MAX_ROUTES: usize = 64;

/// The MCP caller a session's pod serves, as the server records it on the pod
/// (annotation `cli-mcp.redhat.com/caller`) and the proxy reads it back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionCaller {
    pub user: String,
    #[serde(default)]
    pub groups: Vec<String>,
}

impl SessionCaller {
    /// The annotation's value.
    pub fn to_annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The annotation read back; `None` when it is not one.
    pub fn from_annotation(s: &str) -> Option<Self> {
        serde_json::from_str(s).ok()
    }
}

/// Why a domain or a route table is unusable. Messages say what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("domain {0:?} is not a valid host: use a DNS name (letters, digits, '-', '.'), an IPv4 address or a bracketed IPv6 address, without '*', scheme or path")]
    BadHost(String),
    #[error("domain {0:?} needs a port (host:port)")]
    MissingPort(String),
    #[error("domain {0:?} has an invalid port: use 1..65535")]
    BadPort(String),
    #[error("domain {0:?}: an IPv6 address must be in brackets, e.g. [2001:db8::1]:443")]
    UnbracketedIpv6(String),
    #[error("domain {0} is listed more than once; list each host:port once")]
    Duplicate(String),
    #[error("too many routes ({0}); at most {MAX_ROUTES}")]
    TooMany(usize),
    #[error("route table is not valid JSON of the expected shape: {0}")]
    Json(String),
}

/// A canonical `host:port`: lowercase host, IPv6 in brackets, port 1..=65535, no wildcard,
/// no leading or trailing dot. Two spellings of one upstream compare equal, so the proxy's
/// exact-match lookup cannot be dodged by case or a default port.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Domain(String);

impl Domain {
    /// Parses `host:port` (the port is required).
    pub fn parse(s: &str) -> Result<Self, RouteError> {
        let (host, port) = split_host_port(s)?;
        let port = port.ok_or_else(|| RouteError::MissingPort(s.to_owned()))?;
        Self::build(s, host, port)
    }

    /// Parses `host` or `host:port`, taking `port` when none is given.
    pub fn with_default_port(s: &str, port: u16) -> Result<Self, RouteError> {
        let (host, p) = split_host_port(s)?;
        Self::build(s, host, p.unwrap_or(port))
    }

    fn build(original: &str, host: &str, port: u16) -> Result<Self, RouteError> {
        let host = canonical_host(original, host)?;
        if port == 0 {
            return Err(RouteError::BadPort(original.to_owned()));
        }
        Ok(Self(format!("{host}:{port}")))
    }

    /// The host, without brackets for IPv6.
    pub fn host(&self) -> &str {
        let h = self.host_with_brackets();
        h.strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(h)
    }

    fn host_with_brackets(&self) -> &str {
        self.0.rsplit_once(':').map_or(self.0.as_str(), |(h, _)| h)
    }

    pub fn port(&self) -> u16 {
        self.0
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or(443)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the host is an IP literal (a NetworkPolicy can name it; a DNS name it cannot).
    pub fn ip(&self) -> Option<std::net::IpAddr> {
        self.host().parse().ok()
    }
}

impl fmt::Display for Domain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Domain {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Domain {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Domain::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Splits `host[:port]`, with `[v6]` or `[v6]:port` for IPv6.
fn split_host_port(s: &str) -> Result<(&str, Option<u16>), RouteError> {
    // A scheme, path, userinfo or wildcard is never part of a host:port.
    if s.contains(['/', '@', '*', ' ', '?', '#', '\\']) {
        return Err(RouteError::BadHost(s.to_owned()));
    }
    let bad_port = || RouteError::BadPort(s.to_owned());
    let parse_port = |p: &str| -> Result<u16, RouteError> {
        if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad_port());
        }
        p.parse::<u16>().map_err(|_| bad_port())
    };
    if let Some(rest) = s.strip_prefix('[') {
        let (inner, after) = rest
            .split_once(']')
            .ok_or_else(|| RouteError::BadHost(s.to_owned()))?;
        let host = &s[..inner.len() + 2];
        return match after {
            "" => Ok((host, None)),
            p => match p.strip_prefix(':') {
                Some(p) => Ok((host, Some(parse_port(p)?))),
                None => Err(RouteError::BadHost(s.to_owned())),
            },
        };
    }
    match s.matches(':').count() {
        0 => Ok((s, None)),
        1 => {
            let (h, p) = s.split_once(':').ok_or_else(bad_port)?;
            Ok((h, Some(parse_port(p)?)))
        }
        _ => Err(RouteError::UnbracketedIpv6(s.to_owned())),
    }
}

fn canonical_host(original: &str, host: &str) -> Result<String, RouteError> {
    let bad = || RouteError::BadHost(original.to_owned());
    if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        let ip: std::net::Ipv6Addr = inner.parse().map_err(|_| bad())?;
        return Ok(format!("[{ip}]"));
    }
    let h = host.to_ascii_lowercase();
    if h.is_empty() || h.len() > 253 || h.starts_with('.') || h.ends_with('.') {
        return Err(bad());
    }
    if let Ok(ip) = h.parse::<std::net::Ipv4Addr>() {
        return Ok(ip.to_string());
    }
    for label in h.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !ok {
            return Err(bad());
        }
    }
    Ok(h)
}

/// What the proxy adds to a request on a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Injector {
    /// A Kubernetes API server: the admin kubeconfig's token is injected, and the
    /// subresources that open a shell or a tunnel into other pods are refused.
    Kubernetes,
    /// An allow-listed domain: reachable, nothing injected.
    None,
}

/// One upstream a sandbox may reach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Route {
    pub domain: Domain,
    pub injector: Injector,
    /// PEM of the only CA the proxy trusts for this upstream; `None`: the system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_cert: Option<String>,
    /// Whose identity a kubernetes route's requests carry (absent: `shared`).
    #[serde(default, skip_serializing_if = "RouteIdentity::is_shared")]
    pub identity: RouteIdentity,
}

/// Whose identity a kubernetes route's requests reach the API server with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RouteIdentity {
    /// The admin kubeconfig's user, for every session alike.
    #[default]
    Shared,
    /// The kubeconfig's user impersonates the session's MCP caller (user and groups) and
    /// names the session in an extra, so the cluster's RBAC decides per person and its audit
    /// log names person and session. A session without a caller is refused, never served
    /// as the shared identity.
    ImpersonateCaller,
}

impl RouteIdentity {
    pub fn is_shared(&self) -> bool {
        *self == RouteIdentity::Shared
    }
}

/// The routes, sorted by domain, each domain once.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteTable {
    routes: Vec<Route>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTable {
    routes: Vec<Route>,
}

impl RouteTable {
    pub fn new(mut routes: Vec<Route>) -> Result<Self, RouteError> {
        if routes.len() > MAX_ROUTES {
            return Err(RouteError::TooMany(routes.len()));
        }
        routes.sort_by(|a, b| a.domain.cmp(&b.domain));
        if let Some(w) = routes.windows(2).find(|w| w[0].domain == w[1].domain) {
            return Err(RouteError::Duplicate(w[0].domain.to_string()));
        }
        Ok(Self { routes })
    }

    pub fn from_json(s: &str) -> Result<Self, RouteError> {
        let raw: RawTable = serde_json::from_str(s).map_err(|e| RouteError::Json(e.to_string()))?;
        Self::new(raw.routes)
    }

    /// Deterministic JSON (sorted routes), so an unchanged table renders unchanged bytes.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|_| "{\"routes\":[]}".to_owned())
    }

    pub fn get(&self, d: &Domain) -> Option<&Route> {
        self.routes
            .binary_search_by(|r| r.domain.cmp(d))
            .ok()
            .map(|i| &self.routes[i])
    }

    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Result<String, RouteError> {
        Domain::parse(s).map(|d| d.to_string())
    }

    #[test]
    fn domains_are_canonical() {
        assert_eq!(d("Example.COM:443"), Ok("example.com:443".into()));
        assert_eq!(d("[2001:DB8::1]:6443"), Ok("[2001:db8::1]:6443".into()));
        assert_eq!(d("10.0.0.1:443"), Ok("10.0.0.1:443".into()));
        assert_eq!(
            Domain::with_default_port("kubernetes.default.svc", 443).map(|d| d.to_string()),
            Ok("kubernetes.default.svc:443".into())
        );
        assert_eq!(
            Domain::with_default_port("[::1]", 443).map(|d| d.to_string()),
            Ok("[::1]:443".into())
        );
        let v6 = Domain::parse("[::1]:8443").expect("v6");
        assert_eq!((v6.host(), v6.port()), ("::1", 8443));
        assert!(v6.ip().is_some());
        assert!(Domain::parse("a.example:1").expect("dns").ip().is_none());
    }

    #[test]
    fn bad_domains_are_refused_with_what_to_fix() {
        for bad in [
            "*.example.com:443",
            ".example.com:443",
            "example.com.:443",
            "exa mple.com:443",
            "https://example.com:443",
            "example.com:443/path",
            "-a.example:443",
            ":443",
            "[::1:443",
            "[nothex]:443",
        ] {
            assert!(
                matches!(Domain::parse(bad), Err(RouteError::BadHost(_))),
                "{bad}: {:?}",
                Domain::parse(bad)
            );
        }
        assert_eq!(
            Domain::parse("example.com"),
            Err(RouteError::MissingPort("example.com".into()))
        );
        for bad in ["example.com:0", "example.com:65536", "example.com:+1", "a:"] {
            assert!(
                matches!(Domain::parse(bad), Err(RouteError::BadPort(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            Domain::parse("2001:db8::1"),
            Err(RouteError::UnbracketedIpv6(_))
        ));
        let msg = Domain::parse("*.x:1")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(msg.contains("without '*'"), "{msg}");
    }

    #[test]
    fn tables_are_sorted_deduplicated_and_round_trip() {
        let r = |s: &str, i| Route {
            domain: Domain::parse(s).expect("domain"),
            injector: i,
            ca_cert: None,
            identity: RouteIdentity::Shared,
        };
        let t = RouteTable::new(vec![
            r("b.example:443", Injector::None),
            r("a.example:443", Injector::Kubernetes),
        ])
        .expect("table");
        assert_eq!(t.routes()[0].domain.as_str(), "a.example:443");
        let back = RouteTable::from_json(&t.to_json()).expect("round trip");
        assert_eq!(back, t);
        assert_eq!(
            t.get(&Domain::parse("B.EXAMPLE:443").expect("d"))
                .map(|r| r.injector),
            Some(Injector::None)
        );
        assert!(t.get(&Domain::parse("c.example:443").expect("d")).is_none());
        assert_eq!(
            RouteTable::new(vec![
                r("a.example:443", Injector::None),
                r("A.example:443", Injector::None)
            ]),
            Err(RouteError::Duplicate("a.example:443".into()))
        );
        assert!(matches!(
            RouteTable::from_json(r#"{"routes":[{"domain":"a:1","injector":"none","extra":1}]}"#),
            Err(RouteError::Json(_))
        ));
        assert!(matches!(
            RouteTable::from_json(r#"{"routes":[{"domain":"*.a:1","injector":"none"}]}"#),
            Err(RouteError::Json(_))
        ));
        assert!(matches!(
            RouteTable::from_json(r#"{"routes":[]} trailing"#),
            Err(RouteError::Json(_))
        ));
        let many = (0..=MAX_ROUTES)
            .map(|i| r(&format!("h{i}.example:443"), Injector::None))
            .collect();
        assert!(matches!(RouteTable::new(many), Err(RouteError::TooMany(_))));
    }
}
