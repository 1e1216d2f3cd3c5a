//! Stopping a command early, the way Ctrl-C does in a terminal: SIGINT to the command's
//! process groups and to bash, which abandons the rest of the command line and returns to
//! its top level with its state intact; SIGKILL for groups that ignore SIGINT.

use std::collections::BTreeSet;
use std::time::Duration;

use nix::sys::signal::Signal;

use super::bash::Ended;
use super::framing::{random_hex, sync_line};
use super::Shell;
use crate::procs;

/// Why the caller of [`Shell::run`] asks a command to stop early.
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

impl Shell {
    /// SIGINT to the command's process groups and to bash, then SIGKILL to groups that
    /// ignored it, each followed by a grace period. bash then abandons the command line; a
    /// sync line queued behind it tells us when bash is back at its top level. Returns
    /// `Stopped` if bash never answered (the caller restarts it).
    pub(super) async fn interrupt(&mut self, nonce: &str, before: &BTreeSet<i32>) -> Ended {
        let grace = self.opts.kill_grace;
        let sync = random_hex();
        let sync_line = sync_line(&sync, 130);
        let mut never = std::pin::pin!(std::future::pending::<StopReason>());
        for (round, sig) in [Signal::SIGINT, Signal::SIGKILL].into_iter().enumerate() {
            let Some(bash) = self.bash.as_mut() else {
                return Ended::ShellExited(-1);
            };
            if bash.status.closed {
                break;
            }
            let groups = procs::jobs_since(bash.pid, before);
            procs::signal_groups(&groups, sig);
            if round == 0 {
                // Only once: a second SIGINT can land after bash is back at its top level,
                // where an interactive bash discards the input line it is reading.
                bash.signal(Signal::SIGINT);
                // bash reads this only once back at its top level; a write error means it is
                // gone, which the wait below reports. Bounded: a stopped shell with a full
                // stdin pipe must not hang us.
                bash.send_line(&sync_line, grace).await;
            }
            let deadline = tokio::time::Instant::now() + grace;
            match self
                .wait(&[nonce, &sync], deadline, never.as_mut(), None)
                .await
            {
                Ended::Stopped(_) => continue,
                other => return other,
            }
        }
        Ended::Stopped(Stop::Timeout)
    }

    /// After an interrupt, proves bash reads commands normally again: a SIGINT that arrived
    /// while it was reading a line makes an interactive bash discard that line, so a sync
    /// line is sent (twice at most, as SIGINTs do not queue) and its record awaited.
    pub(super) async fn settle(&mut self) -> bool {
        let grace = self.opts.kill_grace.max(Duration::from_millis(500));
        let mut never = std::pin::pin!(std::future::pending::<StopReason>());
        for _ in 0..2 {
            let sync = random_hex();
            let Some(bash) = self.bash.as_mut() else {
                return false;
            };
            if !bash.send_line(&sync_line(&sync, 0), grace).await {
                return false;
            }
            let deadline = tokio::time::Instant::now() + grace;
            match self.wait(&[&sync], deadline, never.as_mut(), None).await {
                Ended::Reported { .. } => return true,
                Ended::ShellExited(_) | Ended::Unreported => return false,
                Ended::Stopped(_) => continue,
            }
        }
        false
    }
}
