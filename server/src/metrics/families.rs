//! The metric families, registered group by group in the order `/metrics` shows them, and
//! the buckets of their histograms.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::labels::{
    AdmissionLabels, AuthLabels, ErrorLabels, HttpLabels, LaunchLabels, OutcomeLabels, ReviewLabels,
};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
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

/// The server's version.
pub(super) fn register_build(registry: &mut Registry) {
    let build = prometheus_client::metrics::info::Info::new(BuildLabels {
        version: env!("CARGO_PKG_VERSION").to_owned(),
    });
    registry.register("build", "The server's version (always 1)", build);
}

/// How sessions start and how many there are.
pub(super) struct SessionFamilies {
    pub sessions_active: Gauge,
    pub session_start: Family<LaunchLabels, Histogram>,
    pub admission: Family<AdmissionLabels, Histogram>,
    pub claim_conflicts: Counter,
}

pub(super) fn register_sessions(registry: &mut Registry) -> SessionFamilies {
    let sessions_active = Gauge::default();
    registry.register(
        "sessions_active",
        "Sessions with a sandbox (kubernetes: assigned pods of the instance; local: agent processes)",
        sessions_active.clone(),
    );
    let session_start =
        Family::<LaunchLabels, Histogram>::new_with_constructor(|| Histogram::new(start_buckets()));
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
    SessionFamilies {
        sessions_active,
        session_start,
        admission,
        claim_conflicts,
    }
}

/// What tool calls did, and why calls and requests failed.
pub(super) struct CallFamilies {
    pub exec_duration: Family<OutcomeLabels, Histogram>,
    pub timeouts: Counter,
    pub truncations: Counter,
    pub state_resets: Counter,
    pub errors: Family<ErrorLabels, Counter>,
}

pub(super) fn register_calls(registry: &mut Registry) -> CallFamilies {
    let exec_duration =
        Family::<OutcomeLabels, Histogram>::new_with_constructor(|| Histogram::new(exec_buckets()));
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
    CallFamilies {
        exec_duration,
        timeouts,
        truncations,
        state_resets,
        errors,
    }
}

/// Authentication: decisions, token reviews and their concurrency.
pub(super) struct AuthFamilies {
    pub auth: Family<AuthLabels, Counter>,
    pub token_reviews: Family<ReviewLabels, Counter>,
    pub token_reviews_in_flight: Gauge,
    pub token_reviews_in_flight_max: Gauge,
    pub auth_busy: Counter,
}

pub(super) fn register_auth(registry: &mut Registry) -> AuthFamilies {
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
    AuthFamilies {
        auth,
        token_reviews,
        token_reviews_in_flight,
        token_reviews_in_flight_max,
        auth_busy,
    }
}

/// HTTP requests answered.
pub(super) fn register_http(registry: &mut Registry) -> Family<HttpLabels, Counter> {
    let http_requests = Family::<HttpLabels, Counter>::default();
    registry.register(
        "http_requests",
        "HTTP requests answered, by listener, route and status class",
        http_requests.clone(),
    );
    http_requests
}
