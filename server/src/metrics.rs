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
    /// The client cancelled the call; the command was interrupted.
    Cancelled,
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

/// Which listener served an HTTP request.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Listener {
    /// `--listen`: `/mcp` and `/sessions`.
    Mcp,
    /// `--health-listen`: `/livez`, `/readyz`, `/metrics`.
    Health,
}

/// The route of an HTTP request: a fixed set, so a path never becomes a label value.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Route {
    Mcp,
    Sessions,
    Session,
    Livez,
    Readyz,
    Metrics,
    /// Any other path (a 404).
    Other,
}

impl Route {
    /// The route of `path` on `listener`.
    pub fn of(listener: Listener, path: &str) -> Self {
        match (listener, path) {
            (Listener::Mcp, "/mcp") => Self::Mcp,
            (Listener::Mcp, "/sessions") => Self::Sessions,
            (Listener::Mcp, p) if p.starts_with("/sessions/") => Self::Session,
            (Listener::Health, "/livez") => Self::Livez,
            (Listener::Health, "/readyz") => Self::Readyz,
            (Listener::Health, "/metrics") => Self::Metrics,
            _ => Self::Other,
        }
    }

    fn of_listener(listener: Listener) -> &'static [Route] {
        match listener {
            Listener::Mcp => &[Self::Mcp, Self::Sessions, Self::Session, Self::Other],
            Listener::Health => &[Self::Livez, Self::Readyz, Self::Metrics, Self::Other],
        }
    }
}

/// The class of an HTTP status (`2xx` …): four values where the codes would be dozens.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum StatusClass {
    Success,
    Redirect,
    ClientError,
    ServerError,
}

impl StatusClass {
    pub fn of(status: u16) -> Self {
        match status {
            0..=299 => Self::Success,
            300..=399 => Self::Redirect,
            400..=499 => Self::ClientError,
            _ => Self::ServerError,
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    pub listener: Listener,
    pub route: Route,
    pub status: StatusClass,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
}

/// Lowercase snake_case label values, as Prometheus users expect; `ALL` lists every value,
/// so that each labelled family can be shown at zero before anything happened.
macro_rules! label_value {
    ($ty:ty { $($variant:ident => $text:literal),+ $(,)? }) => {
        impl $ty {
            pub const ALL: &'static [$ty] = &[$(Self::$variant),+];

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
label_value!(Outcome { Ok => "ok", Failed => "failed", TimedOut => "timed_out", Error => "error", Cancelled => "cancelled" });
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
label_value!(Listener { Mcp => "mcp", Health => "health" });
label_value!(Route {
    Mcp => "/mcp",
    Sessions => "/sessions",
    Session => "/sessions/{id}",
    Livez => "/livez",
    Readyz => "/readyz",
    Metrics => "/metrics",
    Other => "other",
});
label_value!(StatusClass { Success => "2xx", Redirect => "3xx", ClientError => "4xx", ServerError => "5xx" });

/// The exposition formats of `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text: the default.
    OpenMetrics,
    /// The Prometheus text format 0.0.4, for scrapers that ask for `text/plain`.
    PrometheusText,
}

impl Format {
    /// Picks the format from an `Accept` header: Prometheus text when the client rates
    /// `text/plain` above OpenMetrics (`*/*` and `application/*` count for OpenMetrics),
    /// else OpenMetrics. A Prometheus server offers both with OpenMetrics first, and gets
    /// OpenMetrics; one set to `scrape_protocols: [PrometheusText0.0.4]` gets the text format.
    pub fn negotiate(accept: Option<&str>) -> Self {
        let (mut openmetrics, mut text) = (0.0_f64, 0.0_f64);
        for range in accept.unwrap_or("").split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.strip_prefix("q="))
                .find_map(|q| q.trim().parse::<f64>().ok())
                .unwrap_or(1.0);
            match media.as_str() {
                "application/openmetrics-text" | "application/*" | "*/*" => {
                    openmetrics = openmetrics.max(q)
                }
                "text/plain" | "text/*" => text = text.max(q),
                _ => {}
            }
        }
        if text > openmetrics {
            Self::PrometheusText
        } else {
            Self::OpenMetrics
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Self::PrometheusText => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

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
        // The process_* metrics keep their standard names; everything else is cli_mcp_*.
        let mut root = Registry::default();
        root.register_collector(Box::new(ProcessCollector));
        let registry = root.sub_registry_with_prefix("cli_mcp");
        let build = prometheus_client::metrics::info::Info::new(BuildLabels {
            version: env!("CARGO_PKG_VERSION").to_owned(),
        });
        registry.register("build", "The server's version (always 1)", build);
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
        let http_requests = Family::<HttpLabels, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP requests answered, by listener, route and status class",
            http_requests.clone(),
        );
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

/// The standard `process_*` metrics (CPU, memory, descriptors, threads, start time), read
/// from `/proc/self` at each scrape.
#[derive(Debug)]
struct ProcessCollector;

/// The unit of the tick counts in `/proc/<pid>/stat`, fixed at 100 per second (USER_HZ) in
/// the kernel's user ABI.
const TICKS_PER_SECOND: f64 = 100.0;

#[derive(Debug, Default, PartialEq)]
struct ProcessStats {
    cpu_seconds: f64,
    start_time_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    threads: i64,
    open_fds: i64,
    max_fds: i64,
}

/// The `kB` value of `key` in `/proc/<pid>/status`, in bytes.
fn status_kib(status: &str, key: &str) -> Option<i64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<i64>()
                .ok()
        })
        .map(|kib| kib * 1024)
}

/// Parses `/proc/<pid>/stat` (fields after the command name, which may contain spaces and
/// parentheses), `/proc/<pid>/status` and the `btime` line of `/proc/stat`.
fn parse_process(stat: &str, status: &str, proc_stat: &str) -> Option<ProcessStats> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // Field 3 of stat (state) is after_comm's first; utime is field 14, so index 11.
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    let cpu_seconds = (ticks(11)? + ticks(12)?) / TICKS_PER_SECOND;
    let boot_time = proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<f64>().ok())?;
    let start_time_seconds = boot_time + ticks(19)? / TICKS_PER_SECOND;
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse::<i64>().ok())
        .unwrap_or(0);
    Some(ProcessStats {
        cpu_seconds,
        start_time_seconds,
        resident_bytes: status_kib(status, "VmRSS:").unwrap_or(0),
        virtual_bytes: status_kib(status, "VmSize:").unwrap_or(0),
        threads,
        open_fds: 0,
        max_fds: 0,
    })
}

