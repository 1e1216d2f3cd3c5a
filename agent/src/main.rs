//! `cli-mcp-agent`: flags, logging, then [`cli_mcp_agent::run::run`].

use anyhow::Context as _;
use clap::Parser as _;

use cli_mcp_agent::cli::Flags;

fn main() -> anyhow::Result<()> {
    // Before the runtime exists, so only inherited descriptors are affected.
    cli_mcp_agent::procs::cloexec_inherited_fds();
    let flags = Flags::parse();
    init_tracing(flags.log_json);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(cli_mcp_agent::run::run(flags))
}

fn init_tracing(json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.compact().init();
    }
}
