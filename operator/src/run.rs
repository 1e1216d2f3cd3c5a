//! Runs one controller per watch scope until shutdown.

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
