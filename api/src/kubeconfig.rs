//! The admin's kubeconfig for the sandboxes' Kubernetes access: validated before anything
//! uses it, turned into proxy routes, and rewritten into the dummy a sandbox gets.
//!
//! Only what the credential proxy can hold for the sandbox is accepted: bearer tokens and
//! https servers whose CA is embedded. Anything the proxy would have to run (exec plugins,
//! auth providers), read from elsewhere (files) or could not inject (client certificates)
//! is refused with a message that says what to change, and so is any ambiguity about which
//! token a server gets — the answer never depends on the order of the lists.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde_yaml::{Mapping, Value};

use crate::proxy::{Domain, Injector, Route, RouteIdentity, PLACEHOLDER_TOKEN};

/// Largest kubeconfig accepted (a Secret holds at most 1 MiB anyway).
pub const MAX_KUBECONFIG_BYTES: usize = 1 << 20;

/// Why a kubeconfig cannot be used. Each message names the entry and what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KubeconfigError {
    #[error("the kubeconfig is larger than {MAX_KUBECONFIG_BYTES} bytes")]
    TooLarge,
    #[error("the kubeconfig is not valid YAML: {0}")]
    Yaml(String),
    #[error(
        "the kubeconfig has no clusters; add one with a server and certificate-authority-data"
    )]
    NoClusters,
    #[error("the kubeconfig lists {kind} {name:?} more than once; give each a unique name")]
    DuplicateName { kind: &'static str, name: String },
    #[error("{kind} entry {index} of the kubeconfig has no name")]
    Unnamed { kind: &'static str, index: usize },
    #[error(
        "cluster {0:?} has no server; set clusters[].cluster.server to the API server's https URL"
    )]
    NoServer(String),
    #[error("cluster {cluster:?}: server {server:?} must be an https:// URL (the proxy only forwards verified TLS)")]
    NotHttps { cluster: String, server: String },
    #[error("cluster {cluster:?}: server {server:?} is not a usable URL: {reason}")]
    BadServer {
        cluster: String,
        server: String,
        reason: String,
    },
    #[error("cluster {0:?} sets insecure-skip-tls-verify; remove it and embed the API server's CA as certificate-authority-data")]
    Insecure(String),
    #[error("cluster {0:?} names a certificate-authority file, which the proxy cannot read; embed the CA as certificate-authority-data instead")]
    CaFile(String),
    #[error("cluster {0:?}: certificate-authority-data is not base64 of a PEM certificate")]
    BadCaData(String),
    #[error(
        "cluster {cluster:?} sets {field}, which the credential proxy does not support; remove it"
    )]
    UnsupportedClusterField { cluster: String, field: String },
    #[error("user {user:?} uses {field}; only a bearer token (users[].user.token) can be held by the credential proxy — use a ServiceAccount token instead")]
    NotTokenOnly { user: String, field: String },
    #[error(
        "user {0:?} has no token; set users[].user.token (for example from `kubectl create token`)"
    )]
    NoToken(String),
    #[error("context {context:?} refers to {kind} {name:?}, which the kubeconfig does not define")]
    Dangling {
        context: String,
        kind: &'static str,
        name: String,
    },
    #[error("cluster {0:?} is not used by any context, so no token is known for it; add a context or remove the cluster")]
    Unused(String),
    #[error("server {0} is reached with different tokens by different contexts; use exactly one user per server")]
    TokenConflict(String),
    #[error("server {0} is listed by several clusters with different certificate-authority-data; give them the same CA")]
    CaConflict(String),
}

#[derive(Clone, PartialEq, Eq)]
struct Server {
    ca_pem: Option<String>,
    token: String,
}

/// A kubeconfig that passed [`validate`]. `Debug` never shows a token.
#[derive(Clone, PartialEq)]
pub struct Kubeconfig {
    doc: Value,
    servers: BTreeMap<Domain, Server>,
}

