//! Command-line flags (each also an environment variable) with the defaults of the pod the
//! operator renders: inputs mounted where the shared contract says, ports from it.

use std::net::{Ipv4Addr, SocketAddr};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use cli_mcp_api::names::InstanceName;
use cli_mcp_api::proxy::{
    CA_CERT_KEY, CA_DIR, CA_KEY_KEY, PROXY_HEALTH_PORT, PROXY_PORT, ROUTES_DIR, ROUTES_KEY,
};

use crate::upstream::Timeouts;
use crate::{Config, Limits, SandboxCheck};

/// Where the operator mounts the instance HMAC Secret's key (as for the server).
pub const DEFAULT_HMAC_KEY_FILE: &str = "/var/run/cli-mcp/hmac/key";

/// hyper refuses a read buffer below this (it must hold one request head).
const MIN_HEADER_BYTES: usize = 8192;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "cli-mcp-proxy",
    version,
    about = "Credential-injecting egress proxy of cli-mcp: CONNECT to routed hosts only, TLS \
             terminated with the instance CA, the real credential injected upstream"
)]
pub struct Flags {
    /// The CliMcpInstance this proxy serves: only its sandboxes are admitted.
    #[arg(long, env = "CLI_MCP_PROXY_INSTANCE", value_parser = parse_instance)]
    pub instance: InstanceName,
    /// The instance's namespace.
    #[arg(long, env = "CLI_MCP_PROXY_NAMESPACE")]
    pub namespace: String,
    /// The instance HMAC key (64 hex characters): a sandbox pod is trusted only when sealed
    /// with it.
    #[arg(long, env = "CLI_MCP_PROXY_HMAC_KEY_FILE", default_value = DEFAULT_HMAC_KEY_FILE)]
    pub hmac_key_file: PathBuf,
    /// Where the audit lines go: `-` for standard output, else a file appended to.
    #[arg(long, env = "CLI_MCP_PROXY_AUDIT_LOG", default_value = "-")]
    pub audit_log: String,
    /// Connections one client (one sandbox pod) may hold at once; one more gets 429.
    #[arg(long, env = "CLI_MCP_PROXY_MAX_CONNECTIONS_PER_CLIENT", default_value_t = NonZeroUsize::new(Limits::default().max_connections_per_client).unwrap_or(NonZeroUsize::MIN))]
    pub max_connections_per_client: NonZeroUsize,
    /// Route table (JSON).
    #[arg(long, env = "CLI_MCP_PROXY_ROUTES", default_value_t = default_routes())]
    pub routes: String,
    /// Proxy CA certificate (PEM).
    #[arg(long, env = "CLI_MCP_PROXY_CA_CERT", default_value_t = format!("{CA_DIR}/{CA_CERT_KEY}"))]
    pub ca_cert: String,
    /// Proxy CA key (PEM, ECDSA P-256, PKCS#8 or SEC1).
    #[arg(long, env = "CLI_MCP_PROXY_CA_KEY", default_value_t = format!("{CA_DIR}/{CA_KEY_KEY}"))]
    pub ca_key: String,
    /// Admin kubeconfig holding the tokens of kubernetes routes; required when the table has
    /// one. In the operator's pod: /etc/cli-mcp/admin-kubeconfig/kubeconfig.
    #[arg(long, env = "CLI_MCP_PROXY_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Forward proxy (CONNECT) address.
    #[arg(long, env = "CLI_MCP_PROXY_LISTEN", default_value_t = SocketAddr::from((Ipv4Addr::UNSPECIFIED, PROXY_PORT)))]
    pub listen: SocketAddr,
    /// /healthz, /readyz and /metrics address.
    #[arg(long, env = "CLI_MCP_PROXY_HEALTH_LISTEN", default_value_t = SocketAddr::from((Ipv4Addr::UNSPECIFIED, PROXY_HEALTH_PORT)))]
    pub health_listen: SocketAddr,
    /// JSON log lines (one object per line) instead of plain text.
    #[arg(long, env = "CLI_MCP_PROXY_LOG_JSON")]
    pub log_json: bool,
    /// Client connections at once; one more gets 503.
    #[arg(long, env = "CLI_MCP_PROXY_MAX_CONNECTIONS", default_value_t = NonZeroUsize::new(Limits::default().max_connections).unwrap_or(NonZeroUsize::MIN))]
    pub max_connections: NonZeroUsize,
    /// Largest request head in bytes (at least 8192); beyond it: 431.
    #[arg(long, env = "CLI_MCP_PROXY_MAX_HEADER_BYTES", default_value_t = Limits::default().max_header_bytes)]
    pub max_header_bytes: usize,
    /// Most header fields in one request.
    #[arg(long, env = "CLI_MCP_PROXY_MAX_HEADERS", default_value_t = Limits::default().max_headers)]
    pub max_headers: usize,
    /// Time a client has to send its CONNECT request head (e.g. 10s, 500ms).
    #[arg(long, env = "CLI_MCP_PROXY_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub header_read_timeout: Duration,
    /// Time for each step of the TLS handshake inside a tunnel.
    #[arg(long, env = "CLI_MCP_PROXY_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub handshake_timeout: Duration,
    /// Time a tunnel may wait for its next request head (idle or slow client).
    #[arg(long, env = "CLI_MCP_PROXY_IDLE_TIMEOUT", default_value = "90s", value_parser = parse_duration)]
    pub idle_timeout: Duration,
    /// Upstream TCP connect limit.
    #[arg(long, env = "CLI_MCP_PROXY_UPSTREAM_CONNECT_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub upstream_connect_timeout: Duration,
    /// Upstream TLS handshake limit.
    #[arg(long, env = "CLI_MCP_PROXY_UPSTREAM_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub upstream_handshake_timeout: Duration,
    /// Time the upstream has to send response headers (bodies, e.g. watches, are not limited).
    #[arg(long, env = "CLI_MCP_PROXY_RESPONSE_HEADER_TIMEOUT", default_value = "120s", value_parser = parse_duration)]
    pub response_header_timeout: Duration,
    /// After SIGTERM: how long to keep accepting while /readyz fails, so that no connection
    /// the Service still sends here is refused (0s: stop accepting at once).
    #[arg(long, env = "CLI_MCP_PROXY_SHUTDOWN_DELAY", default_value = "5s", value_parser = parse_delay)]
    pub shutdown_delay: Duration,
    /// After the shutdown delay: how long in-flight requests may finish.
    #[arg(long, env = "CLI_MCP_PROXY_GRACE", default_value = "20s", value_parser = parse_duration)]
    pub grace: Duration,
    /// Leaf certificates kept in memory.
    #[arg(long, env = "CLI_MCP_PROXY_LEAF_CACHE", default_value_t = NonZeroUsize::new(256).unwrap_or(NonZeroUsize::MIN))]
    pub leaf_cache: NonZeroUsize,
}

