//! The activity stamp: when a sandbox was created or last used.
//!
//! The server writes it (`created-at` when it makes a pod, `last-activity` after calls) and
//! the operator's idle GC reads it back to decide when a session has been idle for
//! `idleTimeout`, so the format and its precision are a contract between the two: RFC 3339
//! UTC, whole seconds, truncated (`2026-01-01T00:00:00Z`).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;

use crate::names::annotation;

/// Precision of a stamp: the activity happened at most this long after what it says.
pub const STAMP_RESOLUTION: Duration = Duration::from_secs(1);

/// Shortest time between two `last-activity` writes of one sandbox.
pub const STAMP_GAP_MIN: Duration = Duration::from_secs(2);
/// Longest time between two `last-activity` writes of one sandbox in use.
pub const STAMP_GAP_MAX: Duration = Duration::from_secs(60);

/// How long the server may hold a sandbox's newest activity before writing its stamp, for an
/// instance whose `idleTimeout` is `idle_timeout`: a sixtieth of it, between
/// [`STAMP_GAP_MIN`] and [`STAMP_GAP_MAX`]. A busy session then writes at most one stamp per
/// gap (one a minute under an idle timeout of an hour or more, instead of one every 2 s),
/// and the idle GC, which may read a stamp up to a gap old while the session is in use,
/// waits that much longer than `idleTimeout` before it collects.
pub fn stamp_gap(idle_timeout: Duration) -> Duration {
    (idle_timeout / 60).clamp(STAMP_GAP_MIN, STAMP_GAP_MAX)
}

/// The stamp of `at`: RFC 3339 UTC, truncated to whole seconds.
pub fn stamp(at: Timestamp) -> String {
    at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// The stamp of the current time.
pub fn stamp_now() -> String {
    stamp(Timestamp::now())
}

/// Reads a stamp. Any RFC 3339 time is accepted (older writers put fractional seconds or
/// an offset); anything else is `None`, which the idle GC treats as "never collect".
pub fn parse_stamp(s: &str) -> Option<Timestamp> {
    s.parse::<Timestamp>().ok()
}

/// When the sandbox was last used: `last-activity`, else `created-at`, else the pod's
/// creation time (also when the stamp that is present cannot be read).
pub fn last_activity(p: &Pod) -> Option<Timestamp> {
    last_activity_meta(&p.metadata)
}

/// [`last_activity`] of a pod's metadata alone (a cache that keeps no more of a pod).
pub fn last_activity_meta(m: &ObjectMeta) -> Option<Timestamp> {
    let ann = m.annotations.as_ref();
    ann.and_then(|a| a.get(annotation::LAST_ACTIVITY))
        .or_else(|| ann.and_then(|a| a.get(annotation::CREATED_AT)))
        .and_then(|s| parse_stamp(s))
        .or_else(|| m.creation_timestamp.as_ref().map(|t| t.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: &str) -> Timestamp {
        s.parse().expect("timestamp")
    }

    #[test]
    fn stamps_are_whole_seconds_truncated_and_read_back() {
        let at = ts("2026-01-01T00:00:59.999Z");
        let s = stamp(at);
        assert_eq!(s, "2026-01-01T00:00:59Z");
        assert_eq!(parse_stamp(&s), Some(ts("2026-01-01T00:00:59Z")));
        // Never later than the activity, and less than one resolution earlier.
        let back = parse_stamp(&s).expect("parses");
        assert!(back <= at);
        assert!(at.duration_since(back) < STAMP_RESOLUTION.try_into().expect("fits"));
        let now = stamp_now();
        assert_eq!(now.len(), 20, "{now}");
        assert!(now.ends_with('Z') && now.as_bytes()[10] == b'T', "{now}");
    }

    #[test]
    fn the_stamp_gap_is_a_sixtieth_of_the_idle_timeout_within_bounds() {
        let s = Duration::from_secs;
        assert_eq!(stamp_gap(s(60)), STAMP_GAP_MIN, "the shortest idle timeout");
        assert_eq!(stamp_gap(s(90)), STAMP_GAP_MIN);
        assert_eq!(stamp_gap(s(30 * 60)), s(30), "the default 30m");
        assert_eq!(stamp_gap(s(3600)), STAMP_GAP_MAX);
        assert_eq!(stamp_gap(s(168 * 3600)), STAMP_GAP_MAX, "the longest");
        assert_eq!(stamp_gap(Duration::ZERO), STAMP_GAP_MIN);
    }

    #[test]
    fn other_rfc3339_spellings_are_read_and_garbage_is_not() {
        assert_eq!(
            parse_stamp("2026-01-01T01:00:00.5+01:00"),
            Some(ts("2026-01-01T00:00:00.5Z"))
        );
        assert_eq!(parse_stamp("not-a-time"), None);
        assert_eq!(parse_stamp(""), None);
    }

    #[test]
    fn last_activity_prefers_the_newest_kind_of_stamp() {
        let pod = |ann: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({"metadata": {
                "creationTimestamp": "2026-01-01T00:00:00Z", "annotations": ann}}))
            .expect("pod")
        };
        let both = pod(serde_json::json!({
            annotation::CREATED_AT: "2026-01-01T00:00:01Z",
            annotation::LAST_ACTIVITY: "2026-01-01T00:00:02Z"}));
        assert_eq!(last_activity(&both), Some(ts("2026-01-01T00:00:02Z")));
        let created = pod(serde_json::json!({annotation::CREATED_AT: "2026-01-01T00:00:01Z"}));
        assert_eq!(last_activity(&created), Some(ts("2026-01-01T00:00:01Z")));
        let none = pod(serde_json::json!({}));
        assert_eq!(last_activity(&none), Some(ts("2026-01-01T00:00:00Z")));
        let bad = pod(serde_json::json!({annotation::LAST_ACTIVITY: "yesterday"}));
        assert_eq!(last_activity(&bad), Some(ts("2026-01-01T00:00:00Z")));
        assert_eq!(last_activity(&Pod::default()), None);
    }
}