impl std::fmt::Debug for Kubeconfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kubeconfig")
            .field("servers", &self.servers.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

fn named<'a>(
    doc: &'a Value,
    list: &'static str,
    kind: &'static str,
    body: &str,
) -> Result<BTreeMap<String, &'a Mapping>, KubeconfigError> {
    let mut out = BTreeMap::new();
    let Some(items) = doc.get(list).and_then(Value::as_sequence) else {
        return Ok(out);
    };
    static EMPTY: std::sync::OnceLock<Mapping> = std::sync::OnceLock::new();
    for (index, item) in items.iter().enumerate() {
        let name = item
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or(KubeconfigError::Unnamed { kind, index })?;
        let inner = item
            .get(body)
            .and_then(Value::as_mapping)
            .unwrap_or_else(|| EMPTY.get_or_init(Mapping::new));
        if out.insert(name.to_owned(), inner).is_some() {
            return Err(KubeconfigError::DuplicateName {
                kind,
                name: name.to_owned(),
            });
        }
    }
    Ok(out)
}

fn field<'a>(m: &'a Mapping, key: &str) -> Option<&'a Value> {
    m.get(Value::String(key.to_owned()))
        .filter(|v| !v.is_null())
}

fn truthy(v: Option<&Value>) -> bool {
    match v {
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => s.eq_ignore_ascii_case("true"),
        _ => false,
    }
}

/// `https://host[:port][/path]` → the route domain (default port 443).
fn server_domain(cluster: &str, server: &str) -> Result<Domain, KubeconfigError> {
    let bad = |reason: &str| KubeconfigError::BadServer {
        cluster: cluster.to_owned(),
        server: server.to_owned(),
        reason: reason.to_owned(),
    };
    let rest = match server.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("https") => rest,
        _ => {
            return Err(KubeconfigError::NotHttps {
                cluster: cluster.to_owned(),
                server: server.to_owned(),
            })
        }
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err(bad("credentials in the URL are not allowed"));
    }
    Domain::with_default_port(authority, 443).map_err(|e| bad(&e.to_string()))
}

fn ca_pem(cluster: &str, m: &Mapping) -> Result<Option<String>, KubeconfigError> {
    let Some(data) = field(m, "certificate-authority-data") else {
        return Ok(None);
    };
    let bad = || KubeconfigError::BadCaData(cluster.to_owned());
    let text: String = data
        .as_str()
        .ok_or_else(bad)?
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|_| bad())?;
    let pem = String::from_utf8(bytes).map_err(|_| bad())?;
    if !pem.contains("-----BEGIN CERTIFICATE-----") {
        return Err(bad());
    }
    Ok(Some(pem))
}

const USER_FIELDS_REFUSED: &[&str] = &[
    "tokenFile",
    "client-certificate",
    "client-certificate-data",
    "client-key",
    "client-key-data",
    "username",
    "password",
    "exec",
    "auth-provider",
    "as",
    "as-uid",
    "as-groups",
    "as-user-extra",
];

const CLUSTER_FIELDS_REFUSED: &[&str] = &["proxy-url", "tls-server-name"];

/// Validates an admin kubeconfig for use behind the credential proxy.
pub fn validate(yaml: &str) -> Result<Kubeconfig, KubeconfigError> {
    if yaml.len() > MAX_KUBECONFIG_BYTES {
        return Err(KubeconfigError::TooLarge);
    }
    let doc: Value =
        serde_yaml::from_str(yaml).map_err(|e| KubeconfigError::Yaml(e.to_string()))?;
    let clusters = named(&doc, "clusters", "cluster", "cluster")?;
    let users = named(&doc, "users", "user", "user")?;
    let contexts = named(&doc, "contexts", "context", "context")?;
    if clusters.is_empty() {
        return Err(KubeconfigError::NoClusters);
    }
    let clusters = Clusters::read(&clusters)?;
    let tokens = user_tokens(&users)?;
    let servers = clusters.servers(&contexts, &tokens)?;
    Ok(Kubeconfig { doc, servers })
}

/// What the clusters of a kubeconfig say: the server each cluster names, and the CA each
/// server is verified against (`None`: the system roots).
struct Clusters {
    domain: BTreeMap<String, Domain>,
    cas: BTreeMap<Domain, Option<String>>,
}

