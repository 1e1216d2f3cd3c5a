//! The cli-mcp operator: reconciles `CliMcpInstance` objects into an MCP server (Deployment,
//! Service, RBAC, Secrets, NetworkPolicy), keeps the warm pool of sandboxes, collects idle
//! sessions and tears everything down when the instance is deleted.
//!
//! Layout: [`controller`] is the one reconcile entry, a pipeline of named steps;
//! [`resolve`] finds what the children need in the cluster (Secrets, API server peers);
//! [`children`] holds pure builders of every owned object and the whole desired set;
//! [`apply`] writes them with server-side apply (and skips writes that cannot change
//! anything); [`pool`], [`idle`] and [`teardown`] are the sandbox lifecycle;
//! [`status`] computes the status from what was observed; [`runtime_class`] checks the
//! RuntimeClasses an instance names; [`retry`] spaces out the retries
//! of a failing instance; [`briefing`] is what the server tells models about their sandbox;
//! [`watch`] wires the watches;
//! [`cli`], [`run`], [`leader`], [`metrics`] and [`telemetry`] are the process around them
//! (`main.rs` only wires them together).

#![forbid(unsafe_code)]

pub mod api_call;
pub mod apply;
pub mod briefing;
pub mod children;
pub mod cli;
pub mod context;
pub mod controller;
pub mod controllers;
pub mod crdgen;
pub mod demand;
pub mod error;
pub mod http;
pub mod idle;
pub mod isolation;
pub mod leader;
pub mod metrics;
pub mod migrate;
pub mod olm;
pub mod platform;
pub mod policies;
pub mod pool;
pub mod resolve;
pub mod retry;
pub mod rotation;
pub mod run;
pub mod runtime_class;
pub mod sandbox_pod;
pub mod signals;
pub mod status;
pub mod sweep;
pub mod teardown;
pub mod telemetry;
pub mod watch;

pub use context::{Context, OperatorConfig, Scope};
pub use error::{Error, Result};
