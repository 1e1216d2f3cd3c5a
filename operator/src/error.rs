//! The operator's error type. `anyhow` is only used at the edge (`main.rs`).
//!
//! An error names the reconcile step that failed and the object it was about ("resolving
//! Secret ns/cli-mcp-demo-hmac: …", "applying Deployment cli-mcp-demo: …"): the log, the
//! status conditions that carry it (`ApplyFailed`, the pool's `ApiError`) and the Events say
//! what to look at, not just that some API call failed.

use cli_mcp_api::crd::CrdError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or removing a Go-era leftover ([`crate::migrate`]).
    #[error("taking over from the Go operator, {what}: {source}")]
    Migrate {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// Reading or making what the children need ([`crate::resolve`]).
    #[error("resolving {what}: {source}")]
    Resolve {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// Applying one child ([`crate::apply`]).
    #[error("applying {kind} {name}: {source}")]
    Apply {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// A call of the warm pool ([`crate::pool`]).
    #[error("warm pool, {what}: {source}")]
    Pool {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// A call of the idle GC ([`crate::idle`]).
    #[error("idle GC, {what}: {source}")]
    Idle {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// Writing the instance's status.
    #[error("writing the status of {name}: {source}")]
    Status {
        name: String,
        #[source]
        source: kube::Error,
    },
    /// A call of the finalizer's cleanup ([`crate::teardown`]).
    #[error("teardown, {what}: {source}")]
    Teardown {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error(transparent)]
    Crd(#[from] CrdError),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    /// Teardown is progressing but not finished (e.g. pods still terminating). Not a
    /// failure: retried shortly, and watch events wake it up earlier.
    #[error("waiting for {0}")]
    Waiting(String),
    /// Generating a key or certificate (`what`: which one).
    #[error("generating {what}: {source}")]
    Tls {
        what: String,
        #[source]
        source: rcgen::Error,
    },
    /// Encoding an object (`what`) as JSON.
    #[error("encoding {what} as JSON: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("object {0} has no namespace")]
    NoNamespace(String),
}

/// `map_err` adapters that name the object a failed call was about, one per step:
/// `.map_err(Error::resolving(format!("Secret {ns}/{name}")))`.
impl Error {
    pub fn migrating(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Migrate { what, source }
    }

    pub fn resolving(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Resolve { what, source }
    }

    pub fn pool(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Pool { what, source }
    }

    pub fn idle(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Idle { what, source }
    }

    pub fn teardown(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Teardown { what, source }
    }

    pub fn generating(what: impl Into<String>) -> impl FnOnce(rcgen::Error) -> Error {
        let what = what.into();
        move |source| Error::Tls { what, source }
    }

    /// Low-cardinality label for the reconcile error metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            // Every step's failed API call counts as one kind: the API server's.
            Error::Migrate { .. }
            | Error::Resolve { .. }
            | Error::Apply { .. }
            | Error::Pool { .. }
            | Error::Idle { .. }
            | Error::Status { .. }
            | Error::Teardown { .. } => "kube",
            Error::Crd(_) => "invalid_spec",
            // What failed inside the apply or the cleanup, not the wrapper every error of a
            // reconcile comes in.
            Error::Finalizer(inner) => match inner.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => e.metric_label(),
                _ => "finalizer",
            },
            Error::Waiting(_) => "waiting",
            Error::Tls { .. } => "tls",
            Error::Json { .. } => "json",
            Error::NoNamespace(_) => "no_namespace",
        }
    }

    /// True when this is teardown progress rather than a failure.
    pub fn is_waiting(&self) -> bool {
        self.metric_label() == "waiting"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::finalizer::Error as F;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(
            serde_json::from_value(serde_json::json!({
                "status": "Failure", "code": code, "message": "refused", "reason": "",
            }))
            .expect("status"),
        )
    }

    #[test]
    fn the_metric_names_what_failed_inside_the_finalizer() {
        let wrapped = |e: F<Error>| Error::Finalizer(Box::new(e));
        assert_eq!(
            wrapped(F::ApplyFailed(Error::NoNamespace("x".into()))).metric_label(),
            "no_namespace"
        );
        let json = Error::Json {
            what: "x".into(),
            source: serde_json::from_str::<u8>("x").expect_err("not JSON"),
        };
        assert_eq!(wrapped(F::ApplyFailed(json)).metric_label(), "json");
        let waiting = wrapped(F::CleanupFailed(Error::Waiting("pods".into())));
        assert_eq!(waiting.metric_label(), "waiting");
        assert!(waiting.is_waiting());
        assert_eq!(wrapped(F::UnnamedObject).metric_label(), "finalizer");
    }

    /// Every step's error says the step and the object, and counts as the API server's.
    #[test]
    fn a_steps_error_names_the_step_and_the_object() {
        let e = Error::resolving("Secret ns1/cli-mcp-demo-hmac")(api_error(500));
        assert!(
            e.to_string()
                .starts_with("resolving Secret ns1/cli-mcp-demo-hmac: "),
            "{e}"
        );
        assert_eq!(e.metric_label(), "kube");
        let e = Error::Apply {
            kind: "Deployment".into(),
            name: "cli-mcp-demo".into(),
            source: api_error(422),
        };
        assert!(
            e.to_string()
                .starts_with("applying Deployment cli-mcp-demo: "),
            "{e}"
        );
        let e = Error::teardown("Lease ns1/cli-mcp-demo-slot-1")(api_error(403));
        assert!(e.to_string().starts_with("teardown, Lease"), "{e}");
        assert_eq!(e.metric_label(), "kube");
    }
}
