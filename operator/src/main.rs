//! `cli-mcp-operator`: flags and wiring. Logic lives in the library.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tokio::sync::watch;

use cli_mcp_operator::context::{OperatorConfig, Scope};
use cli_mcp_operator::leader::{self, LeaderConfig};
use cli_mcp_operator::metrics::Metrics;
use cli_mcp_operator::{crdgen, http, run, telemetry};

#[derive(Parser, Debug)]
#[command(
    name = "cli-mcp-operator",
    version,
    about = "Kubernetes operator for CliMcpInstance"
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,

    /// Address of /metrics, /livez and /readyz.
    #[arg(long, env = "CLI_MCP_HEALTH_LISTEN", default_value = "0.0.0.0:8081")]
    health_listen: SocketAddr,

    /// Namespaces to watch (comma list); empty = the whole cluster.
    #[arg(long, env = "WATCH_NAMESPACE", default_value = "")]
    watch_namespace: String,

    /// Image of the MCP server.
    #[arg(long, env = "RELATED_IMAGE_SERVER")]
    server_image: Option<String>,

    /// Default sandbox image (spec.sandbox.image overrides it).
    #[arg(long, env = "RELATED_IMAGE_SANDBOX")]
    sandbox_image: Option<String>,

    /// Run leader election on a Lease (disable only for a single replica).
    #[arg(long, env = "CLI_MCP_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,

    /// Namespace of the Lease (default: the operator's own namespace).
    #[arg(long, env = "POD_NAMESPACE")]
    leader_election_namespace: Option<String>,

    #[arg(long, env = "CLI_MCP_LEASE_NAME", default_value = "cli-mcp-operator")]
    lease_name: String,

    /// Lease duration in seconds: how long a dead leader blocks a standby.
    #[arg(long, env = "CLI_MCP_LEASE_DURATION", default_value_t = 15)]
    lease_duration: u64,

    /// Seconds before expiry at which the leader renews.
    #[arg(long, env = "CLI_MCP_LEASE_GRACE", default_value_t = 5)]
    lease_grace: u64,

    /// Identity in the Lease and in Events (default: hostname-pid).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,

    /// Log JSON lines.
    #[arg(long, env = "CLI_MCP_LOG_JSON", default_value_t = false)]
    log_json: bool,

    /// Seconds a teardown waits for pods before releasing the CR anyway.
    #[arg(long, env = "CLI_MCP_TEARDOWN_TIMEOUT", default_value_t = 600)]
    teardown_timeout: u64,

    /// Seconds between periodic re-checks of every instance.
    #[arg(long, env = "CLI_MCP_RESYNC", default_value_t = 600)]
    resync: u64,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the CustomResourceDefinition YAML.
    Crdgen,
}

fn identity(args: &Args) -> String {
    args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "operator".into());
        format!("{host}-{}", std::process::id())
    })
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term => {},
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(Command::Crdgen) = args.command {
        print!("{}", crdgen::crd_yaml()?);
        return Ok(());
    }
    telemetry::init(args.log_json);
    let server_image = args
        .server_image
        .clone()
        .filter(|s| !s.is_empty())
        .context("no server image: set RELATED_IMAGE_SERVER (or --server-image)")?;
    let mut config = OperatorConfig::new(
        server_image,
        args.sandbox_image.clone().filter(|s| !s.is_empty()),
    );
    config.scope = Scope::parse(Some(&args.watch_namespace));
    config.teardown_timeout = Duration::from_secs(args.teardown_timeout);
    config.resync = Duration::from_secs(args.resync.max(10));
    config.identity = identity(&args);
    let config = Arc::new(config);

    let client = kube::Client::try_default()
        .await
        .context("connecting to Kubernetes (in-cluster config or KUBECONFIG)")?;
    let metrics = Arc::new(Metrics::new());
    let (leader_tx, leader_rx) = watch::channel(false);
    let health = tokio::spawn(http::serve(args.health_listen, metrics.clone(), leader_rx));

    let (stop_tx, stop_rx) = watch::channel(false);
    tracing::info!(scope = ?config.scope, identity = %config.identity, "starting");

    if !args.leader_elect {
        let _ = leader_tx.send(true);
        metrics.leader.set(1);
        let runner = tokio::spawn(run::run_controllers(client, config, metrics, stop_rx));
        shutdown_signal().await;
        let _ = stop_tx.send(true);
        let _ = runner.await;
        health.abort();
        return Ok(());
    }

    let ns = args
        .leader_election_namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let lcfg = LeaderConfig {
        namespace: ns,
        lease_name: args.lease_name.clone(),
        identity: config.identity.clone(),
        duration: args.lease_duration,
        grace: args.lease_grace,
    };
    let mut election = leader::start(client.clone(), &lcfg)
        .await
        .context("starting leader election")?;
    tracing::info!(lease = %lcfg.lease_name, namespace = %lcfg.namespace, "waiting for the leader lease");
    let won = tokio::select! {
        r = election.is_leader.wait_for(|l| *l) => r.is_ok(),
        _ = shutdown_signal() => false,
    };
    if !won {
        drop(election.is_leader);
        let _ = tokio::time::timeout(Duration::from_secs(5), election.task).await;
        return Ok(());
    }
    tracing::info!("acquired the leader lease");
    let _ = leader_tx.send(true);
    metrics.leader.set(1);
    let mut runner = tokio::spawn(run::run_controllers(
        client,
        config,
        metrics.clone(),
        stop_rx,
    ));
    let lost = tokio::select! {
        _ = shutdown_signal() => false,
        _ = election.is_leader.wait_for(|l| !*l) => true,
        _ = &mut runner => false,
    };
    let _ = stop_tx.send(true);
    metrics.leader.set(0);
    if lost {
        // Never keep reconciling without the lease: exit and let the Deployment restart us.
        tracing::error!("lost the leader lease; exiting");
        std::process::exit(1);
    }
    let _ = tokio::time::timeout(Duration::from_secs(20), runner).await;
    // Dropping the receiver makes the lease manager release the lease, so a standby takes
    // over at once instead of waiting for expiry.
    drop(election.is_leader);
    let _ = tokio::time::timeout(Duration::from_secs(5), election.task).await;
    health.abort();
    tracing::info!("stopped");
    Ok(())
}
