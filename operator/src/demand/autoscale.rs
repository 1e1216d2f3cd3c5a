//! The size of a warm pool sized by demand (`spec.sandbox.warmPool`), without a client.
//!
//! The pool must hold what sessions take while new warm pods are made. So:
//! - **lead**: how long a session taken from the pool must be covered, twice the median
//!   time this pool's Ready pods took from creation to Ready, plus two seconds for the
//!   operator to see the claim and create (5 s to 60 s). Only a pod Ready within a minute of
//!   its creation is a sample (a later Ready is a restart or a flap, not a start); without
//!   one now the last measured startup holds, and 5 s before any;
//! - the recommendation is the most new sessions that arrived within one lead, over the
//!   last minute, within `min..=max`: a steady rate asks for rate × lead, a burst of N at
//!   once for N.
//!
//! The pool grows to a higher recommendation at once and shrinks only to the highest
//! recommendation of the last `scaleDownDelay` (as the HorizontalPodAutoscaler's downscale
//! stabilization does): a steady rate keeps a steady size, and a quiet spell of
//! `scaleDownDelay` brings it back to `min`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;

use cli_mcp_api::crd::DemandBounds;
use cli_mcp_api::pod_state::is_ready;

/// Startup assumed until a pod of the pool was measured.
pub const DEFAULT_STARTUP: Duration = Duration::from_secs(5);
/// A pod Ready later than this after its creation did not just start (it restarted, or its
/// readiness flapped): not a startup sample.
pub const MAX_STARTUP_SAMPLE: Duration = Duration::from_secs(60);
/// Time for the operator to see a claim and create the replacement, beyond the pod's own
/// startup.
pub const REACTION: Duration = Duration::from_secs(2);
pub const MIN_LEAD: Duration = Duration::from_secs(5);
pub const MAX_LEAD: Duration = Duration::from_secs(60);
/// How soon a pool sized by demand is looked at again while its size may still change:
/// the demand ages without any event to wake the instance.
pub const RECHECK: Duration = Duration::from_secs(10);

/// What the pool's size was chosen from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    /// New sessions in the last minute.
    pub last_minute: usize,
    /// The most new sessions within one [`Self::lead`] of the last minute.
    pub busiest: usize,
    /// Median time from creation to Ready of the pool's Ready pods, if any was measured.
    pub startup: Option<Duration>,
}

impl Demand {
    /// From the ages of the last minute's session starts (any order) and the pool's pods;
    /// `known_startup` is the startup measured before, for when no pod gives one now.
    pub fn read(mut ages: Vec<Duration>, pool: &[&Pod], known_startup: Option<Duration>) -> Self {
        // In order for the window search (the log gives them newest first; tests any way).
        ages.sort();
        let startup = startup_time(pool).or(known_startup);
        Self {
            last_minute: ages.len(),
            busiest: busiest(&ages, lead(startup)),
            startup,
        }
    }

    /// How long a session taken from the pool must be covered before its replacement is
    /// Ready.
    pub fn lead(&self) -> Duration {
        lead(self.startup)
    }

    /// The size this demand asks for, within `bounds`.
    pub fn recommend(&self, bounds: &DemandBounds) -> i32 {
        bounds.clamp(i32::try_from(self.busiest).unwrap_or(i32::MAX))
    }
}

fn lead(startup: Option<Duration>) -> Duration {
    (startup.unwrap_or(DEFAULT_STARTUP) * 2 + REACTION).clamp(MIN_LEAD, MAX_LEAD)
}

/// Most starts within any `window` of the sorted `ages`.
fn busiest(ages: &[Duration], window: Duration) -> usize {
    debug_assert!(window > Duration::ZERO, "an empty window never advances");
    let mut best = 0;
    let mut first = 0;
    for (last, age) in ages.iter().enumerate() {
        while *age - ages[first] >= window {
            first += 1;
        }
        best = best.max(last + 1 - first);
    }
    best
}

/// The (lower) median time the Ready pods of `pool` took from creation to Ready, from their
/// `creationTimestamp` and their Ready condition's `lastTransitionTime` (whole seconds; the
/// API server's clock against the kubelet's). Pods Ready more than [`MAX_STARTUP_SAMPLE`]
/// after their creation are left out.
pub fn startup_time(pool: &[&Pod]) -> Option<Duration> {
    let mut took: Vec<Duration> = pool
        .iter()
        .filter(|p| is_ready(p))
        .filter_map(|p| {
            let created = p.metadata.creation_timestamp.as_ref()?.0;
            let ready = p
                .status
                .as_ref()?
                .conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == "Ready")?
                .last_transition_time
                .as_ref()?
                .0;
            let secs = ready.duration_since(created).as_secs_f64();
            (0.0..=MAX_STARTUP_SAMPLE.as_secs_f64())
                .contains(&secs)
                .then(|| Duration::from_secs_f64(secs))
        })
        .collect();
    took.sort();
    took.get(took.len().saturating_sub(1) / 2).copied()
}

