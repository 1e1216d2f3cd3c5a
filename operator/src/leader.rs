//! Leader election on a `coordination.k8s.io/v1` Lease (kube-lease-manager). Only the
//! holder runs controllers; a standby waits and takes over when the holder's lease expires
//! (or at once when it releases the lease on a clean shutdown).

use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::context::OperatorConfig;
use crate::controllers::{mark_leader, run_controllers, Ended};
use crate::metrics::Metrics;
use crate::signals::signalled;

#[derive(Debug, Clone)]
pub struct LeaderConfig {
    pub namespace: String,
    pub lease_name: String,
    pub identity: String,
    /// Lease duration in seconds.
    pub duration: u64,
    /// Renew this many seconds before expiry (must be < duration).
    pub grace: u64,
}

/// A running election: `is_leader` flips to true when the lease is ours and back to false
/// if it is lost. Dropping the receiver releases the lease.
pub struct Election {
    pub is_leader: watch::Receiver<bool>,
    pub task: JoinHandle<Result<kube_lease_manager::LeaseManager, LeaseManagerError>>,
}

pub async fn start(client: Client, cfg: &LeaderConfig) -> Result<Election, LeaseManagerError> {
    let grace = cfg.grace.clamp(1, cfg.duration.saturating_sub(1).max(1));
    let manager = LeaseManagerBuilder::new(client, &cfg.lease_name)
        .with_namespace(&cfg.namespace)
        .with_identity(&cfg.identity)
        .with_duration(cfg.duration.max(2))
        .with_grace(grace)
        .build()
        .await?;
    let (is_leader, task) = manager.watch().await;
    Ok(Election { is_leader, task })
}

impl Election {
    /// Dropping the receiver makes the lease manager release the lease, so a standby takes
    /// over at once instead of waiting for expiry.
    async fn release(self) {
        drop(self.is_leader);
        let _ = tokio::time::timeout(Duration::from_secs(5), self.task).await;
    }
}

/// Starts the election, retrying while the API server cannot be reached (so a brief outage
/// at start is not a crash loop); `None` when a shutdown signal came first.
async fn start_retrying(
    client: &Client,
    cfg: &LeaderConfig,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<Election> {
    let mut delay = Duration::from_secs(1);
    loop {
        let attempt = tokio::select! {
            r = start(client.clone(), cfg) => r,
            _ = signalled(shutdown) => return None,
        };
        match attempt {
            Ok(e) => return Some(e),
            Err(e) => tracing::warn!(
                lease = %cfg.lease_name,
                namespace = %cfg.namespace,
                "cannot start leader election: {e}; retrying in {}s",
                delay.as_secs()
            ),
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = signalled(shutdown) => return None,
        }
        delay = (delay * 2).min(Duration::from_secs(30));
    }
}

/// With leader election: waits for the lease, runs the controllers while it is held, and
/// stops them on a shutdown signal (releasing the lease) or when the lease is lost.
pub async fn run_elected(
    client: Client,
    config: Arc<OperatorConfig>,
    metrics: Arc<Metrics>,
    leader: &watch::Sender<bool>,
    lease: &LeaderConfig,
    mut shutdown: watch::Receiver<bool>,
) -> Ended {
    let Some(mut election) = start_retrying(&client, lease, &mut shutdown).await else {
        return Ended::Stopped;
    };
    tracing::info!(lease = %lease.lease_name, namespace = %lease.namespace, "waiting for the leader lease");
    let won = tokio::select! {
        r = election.is_leader.wait_for(|l| *l) => r.is_ok(),
        _ = signalled(&mut shutdown) => false,
    };
    if !won {
        election.release().await;
        return Ended::Stopped;
    }
    tracing::info!("acquired the leader lease");
    mark_leader(leader, &metrics);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut runner = tokio::spawn(run_controllers(client, config, metrics.clone(), stop_rx));
    let lost = tokio::select! {
        _ = signalled(&mut shutdown) => false,
        _ = election.is_leader.wait_for(|l| !*l) => true,
        _ = &mut runner => false,
    };
    let _ = stop_tx.send(true);
    metrics.leader.set(0);
    if lost {
        // No waiting for the controllers: they must not reconcile one more time.
        return Ended::LostLease;
    }
    // run_controllers bounds its own drain (DRAIN_TIMEOUT).
    let _ = runner.await;
    election.release().await;
    Ended::Stopped
}
