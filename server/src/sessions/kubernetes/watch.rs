//! The replica's watch of the instance's assigned sandbox pods: it feeds admission's view of
//! the sessions, and drops the route of a session as soon as its pod is going.

use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;

use cli_mcp_api::names::annotation;
use cli_mcp_api::pod_state::{is_deleting, is_terminal};

use super::activity::ActivityStamper;
use super::admission::{PodView, SessionView, SlotLeases};
use super::feed::{feed, WatchFed};
use super::pods::{pod_key, session};
use super::routes::RouteCache;
use super::stops::ContainerStops;

/// The assigned pods, from the watch: admission's view of them, and the routes of the
/// sessions whose pods are going.
pub struct PodWatch<'a> {
    pub view: &'a SessionView,
    /// The session slots, freed as soon as their pod is going.
    pub slots: &'a SlotLeases,
    pub stamper: &'a ActivityStamper,
    pub cache: &'a RouteCache,
    /// Which sandbox containers stopped, for the calls in flight to them.
    pub stops: &'a ContainerStops,
}

impl PodWatch<'_> {
    /// Feeds admission's view of the instance's sessions (see [`SessionView`]), and drops the
    /// route of a session as soon as its pod is being deleted (by the idle GC, an
    /// admin, another replica), so no call is sent to an address that is going away; and
    /// remembers the pod as gone also for sessions this replica never served, so the next
    /// call reports the reset whichever replica serves it. `selector`: the instance's
    /// assigned sandbox pods.
    pub async fn run(&self, pods: Api<Pod>, selector: String, stop: &CancellationToken) {
        let cfg = watcher::Config::default().labels(&selector);
        let events = watcher::watcher(pods, cfg).default_backoff();
        feed(events, self, stop).await;
    }

    /// A pod being deleted or terminated for good is going, as a deleted one is.
    fn note_if_going(&self, pod: &Pod) {
        if is_deleting(pod) || is_terminal(pod) {
            self.pod_going(pod)
        }
    }

    fn pod_going(&self, pod: &Pod) {
        let (Some(sid), Some(uid)) = (session(pod), pod.uid()) else {
            return;
        };
        // A pod being deleted no longer counts against the limits: its slots are freed now
        // (every replica tries; the first delete wins), not when the garbage collector
        // removes them after the pod is gone. A pod that terminated but still exists still
        // counts, as it does in the pod count.
        if is_deleting(pod) || !is_terminal(pod) {
            self.slots.free_of(&uid);
        }
        self.stamper.forget(&pod.name_any());
        let retired = pod.annotations().contains_key(annotation::RETIRED);
        if self.cache.tombstone(&sid, &uid, retired) {
            tracing::info!(session = %sid, pod = %pod.name_any(),
                "session pod is being deleted; route dropped");
        }
    }
}

impl WatchFed<Pod> for PodWatch<'_> {
    fn relist_started(&self) {
        self.view.relist_started(Instant::now());
    }

    fn relisted(&self, p: Pod) {
        self.stops.applied(&p);
        self.view.relisted(pod_view(&p));
        self.note_if_going(&p);
    }

    fn relist_done(&self) {
        self.view.relist_done();
    }

    fn applied(&self, p: Pod) {
        self.stops.applied(&p);
        self.view.applied(pod_view(&p));
        self.note_if_going(&p);
    }

    fn deleted(&self, p: Pod) {
        self.stops.deleted(&p);
        self.view.deleted(pod_view(&p));
        self.pod_going(&p);
    }

    fn failed(&self, error: watcher::Error) {
        self.view.watch_failed();
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
