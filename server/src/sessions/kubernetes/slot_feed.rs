//! The session slots as the Lease watch delivers them: what the replica's view
//! ([`super::slots::Slots`]) keeps of each slot object, fed event by event.

use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{DeleteParams, Preconditions};
use kube::core::PartialObjectMeta;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;

use super::feed::{feed, WatchFed};
use super::slots::{slot_view, Slots, SWEEP_EVERY};
use super::KubeBackend;

/// The slots, from the watch (metadata only); a lease that is no slot of this instance is
/// not one the view keeps.
struct SlotsFed<'a>(&'a Slots);

impl WatchFed<PartialObjectMeta<Lease>> for SlotsFed<'_> {
    fn relist_started(&self) {
        self.0.relist_started();
    }

    fn relisted(&self, m: PartialObjectMeta<Lease>) {
        if let Some(v) = slot_view(self.0, &m.metadata) {
            self.0.relisted(v);
        }
    }

    fn relist_done(&self) {
        self.0.relist_done();
    }

    fn applied(&self, m: PartialObjectMeta<Lease>) {
        if let Some(v) = slot_view(self.0, &m.metadata) {
            self.0.applied(v);
        }
    }

    fn deleted(&self, m: PartialObjectMeta<Lease>) {
        self.0.deleted(&m.name_any());
    }

    fn failed(&self, error: watcher::Error) {
        self.0.watch_failed();
        tracing::debug!(%error, "session slot watch error (retrying)");
    }
}

impl KubeBackend {
    /// Keeps this replica's view of the slots (see [`Slots`]) and, every [`SWEEP_EVERY`],
    /// deletes orphan and duplicate slots.
    pub(super) async fn watch_slots(self: Arc<Self>, stop: CancellationToken) {
        let cfg = watcher::Config::default().labels(&self.instance.slot_selector());
        // Metadata only: owner, age and name are all the view needs.
        let api: Api<PartialObjectMeta<Lease>> =
            Api::namespaced(self.client.clone(), &self.cfg.namespace);
        let events = watcher(api, cfg).default_backoff();
        let sweeping = async {
            let mut sweep = tokio::time::interval(SWEEP_EVERY);
            loop {
                sweep.tick().await;
                self.sweep_slots().await;
            }
        };
        let view = SlotsFed(&self.slots);
        tokio::select! {
            () = feed(events, &view, &stop) => {}
            () = sweeping => {}
        }
    }

    async fn sweep_slots(&self) {
        for s in self.slots.sweepable(k8s_openapi::jiff::Timestamp::now()) {
            // Exactly the object the view saw: a slot bound or replaced since is kept.
            let dp = DeleteParams::default().preconditions(Preconditions {
                uid: Some(s.uid.clone()),
                resource_version: Some(s.resource_version.clone()),
            });
            match self.leases.delete(&s.name, &dp).await {
                Ok(_) => {
                    tracing::info!(slot = %s.name, "deleted an abandoned or duplicate session slot");
                    self.slots.gone(&s.name);
                }
                Err(kube::Error::Api(e)) if e.is_not_found() || e.is_conflict() => {}
                Err(e) => {
                    tracing::debug!(slot = %s.name, error = %e, "cannot delete a session slot")
                }
            }
        }
    }
}
