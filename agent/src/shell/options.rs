//! What the shell is started with: binary, directories, budget, and the environment.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// Environment every command sees on top of the agent's own: nothing may wait for a human.
const NON_INTERACTIVE_ENV: &[(&str, &str)] = &[
    ("PAGER", "cat"),
    ("GIT_PAGER", "cat"),
    ("MANPAGER", "cat"),
    ("SYSTEMD_PAGER", ""),
    ("TERM", "dumb"),
    ("GIT_TERMINAL_PROMPT", "0"),
    ("DEBIAN_FRONTEND", "noninteractive"),
];

/// Variables of the agent that must never reach bash: auth material, and `TMOUT`, which
/// would make the idle interactive shell exit (the shell makes it read-only and empty at
/// start, see `bash::INIT_SCRIPT`).
const HIDDEN_ENV: &[&str] = &[
    cli_mcp_api::wire::ENV_TOKEN_SHA256,
    cli_mcp_api::wire::ENV_ASSIGN_SHA256,
    "TMOUT",
];

#[derive(Debug, Clone)]
pub struct ShellOptions {
    pub shell: PathBuf,
    pub workdir: PathBuf,
    pub state_dir: PathBuf,
    pub env: Vec<(OsString, OsString)>,
    pub output_budget: usize,
    /// Bytes one spill file keeps at most (the start of its stream).
    pub spill_max_bytes: u64,
    /// Bytes all spill files keep together at most; the oldest go first.
    pub spill_total_bytes: u64,
    /// Bytes kept allocated in the state dir, released when it is full so that a command
    /// file can still be written (at least the largest command accepted).
    pub reserve_bytes: u64,
    pub kill_grace: Duration,
    /// Processes the shell may have; near it the agent kills the largest groups. `None`: no
    /// limit.
    pub max_processes: Option<u64>,
    /// Whether `max_processes` is also bash's `RLIMIT_NPROC` (plus the agent's own threads).
    /// The kernel counts that limit per uid, over every process of the uid on the machine:
    /// right for an agent on its own, wrong in a pod, where every sandbox of the node runs as
    /// the same uid and the pod's pids cgroup is the bound per pod.
    pub nproc_rlimit: bool,
}

impl ShellOptions {
    /// The environment bash gets: the agent's, minus auth material, plus the
    /// non-interactive defaults.
    pub fn inherit_env() -> Vec<(OsString, OsString)> {
        let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
            .filter(|(k, _)| {
                !HIDDEN_ENV.iter().any(|h| k == h)
                    && !k.to_string_lossy().starts_with("CLI_MCP_AGENT_")
            })
            .filter(|(k, _)| !NON_INTERACTIVE_ENV.iter().any(|(n, _)| k == n))
            .collect();
        env.extend(
            NON_INTERACTIVE_ENV
                .iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v))),
        );
        env
    }
}