/// One instance's sizing memory: the recommendations of the last `scaleDownDelay`, and the
/// size it last chose.
#[derive(Debug, Default)]
pub struct Autoscaler {
    history: VecDeque<(Instant, i32)>,
    last: Option<i32>,
    /// The last startup measured from the pool's pods (a drained pool measures none).
    startup: Option<Duration>,
}

impl Autoscaler {
    /// The size to aim at now, given this moment's recommendation: the highest of the last
    /// `scaleDownDelay`. `seed` is the size the status last reported, taken as a
    /// recommendation made now when this process has none (a restarted or new leader keeps
    /// the pool it finds for a delay instead of shrinking it at once).
    pub fn target(
        &mut self,
        recommended: i32,
        bounds: &DemandBounds,
        seed: Option<i32>,
        now: Instant,
    ) -> i32 {
        if self.history.is_empty() {
            if let Some(seed) = seed {
                self.history.push_back((now, seed));
            }
        }
        while self
            .history
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > bounds.scale_down_delay)
        {
            self.history.pop_front();
        }
        // Only a new high needs keeping: older, lower values never decide the maximum again.
        while self.history.back().is_some_and(|(_, r)| *r <= recommended) {
            self.history.pop_back();
        }
        self.history.push_back((now, recommended));
        let highest = self.history.iter().map(|(_, r)| *r).max();
        let target = bounds.clamp(highest.unwrap_or(recommended));
        self.last = Some(target);
        target
    }

    /// The size [`Self::target`] last chose, if it ever did in this process.
    pub fn last(&self) -> Option<i32> {
        self.last
    }

    /// The startup measured last, if any.
    pub fn startup(&self) -> Option<Duration> {
        self.startup
    }

    /// Keeps `startup` as the last measured one.
    pub fn measured(&mut self, startup: Option<Duration>) {
        self.startup = startup.or(self.startup);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::{SignedDuration, Timestamp};
    use serde_json::json;

    fn bounds(min: i32, max: i32, delay_secs: u64) -> DemandBounds {
        DemandBounds {
            min,
            max,
            scale_down_delay: Duration::from_secs(delay_secs),
        }
    }

    fn secs(s: &[f64]) -> Vec<Duration> {
        s.iter().map(|s| Duration::from_secs_f64(*s)).collect()
    }

    /// Starts at `per_second` for the whole last minute.
    fn steady(per_second: f64) -> Vec<Duration> {
        let n = (per_second * 60.0) as u64;
        let apart_ms = (1000.0 / per_second) as u64;
        (0..n)
            .map(|i| Duration::from_millis(i * apart_ms))
            .collect()
    }

    fn pool_pod(startup_secs: i64, ready: bool) -> Pod {
        let created = Timestamp::from_second(1_800_000_000).expect("time");
        let at = created + SignedDuration::from_secs(startup_secs);
        serde_json::from_value(json!({
            "metadata": {"name": "p", "creationTimestamp": Time(created)},
            "status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": if ready {"True"} else {"False"},
                 "lastTransitionTime": Time(at)}]}
        }))
        .expect("pod")
    }

    #[test]
    fn the_busiest_window_is_found() {
        let ten = Duration::from_secs(10);
        assert_eq!(busiest(&[], ten), 0);
        let ages = secs(&[0.0, 1.0, 2.0, 30.0, 31.0, 35.0, 39.9, 50.0]);
        assert_eq!(busiest(&ages, ten), 4);
        assert_eq!(busiest(&ages, Duration::from_secs(3)), 3);
    }

    #[test]
    fn a_steady_rate_asks_for_rate_times_lead() {
        // 10 sessions a second, pods Ready in 2 s: lead 2 × 2 + 2 = 6 s, 60 warm.
        let pods = [pool_pod(2, true), pool_pod(2, true), pool_pod(9, false)];
        let refs: Vec<&Pod> = pods.iter().collect();
        let d = Demand::read(steady(10.0), &refs, None);
        assert_eq!(d.startup, Some(Duration::from_secs(2)));
        assert_eq!(d.last_minute, 600);
        assert_eq!(d.lead(), Duration::from_secs(6));
        assert_eq!(d.recommend(&bounds(0, 200, 300)), 60);
        assert_eq!(d.recommend(&bounds(0, 40, 300)), 40, "capped at max");
    }

    #[test]
    fn a_burst_counts_at_once_and_no_demand_asks_for_min() {
        // 100 at once, nothing measured yet: the next burst like it is served warm.
        let d = Demand::read(vec![Duration::from_secs(1); 100], &[], None);
        assert_eq!((d.busiest, d.lead()), (100, Duration::from_secs(12)));
        assert_eq!(d.recommend(&bounds(3, 200, 300)), 100);
        let none = Demand::read(Vec::new(), &[], None);
        assert_eq!(none.recommend(&bounds(3, 200, 300)), 3);
    }

    #[test]
    fn the_lead_is_bounded() {
        let slow = [pool_pod(50, true)];
        let refs: Vec<&Pod> = slow.iter().collect();
        assert_eq!(Demand::read(Vec::new(), &refs, None).lead(), MAX_LEAD);
        let instant = [pool_pod(0, true)];
        let refs: Vec<&Pod> = instant.iter().collect();
        assert_eq!(Demand::read(Vec::new(), &refs, None).lead(), MIN_LEAD);
    }

    #[test]
    fn a_restart_is_no_startup_and_a_drained_pool_keeps_the_last_one() {
        // Ready an hour after its creation: it restarted or flapped, not started.
        let old = [pool_pod(3600, true), pool_pod(3, true)];
        let refs: Vec<&Pod> = old.iter().collect();
        assert_eq!(startup_time(&refs), Some(Duration::from_secs(3)));
        // Two samples: the lower one (a first image pull is the slower).
        let two = [pool_pod(2, true), pool_pod(30, true)];
        let refs: Vec<&Pod> = two.iter().collect();
        assert_eq!(startup_time(&refs), Some(Duration::from_secs(2)));
        // Nothing Ready now: what was measured before holds.
        let d = Demand::read(Vec::new(), &[], Some(Duration::from_secs(4)));
        assert_eq!(d.lead(), Duration::from_secs(10));
        let mut a = Autoscaler::default();
        a.measured(Some(Duration::from_secs(4)));
        a.measured(None);
        assert_eq!(a.startup(), Some(Duration::from_secs(4)));
    }

    #[test]
    fn growing_is_at_once_and_shrinking_waits_for_the_delay() {
        let b = bounds(2, 100, 60);
        let mut a = Autoscaler::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(a.target(2, &b, None, at(0)), 2);
        assert_eq!(
            a.target(50, &b, None, at(5)),
            50,
            "a burst grows the pool at once"
        );
        assert_eq!(a.target(10, &b, None, at(30)), 50, "held within the delay");
        assert_eq!(
            a.target(2, &b, None, at(64)),
            50,
            "a delay after the high is not over"
        );
        assert_eq!(
            a.target(2, &b, None, at(66)),
            10,
            "the highest left in the delay"
        );
        assert_eq!(
            a.target(2, &b, None, at(91)),
            2,
            "a full delay of calm: back to min"
        );
    }

    #[test]
    fn a_steady_but_noisy_rate_keeps_one_size() {
        // The recommendation wobbles around 60 every 10 s for ten minutes: the target
        // settles on the highest and stays there (no pod is created and deleted in turn).
        let b = bounds(0, 200, 300);
        let mut a = Autoscaler::default();
        let t0 = Instant::now();
        let mut targets = Vec::new();
        for i in 0..60u64 {
            let wobble = [60, 54, 66, 58, 62][(i % 5) as usize];
            targets.push(a.target(wobble, &b, None, t0 + Duration::from_secs(i * 10)));
        }
        assert!(targets[2..].iter().all(|t| *t == 66), "{targets:?}");
    }

    #[test]
    fn a_new_leader_keeps_the_size_it_finds_for_a_delay() {
        let b = bounds(1, 100, 60);
        let mut a = Autoscaler::default();
        let t0 = Instant::now();
        assert_eq!(a.target(1, &b, Some(40), t0), 40);
        assert_eq!(a.target(1, &b, Some(40), t0 + Duration::from_secs(61)), 1);
        // Bounds lowered below what was held: the new max wins at once.
        assert_eq!(a.target(90, &b, None, t0 + Duration::from_secs(62)), 90);
        assert_eq!(
            a.target(1, &bounds(1, 20, 60), None, t0 + Duration::from_secs(63)),
            20
        );
    }
}
