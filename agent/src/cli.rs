//! Command-line flags (each also settable through an environment variable).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;

use cli_mcp_api::wire::{
    DEFAULT_OUTPUT_BUDGET, DEFAULT_TIMEOUT_MS, ENV_RELAY_LISTEN, ENV_RELAY_TOKEN_FILE,
    ENV_RELAY_UPSTREAM, MAX_TIMEOUT_MS,
};

use crate::relay::{check_upstream, Relay, RelayLimits};

#[derive(Debug, Clone, Parser)]
#[command(
    name = "cli-mcp-agent",
    version,
    about = "Persistent bash over HTTP for one cli-mcp session"
)]
pub struct Flags {
    /// Address to listen on.
    #[arg(long, env = "CLI_MCP_AGENT_LISTEN", default_value = "0.0.0.0:8090")]
    pub listen: SocketAddr,
    /// Shell binary (bash).
    #[arg(long, env = "CLI_MCP_AGENT_SHELL", default_value = "bash")]
    pub shell: PathBuf,
    /// Initial working directory of the shell (default: $HOME, else the current directory).
    #[arg(long, env = "CLI_MCP_AGENT_WORKDIR")]
    pub workdir: Option<PathBuf>,
    /// Directory for per-command files and spilled output; keep it on a volume that survives
    /// container restarts (the pod's /tmp emptyDir) so a restart can be detected.
    #[arg(
        long,
        env = "CLI_MCP_AGENT_STATE_DIR",
        default_value = "/tmp/cli-mcp-agent"
    )]
    pub state_dir: PathBuf,
    /// Bytes of each stream (stdout, stderr) kept in a response, as head + tail.
    #[arg(long, env = "CLI_MCP_AGENT_OUTPUT_BUDGET", default_value_t = DEFAULT_OUTPUT_BUDGET)]
    pub output_budget: usize,
    /// Bytes one spill file (the full stream of a truncated command) keeps at most: the start
    /// of the stream. The response says how much was not kept.
    #[arg(long, env = "CLI_MCP_AGENT_SPILL_MAX_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub spill_max_bytes: u64,
    /// Bytes all spill files keep together at most (at most 16 files); the oldest are
    /// removed first.
    #[arg(long, env = "CLI_MCP_AGENT_SPILL_TOTAL_BYTES", default_value_t = 128 * 1024 * 1024)]
    pub spill_total_bytes: u64,
    /// Timeout of a command whose request does not set one.
    #[arg(long, env = "CLI_MCP_AGENT_DEFAULT_TIMEOUT_MS", default_value_t = DEFAULT_TIMEOUT_MS)]
    pub default_timeout_ms: u64,
    /// Largest timeout a request may ask for.
    #[arg(long, env = "CLI_MCP_AGENT_MAX_TIMEOUT_MS", default_value_t = MAX_TIMEOUT_MS)]
    pub max_timeout_ms: u64,
    /// Largest request body accepted.
    #[arg(long, env = "CLI_MCP_AGENT_MAX_BODY_BYTES", default_value_t = 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Connections held at once (bounds memory under a flood). A new connection beyond it
    /// closes the oldest one that has no request in flight.
    #[arg(long, env = "CLI_MCP_AGENT_MAX_CONNECTIONS", default_value_t = 32)]
    pub max_connections: usize,
    /// How long a connection may take to send a request head, counted from its accept or
    /// from the end of its previous response; then it is closed.
    #[arg(
        long,
        env = "CLI_MCP_AGENT_HEADER_READ_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub header_read_timeout_ms: u64,
    /// `/exec` callers that may wait for a busy shell at once; more get 409 `busy` at once.
    #[arg(long, env = "CLI_MCP_AGENT_MAX_WAITING", default_value_t = 4)]
    pub max_waiting: usize,
    /// After a timeout, how long the command gets between SIGTERM and SIGKILL, and how long
    /// the shell then gets to report back before it is considered wedged and restarted.
    #[arg(long, env = "CLI_MCP_AGENT_KILL_GRACE_MS", default_value_t = 1000)]
    pub kill_grace_ms: u64,
    /// On SIGTERM, how long a running command may go on before it is killed. The agent exits
    /// within this plus 8 kill graces plus 2 s of the SIGTERM: serving ends by this plus 3
    /// kill graces plus 2 s (a peer that never finishes its request), then up to 3 kill
    /// graces for the running command to return, one for the shell to die and one for the
    /// sweep of what escaped it. A supervisor's SIGKILL grace must be longer.
    #[arg(long, env = "CLI_MCP_AGENT_DRAIN_TIMEOUT_MS", default_value_t = 20_000)]
    pub drain_timeout_ms: u64,
    /// Downward-API file with the pod's annotations, read to recover the assignment.
    #[arg(long, env = "CLI_MCP_AGENT_PODINFO_ANNOTATIONS", default_value = cli_mcp_api::wire::PODINFO_ANNOTATIONS)]
    pub podinfo_annotations: PathBuf,
    /// Stop (as on SIGTERM) when the process with this pid, the agent's parent, dies, even
    /// by SIGKILL (`PR_SET_PDEATHSIG`). The server's local backend sets it; in a pod the
    /// container's end already ends everything in it.
    #[arg(long, env = "CLI_MCP_AGENT_PARENT_PID")]
    pub parent_pid: Option<i32>,
    /// Processes the shell may have. At three quarters of it the agent kills the session's
    /// largest process groups (a fork bomb) before the next command; with `--nproc-rlimit`
    /// it is also the shell's `RLIMIT_NPROC`. 0: no limit. On Kubernetes the kubelet's
    /// `podPidsLimit` is the bound per pod: keep this below it.
    #[arg(long, env = "CLI_MCP_AGENT_MAX_PROCESSES", default_value_t = 4096)]
    pub max_processes: u64,
    /// Whether `--max-processes` is also the shell's `RLIMIT_NPROC` (on top of the agent's
    /// own threads). The kernel counts it over every task of the uid on the machine, not of
    /// the session: in a pod, where every sandbox of the node runs as one uid, one session's
    /// processes would make another's forks fail, so sandbox pods set it to false and rely
    /// on the pod's pids cgroup.
    #[arg(long, env = "CLI_MCP_AGENT_NPROC_RLIMIT", default_value_t = true, action = clap::ArgAction::Set)]
    pub nproc_rlimit: bool,
    /// Where the proxy relay listens (the sandbox's `HTTPS_PROXY`; loopback, so only the pod
    /// reaches it). The relay runs when this, `--proxy-upstream` and `--proxy-token-file` are
    /// set, and not at all when none is.
    #[arg(long, env = ENV_RELAY_LISTEN)]
    pub proxy_relay_listen: Option<SocketAddr>,
    /// The instance's credential proxy, `host:port`, that the relay forwards to.
    #[arg(long, env = ENV_RELAY_UPSTREAM)]
    pub proxy_upstream: Option<String>,
    /// The file holding the pod's proof of identity for the proxy (its projected
    /// ServiceAccount token), read again for every relayed connection.
    #[arg(long, env = ENV_RELAY_TOKEN_FILE)]
    pub proxy_token_file: Option<PathBuf>,
    /// Connections the relay forwards at once; one more is answered 503.
    #[arg(
        long,
        env = "CLI_MCP_AGENT_PROXY_RELAY_MAX_CONNECTIONS",
        default_value_t = 256
    )]
    pub proxy_relay_max_connections: usize,
    /// Log as JSON lines (the default in a cluster).
    #[arg(long, env = "CLI_MCP_AGENT_LOG_JSON", default_value_t = false)]
    pub log_json: bool,
}

