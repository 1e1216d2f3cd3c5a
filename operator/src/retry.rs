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

use kube::ResourceExt;

use cli_mcp_api::crd::CliMcpInstance;

/// Delay after the first failure.
pub const FIRST: Duration = Duration::from_secs(5);
/// Longest delay: an instance failing for hours is still retried every 5 minutes, so it
/// recovers on its own soon after the cause is gone (a watch event wakes it sooner).
pub const MAX: Duration = Duration::from_secs(300);
/// Largest share of a delay taken off at random: instances that failed together (an API
/// outage) then do not all retry at the same instant. Only ever shorter, so [`MAX`] holds.
pub const JITTER: f64 = 0.1;

/// One instance: namespace, name and uid. The uid keeps a re-created instance of the same
/// name from inheriting the failures of the one it replaces.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InstanceKey {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl InstanceKey {
    pub fn of(cr: &CliMcpInstance) -> Self {
        Self {
            namespace: cr.namespace().unwrap_or_default(),
            name: cr.name_any(),
            uid: cr.uid().unwrap_or_default(),
        }
    }
}

/// The delay after the `failures`-th failure in a row (1 = the first): [`FIRST`] doubling,
/// at most [`MAX`].
pub fn delay(failures: u32) -> Duration {
    // 2^16 * FIRST is far past MAX already; the bound only keeps the shift in range.
    let doublings = failures.saturating_sub(1).min(16);
    FIRST.saturating_mul(1u32 << doublings).min(MAX)
}

/// `d` shortened by up to [`JITTER`] of it; `unit` is a random number in `[0, 1)`.
pub fn jittered(d: Duration, unit: f64) -> Duration {
    let unit = if unit.is_finite() {
        unit.clamp(0.0, 1.0)
    } else {
        0.0
    };
    d.mul_f64(1.0 - JITTER * unit)
}

/// Consecutive failures of each instance that is failing now. An instance leaves the map when
/// it reconciles ([`Self::succeeded`]) or is deleted ([`Self::forget`], [`Self::retain`]), so
/// the map holds failing live instances only.
#[derive(Default)]
pub struct RetryBackoff {
    failures: Mutex<HashMap<InstanceKey, u32>>,
}

impl RetryBackoff {
    /// Counts one more failure of `key` and returns how many it has had in a row.
    pub fn fail(&self, key: &InstanceKey) -> u32 {
        let mut guard = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let n = guard.entry(key.clone()).or_insert(0);
        *n = n.saturating_add(1);
        *n
    }

    /// `key` reconciled: its next failure waits [`FIRST`] again.
    pub fn succeeded(&self, key: &InstanceKey) {
        let mut guard = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        guard.remove(key);
    }

    /// The instance `uid` is gone (its teardown is complete).
    pub fn forget(&self, uid: &str) {
        let mut guard = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        guard.retain(|k, _| k.uid != uid);
    }

    /// Keeps only the instances `live` says still exist: one deleted without a teardown (its
    /// finalizer was never added, or removed by hand) is dropped here.
    pub fn retain(&self, live: impl Fn(&InstanceKey) -> bool) {
        let mut guard = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        guard.retain(|k, _| live(k));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str, uid: &str) -> InstanceKey {
        InstanceKey {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    #[test]
    fn delays_double_from_five_seconds_up_to_five_minutes() {
        let secs: Vec<u64> = (1..=9).map(|n| delay(n).as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(delay(u32::MAX), MAX, "no overflow after very many failures");
        assert_eq!(delay(0), FIRST);
    }

    #[test]
    fn jitter_only_shortens_and_by_at_most_a_tenth() {
        assert_eq!(jittered(MAX, 0.0), MAX);
        let shortest = jittered(MAX, 0.999_999);
        assert!(
            shortest < MAX && shortest >= Duration::from_secs(270),
            "{shortest:?}"
        );
        assert_eq!(jittered(FIRST, 2.0), Duration::from_millis(4500), "clamped");
        assert_eq!(jittered(FIRST, -1.0), FIRST, "clamped");
        assert_eq!(jittered(FIRST, f64::NAN), FIRST);
    }

    #[test]
    fn failures_count_per_instance_and_reset_on_success() {
        let b = RetryBackoff::default();
        let a = key("a", "uid-a");
        assert_eq!(b.fail(&a), 1);
        assert_eq!(b.fail(&a), 2);
        assert_eq!(b.fail(&a), 3);
        assert_eq!(
            b.fail(&key("b", "uid-b")),
            1,
            "another instance starts at one"
        );
        assert_eq!(
            b.fail(&key("a", "uid-a2")),
            1,
            "a re-created instance of the same name starts at one"
        );
        b.succeeded(&a);
        assert_eq!(b.fail(&a), 1, "a success starts over");
    }

    #[test]
    fn deleted_instances_are_forgotten() {
        let b = RetryBackoff::default();
        b.fail(&key("a", "uid-a"));
        b.fail(&key("b", "uid-b"));
        b.fail(&key("c", "uid-c"));
        b.forget("uid-a");
        assert_eq!(b.len(), 2);
        b.retain(|k| k.name != "b");
        assert_eq!(b.len(), 1);
        assert_eq!(b.fail(&key("a", "uid-a")), 1);
        assert_eq!(
            b.fail(&key("c", "uid-c")),
            2,
            "live instances keep their count"
        );
    }
}
