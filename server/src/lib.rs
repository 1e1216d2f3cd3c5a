//! `cli-mcp-server`: the MCP server of cli-mcp: the `bash` tool over MCP, each session
//! routed to its own sandbox (docs/server.md).
//!
//! - [`cli`]: flags and their resolution into [`cli::Settings`]; [`limits`]: the limits of
//!   every call, which the flags set and the handler and backends read.
//! - [`mcp`]: the `bash` tool handler and the envelope every tool call runs in; [`render`]
//!   turns an agent answer into a tool result;
//!   [`cancel`]: the running calls a `notifications/cancelled` can stop; [`progress`]:
//!   progress notifications of a running call; [`resources`]: a session's spill files
//!   and workspace files as MCP resources.
//! - [`http`]: routes (`/mcp`, `/sessions`, health, metrics) and the auth middleware;
//!   [`serve`]: the accept loop (TLS, header limits, graceful shutdown).
//! - [`sessions`]: the [`sessions::Backend`] trait with the `kubernetes` backend (lookup,
//!   admission, start, agent wait, API health, route cache, `last-activity` stamps) and the
//!   `local` one.
//! - [`agent_client`]: the sandbox agent's HTTP client (bounded bodies).
//! - [`auth`]: TokenReview + SubjectAccessReview, TLS config.
//! - [`metrics`], [`audit`]: Prometheus metrics and the audit log line.
//! - [`origin`]: `Origin` validation of the MCP listener.
//! - `keyed`: the key → shared value map behind in-flight token reviews and session locks.
//! - [`schema`]: tool schemas limited to standard JSON Schema formats.
//! - [`run`]: wiring and lifecycle (`main.rs` → [`cli`] → [`run`]).

#![forbid(unsafe_code)]

pub mod agent_client;
pub mod audit;
pub mod auth;
pub mod cancel;
pub mod cli;
pub mod http;
mod keyed;
pub mod limits;
pub mod mcp;
pub mod metrics;
pub mod origin;
pub mod progress;
pub mod render;
pub mod resources;
pub mod run;
pub mod schema;
pub mod serve;
pub mod sessions;
