//! What the API server and the operator counted between two snapshots: writes by verb and
//! resource, whose they were, all requests, and the pod watch traffic.

use super::snap::Snap;
use crate::prom::Scrape;

use crate::apiserver::WRITE_VERBS;

/// API writes between two snapshots, by (verb, resource[/subresource]), most first.
pub(super) fn writes_between(a: &Snap, b: &Snap) -> Vec<(String, f64)> {
    crate::apiserver::writes_between(&a.api, &b.api)
}

pub(super) fn delta(a: &Scrape, b: &Scrape, name: &str, filter: &[(&str, &str)]) -> f64 {
    (b.sum(name, filter) - a.sum(name, filter)).max(0.0)
}

/// Writes the operator counted itself between two snapshots (`cli_mcp_operator_api_writes_total`).
pub(super) fn operator_writes(a: &Snap, b: &Snap, filter: &[(&str, &str)]) -> f64 {
    delta(
        &a.operator,
        &b.operator,
        "cli_mcp_operator_api_writes_total",
        filter,
    )
}

/// Writes of pods themselves (not `pods/status`): claims, activity stamps, creates, deletes.
fn pod_writes(a: &Snap, b: &Snap) -> f64 {
    WRITE_VERBS
        .iter()
        .map(|v| {
            delta(
                &a.api,
                &b.api,
                "apiserver_request_total",
                &[("resource", "pods"), ("subresource", ""), ("verb", v)],
            )
        })
        .sum()
}

/// The server's writes: the API server's pod writes less the ones the operator counted
/// (the kubelet writes only `pods/status`; nothing else writes pods during a window).
pub(super) fn server_writes(a: &Snap, b: &Snap) -> f64 {
    (pod_writes(a, b) - operator_writes(a, b, &[("kind", "Pod")])).max(0.0)
}

pub(super) fn all_requests(a: &Snap, b: &Snap) -> f64 {
    delta(&a.api, &b.api, "apiserver_request_total", &[])
}

/// Pod watch events the API server sent and their bytes (its watch-cache metrics name the
/// kind in `kind` or, in newer releases, `resource`).
pub(super) fn pod_watch_events(s: &Scrape) -> (f64, f64) {
    let pick = |name: &str| {
        s.series(name, &[])
            .filter(|x| {
                x.label("kind") == Some("Pod")
                    || (x.label("resource") == Some("pods")
                        && x.label("group").unwrap_or("").is_empty())
            })
            .map(|x| x.value)
            .sum::<f64>()
    };
    (
        pick("apiserver_watch_events_total"),
        pick("apiserver_watch_events_sizes_sum"),
    )
}

pub(super) fn watches_open(s: &Scrape) -> f64 {
    s.sum("apiserver_longrunning_requests", &[("verb", "WATCH")])
}
