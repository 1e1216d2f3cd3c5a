//! `cli-mcp-operator`: parse the flags, connect, serve health, and run the controllers —
//! with leader election unless it is switched off. Flags are in `cli.rs`, the lifecycle in
//! `run.rs` and `leader.rs`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tokio::sync::watch;

use cli_mcp_operator::cli::{Args, Command};
use cli_mcp_operator::metrics::Metrics;
use cli_mcp_operator::run::{self, Ended};
use cli_mcp_operator::{crdgen, http, leader, olm, platform, telemetry};

/// How long the runtime waits for tasks that are still blocked (a DNS lookup, a connect
/// to an unreachable API server) once the controllers have stopped.
const RUNTIME_SHUTDOWN: Duration = Duration::from_secs(1);

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match &args.command {
        Some(Command::Crdgen) => {
            print!("{}", crdgen::crd_yaml()?);
            return Ok(());
        }
        Some(Command::OlmBundle {
            rendered,
            samples,
            root,
            check,
        }) => return olm::generate(rendered, samples, root, *check),
        None => {}
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let result = rt.block_on(operate(args));
    // Dropping the runtime would wait for every blocking task; a stuck one must not keep a
    // stopping operator alive past its grace period.
    rt.shutdown_timeout(RUNTIME_SHUTDOWN);
    result
}

async fn operate(args: Args) -> anyhow::Result<()> {
    telemetry::init(args.log_json);
    // First, so a signal at any later point (even while the API server is unreachable)
    // stops the process.
    let shutdown = run::shutdown_signals().context("installing the SIGTERM/SIGINT handlers")?;
    let mut config = args.operator_config()?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to Kubernetes (in-cluster config or KUBECONFIG)")?;
    let metrics = Arc::new(Metrics::new());
    let (leader_tx, leader_rx) = watch::channel(false);
    let health = tokio::spawn(http::serve(args.health_listen, metrics.clone(), leader_rx));
    // Before any pod is built; a signal still stops a start-up that waits for the API.
    let mut stop = shutdown.clone();
    config.platform = tokio::select! {
        p = platform::resolve(args.platform, &client) => p,
        () = run::signalled(&mut stop) => {
            health.abort();
            tracing::info!("stopped");
            return Ok(());
        }
    };
    let config = Arc::new(config);
    tracing::info!(scope = ?config.scope, identity = %config.identity, "starting");

    let ended = if args.leader_elect {
        let lease = args.lease_config(client.default_namespace());
        leader::run_elected(client, config, metrics, &leader_tx, &lease, shutdown).await
    } else {
        run::run_until_signal(client, config, metrics, &leader_tx, shutdown).await
    };
    health.abort();
    if ended == Ended::LostLease {
        // Never keep reconciling without the lease: exit and let the Deployment restart us.
        tracing::error!("lost the leader lease; exiting");
        std::process::exit(1);
    }
    tracing::info!("stopped");
    Ok(())
}
