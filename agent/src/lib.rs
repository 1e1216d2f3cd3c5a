//! `cli-mcp-agent`: the HTTP front of one persistent bash per sandbox pod.
//!
//! - [`shell`] keeps the bash alive and runs one command at a time in it, with framing that
//!   command output cannot forge (status travels on a private pipe, output through files).
//! - [`output`] turns a command's output streams into bounded head+tail text, and
//!   [`spill`] keeps what is cut in spill files within caps.
//! - [`procs`] and [`reaper`] find, kill and reap the processes a command leaves behind.
//! - [`assignment`] holds who may run commands (token commitments) and recovers it after a
//!   container restart.
//! - [`replay`] remembers the last requests, on disk too; [`runner`] consults it so that a
//!   retry is never run twice.
//! - `state_files` opens files in the state dir, which commands can tamper with.
//! - [`progress`] follows the running command's output for `GET /exec/progress`, and
//!   [`files`] reads spills and workspace files back in bounded chunks (`GET /files/…`).
//! - [`http`] is the axum API: `/exec`, `/exec/progress`, `/files/…`, `/assign`,
//!   `/healthz`; [`serve`] accepts and bounds connections.
//! - [`relay`] is the sandbox's `HTTPS_PROXY`: it forwards each proxy connection to the
//!   instance's credential proxy with the pod's token as `Proxy-Authorization`.
//! - [`cli`] holds the flags; [`run`] starts, serves and shuts down the agent.

// `unsafe` only where audited: the child's set-up before exec (`shell::bash::prepare_child`)
// and borrowing inherited descriptors (`procs::cloexec_inherited_fds`).
#![deny(unsafe_code)]

pub mod assignment;
pub mod cli;
pub mod files;
pub mod http;
pub mod output;
pub mod procs;
pub mod progress;
pub mod reaper;
pub mod relay;
pub mod replay;
pub mod run;
pub mod runner;
pub mod serve;
pub mod shell;
pub mod spill;
mod state_files;

#[cfg(test)]
mod test_support;
