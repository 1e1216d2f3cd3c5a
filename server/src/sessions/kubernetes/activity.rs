//! The idle clock of sandbox pods: the `last-activity` annotation, stamped when a command
//! starts and when it ends, off the hot path.
//!
//! A call only records the event in memory ([`ActivityStamper::record`], never blocks on the
//! API). A background task patches the annotation: at most once per gap per pod (so a burst
//! of calls is one patch; the gap grows with the instance's idle timeout, see
//! [`cli_mcp_api::activity::stamp_gap`], and the idle GC waits that much longer), and every
//! [`IN_FLIGHT_REFRESH`] (or gap, if longer) while a command runs (so a five-minute command
//! is never idle-collected under a one-minute idle timeout).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::json;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use cli_mcp_api::activity::{stamp_now, STAMP_GAP_MIN};
use cli_mcp_api::names::annotation;

use crate::sessions::Activity;

/// Stamp interval while a command runs.
pub const IN_FLIGHT_REFRESH: Duration = Duration::from_secs(30);
/// An idle entry is dropped after this long (memory stays bounded by the active pods).
const FORGET_AFTER: Duration = Duration::from_secs(120);
const TICK: Duration = Duration::from_secs(1);
const PARALLEL_PATCHES: usize = 16;

#[derive(Debug)]
struct Entry {
    uid: String,
    in_flight: u32,
    /// Time (RFC 3339) of the latest event not yet written.
    pending: Option<String>,
    /// The stamp last written: an event in the same (whole) second needs no write, so a
    /// quick command's start and end are one patch, not two a gap apart.
    written: Option<String>,
    last_write: Option<Instant>,
    touched: Instant,
}

impl Entry {
    fn new(uid: &str, now: Instant) -> Self {
        Self {
            uid: uid.to_owned(),
            in_flight: 0,
            pending: None,
            written: None,
            last_write: None,
            touched: now,
        }
    }
}

/// The entry of `pod` with `uid`: a pod of the same name but another uid (a cold pod made
/// again) starts over.
fn entry_of<'a>(
    entries: &'a mut HashMap<String, Entry>,
    pod: &str,
    uid: &str,
    now: Instant,
) -> &'a mut Entry {
    let e = entries
        .entry(pod.to_owned())
        .or_insert_with(|| Entry::new(uid, now));
    if e.uid != uid {
        *e = Entry::new(uid, now);
    }
    e
}

/// A stamp to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamp {
    pub pod: String,
    pub uid: String,
    pub at: String,
}

#[derive(Debug)]
pub struct ActivityStamper {
    entries: Mutex<HashMap<String, Entry>>,
    wake: Notify,
    /// Shortest time between two stamps of one pod.
    gap: Duration,
}

impl Default for ActivityStamper {
    fn default() -> Self {
        Self::with_gap(STAMP_GAP_MIN)
    }
}

impl ActivityStamper {
    /// A stamper writing each pod's stamp at most once per `gap`.
    pub fn new(gap: Duration) -> Arc<Self> {
        Arc::new(Self::with_gap(gap))
    }

