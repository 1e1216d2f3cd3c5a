//! Command-line flags (each also settable through an environment variable) and their
//! resolution into [`Settings`]: defaults that depend on other flags or on the environment,
//! and every cross-flag rule, checked once at startup with an error that says what to do.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use cli_mcp_api::names::InstanceName;
use cli_mcp_api::sandbox::SandboxConfig;
use cli_mcp_api::wire::DEFAULT_OUTPUT_BUDGET;
use cli_mcp_api::SessionId;

mod resolve;

/// Set in every pod by Kubernetes; its presence makes `kubernetes` the default auth and backend.
pub const IN_CLUSTER_ENV: &str = "KUBERNETES_SERVICE_HOST";
/// Fallback for `--namespace` (the downward API usually provides it).
pub const POD_NAMESPACE_ENV: &str = "POD_NAMESPACE";
pub const DEFAULT_HMAC_KEY_FILE: &str = "/var/run/cli-mcp/hmac/key";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    /// MCP Streamable HTTP on `POST /mcp` (stateless).
    Http,
    /// MCP over stdin/stdout for one session (`--session-id`).
    Stdio,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// Sandbox pods in the instance namespace.
    Kubernetes,
    /// One local `cli-mcp-agent` process per session (development; not isolated).
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AuthMode {
    /// Bearer tokens checked with TokenReview + SubjectAccessReview; TLS required.
    Kubernetes,
    /// No authentication (local use only).
    None,
}

