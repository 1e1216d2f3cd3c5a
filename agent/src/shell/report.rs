//! What a response says: the command's output and status, plus the agent's notes about the
//! shell, and the answers given for commands whose result is unknown.

use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use cli_mcp_api::wire::{encode_stream, ExecResponse};

use super::stop::{Stop, StopReason};
use super::{ShellError, EXIT_AGENT_RESTARTED, EXIT_INTERRUPTED, EXIT_TIMEOUT};
use crate::output::Captured;

/// What a response says about the shell beyond the command's own output: `[cli-mcp-agent:
/// …]` lines at the end of stderr, and whether the shell state was reset.
pub(super) struct Notes {
    lines: Vec<String>,
    pub shell_restarted: bool,
}

impl Notes {
    /// Starts with a reset that happened outside any command (an agent restart), if any.
    pub fn new(pending_reset: Option<String>) -> Self {
        Self {
            shell_restarted: pending_reset.is_some(),
            lines: pending_reset.into_iter().collect(),
        }
    }

    pub fn note(&mut self, line: impl Into<String>) {
        self.lines.push(line.into());
    }

    /// The shell was replaced, for the reason `line` gives.
    pub fn reset(&mut self, line: impl Into<String>) {
        self.note(line);
        self.shell_restarted = true;
    }

    /// Puts why the command stopped early first, and returns the exit code that reports it.
    pub fn stopped(&mut self, stop: Stop, timeout: Duration) -> i32 {
        let (line, code) = match stop {
            Stop::Timeout => (
                format!(
                    "command timed out after {} and was killed",
                    human_duration(timeout)
                ),
                EXIT_TIMEOUT,
            ),
            Stop::Aborted(reason) => {
                let why = match reason {
                    StopReason::CallerGone => "the caller went away",
                    StopReason::Shutdown => "the sandbox agent is shutting down",
                };
                (format!("command interrupted: {why}"), EXIT_INTERRUPTED)
            }
        };
        self.lines.insert(0, line);
        code
    }

    /// Appends the notes to `stderr`, each on a line of its own; returns whether the shell
    /// was reset.
    pub fn append_to(self, stderr: &mut Vec<u8>) -> bool {
        for line in &self.lines {
            if !stderr.is_empty() && !stderr.ends_with(b"\n") {
                stderr.push(b'\n');
            }
            let _ = writeln!(stderr, "[cli-mcp-agent: {line}]");
        }
        self.shell_restarted
    }
}

/// How a command ended, as the response reports it.
pub(super) struct Outcome {
    pub exit_code: i32,
    pub cwd: String,
    pub timed_out: bool,
    pub shell_restarted: bool,
    pub started: Instant,
}

pub(super) fn response(out: Captured, err: Captured, outcome: Outcome) -> ExecResponse {
    let (stdout, stdout_encoding) = encode_stream(out.bytes);
    let (stderr, stderr_encoding) = encode_stream(err.bytes);
    ExecResponse {
        stdout,
        stderr,
        stdout_encoding,
        stderr_encoding,
        exit_code: outcome.exit_code,
        duration_ms: u64::try_from(outcome.started.elapsed().as_millis()).unwrap_or(u64::MAX),
        timed_out: outcome.timed_out,
        truncated: out.truncated || err.truncated,
        total_bytes: out.total + err.total,
        cwd: outcome.cwd,
        shell_restarted: outcome.shell_restarted,
    }
}

/// The answer to a retry of a command that was running, since `started`, when a previous
/// agent process died. The command is not run again: it may have finished, partly run or
/// not started, and only the caller can check. The shell it ran in is gone, so this answer
/// also carries the state reset.
pub(super) fn interrupted_by_restart(workdir: &Path, started: SystemTime) -> ExecResponse {
    let ago = SystemTime::now()
        .duration_since(started)
        .map(|d| {
            format!(
                ", started {} ago",
                human_duration(Duration::from_secs(d.as_secs()))
            )
        })
        .unwrap_or_default();
    let stderr = format!(
        "[cli-mcp-agent: the sandbox agent restarted while this command was running{ago} \
         (the container was killed: out of memory, or a crash); the command was not run \
         again. Whether it finished, partly ran or never started is unknown: check its \
         effects before running it again. The shell was restarted too (working directory, \
         variables and functions were reset).]\n"
    );
    unknown_effects(workdir, stderr, EXIT_AGENT_RESTARTED, true)
}

/// The answer kept for a request whose command was sent to bash but whose result was lost
/// to `error` (its output could not be read, or the shell could not be replaced after it).
/// A retry gets this answer: the command may have run, so it is not run again.
pub(super) fn lost_after_send(workdir: &Path, error: &ShellError) -> ExecResponse {
    let stderr = format!(
        "[cli-mcp-agent: this command was sent to the shell, but its result was lost: \
         {error}. The command was not run again. Whether it finished, partly ran or never \
         started is unknown: check its effects before running it again.]\n"
    );
    unknown_effects(workdir, stderr, EXIT_INTERRUPTED, false)
}

fn unknown_effects(
    workdir: &Path,
    stderr: String,
    exit_code: i32,
    shell_restarted: bool,
) -> ExecResponse {
    ExecResponse {
        stdout: String::new(),
        stderr,
        stdout_encoding: Default::default(),
        stderr_encoding: Default::default(),
        exit_code,
        duration_ms: 0,
        timed_out: false,
        truncated: false,
        total_bytes: 0,
        cwd: workdir.display().to_string(),
        shell_restarted,
    }
}

fn human_duration(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_naturally() {
        assert_eq!(human_duration(Duration::from_secs(60)), "60s");
        assert_eq!(human_duration(Duration::from_millis(1500)), "1500ms");
    }
}
