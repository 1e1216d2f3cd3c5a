//! Why a command stops before it finishes on its own: the wait for it ends with this
//! (`bash`), the interrupt acts on it (`interrupt`) and the response says it (`report`).

/// Why the caller of [`super::Shell::run`] asks a command to stop early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The HTTP caller went away.
    CallerGone,
    /// The agent is shutting down (SIGTERM and the drain time is over).
    Shutdown,
}

/// Why a command stopped before finishing on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    Timeout,
    Aborted(StopReason),
}
