//! `Origin` validation of the MCP listener, as MCP's Streamable HTTP transport requires: a
//! web page must not drive a shell through a user's browser (DNS rebinding, cross-site
//! requests). A request without `Origin` (every non-browser client) passes. One with an
//! `Origin` passes only when it is listed with `--allowed-origin`, or is a loopback origin
//! while the server itself listens on loopback. Everything else gets 403.

use std::net::IpAddr;

/// One `--allowed-origin` entry: `scheme://host[:port]`, where port `*` means any port and
/// no port means the scheme's default (80 for http, 443 for https).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedOrigin {
    scheme: String,
    host: String,
    /// `None`: any port.
    port: Option<u16>,
}

/// A parsed `Origin` header value.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Origin {
    scheme: String,
    host: String,
    port: u16,
}

fn default_port(scheme: &str) -> Option<u16> {
    match scheme {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    }
}

/// Splits `scheme://host[:port]` (an origin has no path, query, fragment or user info).
/// The port is returned as text so that `*` can be told apart.
fn split(value: &str) -> Result<(String, String, Option<&str>), String> {
    let (scheme, rest) = value
        .split_once("://")
        .ok_or_else(|| format!("{value:?} is not an origin: expected scheme://host[:port]"))?;
    let scheme = scheme.to_ascii_lowercase();
    if default_port(&scheme).is_none() {
        return Err(format!(
            "{value:?}: the scheme must be http or https, not {scheme:?}"
        ));
    }
    if rest.is_empty() || rest.contains(['/', '?', '#', '@']) {
        return Err(format!(
            "{value:?} is not an origin: expected scheme://host[:port], with no path, query or user"
        ));
    }
    let (host, port) = if let Some(bracketed) = rest.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or_else(|| format!("{value:?}: unclosed '[' in the IPv6 host"))?;
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| format!("{value:?}: expected ':port' after the IPv6 host"))?,
            ),
        };
        (host.to_owned(), port)
    } else {
        match rest.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (rest.to_owned(), None),
        }
    };
    if host.is_empty() {
        return Err(format!("{value:?}: the host is empty"));
    }
    Ok((scheme, host.to_ascii_lowercase(), port))
}

fn parse_port(value: &str, port: &str) -> Result<u16, String> {
    port.parse::<u16>()
        .map_err(|_| format!("{value:?}: {port:?} is not a port number"))
}

impl AllowedOrigin {
    /// Parses a `--allowed-origin` value, with an error that says what is wrong.
    pub fn parse(value: &str) -> Result<Self, String> {
        let value = value.trim();
        let (scheme, host, port) = split(value)?;
        let port = match port {
            Some("*") => None,
            Some(p) => Some(parse_port(value, p)?),
            None => default_port(&scheme),
        };
        Ok(Self { scheme, host, port })
    }

    fn matches(&self, origin: &Origin) -> bool {
        self.scheme == origin.scheme
            && self.host == origin.host
            && self.port.is_none_or(|p| p == origin.port)
    }
}

impl std::fmt::Display for AllowedOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        match self.port {
            None => write!(f, "{}://{host}:*", self.scheme),
            Some(p) => write!(f, "{}://{host}:{p}", self.scheme),
        }
    }
}

fn parse_origin(value: &str) -> Option<Origin> {
    let (scheme, host, port) = split(value).ok()?;
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default_port(&scheme)?,
    };
    Some(Origin { scheme, host, port })
}

