//! `cli-mcp-agent`: flags and wiring; the logic lives in the library modules.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser as _;
use tokio::signal::unix::{signal, SignalKind};

use cli_mcp_agent::assignment::Assignment;
use cli_mcp_agent::cli::Flags;
use cli_mcp_agent::http::{router, AgentState, Limits};
use cli_mcp_agent::listener::LimitedListener;
use cli_mcp_agent::reaper::Reaper;
use cli_mcp_agent::shell::{Shell, ShellOptions};
use cli_mcp_api::wire::{ENV_ASSIGN_SHA256, ENV_TOKEN_SHA256};

fn main() -> anyhow::Result<()> {
    // Before the runtime exists, so only inherited descriptors are affected.
    cli_mcp_agent::procs::cloexec_inherited_fds();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(run())
}

async fn run() -> anyhow::Result<()> {
    let flags = Flags::parse();
    init_tracing(flags.log_json);

    let annotations = std::fs::read_to_string(&flags.podinfo_annotations).ok();
    let assignment = Assignment::from_sources(
        std::env::var(ENV_TOKEN_SHA256).ok().as_deref(),
        std::env::var(ENV_ASSIGN_SHA256).ok().as_deref(),
        annotations.as_deref(),
        &flags.podinfo_annotations.display().to_string(),
    )?;

    let reaper = Reaper::start().context("cannot install the SIGCHLD handler")?;
    let shell = Shell::new(
        ShellOptions {
            shell: flags.shell.clone(),
            workdir: workdir(&flags)?,
            state_dir: flags.state_dir.clone(),
            env: ShellOptions::inherit_env(),
            output_budget: flags.output_budget,
            kill_grace: flags.kill_grace(),
        },
        reaper,
    )?;
    let state = AgentState::new(
        assignment,
        shell,
        Limits {
            default_timeout: Duration::from_millis(flags.default_timeout_ms),
            max_timeout: Duration::from_millis(flags.max_timeout_ms),
            max_body_bytes: flags.max_body_bytes,
        },
    );

    // Before anything is announced: a SIGTERM that arrives right after start must take the
    // graceful path, not the default action.
    let signals = Signals::install().context("cannot install the SIGTERM/SIGINT handlers")?;
    let listener = tokio::net::TcpListener::bind(flags.listen)
        .await
        .with_context(|| format!("cannot listen on {}", flags.listen))?;
    // The bound address (not the flag) so `--listen 127.0.0.1:0` callers learn the port.
    let bound = listener
        .local_addr()
        .context("listener has no local address")?;
    tracing::info!(listen = %bound, "cli-mcp-agent ready");
    let drain = Duration::from_millis(flags.drain_timeout_ms);
    let (stopping_tx, mut stopping) = tokio::sync::watch::channel(false);
    let server = axum::serve(
        LimitedListener::new(listener, flags.max_connections),
        router(state.clone()),
    )
    .with_graceful_shutdown(shutdown_signal(signals, state.clone(), drain, stopping_tx));
    // Graceful shutdown waits for open connections; a peer that never finishes its request
    // must not keep us past the pod's grace period, so the wait itself is bounded.
    let hard_deadline = drain + 3 * flags.kill_grace() + Duration::from_secs(2);
    tokio::select! {
        served = server => served.context("HTTP server failed")?,
        _ = async {
            let _ = stopping.wait_for(|s| *s).await;
            tokio::time::sleep(hard_deadline).await;
        } => tracing::warn!("connections still open after the drain; closing them"),
    }
    if let Ok(mut runner) = tokio::time::timeout(flags.kill_grace() * 3, state.idle_runner()).await
    {
        runner.kill_shell().await;
    }
    // Whatever is left (a command still running past the deadline, escaped orphans) goes
    // with us, also when we are not PID 1 of a container.
    cli_mcp_agent::procs::kill_descendants_of_self();
    tracing::info!("cli-mcp-agent stopped");
    Ok(())
}

struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }
}

/// Resolves on SIGTERM/SIGINT: refuses new commands at once, and interrupts a running one
/// if it has not finished within `drain`.
async fn shutdown_signal(
    mut signals: Signals,
    state: Arc<AgentState>,
    drain: Duration,
    stopping: tokio::sync::watch::Sender<bool>,
) {
    tokio::select! {
        _ = signals.term.recv() => {}
        _ = signals.int.recv() => {}
    }
    tracing::info!(drain_ms = drain.as_millis() as u64, "shutting down");
    state.begin_shutdown();
    stopping.send_replace(true);
    tokio::spawn(async move {
        tokio::time::sleep(drain).await;
        state.abort_running();
    });
}

fn workdir(flags: &Flags) -> anyhow::Result<PathBuf> {
    if let Some(dir) = &flags.workdir {
        return Ok(dir.clone());
    }
    if let Some(home) = std::env::var_os("HOME").map(PathBuf::from) {
        if home.is_dir() {
            return Ok(home);
        }
    }
    std::env::current_dir().context("cannot determine a working directory; pass --workdir")
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
