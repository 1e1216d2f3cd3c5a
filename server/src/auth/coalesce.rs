//! One run of an async lookup per key at a time: callers that miss a cache meanwhile share
//! the run in progress instead of starting their own.
//!
//! An entry lives exactly as long as its run is wanted: it goes when the run has finished,
//! and also when every caller waiting for it went away before (an HTTP/2 stream reset, a
//! closed connection drops the request's future mid-run). Otherwise each abandoned key left
//! an entry behind for good, and anyone could grow the map with junk tokens.

use std::future::Future;
use std::hash::Hash;

use tokio::sync::OnceCell;

use crate::keyed::Keyed;

pub struct Coalesce<K, V> {
    runs: Keyed<K, OnceCell<V>>,
}

impl<K, V> Default for Coalesce<K, V> {
    fn default() -> Self {
        Self {
            runs: Keyed::default(),
        }
    }
}

impl<K: Hash + Eq + Clone, V: Clone> Coalesce<K, V> {
    /// The value of the run in progress for `key`, or of `run` started now; and whether this
    /// caller ran it.
    pub async fn get_or_run<F, Fut>(&self, key: K, run: F) -> (V, bool)
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = V>,
    {
        // Dropped with a cancelled caller: the entry goes with the last one waiting.
        let entry = self.runs.get(key);
        let mut ran = false;
        let value = entry
            .value()
            .get_or_init(|| {
                ran = true;
                run()
            })
            .await
            .clone();
        // The run is over: later misses run afresh. The caller whose run set the value gets
        // here in the same poll, so the entry never outlives its run even when every other
        // caller is cancelled in between; retiring it again is a no-op.
        entry.retire();
        (value, ran)
    }

    /// Runs in progress.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.runs.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn callers_meanwhile_share_one_run_and_the_entry_goes_with_it() {
        let c: Arc<Coalesce<u32, u32>> = Arc::default();
        let runs = Arc::new(AtomicUsize::new(0));
        let (release, released) = tokio::sync::watch::channel(false);
        let callers: Vec<_> = (0..5)
            .map(|_| {
                let c = c.clone();
                let runs = runs.clone();
                let mut released = released.clone();
                tokio::spawn(async move {
                    c.get_or_run(7, || async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        let _ = released.wait_for(|r| *r).await;
                        42
                    })
                    .await
                })
            })
            .collect();
        // All five wait for the run before it may end (the map, five callers and this probe
        // hold its cell).
        while Arc::strong_count(&cell_of(&c, 7)) < 7 {
            tokio::task::yield_now().await;
        }
        release.send_replace(true);
        let mut ran = 0;
        for caller in callers {
            let (value, did) = caller.await.expect("join");
            assert_eq!(value, 42);
            ran += usize::from(did);
        }
        assert_eq!((ran, runs.load(Ordering::SeqCst)), (1, 1));
        assert!(c.is_empty());
    }

    /// The cell of `key`'s run in progress (a clone: one more holder).
    fn cell_of(c: &Coalesce<u32, u32>, key: u32) -> Arc<OnceCell<u32>> {
        c.runs.peek(&key).unwrap_or_default()
    }

    #[tokio::test]
    async fn a_run_whose_callers_all_went_away_leaves_no_entry() {
        let c: Arc<Coalesce<u32, u32>> = Arc::default();
        for key in 0..100 {
            let (started, on_start) = tokio::sync::oneshot::channel::<()>();
            let c2 = c.clone();
            let caller = tokio::spawn(async move {
                c2.get_or_run(key, || async move {
                    let _ = started.send(());
                    std::future::pending::<u32>().await
                })
                .await
            });
            on_start.await.expect("the run started");
            caller.abort();
            let _ = caller.await;
        }
        assert!(c.is_empty(), "{} entries left", c.len());
        // A new caller of an abandoned key runs afresh.
        let (v, ran) = c.get_or_run(3, || async { 9 }).await;
        assert_eq!((v, ran), (9, true));
        assert!(c.is_empty());
    }
}
