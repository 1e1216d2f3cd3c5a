//! The label values of the metrics: each label has a small, fixed set of values, so no
//! session id, pod name, caller or path ever becomes one.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};

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

    pub(super) fn of_listener(listener: Listener) -> &'static [Route] {
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
