//! `cli-mcp-operator`: the flags ([`cli_mcp_operator::cli`]), then a one-shot command or
//! the operator's process ([`cli_mcp_operator::run::run`]).

use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;

use cli_mcp_operator::cli::Args;
use cli_mcp_operator::run;

/// How long the runtime waits for tasks that are still blocked (a DNS lookup, a connect
/// to an unreachable API server) once the controllers have stopped.
const RUNTIME_SHUTDOWN: Duration = Duration::from_secs(1);

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(command) = &args.command {
        return command.run();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let result = rt.block_on(run::run(args));
    // Dropping the runtime would wait for every blocking task; a stuck one must not keep a
    // stopping operator alive past its grace period.
    rt.shutdown_timeout(RUNTIME_SHUTDOWN);
    result
}
