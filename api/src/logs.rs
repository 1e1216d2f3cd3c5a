//! Logging for every binary: to stderr (stdout may carry MCP or a protocol), JSON lines in a
//! cluster (`--log-json`), compact and human-readable otherwise, filtered by `RUST_LOG`.
//! Written once so the four binaries' logs read alike to whoever collects them.

use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line, the event's fields at the top level: what a cluster's log
    /// collector parses.
    Json,
    /// One short line per event, coloured only on a terminal (see [`crate::terminal`]).
    Compact,
}

impl LogFormat {
    /// The format a binary's `--log-json` flag asks for.
    pub fn from_json_flag(json: bool) -> Self {
        if json {
            Self::Json
        } else {
            Self::Compact
        }
    }
}

/// Installs the process's log subscriber. `default_directives` applies when `RUST_LOG` is
/// unset or invalid: each binary mutes its own noisy dependencies there (e.g. rmcp's
/// per-request lines). A second call keeps the first subscriber, so tests may call it
/// more than once.
pub fn init(format: LogFormat, default_directives: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_directives));
    let registry = tracing_subscriber::registry().with(filter);
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(crate::terminal::log_colours());
    let result = match format {
        // The current span repeats what the span list already carries.
        LogFormat::Json => registry
            .with(layer.json().flatten_event(true).with_current_span(false))
            .try_init(),
        LogFormat::Compact => registry.with(layer.compact()).try_init(),
    };
    // Already installed (a test called this before): the first one stays, as documented.
    let _ = result;
}
