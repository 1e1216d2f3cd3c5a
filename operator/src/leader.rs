//! Leader election on a `coordination.k8s.io/v1` Lease (kube-lease-manager). Only the
//! holder runs controllers; a standby waits and takes over when the holder's lease expires
//! (or at once when it releases the lease on a clean shutdown).

use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::watch;
use tokio::task::JoinHandle;

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