impl Flags {
    pub fn kill_grace(&self) -> Duration {
        Duration::from_millis(self.kill_grace_ms)
    }

    /// `--state-dir` as an absolute path. The agent hands bash paths inside it, and bash
    /// resolves a relative one against its own working directory, which every `cd` changes:
    /// so it is made absolute once, against the agent's directory at start.
    pub fn resolve_state_dir(&self) -> anyhow::Result<PathBuf> {
        std::path::absolute(&self.state_dir).with_context(|| {
            format!(
                "cannot make --state-dir {} absolute; pass an absolute path",
                self.state_dir.display()
            )
        })
    }

    /// The proxy relay's address and set-up, if the three relay flags are set; `None` if none
    /// is (the server's local backend has no proxy). Only some of them is a mistake in the
    /// pod spec, refused here rather than leaving the sandbox without its proxy.
    pub fn relay(&self) -> anyhow::Result<Option<(SocketAddr, Relay)>> {
        let upstream = self.proxy_upstream.as_deref().filter(|u| !u.is_empty());
        let token_file = self
            .proxy_token_file
            .as_ref()
            .filter(|f| !f.as_os_str().is_empty());
        let (listen, upstream, token_file) = match (self.proxy_relay_listen, upstream, token_file) {
            (None, None, None) => return Ok(None),
            (Some(listen), Some(upstream), Some(token_file)) => (listen, upstream, token_file),
            (listen, upstream, token_file) => {
                let missing: Vec<String> = [
                    ("--proxy-relay-listen", ENV_RELAY_LISTEN, listen.is_none()),
                    ("--proxy-upstream", ENV_RELAY_UPSTREAM, upstream.is_none()),
                    (
                        "--proxy-token-file",
                        ENV_RELAY_TOKEN_FILE,
                        token_file.is_none(),
                    ),
                ]
                .into_iter()
                .filter(|(_, _, missing)| *missing)
                .map(|(flag, env, _)| format!("{flag} ({env})"))
                .collect();
                anyhow::bail!(
                    "the proxy relay needs --proxy-relay-listen, --proxy-upstream and \
                     --proxy-token-file together, and {} is not set: set all three, or none \
                     for no relay",
                    missing.join(" and ")
                );
            }
        };
        check_upstream(upstream)
            .map_err(|e| anyhow::anyhow!("--proxy-upstream: {e}; give the proxy as host:port"))?;
        anyhow::ensure!(
            self.proxy_relay_max_connections > 0,
            "--proxy-relay-max-connections must be at least 1"
        );
        let relay = Relay {
            upstream: upstream.to_owned(),
            token_file: token_file.clone(),
            limits: RelayLimits {
                max_connections: self.proxy_relay_max_connections,
                ..RelayLimits::default()
            },
        };
        Ok(Some((listen, relay)))
    }

