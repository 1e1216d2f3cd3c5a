//! The shared contract of cli-mcp.
//!
//! Everything two of our binaries must agree on lives here, so it is written once:
//! object names and label keys ([`names`]), the session identifier ([`SessionId`]), the token
//! scheme ([`token`]) with the seal that binds a sandbox pod to its uid ([`seal`]), the
//! agent's JSON wire types ([`wire`]) and — with the default `k8s`
//! feature — the sandbox pod builder used by both pod writers ([`sandbox`]), what a pod's
//! observed state means ([`pod_state`]), the restricted security settings of every pod we
//! build ([`pod_security`]) and the activity stamp the server writes and the
//! operator's idle GC reads ([`activity`]). The credential proxy's route table is in
//! [`proxy`]; with the `kubeconfig` feature, the validation of the admin kubeconfig it holds
//! ([`kubeconfig`]). With the `process` feature, what every long-running binary sets up
//! first: its logs ([`logs`]) and its SIGTERM/SIGINT ([`signals`]).
//!
//! The agent depends on this crate without the `k8s` feature, so it stays free of kube.

#![forbid(unsafe_code)]

pub mod names;
pub mod proxy;
pub mod seal;
pub mod session;
pub mod terminal;
pub mod token;
pub mod wire;

#[cfg(feature = "k8s")]
pub mod activity;
#[cfg(feature = "k8s")]
pub mod crd;
#[cfg(feature = "kubeconfig")]
pub mod kubeconfig;
#[cfg(feature = "process")]
pub mod logs;
#[cfg(feature = "k8s")]
pub mod pod_security;
#[cfg(feature = "k8s")]
pub mod pod_state;
#[cfg(feature = "k8s")]
pub mod sandbox;
#[cfg(feature = "process")]
pub mod signals;

pub use session::{SessionId, SessionIdError};
