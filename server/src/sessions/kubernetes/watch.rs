//! The replica's watch of the instance's assigned sandbox pods: it feeds admission's view of
//! the sessions, and drops the route of a session as soon as its pod is going.

use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{watcher, WatchStreamExt};
use kube::ResourceExt;
use tokio_util::sync::CancellationToken;

use cli_mcp_api::names::annotation;
use cli_mcp_api::pod_state::{is_deleting, is_terminal};

use super::admission::PodView;
use super::feed::{feed, WatchFed};
use super::pods::{pod_key, session};
use super::KubeBackend;

impl KubeBackend {
    /// Feeds admission's view of the instance's sessions (see [`Admission`]), and drops the
    /// route of a session as soon as its pod is being deleted (by the idle GC, an
    /// admin, another replica), so no call is sent to an address that is going away; and
    /// remembers the pod as gone also for sessions this replica never served, so the next
    /// call reports the reset whichever replica serves it.
    pub(super) async fn watch_routes(self: Arc<Self>, stop: CancellationToken) {
        let cfg = watcher::Config::default().labels(&self.instance.assigned_selector());
        let events = watcher::watcher(self.pods.api().clone(), cfg).default_backoff();
        feed(events, &Routes(&self), &stop).await;
    }

    /// A pod being deleted or terminated for good is going, as a deleted one is.
    fn note_if_going(&self, pod: &Pod) {
        if is_deleting(pod) || is_terminal(pod) {
            self.pod_going(pod)
        }
    }

    pub(super) fn pod_going(&self, pod: &Pod) {
        let (Some(sid), Some(uid)) = (session(pod), pod.uid()) else {
            return;
        };
        // A pod being deleted no longer counts against the limits: its slots are freed now
        // (every replica tries; the first delete wins), not when the garbage collector
        // removes them after the pod is gone. A pod that terminated but still exists still
        // counts, as it does in the pod count.
        if is_deleting(pod) || !is_terminal(pod) {
            self.admission.slots().free_of(&uid);
        }
        self.stamper.forget(&pod.name_any());
        let retired = pod.annotations().contains_key(annotation::RETIRED);
        if self.cache.tombstone(&sid, &uid, retired) {
            tracing::info!(session = %sid, pod = %pod.name_any(),
                "session pod is being deleted; route dropped");
        }
    }
}

/// The assigned pods, from the watch: admission's view of them, and the routes of the
/// sessions whose pods are going.
struct Routes<'a>(&'a KubeBackend);

impl WatchFed<Pod> for Routes<'_> {
    fn relist_started(&self) {
        self.0.admission.view().relist_started(Instant::now());
    }

    fn relisted(&self, p: Pod) {
        self.0.admission.view().relisted(pod_view(&p));
        self.0.note_if_going(&p);
    }

    fn relist_done(&self) {
        self.0.admission.view().relist_done();
    }

    fn applied(&self, p: Pod) {
        self.0.admission.view().applied(pod_view(&p));
        self.0.note_if_going(&p);
    }

    fn deleted(&self, p: Pod) {
        self.0.admission.view().deleted(pod_view(&p));
        self.0.pod_going(&p);
    }

    fn failed(&self, error: watcher::Error) {
        self.0.admission.view().watch_failed();
        tracing::debug!(%error, "sandbox pod watch error (retrying)");
    }
}

/// What admission needs of an assigned pod.
fn pod_view(p: &Pod) -> PodView {
    PodView {
        key: pod_key(p),
        session: session(p),
        terminating: is_deleting(p),
    }
}
