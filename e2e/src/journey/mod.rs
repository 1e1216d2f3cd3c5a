//! Test support for the end-to-end journeys (docs/e2e.md): install the operator from
//! `config/default` the way a user would, apply instances, and talk MCP over TLS to an
//! instance's Service through a loopback forward with a ServiceAccount token.
//!
//! This is test support: every helper panics with context on failure (a failed test), and
//! never retries behind the caller's back.
//!
//! - [`Env`] (`env.rs`): one test's namespace, the operator installed into it, instances,
//!   and the cleanup at the end.
//! - [`Mcp`] (`mcp.rs`): the MCP client of one instance.
//! - `pods.rs`: selectors, a pod's session and host process, faults on host processes.

mod env;
mod mcp;
mod pods;

pub use env::{apply_yaml, tools, Env};
pub use mcp::{error_chain, response, stdout, text, CallError, Mcp};
pub use pods::{
    container_pid, kill_when_running, process_running, sandbox_selector, server_selector,
    server_starts, session_of,
};

use serde_json::{json, Value};

pub const SERVER_IMAGE: &str = "cli-mcp-server:dev";
pub const SANDBOX_IMAGE: &str = "cli-mcp-agent:dev";
/// The field manager of "the user" (kubectl apply --server-side).
pub const USER: &str = "kubectl";

pub fn small() -> Value {
    json!({"requests": {"cpu": "5m", "memory": "16Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}})
}