    fn with_gap(gap: Duration) -> Self {
        Self {
            entries: Mutex::default(),
            wake: Notify::new(),
            gap,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a command start or end in `pod` (cheap; never waits for the API).
    pub fn record(&self, pod: &str, uid: &str, event: Activity) {
        self.record_at(pod, uid, event, stamp_now());
    }

    /// [`Self::record`] of an event whose stamp is `at`.
    fn record_at(&self, pod: &str, uid: &str, event: Activity, at: String) {
        let now = Instant::now();
        let mut entries = self.lock();
        let e = entry_of(&mut entries, pod, uid, now);
        match event {
            Activity::Start => e.in_flight += 1,
            Activity::End => e.in_flight = e.in_flight.saturating_sub(1),
        }
        e.touched = now;
        // Stamps only move forward, so an event in the second last written changes nothing.
        if e.written.as_ref() == Some(&at) {
            return;
        }
        e.pending = Some(at);
        drop(entries);
        self.wake.notify_one();
    }

    /// `pod`'s annotation already says `at`, written by another patch (a warm pod's claim
    /// stamps it): an event in that second needs no write of its own, and the next stamp
    /// waits a gap as after any write. A warm start's first quick command then costs no
    /// stamp of its own.
    pub fn written_by_claim(&self, pod: &str, uid: &str, at: String) {
        self.written_at(pod, uid, at, Instant::now());
    }

    fn written_at(&self, pod: &str, uid: &str, at: String, now: Instant) {
        let mut entries = self.lock();
        let e = entry_of(&mut entries, pod, uid, now);
        e.written = Some(at);
        e.last_write = Some(now);
        e.touched = now;
    }

    /// The stamps due at `now`, marking them written.
    pub fn due(&self, now: Instant) -> Vec<Stamp> {
        let mut entries = self.lock();
        let mut out = Vec::new();
        for (pod, e) in entries.iter_mut() {
            let since = e.last_write.map(|t| now.saturating_duration_since(t));
            let gap_ok = since.is_none_or(|s| s >= self.gap);
            let refresh = e.in_flight > 0 && since.is_none_or(|s| s >= IN_FLIGHT_REFRESH);
            if gap_ok && (e.pending.is_some() || refresh) {
                let at = e.pending.take().unwrap_or_else(stamp_now);
                e.written = Some(at.clone());
                e.last_write = Some(now);
                out.push(Stamp {
                    pod: pod.clone(),
                    uid: e.uid.clone(),
                    at,
                });
            }
        }
        entries.retain(|_, e| {
            e.in_flight > 0
                || e.pending.is_some()
                || now.saturating_duration_since(e.touched) < FORGET_AFTER
        });
        out
    }

    /// Forgets a pod (deleted or gone).
    pub fn forget(&self, pod: &str) {
        self.lock().remove(pod);
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Writes due stamps until `stop`, then writes what is still pending.
    pub async fn run(self: Arc<Self>, pods: Api<Pod>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
                _ = self.wake.notified() => {}
            }
            self.write(&pods, self.due(Instant::now())).await;
        }
        // Final flush, ignoring the gap.
        let pending: Vec<Stamp> = {
            let mut entries = self.lock();
            entries
                .iter_mut()
                .filter_map(|(pod, e)| {
                    e.pending.take().map(|at| Stamp {
                        pod: pod.clone(),
                        uid: e.uid.clone(),
                        at,
                    })
                })
                .collect()
        };
        self.write(&pods, pending).await;
    }

    async fn write(&self, pods: &Api<Pod>, stamps: Vec<Stamp>) {
        if stamps.is_empty() {
            return;
        }
        futures::stream::iter(stamps)
            .for_each_concurrent(PARALLEL_PATCHES, |s| async move {
                // The uid is a precondition: a re-created pod of the same name is not stamped
                // with the old one's activity.
                let patch = json!({
                    "metadata": {
                        "uid": s.uid,
                        "annotations": { annotation::LAST_ACTIVITY: s.at }
                    }
                });
                match pods
                    .patch(&s.pod, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {
                        self.forget(&s.pod);
                    }
                    Err(e) => {
                        tracing::warn!(pod = %s.pod, error = %e, "cannot stamp last-activity");
                    }
                }
            })
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stamp of second `sec` of a test's timeline.
    fn at(sec: u64) -> String {
        format!("2026-01-01T00:{:02}:{:02}Z", sec / 60, sec % 60)
    }

    #[test]
    fn a_claims_stamp_is_not_written_again() {
        let s = ActivityStamper::with_gap(Duration::from_secs(5));
        let t0 = Instant::now();
        s.written_at("p", "u", at(0), t0);
        // The first command, within the claim's second: nothing to write.
        s.record_at("p", "u", Activity::Start, at(0));
        s.record_at("p", "u", Activity::End, at(0));
        assert!(s.due(t0).is_empty(), "the claim wrote this second");
        // A later event waits a gap after the claim's write, then is written.
        s.record_at("p", "u", Activity::Start, at(2));
        s.record_at("p", "u", Activity::End, at(2));
        assert!(s.due(t0 + Duration::from_secs(2)).is_empty());
        let due = s.due(t0 + Duration::from_secs(5));
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].at, at(2));
        // Another pod of the same name (re-created) starts over.
        s.written_at("p", "v", at(9), t0);
        s.record_at("p", "v", Activity::End, at(9));
        assert!(s.due(t0).is_empty());
    }

