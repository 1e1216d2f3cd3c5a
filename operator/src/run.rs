//! The process's lifecycle: logs, signal handlers, the client, the health endpoints, the
//! platform, then the controllers ([`crate::controllers`]) — under leader election
//! ([`crate::leader::run_elected`]) or, without it, until a shutdown signal.

use std::sync::Arc;

use anyhow::Context as _;
use kube::Client;
use tokio::sync::watch;

use crate::cli::Args;
use crate::context::OperatorConfig;
use crate::controllers::{mark_leader, run_controllers, Ended};
use crate::metrics::Metrics;
use crate::{http, leader, platform, signals, telemetry};

/// The operator's process: logs, signal handlers, the client, health endpoints, the
/// platform, then the controllers — with leader election unless it is switched off.
pub async fn run(args: Args) -> anyhow::Result<()> {
    telemetry::init(args.log_json);
    // First, so a signal at any later point (even while the API server is unreachable)
    // stops the process.
    let shutdown = signals::shutdown_signals().context("installing the SIGTERM/SIGINT handlers")?;
    let mut config = args.operator_config()?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to Kubernetes (in-cluster config or KUBECONFIG)")?;
    // Before anything is reconciled: the policies hold this operator too.
    if args.create_admission_policies {
        crate::policies::ensure(&client)
            .await
            .context("creating the admission policies (CLI_MCP_CREATE_ADMISSION_POLICIES)")?;
    }
    let metrics = Arc::new(Metrics::new());
    let (leader_tx, leader_rx) = watch::channel(false);
    let health = tokio::spawn(http::serve(args.health_listen, metrics.clone(), leader_rx));
    // Before any pod is built; a signal still stops a start-up that waits for the API.
    let mut stop = shutdown.clone();
    config.platform = tokio::select! {
        p = platform::resolve(args.platform, &client) => p,
        () = signals::signalled(&mut stop) => {
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
        run_until_signal(client, config, metrics, &leader_tx, shutdown).await
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

/// Without leader election: runs the controllers until a shutdown signal.
pub async fn run_until_signal(
    client: Client,
    config: Arc<OperatorConfig>,
    metrics: Arc<Metrics>,
    leader: &watch::Sender<bool>,
    shutdown: watch::Receiver<bool>,
) -> Ended {
    mark_leader(leader, &metrics);
    run_controllers(client, config, metrics, shutdown).await;
    Ended::Stopped
}
