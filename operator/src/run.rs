//! Runs one controller per watch scope until shutdown, and the process lifecycle around it
//! when there is no leader election (see [`crate::leader::run_elected`] for the other case).

use std::sync::Arc;

use futures::StreamExt;
use kube::Client;
use tokio::sync::watch;

use crate::context::{Context, OperatorConfig, Scope};
use crate::controller::{error_policy, reconcile};
use crate::metrics::Metrics;

/// `Store::wait_until_ready` wakes only the last task that polled it (a oneshot underneath)
/// and the controller polls it too, so poll again periodically until it resolves.
async fn wait_ready<K>(store: &kube::runtime::reflector::Store<K>)
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    loop {
        let poll = tokio::time::timeout(
            std::time::Duration::from_millis(200),
            store.wait_until_ready(),
        );
        match poll.await {
            Ok(_) => return,
            Err(_) => continue,
        }
    }
}

/// Runs the controllers (one per namespace of `WATCH_NAMESPACE`, or one for the cluster)
/// until `shutdown` turns true. Marks the process ready once every cache has synced.
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
        syncs.push(async move {
            wait_ready(&stores.instances).await;
            wait_ready(&stores.pods).await;
            wait_ready(&stores.deployments).await;
            wait_ready(&stores.secrets).await;
        });
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
    futures::future::join_all(runs).await;
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

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
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

/// Reports this process as the one that reconciles (`/readyz`, the `leader` gauge).
pub fn mark_leader(leader: &watch::Sender<bool>, metrics: &Metrics) {
    let _ = leader.send(true);
    metrics.leader.set(1);
}

/// Without leader election: runs the controllers until a shutdown signal.
pub async fn run_until_signal(
    client: Client,
    config: Arc<OperatorConfig>,
    metrics: Arc<Metrics>,
    leader: &watch::Sender<bool>,
) -> Ended {
    mark_leader(leader, &metrics);
    let (stop_tx, stop_rx) = watch::channel(false);
    let runner = tokio::spawn(run_controllers(client, config, metrics, stop_rx));
    shutdown_signal().await;
    let _ = stop_tx.send(true);
    let _ = runner.await;
    Ended::Stopped
}
