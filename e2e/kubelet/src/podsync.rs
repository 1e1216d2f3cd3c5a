//! Watches the pods bound to this node and keeps one worker per pod uid.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::worker::{self, Ctx, PodUpdate};

struct Handle {
    tx: watch::Sender<PodUpdate>,
    join: JoinHandle<()>,
}

/// Remembers recently finished uids so late watch events do not restart a deleted pod.
#[derive(Default)]
struct Tombstones {
    set: HashSet<String>,
    order: VecDeque<String>,
}

impl Tombstones {
    const CAP: usize = 4096;

    fn insert(&mut self, uid: String) {
        if self.set.insert(uid.clone()) {
            self.order.push_back(uid);
            while self.order.len() > Self::CAP {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }

    fn contains(&self, uid: &str) -> bool {
        self.set.contains(uid)
    }
}

struct Sync {
    ctx: Arc<Ctx>,
    cancel: CancellationToken,
    workers: HashMap<String, Handle>,
    finished: Tombstones,
    done_tx: mpsc::UnboundedSender<String>,
}

impl Sync {
    fn apply(&mut self, pod: Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            tracing::warn!("ignoring a pod without metadata.uid");
            return;
        };
        if pod.spec.is_none() || pod.metadata.name.is_none() {
            tracing::warn!(uid = %uid, "ignoring a pod without name or spec");
            return;
        }
        let pod = Arc::new(pod);
        if let Some(h) = self.workers.get(&uid) {
            h.tx.send_replace(PodUpdate::Present(pod));
            return;
        }
        if self.finished.contains(&uid) {
            return;
        }
        let (tx, rx) = watch::channel(PodUpdate::Present(pod));
        let ctx = self.ctx.clone();
        let cancel = self.cancel.child_token();
        let done = self.done_tx.clone();
        let worker_uid = uid.clone();
        let join = tokio::spawn(async move {
            worker::run(ctx, rx, cancel).await;
            let _ = done.send(worker_uid);
        });
        self.workers.insert(uid, Handle { tx, join });
    }

    fn gone(&mut self, pod: Arc<Pod>) {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return;
        };
        if let Some(h) = self.workers.get(uid) {
            h.tx.send_replace(PodUpdate::Gone(pod.clone()));
        }
    }
}

/// Runs until `cancel`; then waits (bounded) for all workers to stop their pods.
pub async fn run(ctx: Arc<Ctx>, cancel: CancellationToken) {
    let api: Api<Pod> = Api::all(ctx.client.clone());
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={}", ctx.node.name));
    let mut stream = watcher::watcher(api, cfg).default_backoff().boxed();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<String>();
    let mut sync = Sync {
        ctx,
        cancel: cancel.clone(),
        workers: HashMap::new(),
        finished: Tombstones::default(),
        done_tx,
    };
    let mut listing: Option<HashSet<String>> = None;
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            Some(uid) = done_rx.recv() => {
                sync.workers.remove(&uid);
                sync.finished.insert(uid);
            }
            ev = stream.next() => match ev {
                Some(Ok(Event::Init)) => listing = Some(HashSet::new()),
                Some(Ok(Event::InitApply(pod))) => {
                    if let (Some(l), Some(uid)) = (listing.as_mut(), pod.metadata.uid.clone()) {
                        l.insert(uid);
                    }
                    sync.apply(pod);
                }
                Some(Ok(Event::InitDone)) => {
                    // Pods that vanished while the watch was down.
                    if let Some(seen) = listing.take() {
                        let vanished: Vec<String> = sync
                            .workers
                            .keys()
                            .filter(|u| !seen.contains(*u))
                            .cloned()
                            .collect();
                        for uid in vanished {
                            let last = match &*sync.workers[&uid].tx.borrow() {
                                PodUpdate::Present(p) | PodUpdate::Gone(p) => p.clone(),
                            };
                            sync.gone(last);
                        }
                    }
                }
                Some(Ok(Event::Apply(pod))) => sync.apply(pod),
                Some(Ok(Event::Delete(pod))) => sync.gone(Arc::new(pod)),
                Some(Err(e)) => tracing::warn!("pod watch error (retrying): {e}"),
                None => {
                    tracing::error!("pod watch ended unexpectedly");
                    break;
                }
            }
        }
    }
    let joins: Vec<JoinHandle<()>> = sync.workers.into_values().map(|h| h.join).collect();
    tracing::info!("stopping {} pod worker(s)", joins.len());
    let all = futures::future::join_all(joins);
    if tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .is_err()
    {
        tracing::warn!("some pod workers did not stop within 60s");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tombstones_are_bounded() {
        let mut t = Tombstones::default();
        for i in 0..(Tombstones::CAP + 10) {
            t.insert(format!("u{i}"));
        }
        assert!(!t.contains("u0"));
        assert!(t.contains(&format!("u{}", Tombstones::CAP + 9)));
        assert_eq!(t.order.len(), Tombstones::CAP);
    }
}