fn is_loopback_host(host: &str) -> bool {
    host == "localhost"
        || host.ends_with(".localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Which `Origin` values the MCP listener accepts.
#[derive(Debug, Clone, Default)]
pub struct OriginPolicy {
    pub allowed: Vec<AllowedOrigin>,
    /// Accept any loopback origin (`http://localhost:3000`, `http://127.0.0.1:8080`, …):
    /// set when the listener is bound to loopback, so only local pages can reach it anyway.
    pub loopback: bool,
}

impl OriginPolicy {
    /// `Ok` when a request with this `Origin` header value may proceed, else why not.
    pub fn check(&self, header: &http::HeaderValue) -> Result<(), String> {
        let text = header
            .to_str()
            .map_err(|_| "the Origin header is not plain ASCII text".to_owned())?;
        let origin = parse_origin(text.trim());
        let allowed = origin.as_ref().is_some_and(|o| {
            (self.loopback && is_loopback_host(&o.host))
                || self.allowed.iter().any(|a| a.matches(o))
        });
        if allowed {
            return Ok(());
        }
        let what = if origin.is_none() {
            " (not an http(s) origin)"
        } else {
            ""
        };
        // Both ways to allow one: an operator-managed server takes it from the instance.
        let hint = if self.loopback {
            "loopback origins and those given with --allowed-origin \
             (spec.server.allowedOrigins of a CliMcpInstance)"
        } else {
            "the origins given with --allowed-origin (spec.server.allowedOrigins of a \
             CliMcpInstance)"
        };
        Err(format!(
            "Origin {text:?}{what} is not allowed: this server accepts requests from browsers only \
             for {hint} (non-browser clients send no Origin header)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(v: &str) -> http::HeaderValue {
        http::HeaderValue::from_str(v).expect("header value")
    }

    #[test]
    fn allowed_origins_parse_or_say_what_is_wrong() {
        let a = AllowedOrigin::parse("https://App.Example.com").expect("valid");
        assert_eq!(a.to_string(), "https://app.example.com:443");
        assert_eq!(
            AllowedOrigin::parse("http://localhost:*")
                .expect("valid")
                .to_string(),
            "http://localhost:*"
        );
        assert_eq!(
            AllowedOrigin::parse("http://[::1]:3000")
                .expect("valid")
                .to_string(),
            "http://[::1]:3000"
        );
        for (bad, needle) in [
            ("app.example.com", "scheme://host"),
            ("ftp://app.example.com", "http or https"),
            ("https://app.example.com/path", "no path"),
            ("https://app.example.com:99999", "not a port"),
            ("https://", "no path"),
            ("https://[::1", "unclosed"),
        ] {
            let e = AllowedOrigin::parse(bad).expect_err(bad);
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn loopback_origins_pass_only_on_a_loopback_listener() {
        let local = OriginPolicy {
            allowed: vec![],
            loopback: true,
        };
        for ok in [
            "http://localhost:3000",
            "http://127.0.0.1:8080",
            "https://[::1]",
            "http://app.localhost",
        ] {
            assert!(local.check(&header(ok)).is_ok(), "{ok}");
        }
        for bad in [
            "http://evil.example",
            "null",
            "http://127.0.0.1.evil.example",
        ] {
            let e = local.check(&header(bad)).expect_err(bad);
            assert!(e.contains("is not allowed"), "{bad}: {e}");
        }
        let cluster = OriginPolicy::default();
        let e = cluster
            .check(&header("http://localhost:3000"))
            .expect_err("not allowed in a cluster");
        // Says how to allow it, both ways.
        assert!(
            e.contains("--allowed-origin") && e.contains("spec.server.allowedOrigins"),
            "{e}"
        );
    }

    #[test]
    fn listed_origins_pass_with_their_port() {
        let p = OriginPolicy {
            allowed: vec![
                AllowedOrigin::parse("https://app.example.com").expect("valid"),
                AllowedOrigin::parse("http://dev.example.com:*").expect("valid"),
            ],
            loopback: false,
        };
        assert!(p.check(&header("https://app.example.com")).is_ok());
        assert!(p.check(&header("https://app.example.com:443")).is_ok());
        assert!(p.check(&header("https://app.example.com:8443")).is_err());
        assert!(p.check(&header("http://app.example.com")).is_err());
        assert!(p.check(&header("http://dev.example.com:5173")).is_ok());
        assert!(p.check(&header("https://dev.example.com")).is_err());
    }
}