#[derive(Debug, Clone, Parser)]
#[command(
    name = "cli-mcp-server",
    version,
    about = "MCP server of cli-mcp: one tool, `bash`, running commands in a sandbox per session",
    after_help = "Without a cluster: cli-mcp-server --backend local --auth none --listen 127.0.0.1:8080"
)]
pub struct Flags {
    /// MCP listen address (POST /mcp, DELETE /sessions/{id}, GET /sessions). Default
    /// 0.0.0.0:8443 with --auth kubernetes, else 127.0.0.1:8080.
    #[arg(long, env = "CLI_MCP_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Plain-HTTP address of /livez, /readyz and /metrics (never needs auth or TLS). Default
    /// 127.0.0.1:8081 with --backend local, else 0.0.0.0:8081.
    #[arg(long, env = "CLI_MCP_HEALTH_LISTEN")]
    pub health_listen: Option<SocketAddr>,
    #[arg(long, env = "CLI_MCP_TRANSPORT", value_enum, default_value_t = Transport::Http)]
    pub transport: Transport,
    /// Session of the stdio transport.
    #[arg(long, env = "CLI_MCP_SESSION_ID")]
    pub session_id: Option<String>,
    /// Default: kubernetes when running in a cluster (KUBERNETES_SERVICE_HOST set), else local.
    #[arg(long, env = "CLI_MCP_BACKEND", value_enum)]
    pub backend: Option<BackendKind>,
    /// Default: kubernetes when running in a cluster (KUBERNETES_SERVICE_HOST set), else none.
    #[arg(long, env = "CLI_MCP_AUTH", value_enum)]
    pub auth: Option<AuthMode>,
    /// PEM certificate chain for TLS on --listen (required with --auth kubernetes).
    #[arg(long, env = "CLI_MCP_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for TLS on --listen (required with --auth kubernetes).
    #[arg(long, env = "CLI_MCP_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// CliMcpInstance name (default: from --sandbox-config).
    #[arg(long, env = "CLI_MCP_INSTANCE")]
    pub instance: Option<String>,
    /// Namespace of the instance (falls back to $POD_NAMESPACE, then --sandbox-config).
    #[arg(long, env = "CLI_MCP_NAMESPACE")]
    pub namespace: Option<String>,
    /// File holding the instance HMAC key (64 hex characters).
    #[arg(long, env = "CLI_MCP_HMAC_KEY_FILE", default_value = DEFAULT_HMAC_KEY_FILE)]
    pub hmac_key_file: PathBuf,
    /// JSON of cli_mcp_api::sandbox::SandboxConfig (camelCase), as rendered by the operator.
    #[arg(long, env = "CLI_MCP_SANDBOX_CONFIG")]
    pub sandbox_config: Option<String>,
    /// Most sessions the instance may hold at once.
    #[arg(long, env = "CLI_MCP_MAX_SESSIONS", default_value_t = 100)]
    pub max_sessions: usize,
    /// Most sessions one caller identity may hold at once, across every replica (kubernetes
    /// backend; default: no per-client limit).
    #[arg(long, env = "CLI_MCP_MAX_SESSIONS_PER_CLIENT")]
    pub max_sessions_per_client: Option<usize>,
    /// Most new sessions one caller identity may start per minute, on each replica
    /// (kubernetes backend; default: no rate limit).
    #[arg(long, env = "CLI_MCP_NEW_SESSIONS_PER_MINUTE_PER_CLIENT")]
    pub new_sessions_per_minute_per_client: Option<u32>,
    /// Command timeout (seconds) when a call does not set one.
    #[arg(long, env = "CLI_MCP_DEFAULT_TIMEOUT", default_value_t = 60)]
    pub default_timeout: u64,
    /// Largest command timeout (seconds) a call may ask for (at most 300).
    #[arg(long, env = "CLI_MCP_MAX_TIMEOUT", default_value_t = 300)]
    pub max_timeout: u64,
    /// Bytes of stdout and of stderr kept per call (head + tail).
    #[arg(long, env = "CLI_MCP_OUTPUT_BUDGET", default_value_t = DEFAULT_OUTPUT_BUDGET)]
    pub output_budget: usize,
    /// Most bytes one `resources/read` of a spill or workspace file returns (1 KiB to 4 MiB).
    #[arg(long, env = "CLI_MCP_MAX_RESOURCE_READ_BYTES", default_value_t = DEFAULT_RESOURCE_READ)]
    pub max_resource_read_bytes: u64,
    /// The cli-mcp-agent binary of the local backend (default: beside this binary, then PATH).
    #[arg(long, env = "CLI_MCP_AGENT_BINARY")]
    pub agent_binary: Option<PathBuf>,
    /// Log JSON lines (the default the operator renders in a cluster).
    #[arg(long, env = "CLI_MCP_LOG_JSON", default_value_t = false)]
    pub log_json: bool,
    /// Largest MCP request body (bytes).
    #[arg(long, env = "CLI_MCP_MAX_BODY_BYTES", default_value_t = 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Shortest time (seconds, 2 to 60) between two writes of a sandbox's `last-activity`
    /// stamp (kubernetes backend): a burst of calls is one write. The operator sets it from
    /// the instance's `idleTimeout` (a sixtieth of it), and its idle GC waits that much
    /// longer than `idleTimeout`; run by hand, keep it at most a sixtieth of the idle timeout.
    #[arg(long, env = "CLI_MCP_ACTIVITY_STAMP_GAP", default_value_t = 2)]
    pub activity_stamp_gap: u64,
    /// How long a new session may wait for its sandbox to become ready (seconds).
    #[arg(long, env = "CLI_MCP_START_TIMEOUT", default_value_t = 120)]
    pub start_timeout: u64,
    /// After SIGTERM, seconds to keep serving while /readyz fails and every response closes
    /// its connection, so the Service stops sending new connections here before the listener
    /// closes (0: stop accepting at once). At most 5: the drain of open calls (20 s) follows,
    /// and both must fit, with a margin, in the pod's 30 s termination grace period.
    #[arg(long, env = "CLI_MCP_SHUTDOWN_DELAY", default_value_t = 5)]
    pub shutdown_delay: u64,
    /// With --auth kubernetes: an audience the callers' tokens must be bound to (repeat the
    /// flag, or separate with commas in the env var). Sent as spec.audiences of each
    /// TokenReview; the answer must name one of them. Default: none, so the API server's own
    /// audiences apply. Callers then get tokens with `kubectl create token <sa> --audience <aud>`.
    #[arg(
        long = "token-audience",
        env = "CLI_MCP_TOKEN_AUDIENCES",
        value_delimiter = ','
    )]
    pub token_audiences: Vec<String>,
    /// With --auth kubernetes: seconds an allow decision is reused (a refused token: half as
    /// long, at least 1 s).
    #[arg(long, env = "CLI_MCP_AUTH_CACHE_SECONDS", default_value_t = 10)]
    pub auth_cache_seconds: u64,
    /// A browser origin (`scheme://host[:port]`, port `*` for any) whose pages may call the MCP
    /// listener (repeat the flag, or separate with commas in the env var). Requests without an
    /// Origin header always pass; loopback origins pass when --listen is a loopback address;
    /// any other Origin gets 403.
    #[arg(
        long = "allowed-origin",
        env = "CLI_MCP_ALLOWED_ORIGINS",
        value_delimiter = ','
    )]
    pub allowed_origins: Vec<String>,
    /// Text for the MCP clients' models, sent after the server's own instructions in the
    /// initialize result: which CLIs and kube contexts the sandbox has, what it is for.
    #[arg(long, env = "CLI_MCP_INSTRUCTIONS")]
    pub instructions: Option<String>,
    /// The sandbox briefing the operator generates (the image's tools and versions, each
    /// Kubernetes context and what its identity may do, the reachable domains, the limits),
    /// sent between the server's own instructions and --instructions. Blank: none.
    #[arg(long, env = "CLI_MCP_BRIEFING")]
    pub briefing: Option<String>,
    /// With --auth kubernetes: the issuer URL (https, no query or fragment) of an OAuth
    /// authorization server whose tokens the Kubernetes API accepts as a JWT issuer of its
    /// AuthenticationConfiguration (repeat the flag, or separate with commas in the env var).
    /// Listed in the protected resource metadata that MCP clients discover after a 401; a
    /// token whose `iss` is one of them must name --token-audience or --resource-url in `aud`.
    #[arg(
        long = "authorization-server",
        env = "CLI_MCP_AUTHORIZATION_SERVERS",
        value_delimiter = ','
    )]
    pub authorization_servers: Vec<String>,
    /// The public URL of the MCP endpoint (for example https://mcp.example.com/mcp): the
    /// `resource` of the protected resource metadata and an audience authorization servers'
    /// tokens may name. Default: https://<request Host>/mcp, right when nothing in front of
    /// the server rewrites Host.
    #[arg(long, env = "CLI_MCP_RESOURCE_URL")]
    pub resource_url: Option<String>,
    /// A scope MCP clients ask the authorization server for (`scopes_supported` of the
    /// metadata; repeat the flag, or separate with commas in the env var). Advertised only:
    /// access is decided by RBAC on climcpinstances/mcp.
    #[arg(long = "scope", env = "CLI_MCP_SCOPES", value_delimiter = ',')]
    pub scopes: Vec<String>,
}

