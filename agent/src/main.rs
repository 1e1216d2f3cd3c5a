//! `cli-mcp-agent`: flags, logging, then [`cli_mcp_agent::run::run`].

use anyhow::Context as _;
use clap::Parser as _;

use cli_mcp_agent::cli::Flags;
use cli_mcp_api::logs::{self, LogFormat};

fn main() -> anyhow::Result<()> {
    // First of all, before any request (and its bearer token) is in memory: the shell runs
    // as our user, and a dumpable process's memory and environment are open to its user
    // through /proc/<pid>/mem and /proc/<pid>/environ. Non-dumpable, they are root's.
    nix::sys::prctl::set_dumpable(false)
        .context("cannot make the agent non-dumpable (prctl PR_SET_DUMPABLE)")?;
    // Before the runtime exists, so only inherited descriptors are affected.
    cli_mcp_agent::procs::cloexec_inherited_fds();
    let flags = Flags::parse();
    logs::init(LogFormat::from_json_flag(flags.log_json), "info");
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(cli_mcp_agent::run::run(flags))
}
