//! New sessions per instance, as the sandbox pod watch sees them start: a pod that turns
//! assigned (a warm claim) or appears already assigned (a cold start), and the warm pool
//! size they ask for ([`autoscale`]), which the pool follows when it is sized by demand
//! (`spec.sandbox.warmPool`; the pool's `size` step).
//!
//! They are counted from the watch's events rather than from the cache at reconcile time:
//! a session that ends within a reconcile's time would not be in the cache to count, and
//! an alert storm is exactly many short sessions at once.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub mod autoscale;

/// The starts of one instance, oldest first.
type Starts = VecDeque<Instant>;

/// How long a session start is kept: the longest window the sizing reads.
pub const KEPT_FOR: Duration = Duration::from_secs(60);
/// Most starts kept per instance; more than any cluster starts pods in [`KEPT_FOR`], so the
/// count is exact, and a bound on the memory a flood of pod events can take.
const MAX_KEPT: usize = 20_000;

/// The session starts of every instance in the last [`KEPT_FOR`], shared between the pod
/// watch (which records) and the reconciles (which read).
#[derive(Clone, Default)]
pub struct SessionStarts(Arc<Mutex<HashMap<(String, String), Starts>>>);

impl SessionStarts {
    /// A session of `instance` in `namespace` started at `at`.
    pub fn record(&self, namespace: &str, instance: &str, at: Instant) {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let starts = all
            .entry((namespace.to_owned(), instance.to_owned()))
            .or_default();
        prune(starts, at);
        if starts.len() == MAX_KEPT {
            starts.pop_front();
        }
        starts.push_back(at);
    }

    /// How long ago each start of the last [`KEPT_FOR`] was, newest first.
    pub fn ages(&self, namespace: &str, instance: &str, now: Instant) -> Vec<Duration> {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let key = (namespace.to_owned(), instance.to_owned());
        let Some(starts) = all.get_mut(&key) else {
            return Vec::new();
        };
        prune(starts, now);
        if starts.is_empty() {
            all.remove(&key);
            return Vec::new();
        }
        starts
            .iter()
            .rev()
            .map(|at| now.saturating_duration_since(*at))
            .collect()
    }

    /// The instance is gone.
    pub fn forget(&self, namespace: &str, instance: &str) {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.remove(&(namespace.to_owned(), instance.to_owned()));
    }
}

fn prune(starts: &mut Starts, now: Instant) {
    while starts
        .front()
        .is_some_and(|at| now.saturating_duration_since(*at) > KEPT_FOR)
    {
        starts.pop_front();
    }
}

/// Whether a pod event shows a session starting. `before` is whether the watch last saw the
/// pod assigned (`None`: never saw it); `listing` is true while the watch (re)lists, when a
/// pod it never saw may have started long ago, so only a pod seen unassigned before counts.
pub fn starts_session(before: Option<bool>, listing: bool, assigned: bool, deleting: bool) -> bool {
    assigned
        && !deleting
        && match before {
            Some(was_assigned) => !was_assigned,
            None => !listing,
        }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_and_a_cold_start_count_and_nothing_else_does() {
        // A warm pod claimed; a pod that appears assigned (cold start).
        assert!(starts_session(Some(false), false, true, false));
        assert!(starts_session(None, false, true, false));
        // Seen unassigned before a relist, assigned in it: claimed during the gap.
        assert!(starts_session(Some(false), true, true, false));
        // Already assigned; a pod first seen by a (re)list; a pool pod; a pod going away.
        assert!(!starts_session(Some(true), false, true, false));
        assert!(!starts_session(None, true, true, false));
        assert!(!starts_session(None, false, false, false));
        assert!(!starts_session(Some(false), false, true, true));
    }

    #[test]
    fn starts_are_kept_for_a_minute_per_instance() {
        let log = SessionStarts::default();
        let t0 = Instant::now();
        log.record("ns", "a", t0);
        log.record("ns", "a", t0 + Duration::from_secs(30));
        log.record("ns", "b", t0 + Duration::from_secs(30));
        let now = t0 + Duration::from_secs(40);
        assert_eq!(
            log.ages("ns", "a", now),
            vec![Duration::from_secs(10), Duration::from_secs(40)]
        );
        let later = t0 + Duration::from_secs(80);
        assert_eq!(log.ages("ns", "a", later), vec![Duration::from_secs(50)]);
        assert_eq!(log.ages("other", "a", later), Vec::<Duration>::new());
        log.forget("ns", "b");
        assert!(log.ages("ns", "b", now).is_empty());
    }

    #[test]
    fn a_flood_of_starts_is_bounded() {
        let log = SessionStarts::default();
        let t0 = Instant::now();
        for _ in 0..MAX_KEPT + 10 {
            log.record("ns", "a", t0);
        }
        assert_eq!(log.ages("ns", "a", t0).len(), MAX_KEPT);
    }
}
