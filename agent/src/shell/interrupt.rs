//! Stopping a command early, the way Ctrl-C does in a terminal: SIGINT to the command's
//! processes and to bash, which abandons the rest of the command line and returns to its
//! top level with its state intact; SIGKILL for processes that ignore SIGINT.

use std::collections::BTreeSet;
use std::time::Duration;

use nix::sys::signal::Signal;

use super::bash::Ended;
use super::framing::{random_hex, sync_line};
use super::report::Notes;
use super::stop::{Stop, StopReason};
use super::Shell;
use crate::procs;

/// Whom a round of [`Shell::interrupt`] signals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Targets {
    /// The command's job groups and its substitutions.
    Command,
    /// The jobs that existed before the command.
    EarlierJobs,
}

impl Shell {
    /// Ctrl-C: SIGINT to the command's process groups, to its command and process
    /// substitutions (in bash's own group) and to bash, then SIGKILL to those that ignored
    /// it, each followed by a grace period. bash then abandons the command line; a sync line
    /// queued behind it tells us when bash is back at its top level. If bash still waits, it
    /// waits for a job of an earlier call that the command brought to the foreground (`fg`):
    /// there is no terminal to tell which, so the earlier calls' jobs get the same two rounds
    /// (the shell's restart would end them anyway), and `notes` says so. Returns `Stopped` if
    /// bash never answered (the caller restarts it).
    pub(super) async fn interrupt(
        &mut self,
        nonce: &str,
        before: &BTreeSet<i32>,
        notes: &mut Notes,
    ) -> Ended {
        let grace = self.opts.kill_grace;
        let sync = random_hex();
        let sync_line = sync_line(&sync, 130);
        let mut never = std::pin::pin!(std::future::pending::<StopReason>());
        let rounds = [
            (Signal::SIGINT, Targets::Command),
            (Signal::SIGKILL, Targets::Command),
            (Signal::SIGINT, Targets::EarlierJobs),
            (Signal::SIGKILL, Targets::EarlierJobs),
        ];
        for (round, (sig, targets)) in rounds.into_iter().enumerate() {
            let Some(bash) = self.bash.as_mut() else {
                return Ended::ShellExited(-1);
            };
            if bash.status.closed {
                break;
            }
            match targets {
                Targets::Command => {
                    procs::signal_groups(&procs::jobs_since(bash.pid, before), sig);
                    procs::signal_pids(&procs::substitutions_since(bash.pid, before), sig);
                }
                Targets::EarlierJobs => {
                    let earlier = procs::jobs_from_before(bash.pid, before);
                    if earlier.is_empty() {
                        break;
                    }
                    if sig == Signal::SIGINT {
                        notes.note(format!(
                            "bash still waited after the command's processes were stopped: for a job of an \
                             earlier call brought to the foreground (fg)? The earlier calls' \
                             jobs ({} process group(s)) were interrupted too, and killed if they \
                             ignored it",
                            earlier.len()
                        ));
                    }
                    procs::signal_groups(&earlier, sig);
                }
            }
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
