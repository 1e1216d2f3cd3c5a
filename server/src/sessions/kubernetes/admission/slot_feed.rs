//! The session slots outside a session's start: the Lease watch that feeds the replica's
//! view ([`super::slots::Slots`]), the sweep of abandoned slots, and the release of a
//! session's slots when its pod goes.

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{DeleteParams, ListParams, Preconditions};
use kube::core::PartialObjectMeta;
use kube::runtime::{watcher, WatchStreamExt};
use kube::ResourceExt;
use tokio_util::sync::CancellationToken;

use cli_mcp_api::names::label;
use cli_mcp_api::SessionId;

use super::slot_leases::SlotLeases;
use super::slots::{slot_ref, slot_view, Slots, SWEEP_EVERY};
use crate::sessions::kubernetes::feed::{feed, WatchFed};

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

impl SlotLeases {
    /// Keeps this replica's view of the slots (see [`Slots`]) and, every [`SWEEP_EVERY`],
    /// deletes orphan and duplicate slots.
    pub async fn watch(self, stop: CancellationToken) {
        let cfg = watcher::Config::default().labels(&self.instance.slot_selector());
        // Metadata only: owner, age and name are all the view needs.
        let events = watcher(self.meta.clone(), cfg).default_backoff();
        let sweeping = async {
            let mut sweep = tokio::time::interval(SWEEP_EVERY);
            loop {
                sweep.tick().await;
                self.sweep().await;
            }
        };
        let view = SlotsFed(&self.slots);
        tokio::select! {
            () = feed(events, &view, &stop) => {}
            () = sweeping => {}
        }
    }

    async fn sweep(&self) {
        for s in self.slots.sweepable(k8s_openapi::jiff::Timestamp::now()) {
            // Exactly the object the view saw: a slot bound or replaced since is kept.
            let dp = DeleteParams::default().preconditions(Preconditions {
                uid: Some(s.uid.clone()),
                resource_version: Some(s.resource_version.clone()),
            });
            match self.api.delete(&s.name, &dp).await {
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

    /// Deletes the slots of pod `pod_uid` of session `sid`: those the view knows of and those
    /// a LIST of the session's slots finds. The view alone can lag behind the API (under
    /// load the watch delivered one slot's binding to the pod and not yet the other's), and
    /// a slot left behind refused the caller's next session for the one it had just ended.
    pub async fn release_of(&self, sid: &SessionId, pod_uid: &str) {
        let mut owned = self.slots.owned_by(pod_uid);
        let sel = format!(
            "{},{}={sid}",
            self.instance.slot_selector(),
            label::SESSION_ID
        );
        match self.api.list(&ListParams::default().labels(&sel)).await {
            Ok(list) => {
                let listed = list
                    .items
                    .iter()
                    .filter_map(|l| slot_view(&self.slots, &l.metadata))
                    .filter(|v| v.owner.as_deref() == Some(pod_uid))
                    .filter_map(|v| slot_ref(&v));
                for s in listed {
                    if !owned.iter().any(|o| o.name == s.name) {
                        owned.push(s);
                    }
                }
            }
            Err(e) => tracing::debug!(session = %sid, error = %e,
                "cannot list the session's slots (the pod watch or the garbage collector frees them)"),
        }
        for s in owned {
            self.delete(&s).await;
        }
    }

    /// Frees the slots of a pod that is going (deleted, by anyone): spawned, never blocks.
    pub fn free_of(&self, pod_uid: &str) {
        let owned = self.slots.owned_by(pod_uid);
        if owned.is_empty() {
            return;
        }
        let leases = self.clone();
        tokio::spawn(async move {
            for s in owned {
                leases.delete(&s).await;
            }
        });
    }
}
