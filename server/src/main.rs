//! `cli-mcp-server`: flags, logging, then [`cli_mcp_server::run::run`].

use clap::Parser as _;

use cli_mcp_api::logs::{self, LogFormat};
use cli_mcp_server::cli::Flags;

/// Stack of each runtime worker thread. A request's future holds rmcp's handler, the session
/// start's steps (several side by side) and kube's calls; unoptimised builds (the tests,
/// `make run`) keep their temporaries on the polling thread's stack, which needed more than
/// 1.5 MiB of tokio's default 2 MiB. Address space only: pages are touched as used.
const WORKER_STACK_BYTES: usize = 8 << 20;

fn main() -> std::process::ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(WORKER_STACK_BYTES)
        .build();
    match runtime {
        Ok(rt) => rt.block_on(serve()),
        Err(e) => {
            eprintln!("cli-mcp-server: cannot start the async runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve() -> std::process::ExitCode {
    let flags = Flags::parse();
    // rmcp's per-request INFO lines are muted unless RUST_LOG asks for them.
    logs::init(LogFormat::from_json_flag(flags.log_json), "info,rmcp=warn");
    raise_fd_limit();
    let settings = match flags.resolve(|k| std::env::var(k).ok()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("cli-mcp-server: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match cli_mcp_server::run::run(settings).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("cli-mcp-server: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Every session holds a few descriptors (agent connection; locally also a pipe and a child):
/// lift the soft limit to the hard one.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(error = %e, soft, hard, "cannot raise the open-files limit");
            }
        }
    }
}