impl Clusters {
    /// Reads every cluster; several clusters may name one server, with the same CA.
    fn read(clusters: &BTreeMap<String, &Mapping>) -> Result<Self, KubeconfigError> {
        let mut domain = BTreeMap::new();
        let mut cas: BTreeMap<Domain, Option<String>> = BTreeMap::new();
        for (name, m) in clusters {
            let server = cluster_server(name, m)?;
            let ca = ca_pem(name, m)?;
            match cas.get(&server) {
                Some(existing) if *existing != ca => {
                    return Err(KubeconfigError::CaConflict(server.to_string()))
                }
                _ => {
                    cas.insert(server.clone(), ca);
                }
            }
            domain.insert(name.clone(), server);
        }
        Ok(Clusters { domain, cas })
    }

    /// The token and CA of each server, from the contexts that pair a cluster with a user.
    /// Every cluster must be used by a context, and a server reached by several contexts
    /// must get the same token from each.
    fn servers(
        &self,
        contexts: &BTreeMap<String, &Mapping>,
        tokens: &BTreeMap<String, String>,
    ) -> Result<BTreeMap<Domain, Server>, KubeconfigError> {
        let mut servers: BTreeMap<Domain, Server> = BTreeMap::new();
        let mut used = std::collections::BTreeSet::new();
        for (ctx, m) in contexts {
            let get = |kind: &'static str| -> Result<String, KubeconfigError> {
                let name = field(m, kind).and_then(Value::as_str).unwrap_or_default();
                Ok(name.to_owned())
            };
            let cluster = get("cluster")?;
            let user = get("user")?;
            let domain = self
                .domain
                .get(&cluster)
                .ok_or_else(|| KubeconfigError::Dangling {
                    context: ctx.clone(),
                    kind: "cluster",
                    name: cluster.clone(),
                })?;
            let token = tokens.get(&user).ok_or_else(|| KubeconfigError::Dangling {
                context: ctx.clone(),
                kind: "user",
                name: user.clone(),
            })?;
            used.insert(cluster);
            let entry = Server {
                ca_pem: self.cas.get(domain).cloned().flatten(),
                token: token.clone(),
            };
            match servers.get(domain) {
                Some(s) if s.token != entry.token => {
                    return Err(KubeconfigError::TokenConflict(domain.to_string()))
                }
                _ => {
                    servers.insert(domain.clone(), entry);
                }
            }
        }
        if let Some(unused) = self.domain.keys().find(|c| !used.contains(*c)) {
            return Err(KubeconfigError::Unused(unused.clone()));
        }
        Ok(servers)
    }
}

/// The https server of cluster `name`, which must be verified (no `insecure-skip-tls-verify`)
/// against an embedded CA or the system roots, and need nothing the proxy does not do.
fn cluster_server(name: &str, m: &Mapping) -> Result<Domain, KubeconfigError> {
    let server = field(m, "server")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| KubeconfigError::NoServer(name.to_owned()))?;
    let domain = server_domain(name, server)?;
    if truthy(field(m, "insecure-skip-tls-verify")) {
        return Err(KubeconfigError::Insecure(name.to_owned()));
    }
    if field(m, "certificate-authority").is_some() {
        return Err(KubeconfigError::CaFile(name.to_owned()));
    }
    if let Some(f) = CLUSTER_FIELDS_REFUSED
        .iter()
        .find(|f| field(m, f).is_some())
    {
        return Err(KubeconfigError::UnsupportedClusterField {
            cluster: name.to_owned(),
            field: (*f).to_owned(),
        });
    }
    Ok(domain)
}

/// Each user's bearer token; a user must have one and nothing else that authenticates.
fn user_tokens(
    users: &BTreeMap<String, &Mapping>,
) -> Result<BTreeMap<String, String>, KubeconfigError> {
    let mut tokens = BTreeMap::new();
    for (name, m) in users {
        if let Some(f) = USER_FIELDS_REFUSED.iter().find(|f| field(m, f).is_some()) {
            return Err(KubeconfigError::NotTokenOnly {
                user: name.clone(),
                field: (*f).to_owned(),
            });
        }
        let token = field(m, "token")
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| KubeconfigError::NoToken(name.clone()))?;
        tokens.insert(name.clone(), token.to_owned());
    }
    Ok(tokens)
}

