//! Prometheus metrics (docs/server.md lists them). Every label has a small, fixed set of values: no session ids,
//! pod names or callers ever become labels.

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// How a session's sandbox came to be.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Launch {
    /// A warm pool pod was claimed.
    Warm,
    /// A pod was created on demand.
    Cold,
    /// A local agent process was started (local backend).
    Local,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LaunchLabels {
    pub launch: Launch,
}

/// Result of one `bash` call.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Outcome {
    /// Exit code 0.
    Ok,
    /// Non-zero exit code.
    Failed,
    TimedOut,
    /// The call did not reach a result (see `errors_total` for the kind).
    Error,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: Outcome,
}

/// What `--max-sessions` admission decided for a new session.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Admitted {
    Admitted,
    /// The limit error.
    Refused,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    pub result: Admitted,
}

/// Why a call or request failed.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum ErrorKind {
    /// Missing or invalid X-Session-ID, bad arguments.
    BadRequest,
    /// No valid bearer token.
    Unauthenticated,
    /// SubjectAccessReview denied, or another identity's session.
    Forbidden,
    /// --max-sessions reached.
    SessionLimit,
    /// The sandbox could not be found, claimed, created or started.
    Sandbox,
    /// The agent answered with an error or could not be reached.
    Agent,
    /// Another command of the session is still running.
    Busy,
    /// The Kubernetes API failed.
    KubernetesApi,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub kind: ErrorKind,
}

#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum AuthResult {
    Allowed,
    Denied,
    Unauthenticated,
    Error,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AuthLabels {
    pub result: AuthResult,
    pub cached: bool,
}

/// What one TokenReview answered.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum ReviewResult {
    Authenticated,
    Unauthenticated,
    /// The API could not be asked, or did not answer.
    Error,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReviewLabels {
    pub result: ReviewResult,
}

/// Lowercase snake_case label values, as Prometheus users expect.
macro_rules! label_value {
    ($ty:ty { $($variant:ident => $text:literal),+ $(,)? }) => {
        impl $ty {
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text),+
                }
            }
        }
        impl EncodeLabelValue for $ty {
            fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
                EncodeLabelValue::encode(&self.as_str(), encoder)
            }
        }
    };
}

label_value!(Launch { Warm => "warm", Cold => "cold", Local => "local" });
label_value!(Admitted { Admitted => "admitted", Refused => "refused" });
label_value!(Outcome { Ok => "ok", Failed => "failed", TimedOut => "timed_out", Error => "error" });
label_value!(ErrorKind {
    BadRequest => "bad_request",
    Unauthenticated => "unauthenticated",
    Forbidden => "forbidden",
    SessionLimit => "session_limit",
    Sandbox => "sandbox",
    Agent => "agent",
    Busy => "busy",
    KubernetesApi => "kubernetes_api",
});
label_value!(ReviewResult { Authenticated => "authenticated", Unauthenticated => "unauthenticated", Error => "error" });
label_value!(AuthResult { Allowed => "allowed", Denied => "denied", Unauthenticated => "unauthenticated", Error => "error" });

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
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

fn start_buckets() -> impl Iterator<Item = f64> {
    [
        0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    ]
    .into_iter()
}

/// Admission is an in-memory check (microseconds) unless it has to count from a LIST.
fn admission_buckets() -> impl Iterator<Item = f64> {
    [
        1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 0.01, 0.1, 1.0,
        10.0,
    ]
    .into_iter()
}

fn exec_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        120.0, 300.0,
    ]
    .into_iter()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("cli_mcp");
        let sessions_active = Gauge::default();
        registry.register(
            "sessions_active",
            "Sessions with a sandbox (kubernetes: assigned pods of the instance; local: agent processes)",
            sessions_active.clone(),
        );
        let session_start = Family::<LaunchLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(start_buckets())
        });
        registry.register(
            "session_start_seconds",
            "Time from a new session's first call to its sandbox being ready, by launch (warm, cold, local)",
            session_start.clone(),
        );
        let admission = Family::<AdmissionLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(admission_buckets())
        });
        registry.register(
            "session_admission_seconds",
            "Time --max-sessions admission took to decide on a new session, by result (admitted, refused)",
            admission.clone(),
        );
        let claim_conflicts = Counter::default();
        registry.register(
            "claim_conflicts",
            "Warm-pod claims lost to another claimer (409 on the resourceVersion-guarded patch)",
            claim_conflicts.clone(),
        );
        let exec_duration = Family::<OutcomeLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exec_buckets())
        });
        registry.register(
            "exec_duration_seconds",
            "Duration of bash tool calls end to end, by outcome",
            exec_duration.clone(),
        );
        let timeouts = Counter::default();
        registry.register(
            "exec_timeouts",
            "Commands that hit their timeout",
            timeouts.clone(),
        );
        let truncations = Counter::default();
        registry.register(
            "exec_truncations",
            "Calls whose output was truncated to the output budget",
            truncations.clone(),
        );
        let state_resets = Counter::default();
        registry.register(
            "session_state_resets",
            "Calls that reported a reset session state (sandbox replaced or shell restarted)",
            state_resets.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "errors",
            "Failed calls and requests, by kind",
            errors.clone(),
        );
        let auth = Family::<AuthLabels, Counter>::default();
        registry.register(
            "auth_decisions",
            "Authentication/authorization decisions, by result and whether they came from the cache",
            auth.clone(),
        );
        let token_reviews = Family::<ReviewLabels, Counter>::default();
        registry.register(
            "token_reviews",
            "TokenReviews sent to the Kubernetes API, by result",
            token_reviews.clone(),
        );
        let token_reviews_in_flight = Gauge::default();
        registry.register(
            "token_reviews_in_flight",
            "Token reviews (TokenReview, then SubjectAccessReview) in progress",
            token_reviews_in_flight.clone(),
        );
        let token_reviews_in_flight_max = Gauge::default();
        registry.register(
            "token_reviews_in_flight_max",
            "Most token reviews in progress at once since the server started",
            token_reviews_in_flight_max.clone(),
        );
        let auth_busy = Counter::default();
        registry.register(
            "auth_busy",
            "Requests answered 503 because the most token reviews were already in progress",
            auth_busy.clone(),
        );
        Self {
            token_reviews,
            token_reviews_in_flight,
            token_reviews_in_flight_max,
            auth_busy,
            registry,
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
        }
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

    /// The Prometheus text exposition (OpenMetrics).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
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
}