fn read_process() -> Option<ProcessStats> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let proc_stat = std::fs::read_to_string("/proc/stat").ok()?;
    let mut p = parse_process(&stat, &status, &proc_stat)?;
    p.open_fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as i64)
        .unwrap_or(0);
    p.max_fds = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| i64::try_from(soft).unwrap_or(i64::MAX))
        .unwrap_or(0);
    Some(p)
}

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric as _;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::registry::Unit;
        // Without /proc (not Linux) there is nothing to report; the rest of /metrics stands.
        let Some(p) = read_process() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(p.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu",
            "Total user and system CPU time spent",
            Some(&Unit::Seconds),
            cpu.metric_type(),
        )?)?;
        let gauges: [(&str, &str, Option<Unit>, ConstGauge<f64>); 6] = [
            (
                "process_start_time",
                "Start time of the process since the Unix epoch",
                Some(Unit::Seconds),
                ConstGauge::new(p.start_time_seconds),
            ),
            (
                "process_resident_memory",
                "Resident memory size",
                Some(Unit::Bytes),
                ConstGauge::new(p.resident_bytes as f64),
            ),
            (
                "process_virtual_memory",
                "Virtual memory size",
                Some(Unit::Bytes),
                ConstGauge::new(p.virtual_bytes as f64),
            ),
            (
                "process_open_fds",
                "Open file descriptors",
                None,
                ConstGauge::new(p.open_fds as f64),
            ),
            (
                "process_max_fds",
                "Most open file descriptors (soft limit)",
                None,
                ConstGauge::new(p.max_fds as f64),
            ),
            (
                "process_threads",
                "OS threads of the process",
                None,
                ConstGauge::new(p.threads as f64),
            ),
        ];
        for (name, help, unit, gauge) in gauges {
            gauge.encode(encoder.encode_descriptor(
                name,
                help,
                unit.as_ref(),
                gauge.metric_type(),
            )?)?;
        }
        Ok(())
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

    #[test]
    fn the_format_follows_the_scrapers_accept_header() {
        use Format::*;
        for (accept, want) in [
            (None, OpenMetrics),
            (Some("*/*"), OpenMetrics),
            (Some("text/plain"), PrometheusText),
            (Some("text/plain;version=0.0.4"), PrometheusText),
            (Some("application/openmetrics-text;version=1.0.0"), OpenMetrics),
            // What Prometheus 3 sends by default.
            (Some("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"), OpenMetrics),
            (Some("text/plain;version=0.0.4;q=0.9,*/*;q=0.1"), PrometheusText),
            (Some("application/json"), OpenMetrics),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
        let m = Metrics::new();
        m.error(ErrorKind::Busy);
        let text = m.encode_as(PrometheusText);
        assert!(
            text.contains("# TYPE cli_mcp_errors_total counter"),
            "{text}"
        );
        assert!(
            text.contains("cli_mcp_errors_total{kind=\"busy\"} 1"),
            "{text}"
        );
        assert!(text.contains("cli_mcp_build_info{version="), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
        assert!(m.encode().ends_with("# EOF\n"));
    }

    #[test]
    fn proc_files_parse_even_with_parentheses_in_the_command_name() {
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 50 0 0 20 0 7 0 1000 123456789 2048 18446744073709551615";
        let status = "Name:\tx\nVmSize:\t  120000 kB\nVmRSS:\t    9000 kB\nThreads:\t7\n";
        let proc_stat = "cpu  1 2 3\nbtime 1700000000\nprocesses 10\n";
        let p = parse_process(stat, status, proc_stat).expect("parses");
        assert_eq!(p.cpu_seconds, 3.0);
        assert_eq!(p.start_time_seconds, 1_700_000_010.0);
        assert_eq!(p.resident_bytes, 9000 * 1024);
        assert_eq!(p.virtual_bytes, 120000 * 1024);
        assert_eq!(p.threads, 7);
        assert_eq!(parse_process("garbage", status, proc_stat), None);
    }
}
