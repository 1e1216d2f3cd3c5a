//! Prometheus metrics (docs/server.md lists them). Every label has a small, fixed set of values: no session ids,
//! pod names or callers ever become labels.
//!
//! - [`labels`]: the label values and label sets;
//! - `families`: the registration of every family, group by group;
//! - [`format`](mod@format): the exposition formats a scraper may ask for;
//! - `process`: the standard `process_*` metrics.

use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

mod families;
pub mod format;
pub mod labels;
mod process;

use self::families::{AuthFamilies, CallFamilies, SessionFamilies};
pub use self::format::Format;
pub use self::labels::*;
use self::process::ProcessCollector;

pub struct Metrics {
    registry: Registry,
    pub sessions_active: Gauge,
    pub session_start: Family<LaunchLabels, Histogram>,
    pub admission: Family<AdmissionLabels, Histogram>,
    pub claim_conflicts: Counter,
    pub exec_duration: Family<OutcomeLabels, Histogram>,
    pub timeouts: Counter,
    pub truncations: Counter,
    pub state_resets: Counter,
    pub errors: Family<ErrorLabels, Counter>,
    pub auth: Family<AuthLabels, Counter>,
    pub token_reviews: Family<ReviewLabels, Counter>,
    pub token_reviews_in_flight: Gauge,
    pub token_reviews_in_flight_max: Gauge,
    pub auth_busy: Counter,
    pub http_requests: Family<HttpLabels, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        // The process_* metrics keep their standard names; everything else is cli_mcp_*.
        let mut root = Registry::default();
        root.register_collector(Box::new(ProcessCollector));
        let registry = root.sub_registry_with_prefix("cli_mcp");
        families::register_build(registry);
        let SessionFamilies {
            sessions_active,
            session_start,
            admission,
            claim_conflicts,
        } = families::register_sessions(registry);
        let CallFamilies {
            exec_duration,
            timeouts,
            truncations,
            state_resets,
            errors,
        } = families::register_calls(registry);
        let AuthFamilies {
            auth,
            token_reviews,
            token_reviews_in_flight,
            token_reviews_in_flight_max,
            auth_busy,
        } = families::register_auth(registry);
        let http_requests = families::register_http(registry);
        let m = Self {
            http_requests,
            token_reviews,
            token_reviews_in_flight,
            token_reviews_in_flight_max,
            auth_busy,
            registry: root,
            sessions_active,
            session_start,
            admission,
            claim_conflicts,
            exec_duration,
            timeouts,
            truncations,
            state_resets,
            errors,
            auth,
        };
        m.zero_all_label_sets();
        m
    }

    /// Creates every label set of every family, so each series is there (at 0) from the
    /// first scrape: `rate()` and alerts on a series that appears only with its first event
    /// miss that event.
    fn zero_all_label_sets(&self) {
        for &launch in Launch::ALL {
            let _ = self.session_start.get_or_create(&LaunchLabels { launch });
        }
        for &result in Admitted::ALL {
            let _ = self.admission.get_or_create(&AdmissionLabels { result });
        }
        for &outcome in Outcome::ALL {
            let _ = self.exec_duration.get_or_create(&OutcomeLabels { outcome });
        }
        for &kind in ErrorKind::ALL {
            let _ = self.errors.get_or_create(&ErrorLabels { kind });
        }
        for &result in AuthResult::ALL {
            for cached in [false, true] {
                let _ = self.auth.get_or_create(&AuthLabels { result, cached });
            }
        }
        for &result in ReviewResult::ALL {
            let _ = self.token_reviews.get_or_create(&ReviewLabels { result });
        }
        for &listener in Listener::ALL {
            for &route in Route::of_listener(listener) {
                for &status in StatusClass::ALL {
                    let _ = self.http_requests.get_or_create(&HttpLabels {
                        listener,
                        route,
                        status,
                    });
                }
            }
        }
    }

    /// Counts one answered HTTP request.
    pub fn http_request(&self, listener: Listener, path: &str, status: u16) {
        self.http_requests
            .get_or_create(&HttpLabels {
                listener,
                route: Route::of(listener, path),
                status: StatusClass::of(status),
            })
            .inc();
    }

    pub fn error(&self, kind: ErrorKind) {
        self.errors.get_or_create(&ErrorLabels { kind }).inc();
    }

    pub fn started(&self, launch: Launch, took: Duration) {
        self.session_start
            .get_or_create(&LaunchLabels { launch })
            .observe(took.as_secs_f64());
    }

    pub fn admission(&self, result: Admitted, took: Duration) {
        self.admission
            .get_or_create(&AdmissionLabels { result })
            .observe(took.as_secs_f64());
    }

    pub fn exec(&self, outcome: Outcome, took: Duration) {
        self.exec_duration
            .get_or_create(&OutcomeLabels { outcome })
            .observe(took.as_secs_f64());
    }

    pub fn auth(&self, result: AuthResult, cached: bool) {
        self.auth
            .get_or_create(&AuthLabels { result, cached })
            .inc();
    }

    pub fn token_review(&self, result: ReviewResult) {
        self.token_reviews
            .get_or_create(&ReviewLabels { result })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        self.encode_as(Format::OpenMetrics)
    }

    /// The exposition in `format`.
    pub fn encode_as(&self, format: Format) -> String {
        let mut out = String::new();
        let result = match format {
            Format::OpenMetrics => {
                prometheus_client::encoding::text::encode(&mut out, &self.registry)
            }
            Format::PrometheusText => {
                prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
            }
        };
        if let Err(e) = result {
            tracing::error!(error = %e, "encoding metrics failed");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_the_spec_metrics_with_low_cardinality_labels() {
        let m = Metrics::new();
        m.sessions_active.set(3);
        m.started(Launch::Warm, Duration::from_millis(40));
        m.claim_conflicts.inc();
        m.exec(Outcome::Ok, Duration::from_millis(2));
        m.timeouts.inc();
        m.truncations.inc();
        m.error(ErrorKind::SessionLimit);
        m.auth(AuthResult::Allowed, true);
        m.token_review(ReviewResult::Unauthenticated);
        m.auth_busy.inc();
        m.admission(Admitted::Refused, Duration::from_micros(3));
        let text = m.encode();
        for needle in [
            "cli_mcp_sessions_active 3",
            "cli_mcp_session_start_seconds_count{launch=\"warm\"} 1",
            "cli_mcp_claim_conflicts_total 1",
            "cli_mcp_exec_duration_seconds_count{outcome=\"ok\"} 1",
            "cli_mcp_exec_timeouts_total 1",
            "cli_mcp_exec_truncations_total 1",
            "cli_mcp_errors_total{kind=\"session_limit\"} 1",
            "cli_mcp_auth_decisions_total{result=\"allowed\",cached=\"true\"} 1",
            "cli_mcp_token_reviews_total{result=\"unauthenticated\"} 1",
            "cli_mcp_token_reviews_in_flight 0",
            "cli_mcp_token_reviews_in_flight_max 0",
            "cli_mcp_auth_busy_total 1",
            "cli_mcp_session_admission_seconds_count{result=\"refused\"} 1",
            "cli_mcp_session_admission_seconds_bucket{le=\"0.000005\",result=\"refused\"} 1",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
    }

    #[test]
    fn every_labelled_family_starts_at_zero_next_to_build_and_process_facts() {
        let text = Metrics::new().encode();
        for needle in [
            "cli_mcp_errors_total{kind=\"busy\"} 0",
            "cli_mcp_errors_total{kind=\"kubernetes_api\"} 0",
            "cli_mcp_exec_duration_seconds_count{outcome=\"error\"} 0",
            "cli_mcp_session_start_seconds_count{launch=\"cold\"} 0",
            "cli_mcp_session_admission_seconds_count{result=\"admitted\"} 0",
            "cli_mcp_auth_decisions_total{result=\"denied\",cached=\"false\"} 0",
            "cli_mcp_token_reviews_total{result=\"error\"} 0",
            "cli_mcp_http_requests_total{listener=\"health\",route=\"/metrics\",status=\"2xx\"} 0",
            "# TYPE cli_mcp_build info",
            "# TYPE process_cpu_seconds counter",
            "# UNIT process_resident_memory_bytes bytes",
            "process_threads ",
            "process_max_fds ",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
    }

    #[test]
    fn http_requests_are_counted_by_route_and_status_class() {
        let m = Metrics::new();
        m.http_request(Listener::Mcp, "/mcp", 200);
        m.http_request(Listener::Mcp, "/sessions/abc", 204);
        m.http_request(Listener::Mcp, "/nope/secret-looking-path", 404);
        m.http_request(Listener::Mcp, "/mcp", 503);
        let text = m.encode();
        for needle in [
            "{listener=\"mcp\",route=\"/mcp\",status=\"2xx\"} 1",
            "{listener=\"mcp\",route=\"/sessions/{id}\",status=\"2xx\"} 1",
            "{listener=\"mcp\",route=\"other\",status=\"4xx\"} 1",
            "{listener=\"mcp\",route=\"/mcp\",status=\"5xx\"} 1",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
        assert!(
            !text.contains("secret-looking"),
            "paths never become labels"
        );
    }
}