fn parse_instance(s: &str) -> Result<InstanceName, String> {
    InstanceName::parse(s).map_err(|e| e.to_string())
}

fn default_routes() -> String {
    format!("{ROUTES_DIR}/{ROUTES_KEY}")
}

/// `<n>ms`, `<n>s` or `<n>m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a duration: use e.g. 500ms, 10s or 2m");
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))
        .ok_or_else(bad)?;
    let n: u64 = num.parse().map_err(|_| bad())?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        _ => return Err(bad()),
    };
    if d.is_zero() {
        return Err(format!("{s:?}: a timeout must be more than zero"));
    }
    Ok(d)
}

/// Like [`parse_duration`], and `0s` is allowed.
fn parse_delay(s: &str) -> Result<Duration, String> {
    let number = s
        .strip_suffix("ms")
        .or_else(|| s.strip_suffix('s'))
        .or_else(|| s.strip_suffix('m'));
    if number.is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b == b'0')) {
        return Ok(Duration::ZERO);
    }
    parse_duration(s)
}

/// The pod's termination grace period (the Kubernetes default, which the operator keeps):
/// the shutdown delay and the grace must fit in it, with a margin for the exit itself.
const TERMINATION_GRACE: Duration = Duration::from_secs(30);
const EXIT_MARGIN: Duration = Duration::from_secs(5);