    /// `--workdir` (made absolute, as it is reported as the shell's directory after a reset),
    /// else `$HOME` if it is a directory, else the current directory.
    pub fn resolve_workdir(&self) -> anyhow::Result<PathBuf> {
        if let Some(dir) = &self.workdir {
            return std::path::absolute(dir).with_context(|| {
                format!(
                    "cannot make --workdir {} absolute; pass an absolute path",
                    dir.display()
                )
            });
        }
        if let Some(home) = std::env::var_os("HOME").map(PathBuf::from) {
            if home.is_dir() {
                return Ok(home);
            }
        }
        std::env::current_dir().context("cannot determine a working directory; pass --workdir")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(args: &[&str]) -> Flags {
        Flags::try_parse_from(std::iter::once("cli-mcp-agent").chain(args.iter().copied()))
            .expect("flags parse")
    }

    #[test]
    fn the_relay_takes_all_three_flags_or_none() {
        // The environment of the test run must not set them.
        if [ENV_RELAY_LISTEN, ENV_RELAY_UPSTREAM, ENV_RELAY_TOKEN_FILE]
            .iter()
            .any(|env| std::env::var_os(env).is_some())
        {
            return;
        }
        assert!(flags(&[]).relay().expect("no relay").is_none());
        let (listen, relay) = flags(&[
            "--proxy-relay-listen",
            "127.0.0.1:3128",
            "--proxy-upstream",
            "p.ns.svc:8080",
            "--proxy-token-file",
            "/t/token",
        ])
        .relay()
        .expect("valid")
        .expect("a relay");
        assert_eq!(listen.to_string(), "127.0.0.1:3128");
        assert_eq!(relay.upstream, "p.ns.svc:8080");
        assert_eq!(relay.limits.max_connections, 256);
        let err = flags(&["--proxy-upstream", "p.ns.svc:8080"])
            .relay()
            .expect_err("incomplete")
            .to_string();
        assert!(
            err.contains("--proxy-relay-listen (CLI_MCP_AGENT_PROXY_RELAY_LISTEN)")
                && err.contains("--proxy-token-file (CLI_MCP_AGENT_PROXY_TOKEN_FILE)")
                && !err.contains("--proxy-upstream (")
        );
        let err = flags(&[
            "--proxy-relay-listen",
            "127.0.0.1:3128",
            "--proxy-upstream",
            "http://p.ns.svc:8080",
            "--proxy-token-file",
            "/t/token",
        ])
        .relay()
        .expect_err("a URL");
        assert!(err.to_string().contains("host:port"), "{err}");
    }
}
