//! The agent's life: start-up (assignment, shell, listener, proxy relay), serving, and a
//! bounded, graceful shutdown on SIGTERM/SIGINT.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use cli_mcp_api::signals::Signals;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use cli_mcp_api::wire::{ENV_ASSIGN_SHA256, ENV_TOKEN_SHA256};

use crate::assignment::Assignment;
use crate::cli::Flags;
use crate::http::{router, AgentState, Limits};
use crate::procs;
use crate::reaper::Reaper;
use crate::relay::{self, Relay};
use crate::serve::{serve, ServeOptions};
use crate::shell::{Shell, ShellOptions};

/// Serves until SIGTERM/SIGINT, then drains and kills everything the shell started.
pub async fn run(flags: Flags) -> anyhow::Result<()> {
    // The relay's flags first: a pod spec with only some of them fails before anything starts.
    let relay = flags.relay()?;
    let state = start(&flags)?;
    // Before anything is announced: a SIGTERM that arrives right after start must take the
    // graceful path, not the default action.
    let signals = Signals::install().context("cannot install the SIGTERM/SIGINT handlers")?;
    if let Some(parent) = flags.parent_pid {
        stop_with_parent(parent)?;
    }
    let relay = match relay {
        Some((listen, relay)) => Some(start_relay(listen, relay).await?),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(flags.listen)
        .await
        .with_context(|| format!("cannot listen on {}", flags.listen))?;
    // The bound address (not the flag) so `--listen 127.0.0.1:0` callers learn the port.
    let bound = listener
        .local_addr()
        .context("listener has no local address")?;
    tracing::info!(listen = %bound, "cli-mcp-agent ready");
    let drain = Duration::from_millis(flags.drain_timeout_ms);
    let (stopping_tx, mut stopping) = watch::channel(false);
    let server = serve(
        listener,
        router(state.clone()),
        ServeOptions {
            max_connections: flags.max_connections,
            header_read_timeout: Duration::from_millis(flags.header_read_timeout_ms),
        },
        stopping.clone(),
    );
    tokio::spawn(shutdown_signal(signals, state.clone(), drain, stopping_tx));
    // Stopping waits for requests in flight; a peer that never finishes its request must
    // not keep us past the pod's grace period, so the wait itself is bounded.
    let hard_deadline = drain + 3 * flags.kill_grace() + Duration::from_secs(2);
    tokio::select! {
        _ = server => {}
        _ = async {
            let _ = stopping.wait_for(|s| *s).await;
            tokio::time::sleep(hard_deadline).await;
        } => tracing::warn!("connections still open after the drain; closing them"),
    }
    stop(&state, flags.kill_grace()).await;
    if let Some((stop_relay, relay)) = relay {
        stop_relay.send_replace(true);
        let _ = relay.await;
    }
    Ok(())
}

/// Listens for the proxy relay and serves it in a task, until told to stop. It outlives the
/// HTTP server's drain on purpose: a command still running then may need the network.
async fn start_relay(
    listen: std::net::SocketAddr,
    relay: Relay,
) -> anyhow::Result<(watch::Sender<bool>, JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {listen} for the proxy relay (--proxy-relay-listen); is \
                 another process on that port?"
            )
        })?;
    if !listen.ip().is_loopback() {
        tracing::warn!(%listen, "the proxy relay listens beyond loopback: whoever reaches it uses the pod's identity");
    }
    tracing::info!(
        %listen,
        upstream = %relay.upstream,
        token_file = %relay.token_file.display(),
        "proxy relay ready"
    );
    let (stop, stopped) = watch::channel(false);
    Ok((stop, tokio::spawn(relay::serve(listener, relay, stopped))))
}

/// SIGTERM (the graceful path: the shell and everything it started are killed) when the
/// parent `parent` dies. The kernel sends it when the parent *thread* that spawned us exits.
fn stop_with_parent(parent: i32) -> anyhow::Result<()> {
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
        .context("cannot set the parent-death signal (--parent-pid)")?;
    // The parent died before the prctl: nobody will send the signal.
    let now = nix::unistd::getppid().as_raw();
    anyhow::ensure!(
        now == parent,
        "--parent-pid {parent} is not this agent's parent (pid {now}): it has exited"
    );
    Ok(())
}

/// Who may run commands, and the shell they run in (not started until the first command).
fn start(flags: &Flags) -> anyhow::Result<Arc<AgentState>> {
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
            workdir: flags.resolve_workdir()?,
            state_dir: flags.resolve_state_dir()?,
            env: ShellOptions::inherit_env(),
            output_budget: flags.output_budget,
            spill_max_bytes: flags.spill_max_bytes,
            spill_total_bytes: flags.spill_total_bytes,
            // The largest command file, plus its directory and the journal's records.
            reserve_bytes: flags.max_body_bytes as u64 + 64 * 1024,
            kill_grace: flags.kill_grace(),
            max_processes: (flags.max_processes > 0).then_some(flags.max_processes),
            nproc_rlimit: flags.nproc_rlimit,
        },
        reaper,
    )?;
    Ok(AgentState::new(
        assignment,
        shell,
        Limits {
            default_timeout: Duration::from_millis(flags.default_timeout_ms),
            max_timeout: Duration::from_millis(flags.max_timeout_ms),
            max_body_bytes: flags.max_body_bytes,
            max_waiting: flags.max_waiting,
        },
    ))
}

/// Kills the shell once no command runs (bounded), then whatever is left.
async fn stop(state: &AgentState, kill_grace: Duration) {
    if let Ok(mut runner) = tokio::time::timeout(kill_grace * 3, state.idle_runner()).await {
        runner.kill_shell().await;
    }
    // Whatever is left (a command still running past the deadline, escaped orphans) goes
    // with us, also when we are not PID 1 of a container.
    let left = procs::kill_descendants_of_self(kill_grace).await;
    if left > 0 {
        tracing::warn!(left, "processes below the agent still alive as it exits");
    }
    tracing::info!("cli-mcp-agent stopped");
}

/// Resolves on SIGTERM/SIGINT: refuses new commands at once, and interrupts a running one
/// if it has not finished within `drain`.
async fn shutdown_signal(
    mut signals: Signals,
    state: Arc<AgentState>,
    drain: Duration,
    stopping: watch::Sender<bool>,
) {
    let signal = signals.recv().await;
    tracing::info!(signal, drain_ms = drain.as_millis() as u64, "shutting down");
    state.begin_shutdown();
    stopping.send_replace(true);
    tokio::spawn(async move {
        tokio::time::sleep(drain).await;
        state.abort_running();
    });
}
