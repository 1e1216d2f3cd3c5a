//! The operator's error type. `anyhow` is only used at the edge (`main.rs`).

use cli_mcp_api::crd::CrdError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Crd(#[from] CrdError),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    /// Teardown is progressing but not finished (e.g. pods still terminating). Not a
    /// failure: retried shortly, and watch events wake it up earlier.
    #[error("waiting for {0}")]
    Waiting(String),
    #[error("generating the TLS certificate: {0}")]
    Tls(#[from] rcgen::Error),
    #[error("encoding JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("object {0} has no namespace")]
    NoNamespace(String),
}

impl Error {
    /// Low-cardinality label for the reconcile error metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Crd(_) => "invalid_spec",
            // What failed inside the apply or the cleanup, not the wrapper every error of a
            // reconcile comes in.
            Error::Finalizer(inner) => match inner.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => e.metric_label(),
                _ => "finalizer",
            },
            Error::Waiting(_) => "waiting",
            Error::Tls(_) => "tls",
            Error::Json(_) => "json",
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

    #[test]
    fn the_metric_names_what_failed_inside_the_finalizer() {
        let wrapped = |e: F<Error>| Error::Finalizer(Box::new(e));
        assert_eq!(
            wrapped(F::ApplyFailed(Error::NoNamespace("x".into()))).metric_label(),
            "no_namespace"
        );
        assert_eq!(
            wrapped(F::ApplyFailed(Error::Json(
                serde_json::from_str::<u8>("x").expect_err("not JSON")
            )))
            .metric_label(),
            "json"
        );
        let waiting = wrapped(F::CleanupFailed(Error::Waiting("pods".into())));
        assert_eq!(waiting.metric_label(), "waiting");
        assert!(waiting.is_waiting());
        assert_eq!(wrapped(F::UnnamedObject).metric_label(), "finalizer");
    }
}
