//! Errors of the local-cluster harness. Every message says what failed and, where the
//! fix is on the user's side, what to do about it.

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while bringing up, using or tearing down the local cluster.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The machine is not prepared (missing package, sysctl, binary, permissions).
    /// The message names the fix.
    #[error("{0}")]
    Prerequisite(String),

    /// A file or directory operation failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// An external command (`ip`, the build script, ...) could not be run or failed.
    #[error("command `{command}` failed: {detail}")]
    Command { command: String, detail: String },

    /// Certificate or key generation failed.
    #[error("generating PKI: {0}")]
    Pki(#[from] rcgen::Error),

    /// A call to the Kubernetes API failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),

    /// The kubeconfig could not be read or turned into a client configuration.
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),

    /// A watch used to wait for a condition failed.
    #[error("watching while waiting for {what}: {source}")]
    Watch {
        what: String,
        #[source]
        source: kube::runtime::wait::Error,
    },

    /// A control-plane component (or the kubelet) exited while it was needed.
    #[error("{component} exited unexpectedly ({status}); see {}. Last log lines:\n{tail}", log.display())]
    ComponentExited {
        component: String,
        status: String,
        log: PathBuf,
        tail: String,
    },

    /// A deadline passed.
    #[error("timed out after {:.1?} waiting for {what}", elapsed)]
    Timeout {
        what: String,
        elapsed: std::time::Duration,
    },

    /// A file the harness reads (cluster.json, image map, ...) is malformed.
    #[error("parsing {}: {detail}", path.display())]
    Parse { path: PathBuf, detail: String },

    /// Anything else, described in words.
    #[error("{0}")]
    Other(String),
}

impl Error {
    /// Shorthand for an [`Error::Io`].
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
