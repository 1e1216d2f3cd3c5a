//! SIGTERM and SIGINT for the long-running binaries.

use tokio::signal::unix::{signal, Signal, SignalKind};

/// SIGTERM and SIGINT, listened for from a binary's start to its end. Install them before
/// the binary announces itself: a signal that arrives before tokio's handler exists kills
/// the process outright (no graceful shutdown), and one that arrives while no stream exists
/// is lost (tokio's handler stays installed, so the default action no longer applies).
#[derive(Debug)]
pub struct Signals {
    term: Signal,
    int: Signal,
}

impl Signals {
    pub fn install() -> std::io::Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// The next SIGTERM or SIGINT, by name (for the log line that says why the process
    /// stops).
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