impl Kubeconfig {
    /// One `kubernetes` route per distinct server, sorted, with the server's CA pinned when
    /// the kubeconfig embeds one.
    pub fn routes(&self) -> Vec<Route> {
        self.servers
            .iter()
            .map(|(d, s)| Route {
                domain: d.clone(),
                injector: Injector::Kubernetes,
                ca_cert: s.ca_pem.clone(),
                identity: RouteIdentity::Shared,
            })
            .collect()
    }

    /// The token the proxy injects for `d`.
    pub fn token_for(&self, d: &Domain) -> Option<&str> {
        self.servers.get(d).map(|s| s.token.as_str())
    }

    /// The sandbox's kubeconfig: the same clusters, contexts and current context, every
    /// token replaced by [`PLACEHOLDER_TOKEN`] and every cluster CA by the proxy's CA (the
    /// proxy terminates TLS). Deterministic for equal inputs, and independent of the
    /// tokens, so rotating a token does not change it.
    pub fn dummy(&self, proxy_ca_pem: &str) -> String {
        let mut doc = self.doc.clone();
        let ca = base64::engine::general_purpose::STANDARD.encode(proxy_ca_pem.as_bytes());
        if let Some(items) = doc.get_mut("users").and_then(Value::as_sequence_mut) {
            for item in items {
                if let Some(m) = item.as_mapping_mut() {
                    let mut user = Mapping::new();
                    user.insert("token".into(), PLACEHOLDER_TOKEN.into());
                    m.insert("user".into(), Value::Mapping(user));
                }
            }
        }
        if let Some(items) = doc.get_mut("clusters").and_then(Value::as_sequence_mut) {
            for item in items {
                if let Some(c) = item.get_mut("cluster").and_then(Value::as_mapping_mut) {
                    for k in ["certificate-authority", "insecure-skip-tls-verify"]
                        .iter()
                        .chain(CLUSTER_FIELDS_REFUSED)
                    {
                        c.remove(*k);
                    }
                    c.insert("certificate-authority-data".into(), ca.clone().into());
                }
            }
        }
        serde_yaml::to_string(&doc).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CA: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    fn kc(cluster: &str, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n{cluster}\nusers:\n- name: u\n  user:\n{user}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u, namespace: ns}}\ncurrent-context: x\n"
        )
    }

    fn good() -> String {
        kc(
            &format!(
                "    server: https://Kubernetes.Default.svc\n    certificate-authority-data: {}",
                b64(CA)
            ),
            "    token: secret-token",
        )
    }

    #[test]
    fn a_token_kubeconfig_gives_one_pinned_route_and_its_token() {
        let k = validate(&good()).expect("valid");
        let routes = k.routes();
        assert_eq!(routes.len(), 1);
        assert_eq!(routes[0].domain.as_str(), "kubernetes.default.svc:443");
        assert_eq!(routes[0].injector, Injector::Kubernetes);
        assert_eq!(routes[0].ca_cert.as_deref(), Some(CA));
        assert_eq!(k.token_for(&routes[0].domain), Some("secret-token"));
        assert!(!format!("{k:?}").contains("secret-token"));
    }

    #[test]
    fn the_dummy_holds_no_secret_and_trusts_the_proxy_ca() {
        let k = validate(&good()).expect("valid");
        let proxy_ca = "-----BEGIN CERTIFICATE-----\nPROXY\n-----END CERTIFICATE-----\n";
        let dummy = k.dummy(proxy_ca);
        assert!(!dummy.contains("secret-token"), "{dummy}");
        assert!(dummy.contains(PLACEHOLDER_TOKEN));
        assert!(dummy.contains(&b64(proxy_ca)));
        assert!(!dummy.contains(&b64(CA)));
        // Still a kubeconfig kubectl reads: same context, namespace and server.
        let v: Value = serde_yaml::from_str(&dummy).expect("yaml");
        assert_eq!(v["current-context"].as_str(), Some("x"));
        assert_eq!(
            v["contexts"][0]["context"]["namespace"].as_str(),
            Some("ns")
        );
        assert_eq!(
            v["clusters"][0]["cluster"]["server"].as_str(),
            Some("https://Kubernetes.Default.svc")
        );
        // Rotating the token does not change the dummy.
        let rotated = validate(&good().replace("secret-token", "new-token")).expect("valid");
        assert_eq!(rotated.dummy(proxy_ca), dummy);
    }

    fn err(yaml: &str) -> String {
        match validate(yaml) {
            Ok(_) => panic!("accepted: {yaml}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn what_the_proxy_cannot_hold_is_refused_with_what_to_fix() {
        let server = "    server: https://api.example:6443";
        for (user, what) in [
            (
                "    client-certificate-data: AAAA\n    client-key-data: AAAA",
                "client-certificate-data",
            ),
            ("    exec: {command: aws}", "exec"),
            ("    auth-provider: {name: oidc}", "auth-provider"),
            ("    username: a\n    password: b", "username"),
            ("    tokenFile: /var/run/token", "tokenFile"),
            ("    token: t\n    as: admin", "as"),
        ] {
            let m = err(&kc(server, user));
            assert!(m.contains(what) && m.contains("bearer token"), "{m}");
        }
        assert!(err(&kc(server, "    token: ''")).contains("has no token"));
        assert!(err(&kc("    server: http://api.example", "    token: t")).contains("https://"));
        assert!(err(&kc("    server: api.example:6443", "    token: t")).contains("https://"));
        assert!(
            err(&kc("    server: https://u:p@api.example", "    token: t")).contains("credentials")
        );
        assert!(
            err(&kc("    server: https://*.example", "    token: t")).contains("not a usable URL")
        );
        assert!(err(&kc(
            &format!("{server}\n    insecure-skip-tls-verify: true"),
            "    token: t"
        ))
        .contains("insecure-skip-tls-verify"));
        assert!(err(&kc(
            &format!("{server}\n    certificate-authority: /ca.crt"),
            "    token: t"
        ))
        .contains("certificate-authority-data instead"));
        assert!(err(&kc(
            &format!("{server}\n    certificate-authority-data: '!!'"),
            "    token: t"
        ))
        .contains("not base64"));
        assert!(err(&kc(
            &format!("{server}\n    proxy-url: http://p:1"),
            "    token: t"
        ))
        .contains("proxy-url"));
        assert!(
            err(&kc("    insecure-skip-tls-verify: false", "    token: t"))
                .contains("has no server")
        );
        assert!(err("clusters: []").contains("no clusters"));
        assert!(err(": : :").contains("not valid YAML"));
        assert_eq!(
            validate(&"a".repeat(MAX_KUBECONFIG_BYTES + 1)).err(),
            Some(KubeconfigError::TooLarge)
        );
    }

    #[test]
    fn ambiguity_is_refused_whatever_the_order() {
        let two_users = |first: &str, second: &str| {
            format!(
                "clusters:\n- name: c\n  cluster: {{server: 'https://a.example'}}\n- name: c2\n  cluster: {{server: 'https://A.example:443'}}\nusers:\n- name: {first}\n  user: {{token: t1}}\n- name: {second}\n  user: {{token: t2}}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u1}}\n- name: y\n  context: {{cluster: c2, user: u2}}\n"
            )
        };
        assert!(err(&two_users("u1", "u2")).contains("exactly one user per server"));
        assert!(err(&two_users("u2", "u1")).contains("exactly one user per server"));
        // Same server, same token: fine, one route.
        let same = two_users("u1", "u2").replace("token: t2", "token: t1");
        assert_eq!(validate(&same).expect("valid").routes().len(), 1);
        // Same server, different CAs.
        let cas = format!(
            "clusters:\n- name: c\n  cluster: {{server: 'https://a.example', certificate-authority-data: {}}}\n- name: c2\n  cluster: {{server: 'https://a.example'}}\nusers:\n- name: u\n  user: {{token: t}}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\n- name: y\n  context: {{cluster: c2, user: u}}\n",
            b64(CA)
        );
        assert!(err(&cas).contains("different certificate-authority-data"));
        let dangling = good().replace("cluster: c, user: u", "cluster: c, user: nobody");
        assert!(err(&dangling).contains("\"nobody\""));
        let unused = good().replace("contexts:", "contexts: []\nold:");
        assert!(err(&unused).contains("not used by any context"));
        let dup = good().replace(
            "users:\n- name: u",
            "users:\n- name: u\n  user: {token: a}\n- name: u",
        );
        assert!(err(&dup).contains("more than once"));
    }
}
