//! A command whose processes multiply without end (a fork bomb, `:(){ :|:& };:`) must not
//! take the session, or the node, with it.
//!
//! Two bounds. The kernel's: bash is started with `RLIMIT_NPROC` at `--max-processes` (plus
//! the agent's own threads, which count against it too), so forks beyond it fail. The
//! limit counts every task of the uid, not of the session; it does not bind root; and on
//! Kubernetes the kubelet's `podPidsLimit` is the bound that is per pod. The agent's: a
//! bomb that has reached the limit lives on in the background (its command returned at
//! once), every fork in the session fails, and the processes keep retrying. So before each
//! command, and after a command that was stopped, the agent counts the session's
//! processes; at three quarters of the limit it kills the largest process groups (a bomb is
//! one group, or a few) until fewer than half that remain, and says so in the response. The
//! shell itself and its state are kept.

use std::collections::HashMap;
use std::time::Duration;

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use super::report::Notes;
use super::Shell;
use crate::procs;

/// How long the agent keeps killing before it answers anyway (the kernel limit still holds).
const KILL_FOR: Duration = Duration::from_secs(3);

/// `--max-processes` as it can be had: a non-root agent cannot raise the hard limit it was
/// started with, which then bounds the shell (less the agent's own threads), and the agent
/// steps in relative to that.
pub(super) fn effective_max(max: u64) -> u64 {
    let threads = crate::procs::own_threads();
    match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NPROC) {
        Ok((_, hard)) if hard < max.saturating_add(threads) => {
            let max_here = hard.saturating_sub(threads).max(1);
            tracing::warn!(
                max_processes = max,
                hard_limit = hard,
                "the agent's own process limit is lower than --max-processes; using {max_here}"
            );
            max_here
        }
        _ => max,
    }
}

/// Session processes at which the agent steps in, for a limit of `max`.
pub(super) fn threshold(max: u64) -> usize {
    usize::try_from(max.saturating_mul(3) / 4)
        .unwrap_or(usize::MAX)
        .max(2)
}

impl Shell {
    /// Kills the session's largest process groups if its processes reached the threshold.
    pub(super) async fn stop_runaway(&mut self, notes: &mut Notes) {
        self.shell_children = None;
        let (Some(max), Some(bash)) = (self.opts.max_processes, self.bash.as_ref()) else {
            return;
        };
        let shell = bash.pid;
        let threshold = threshold(max);
        let found = match procs::session_count(shell, &bash.children, threshold) {
            Some((n, shell_children)) => {
                self.shell_children = Some((shell, shell_children));
                n
            }
            None => procs::session(shell).len(),
        };
        if found < threshold {
            return;
        }
        let target = threshold / 2;
        let deadline = tokio::time::Instant::now() + KILL_FOR;
        let mut groups_killed = 0;
        let mut left;
        loop {
            let session = procs::session(shell);
            left = session.len();
            if left < target || tokio::time::Instant::now() >= deadline {
                break;
            }
            groups_killed += kill_largest(&session, shell, target);
            // Let the kernel deliver the signals and the reaper reap before counting again.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tracing::warn!(
            processes = found,
            limit = max,
            groups_killed,
            left,
            "the shell's processes ran away; killed the largest groups"
        );
        notes.note(format!(
            "the shell had {found} processes or more ({max} are allowed, --max-processes; a \
             fork bomb?): the agent killed its {groups_killed} largest process group(s), {left} \
             of its processes are left; the shell and its state were kept"
        ));
    }
}

/// SIGKILLs the largest groups of `session` until fewer than `target` processes would be
/// left. Processes in the shell's own group (a command substitution's subshells) are killed
/// one by one, never the group, which is the shell's. Returns the groups killed.
fn kill_largest(session: &[procs::ProcInfo], shell: i32, target: usize) -> usize {
    let mut sizes: HashMap<i32, usize> = HashMap::new();
    for p in session {
        if p.pgid == shell || p.pgid <= 1 {
            let _ = kill(Pid::from_raw(p.pid), Signal::SIGKILL);
        } else {
            *sizes.entry(p.pgid).or_default() += 1;
        }
    }
    let mut sizes: Vec<(i32, usize)> = sizes.into_iter().collect();
    sizes.sort_by_key(|g| std::cmp::Reverse(g.1));
    let mut left: usize = sizes.iter().map(|g| g.1).sum();
    let mut killed = 0;
    for (group, size) in sizes {
        if left < target {
            break;
        }
        let _ = killpg(Pid::from_raw(group), Signal::SIGKILL);
        left -= size;
        killed += 1;
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_steps_in_at_three_quarters_of_the_limit() {
        assert_eq!(threshold(4096), 3072);
        assert_eq!(threshold(40), 30);
        // Never at the shell alone, however small the limit.
        assert_eq!(threshold(1), 2);
    }
}