/// Everything the server needs, validated.
#[derive(Debug, Clone)]
pub struct Settings {
    pub transport: Transport,
    pub stdio_session: Option<SessionId>,
    pub listen: SocketAddr,
    pub health_listen: SocketAddr,
    pub backend: BackendKind,
    pub auth: AuthMode,
    pub tls: Option<TlsFiles>,
    pub instance: Option<InstanceName>,
    pub namespace: Option<String>,
    pub hmac_key_file: PathBuf,
    pub sandbox: Option<SandboxConfig>,
    /// How `--auth kubernetes` reviews tokens and caches decisions.
    pub auth_options: crate::auth::AuthOptions,
    pub limits: Limits,
    pub agent_binary: Option<PathBuf>,
    pub log_json: bool,
    /// See `--shutdown-delay`.
    pub shutdown_delay: Duration,
    /// See `--allowed-origin`.
    pub allowed_origins: Vec<crate::origin::AllowedOrigin>,
    /// See `--instructions`.
    pub instructions: Option<String>,
    /// See `--briefing`.
    pub briefing: Option<String>,
    /// The protected resource metadata (`--authorization-server`, `--resource-url`,
    /// `--scope`); `None` with `--auth none`.
    pub protected_resource: Option<crate::auth::resource::ProtectedResource>,
}

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

pub use crate::limits::{Limits, DEFAULT_RESOURCE_READ, MAX_COMMAND_BYTES};

/// A startup error: what is wrong and how to fix it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct FlagError(pub String);

fn err(msg: impl Into<String>) -> FlagError {
    FlagError(msg.into())
}