    #[test]
    fn start_and_end_of_a_quick_command_coalesce() {
        let s = ActivityStamper::default();
        let t0 = Instant::now();
        s.record_at("p", "u", Activity::Start, at(0));
        assert_eq!(s.due(t0).len(), 1, "first event is written at once");
        s.record_at("p", "u", Activity::End, at(0));
        s.record_at("p", "u", Activity::Start, at(1));
        s.record_at("p", "u", Activity::End, at(1));
        assert!(
            s.due(t0 + Duration::from_millis(500)).is_empty(),
            "within the gap"
        );
        let later = s.due(t0 + STAMP_GAP_MIN);
        assert_eq!(later.len(), 1, "the burst becomes one write");
        assert_eq!(later[0].at, at(1), "of the newest event");
        assert!(s.due(t0 + STAMP_GAP_MIN * 2).is_empty(), "nothing new");
    }

    #[test]
    fn an_event_in_the_second_already_written_writes_nothing() {
        let s = ActivityStamper::default();
        let t0 = Instant::now();
        s.record_at("p", "u", Activity::Start, at(0));
        assert_eq!(s.due(t0).len(), 1);
        s.record_at("p", "u", Activity::End, at(0));
        assert!(
            s.due(t0 + STAMP_GAP_MIN * 5).is_empty(),
            "a quick command's end stamps the same second as its start"
        );
        s.record_at("p", "u", Activity::Start, at(20));
        assert_eq!(s.due(t0 + STAMP_GAP_MIN * 10).len(), 1, "a later second is");
    }

    /// 100 sessions each calling once a second for a minute, under an idle timeout of an
    /// hour or more: one stamp per session at the start and one a minute after, not 30.
    #[test]
    fn a_longer_gap_coalesces_a_busy_minute() {
        let gap = cli_mcp_api::activity::stamp_gap(Duration::from_secs(168 * 3600));
        let s = ActivityStamper::with_gap(gap);
        let t0 = Instant::now();
        let mut written = 0;
        for sec in 0..=60u64 {
            for p in 0..100 {
                s.record_at(&format!("p{p}"), "u", Activity::Start, at(sec));
                s.record_at(&format!("p{p}"), "u", Activity::End, at(sec));
            }
            written += s.due(t0 + Duration::from_secs(sec)).len();
        }
        assert_eq!(written, 200, "the first call, then one a gap (60 s) later");
        let short = ActivityStamper::default();
        let mut written = 0;
        for sec in 0..=60u64 {
            short.record_at("p", "u", Activity::End, at(sec));
            written += short.due(t0 + Duration::from_secs(sec)).len();
        }
        assert_eq!(written, 31, "every 2 s under a short idle timeout");
    }

    #[test]
    fn a_running_command_is_refreshed() {
        let s = ActivityStamper::default();
        let t0 = Instant::now();
        s.record_at("p", "u", Activity::Start, at(0));
        assert_eq!(s.due(t0).len(), 1);
        assert!(s.due(t0 + Duration::from_secs(10)).is_empty());
        assert_eq!(
            s.due(t0 + IN_FLIGHT_REFRESH).len(),
            1,
            "refresh while running"
        );
        // The refresh stamped the wall clock; the end is stamped later than that.
        s.record_at("p", "u", Activity::End, "2099-01-01T00:00:00Z".into());
        assert_eq!(
            s.due(t0 + IN_FLIGHT_REFRESH * 2).len(),
            1,
            "the end is written"
        );
        assert!(
            s.due(t0 + IN_FLIGHT_REFRESH * 3).is_empty(),
            "idle: nothing more"
        );
    }

    #[test]
    fn idle_entries_are_forgotten() {
        let s = ActivityStamper::default();
        let t0 = Instant::now();
        s.record("p", "u", Activity::Start);
        s.record("p", "u", Activity::End);
        s.due(t0);
        s.due(t0 + Duration::from_secs(1000));
        assert!(s.is_empty());
    }
}