impl Flags {
    pub fn config(&self) -> Result<Config, String> {
        if self.max_header_bytes < MIN_HEADER_BYTES {
            return Err(format!(
                "--max-header-bytes {} is below the minimum of {MIN_HEADER_BYTES}",
                self.max_header_bytes
            ));
        }
        if self.max_headers == 0 {
            return Err("--max-headers must be at least 1".into());
        }
        if self.shutdown_delay + self.grace + EXIT_MARGIN > TERMINATION_GRACE {
            return Err(format!(
                "--shutdown-delay {:?} plus --grace {:?} is too long: together at most {:?}, so \
                 that both end within the pod's {:?} termination grace period",
                self.shutdown_delay,
                self.grace,
                TERMINATION_GRACE - EXIT_MARGIN,
                TERMINATION_GRACE
            ));
        }
        Ok(Config {
            routes: PathBuf::from(&self.routes),
            ca_cert: PathBuf::from(&self.ca_cert),
            ca_key: PathBuf::from(&self.ca_key),
            kubeconfig: self.kubeconfig.clone(),
            listen: self.listen,
            health_listen: self.health_listen,
            sandboxes: SandboxCheck::Verified {
                namespace: self.namespace.clone(),
                instance: self.instance.clone(),
                hmac_key_file: self.hmac_key_file.clone(),
            },
            audit_log: (self.audit_log != "-").then(|| PathBuf::from(&self.audit_log)),
            limits: Limits {
                max_connections: self.max_connections.get(),
                max_connections_per_client: self.max_connections_per_client.get(),
                max_header_bytes: self.max_header_bytes,
                max_headers: self.max_headers,
                header_read_timeout: self.header_read_timeout,
                handshake_timeout: self.handshake_timeout,
                idle_timeout: self.idle_timeout,
            },
            upstream: Timeouts {
                connect: self.upstream_connect_timeout,
                handshake: self.upstream_handshake_timeout,
                response_headers: self.response_header_timeout,
            },
            shutdown_delay: self.shutdown_delay,
            grace: self.grace,
            leaf_cache: self.leaf_cache,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_contract_paths_and_ports() {
        assert!(
            Flags::try_parse_from(["cli-mcp-proxy"]).is_err(),
            "the instance and namespace are required"
        );
        let f = Flags::try_parse_from(["p", "--instance", "demo", "--namespace", "ns"]).unwrap();
        let c = f.config().unwrap();
        assert!(matches!(
            c.sandboxes,
            SandboxCheck::Verified { ref hmac_key_file, .. }
                if hmac_key_file == &PathBuf::from("/var/run/cli-mcp/hmac/key")
        ));
        assert_eq!(c.audit_log, None);
        assert_eq!(c.limits.max_connections_per_client, 128);
        assert_eq!(c.routes, PathBuf::from("/etc/cli-mcp/proxy/routes.json"));
        assert_eq!(c.ca_cert, PathBuf::from("/etc/cli-mcp/proxy-ca/ca.crt"));
        assert_eq!(c.ca_key, PathBuf::from("/etc/cli-mcp/proxy-ca/ca.key"));
        assert_eq!(c.listen.port(), 8080);
        assert_eq!(c.health_listen.port(), 8081);
        assert_eq!(c.kubeconfig, None);
        assert_eq!(c.limits.header_read_timeout, Duration::from_secs(10));
        assert_eq!(c.shutdown_delay, Duration::from_secs(5));
        assert_eq!(c.grace, Duration::from_secs(20));
    }

    #[test]
    fn bad_values_are_refused_with_a_reason() {
        let p = |args: &[&str]| {
            let mut all = vec!["p", "--instance", "demo", "--namespace", "ns"];
            all.extend_from_slice(args);
            Flags::try_parse_from(all)
        };
        assert!(p(&["--instance", "Not_A_Name"]).is_err());
        assert!(p(&["--max-connections-per-client", "0"]).is_err());
        assert!(Flags::try_parse_from(["p", "--idle-timeout", "10"]).is_err());
        assert!(Flags::try_parse_from(["p", "--idle-timeout", "0s"]).is_err());
        assert!(Flags::try_parse_from(["p", "--max-connections", "0"]).is_err());
        let f = p(&["--max-header-bytes", "100"]).unwrap();
        assert!(f.config().unwrap_err().contains("8192"));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("5h").is_err());
        assert_eq!(parse_delay("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_delay("3s"), Ok(Duration::from_secs(3)));
        assert!(parse_delay("s").is_err());
        let f = p(&["--shutdown-delay", "10s", "--grace", "20s"]).unwrap();
        let e = f.config().unwrap_err();
        assert!(e.contains("--shutdown-delay") && e.contains("25s"), "{e}");
    }
}
