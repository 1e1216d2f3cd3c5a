//! The loop behind each of the replica's watch-fed views (the sessions' pods for admission
//! and routes, the warm pool, the session slots): a view says what a relist and each change
//! after it mean to it; the loop ends with the replica's stop or with the stream.

use futures::{Stream, StreamExt};
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;

/// A view kept from a watch. A relist (`relist_started`, `relisted` for each object,
/// `relist_done`) replaces it; `applied` and `deleted` change it after that.
pub(super) trait WatchFed<K> {
    fn relist_started(&self);
    fn relisted(&self, object: K);
    fn relist_done(&self);
    fn applied(&self, object: K);
    fn deleted(&self, object: K);
    /// The watch failed; it is retried with back-off, and the view is stale until its next
    /// relist is done.
    fn failed(&self, error: watcher::Error);
}

/// Feeds `view` from `events` until `stop` or the end of the stream.
pub(super) async fn feed<K>(
    events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
    view: &impl WatchFed<K>,
    stop: &CancellationToken,
) {
    let mut events = std::pin::pin!(events);
    loop {
        let event = tokio::select! {
            _ = stop.cancelled() => return,
            e = events.next() => match e {
                Some(e) => e,
                None => return,
            },
        };
        match event {
            Ok(watcher::Event::Init) => view.relist_started(),
            Ok(watcher::Event::InitApply(o)) => view.relisted(o),
            Ok(watcher::Event::InitDone) => view.relist_done(),
            Ok(watcher::Event::Apply(o)) => view.applied(o),
            Ok(watcher::Event::Delete(o)) => view.deleted(o),
            Err(e) => view.failed(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    struct Log(Mutex<Vec<String>>);

    impl Log {
        fn push(&self, s: String) {
            self.0.lock().expect("log").push(s);
        }
        fn take(&self) -> Vec<String> {
            std::mem::take(&mut *self.0.lock().expect("log"))
        }
    }

    impl WatchFed<u32> for Log {
        fn relist_started(&self) {
            self.push("relist".into());
        }
        fn relisted(&self, o: u32) {
            self.push(format!("listed {o}"));
        }
        fn relist_done(&self) {
            self.push("done".into());
        }
        fn applied(&self, o: u32) {
            self.push(format!("applied {o}"));
        }
        fn deleted(&self, o: u32) {
            self.push(format!("deleted {o}"));
        }
        fn failed(&self, _: watcher::Error) {
            self.push("failed".into());
        }
    }

    #[tokio::test]
    async fn each_event_goes_to_its_method_in_order_until_the_stream_ends() {
        let events = futures::stream::iter([
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitApply(1)),
            Ok(watcher::Event::InitDone),
            Ok(watcher::Event::Apply(2)),
            Err(watcher::Error::NoResourceVersion),
            Ok(watcher::Event::Delete(1)),
        ]);
        let log = Log::default();
        feed(events, &log, &CancellationToken::new()).await;
        assert_eq!(
            log.take(),
            [
                "relist",
                "listed 1",
                "done",
                "applied 2",
                "failed",
                "deleted 1"
            ]
        );
    }

    #[tokio::test]
    async fn a_stop_ends_a_feed_whose_stream_never_ends() {
        let events =
            futures::stream::iter([Ok(watcher::Event::Apply(7))]).chain(futures::stream::pending());
        let log = Log::default();
        let stop = CancellationToken::new();
        let fed = feed(events, &log, &stop);
        let stopping = async {
            // The one event is fed before the stream goes quiet.
            tokio::task::yield_now().await;
            stop.cancel();
        };
        let joined = async { tokio::join!(fed, stopping) };
        // Without the stop the feed would never end: fail instead of hanging.
        tokio::time::timeout(std::time::Duration::from_secs(10), joined)
            .await
            .expect("the feed ends when stopped");
        assert_eq!(log.take(), ["applied 7"]);
    }
}
