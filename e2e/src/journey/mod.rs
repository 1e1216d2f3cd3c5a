//! Test support for the end-to-end journeys (docs/e2e.md): install the operator from
//! `config/default` the way a user would, apply instances, and talk MCP over TLS to an
//! instance's Service through a loopback forward with a ServiceAccount token.
//!
//! This is test support: every helper panics with context on failure (a failed test), and
//! never retries behind the caller's back.
//!
//! - [`Env`] (`env.rs`): one test's namespace, the operator installed into it (the overlay of
//!   [`operator_overlay`]), instances, and the cleanup at the end.
//! - [`Mcp`] (`mcp.rs`): the MCP client of one instance (requests and tool results are
//!   [`crate::jsonrpc`]'s).
//! - [`journeys`]: the admin, session, warm-pool and teardown journeys, run on the process
//!   kubelet (`e2e/tests/journeys.rs`) and on the real node (`e2e/tests/journeys_real_node.rs`).
//! - [`runtime_session`]: a session's life under a sandbox runtime (runc or gVisor), on the
//!   real node (`e2e/tests/journeys_real_node.rs`).
//! - `pods.rs`: selectors, a pod's session and host process, the server pods' metrics,
//!   faults on host processes.
//!
//! What is not about journeys (the `CliMcpInstance` object and its waits, HTTP clients,
//! host processes) is in [`crate::instance`], [`crate::http`] and [`crate::child`], shared
//! with the operator's and the server's tests and the benches.

mod env;
pub mod journeys;
mod mcp;
mod overlay;
mod pods;
pub mod runtime_session;

pub use crate::instance::{SANDBOX_IMAGE, SERVER_IMAGE};
pub use crate::jsonrpc::{response, stdout, text};
pub use env::{apply_yaml, hack_bin_dir, kustomize_build, tools, Env};
pub use mcp::{error_chain, CallError, Mcp};
pub use overlay::operator_overlay;
pub use pods::{
    container_pid, kill_when_running, process_running, sandbox_selector, server_selector,
    server_starts, session_of,
};

/// The field manager of "the user" (kubectl apply --server-side).
pub const USER: &str = "kubectl";
