//! cli-mcp-kubelet: a "process kubelet" for local end-to-end tests (see docs/process-kubelet.md).

mod backoff;
mod cli;
mod cni;
mod downward;
mod env;
mod exec_helper;
mod identity;
mod imagemap;
mod kubelet;
mod launch;
mod logserver;
mod netns;
mod node;
mod podsync;
mod probes;
mod process;
mod quantity;
mod services;
mod state;
mod status;
mod volumes;
mod worker;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(exec_helper::SUBCOMMAND) {
        exec_helper::main(&argv[2..]);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(cli_mcp_api::terminal::log_colours())
        .init();
    let args = cli::Args::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cli-mcp-kubelet: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(kubelet::run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
