//! Runs one controller per watch scope until shutdown: the part of the process that is the
//! same with and without leader election ([`crate::run`], [`crate::leader`]).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::Client;
use tokio::sync::watch;

use crate::context::{Context, OperatorConfig, Scope};
use crate::controller::{error_policy, reconcile};
use crate::metrics::Metrics;

/// How long a shutdown waits for in-flight reconciles before dropping them. Well inside the
/// Deployment's 30 s termination grace period, leaving room to release the lease; dropping a
/// reconcile is safe because every step is idempotent and the next process repeats it.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs the controllers (one per namespace of `WATCH_NAMESPACE`, or one for the cluster)
/// until `shutdown` turns true. Marks the process ready once every cache has synced.
///
/// After the shutdown signal the controllers get [`DRAIN_TIMEOUT`] to finish what is in
/// flight — none at all while the caches have not synced: kube's controller holds its
/// queue until the stores are ready, so with an unreachable API server it would never
/// finish draining (and the process would ignore SIGTERM until SIGKILL).
pub async fn run_controllers(
    client: Client,
    config: Arc<OperatorConfig>,
    metrics: Arc<Metrics>,
    shutdown: watch::Receiver<bool>,
) {
    let namespaces: Vec<Option<String>> = match &config.scope {
        Scope::All => vec![None],
        Scope::Namespaces(list) => list.iter().cloned().map(Some).collect(),
    };
    let mut runs = Vec::new();
    let mut syncs = Vec::new();
    for ns in namespaces {
        let (controller, stores) = crate::watch::build(&client, ns.as_deref(), &config.scope);
        let ctx = Arc::new(Context::new(
            client.clone(),
            config.clone(),
            metrics.clone(),
            stores.clone(),
        ));
        let mut stop = shutdown.clone();
        let controller = controller.graceful_shutdown_on(async move {
            let _ = stop.wait_for(|s| *s).await;
        });
        syncs.push(async move { stores.synced().await });
        let scope = ns.clone().unwrap_or_else(|| "<all>".into());
        runs.push(
            controller
                .run(reconcile, error_policy, ctx)
                .for_each(move |res| {
                    let scope = scope.clone();
                    async move {
                        match res {
                            Ok((obj, _)) => tracing::debug!(%scope, object = %obj, "reconciled"),
                            Err(e) => tracing::debug!(%scope, "controller: {e}"),
                        }
                    }
                }),
        );
    }
    let ready = metrics.clone();
    tokio::spawn(async move {
        futures::future::join_all(syncs).await;
        ready.set_ready(true);
        tracing::info!("caches synced; reconciling");
    });
    let mut stop = shutdown.clone();
    let synced = metrics.clone();
    let deadline = async move {
        let _ = stop.wait_for(|s| *s).await;
        if !synced.is_ready() {
            tracing::info!("stopping before the caches synced: nothing is in flight");
            return;
        }
        tokio::time::sleep(DRAIN_TIMEOUT).await;
        tracing::warn!(
            "reconciles still running {}s after the shutdown signal; dropping them (they are idempotent)",
            DRAIN_TIMEOUT.as_secs()
        );
    };
    tokio::select! {
        _ = futures::future::join_all(runs) => {}
        _ = deadline => {}
    }
    metrics.set_ready(false);
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Shut down by a signal (or the controllers ended).
    Stopped,
    /// Another process holds the lease now: this one must not reconcile any more.
    LostLease,
}

/// Reports this process as the one that reconciles (`/readyz`, the `leader` gauge).
pub fn mark_leader(leader: &watch::Sender<bool>, metrics: &Metrics) {
    let _ = leader.send(true);
    metrics.leader.set(1);
}
