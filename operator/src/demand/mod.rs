//! New sessions per instance, as the sandbox pod watch sees them start: a pod that turns
//! assigned (a warm claim) or appears already assigned (a cold start), and the warm pool
//! size they ask for ([`autoscale`]), which the pool follows when it is sized by demand
//! (`spec.sandbox.warmPool`; the pool's `size` step).
//!
//! They are counted from the watch's events rather than from the cache at reconcile time:
//! a session that ends within a reconcile's time would not be in the cache to count, and
//! an alert storm is exactly many short sessions at once. Only instances sized by demand
//! are followed ([`SessionStarts::follow`], by their reconcile), so a pod labelled with an
//! instance that does not exist, or does not size its pool by demand, costs no memory; and
//! each pod counts once, however often its `session-id` label comes and goes.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub mod autoscale;

/// The starts of one instance, oldest first.
type Starts = VecDeque<Instant>;

/// How long a session start is kept: the longest window the sizing reads.
pub const KEPT_FOR: Duration = Duration::from_secs(60);
/// Most starts kept per instance: far more than the largest pool (200) the count decides,
/// and a bound on the memory a flood of pod events can take. The last minute's count in the
/// status stops there.
const MAX_KEPT: usize = 4096;

/// The session starts of every instance in the last [`KEPT_FOR`], shared between the pod
/// watch (which records) and the reconciles (which read).
#[derive(Clone, Default)]
pub struct SessionStarts(Arc<Mutex<HashMap<(String, String), Starts>>>);

impl SessionStarts {
    /// From now on, record the session starts of `instance` in `namespace`.
    pub fn follow(&self, namespace: &str, instance: &str) {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.entry((namespace.to_owned(), instance.to_owned()))
            .or_default();
    }

    /// A session of `instance` in `namespace` started at `at`; dropped unless the instance
    /// is followed.
    pub fn record(&self, namespace: &str, instance: &str, at: Instant) {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(starts) = all.get_mut(&(namespace.to_owned(), instance.to_owned())) else {
            return;
        };
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
        // A flood's memory goes back once it has aged out.
        starts.shrink_to(starts.len().max(16));
        starts
            .iter()
            .rev()
            .map(|at| now.saturating_duration_since(*at))
            .collect()
    }

    /// The instance is gone, or no longer sized by demand: stop following it.
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

/// Whether a pod event shows a session starting. `ever_assigned` is whether the watch ever
/// saw this pod assigned (`None`: never saw the pod), so a pod counts once however often
/// its label comes and goes. Nothing a (re)list reports counts: the claims made while the
/// watch was away would all be stamped with the relist's moment, one false burst.
pub fn starts_session(
    ever_assigned: Option<bool>,
    listing: bool,
    assigned: bool,
    deleting: bool,
) -> bool {
    assigned && !deleting && !listing && ever_assigned != Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_and_a_cold_start_count_and_nothing_else_does() {
        // A warm pod claimed; a pod that appears assigned (cold start).
        assert!(starts_session(Some(false), false, true, false));
        assert!(starts_session(None, false, true, false));
        // What a relist reports, claimed during the gap or not.
        assert!(!starts_session(Some(false), true, true, false));
        // Assigned before (again, after its label went and came back); a pod first seen by
        // a (re)list; a pool pod; a pod going away.
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
        assert!(log.ages("ns", "a", t0).is_empty(), "not followed: dropped");
        log.follow("ns", "a");
        log.follow("ns", "b");
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
        log.record("ns", "b", now);
        assert!(log.ages("ns", "b", now).is_empty());
    }

    #[test]
    fn a_flood_of_starts_is_bounded() {
        let log = SessionStarts::default();
        let t0 = Instant::now();
        log.follow("ns", "a");
        for _ in 0..MAX_KEPT + 10 {
            log.record("ns", "a", t0);
        }
        assert_eq!(log.ages("ns", "a", t0).len(), MAX_KEPT);
    }
}
