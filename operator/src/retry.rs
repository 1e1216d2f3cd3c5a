//! Backoff of failed reconciles, per instance. A flat retry period hammered a broken API
//! server (or a webhook that refuses every write) with every failing instance at the same
//! rate however long the failure lasted; now each instance waits [`FIRST`], then twice as
//! long after each further failure, up to [`MAX`], and starts over once a reconcile's writes
//! all go through. Refused writes (recorded in the status, not returned) count as failures.
//! Teardown progress ([`crate::Error::Waiting`]) is not a failure and keeps its short
//! requeue.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// Delay after the first failure.
pub const FIRST: Duration = Duration::from_secs(5);
/// Longest delay: an instance failing for hours is still retried every 5 minutes, so it
/// recovers on its own soon after the cause is gone (a watch event wakes it sooner).
pub const MAX: Duration = Duration::from_secs(300);
/// Largest share of a delay taken off at random: instances that failed together (an API
/// outage) then do not all retry at the same instant. Only ever shorter, so [`MAX`] holds.
pub const JITTER: f64 = 0.1;

/// The delay after the `failures`-th failure in a row (1 = the first): [`FIRST`] doubling,
/// at most [`MAX`].
pub fn delay(failures: u32) -> Duration {
    // 2^16 * FIRST is far past MAX already; the bound only keeps the shift in range.
    let doublings = failures.saturating_sub(1).min(16);
    FIRST.saturating_mul(1u32 << doublings).min(MAX)
}

/// `d` shortened by up to [`JITTER`] of it; `unit` is a random number in `[0, 1)`.
pub fn jittered(d: Duration, unit: f64) -> Duration {
    d.mul_f64(1.0 - JITTER * unit)
}

/// Consecutive failures of each instance that is failing now, by uid (a re-created instance
/// of the same name starts over). An instance leaves the map when its writes all go through
/// or its teardown completes ([`Self::reset`]). One deleted before its finalizer was ever
/// added (the finalizer comes first, so only if adding it failed) keeps a few bytes here
/// for the process's life.
#[derive(Default)]
pub struct RetryBackoff {
    failures: Mutex<HashMap<String, u32>>,
}

impl RetryBackoff {
    /// Counts one more failure of instance `uid` and returns how many it has had in a row.
    pub fn fail(&self, uid: &str) -> u32 {
        let mut guard = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let n = guard.entry(uid.to_owned()).or_insert(0);
        *n = n.saturating_add(1);
        *n
    }

    /// Instance `uid` reconciled (its next failure waits [`FIRST`] again), or is gone.
    pub fn reset(&self, uid: &str) {
        let mut guard = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        guard.remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_from_five_seconds_up_to_five_minutes() {
        let secs: Vec<u64> = (1..=9).map(|n| delay(n).as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(delay(u32::MAX), MAX, "no overflow after very many failures");
    }

    #[test]
    fn jitter_only_shortens_and_by_at_most_a_tenth() {
        assert_eq!(jittered(MAX, 0.0), MAX);
        let shortest = jittered(MAX, 0.999_999);
        assert!(
            shortest < MAX && shortest >= Duration::from_secs(270),
            "{shortest:?}"
        );
    }

    #[test]
    fn failures_count_per_instance_and_reset() {
        let b = RetryBackoff::default();
        assert_eq!(b.fail("uid-a"), 1);
        assert_eq!(b.fail("uid-a"), 2);
        assert_eq!(b.fail("uid-a"), 3);
        assert_eq!(b.fail("uid-b"), 1, "another instance starts at one");
        b.reset("uid-a");
        assert_eq!(b.fail("uid-a"), 1, "a reset starts over");
        assert_eq!(b.fail("uid-b"), 2, "the other keeps its count");
    }
}
