//! One persistent bash, robust by construction.
//!
//! Protocol (never parses command output):
//! - bash reads *our* lines on its stdin; the command itself is written to a file and run
//!   with `. file </dev/null >out 2>err 3>&-`, so `cd`, `export` and functions persist, the
//!   command cannot read the control channel, and its output goes to files.
//! - after the command, bash writes `<nonce> <status> <cwd>\0` to fd 3, a pipe only the
//!   agent reads. Output can contain any marker text, NULs or invalid UTF-8 without
//!   effect; completion is only ever signalled on that pipe, tagged with a fresh nonce.
//! - bash runs interactive (`-i`, in its own session, prompts off) with `set -m`, so every
//!   job has its own process group and a timeout works like Ctrl-C in a terminal: SIGINT
//!   to the command's groups and to bash makes bash abandon the rest of the command line
//!   and return to its top level with `cd`, `export` and functions intact. A non-interactive
//!   bash would instead kill itself when its foreground job dies of SIGINT. Jobs that
//!   ignore SIGINT get SIGKILL; only a shell that still does not answer is replaced, and
//!   the response says so.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::future::Future;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::watch;

use cli_mcp_api::wire::{encode_stream, ExecResponse};

use crate::output::{self, Captured, SPILLS_KEPT};
use crate::procs;
use crate::reaper::{ExitCode, Reaper};

/// Exit code reported for a command that timed out (as coreutils `timeout` does).
pub const EXIT_TIMEOUT: i32 = 124;
/// Exit code reported for a command interrupted because its caller went away.
pub const EXIT_INTERRUPTED: i32 = 130;
/// Exit code reported for a command that was running when the agent process died: the
/// container's processes, the command included, were killed with it (128 + SIGKILL).
pub const EXIT_AGENT_RESTARTED: i32 = 137;

/// Environment every command sees on top of the agent's own: nothing may wait for a human.
const NON_INTERACTIVE_ENV: &[(&str, &str)] = &[
    ("PAGER", "cat"),
    ("GIT_PAGER", "cat"),
    ("MANPAGER", "cat"),
    ("SYSTEMD_PAGER", ""),
    ("TERM", "dumb"),
    ("GIT_TERMINAL_PROMPT", "0"),
    ("DEBIAN_FRONTEND", "noninteractive"),
];

/// Variables of the agent that must never reach bash.
const HIDDEN_ENV: &[&str] = &[
    cli_mcp_api::wire::ENV_TOKEN_SHA256,
    cli_mcp_api::wire::ENV_ASSIGN_SHA256,
];

#[derive(Debug, Clone)]
pub struct ShellOptions {
    pub shell: PathBuf,
    pub workdir: PathBuf,
    pub state_dir: PathBuf,
    pub env: Vec<(OsString, OsString)>,
    pub output_budget: usize,
    pub kill_grace: Duration,
}

impl ShellOptions {
    /// The environment bash gets: the agent's, minus auth material, plus the
    /// non-interactive defaults.
    pub fn inherit_env() -> Vec<(OsString, OsString)> {
        let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
            .filter(|(k, _)| {
                !HIDDEN_ENV.iter().any(|h| k == h)
                    && !k.to_string_lossy().starts_with("CLI_MCP_AGENT_")
            })
            .filter(|(k, _)| !NON_INTERACTIVE_ENV.iter().any(|(n, _)| k == n))
            .collect();
        env.extend(
            NON_INTERACTIVE_ENV
                .iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v))),
        );
        env
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ShellError {
    #[error(
        "cannot start the shell {shell:?}: {source}; check --shell and that bash is installed"
    )]
    Spawn { shell: PathBuf, source: io::Error },
    #[error("cannot prepare files for the command in {dir:?}: {source}; check that --state-dir is writable and not full")]
    Files { dir: PathBuf, source: io::Error },
    #[error("the shell stopped reading commands twice in a row; giving up on this command")]
    Unresponsive,
    /// Failed after the command was handed to bash: it may have run, in part or in full.
    #[error("{0}; this happened after the command was sent to the shell, so it may have run")]
    AfterSend(Box<ShellError>),
}

impl ShellError {
    /// False only when the command certainly never reached bash (a retry may run it);
    /// true when it was sent and may have run, so a retry must not run it again.
    pub fn command_may_have_run(&self) -> bool {
        matches!(self, Self::AfterSend(_))
    }
}

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
enum Stop {
    Timeout,
    Aborted(StopReason),
}

/// Most bytes kept from the status pipe while looking for a record. Records are tiny (a
/// nonce, a status and a path); anything longer is junk someone wrote on the pipe.
const STATUS_BUF_MAX: usize = 16 * 1024;

/// What the wait for a command ended with.
enum Ended {
    /// bash reported `status` and `cwd` on the status pipe.
    Reported { status: i32, cwd: String },
    /// The shell process exited (or was replaced through `exec` and then exited).
    ShellExited(ExitCode),
    /// Timeout or interruption before either of the above.
    Stopped(Stop),
}

/// One command's directory: `cmd` holds the command, `out` and `err` its output.
struct CommandFiles {
    dir: PathBuf,
    /// Tags the command's status record; also part of the directory's name.
    nonce: String,
    seq: u64,
}

impl CommandFiles {
    fn line(&self) -> String {
        command_line(&self.dir, &self.nonce)
    }

    fn error(&self, source: io::Error) -> ShellError {
        ShellError::Files {
            dir: self.dir.clone(),
            source,
        }
    }
}

/// What a response says about the shell beyond the command's own output: `[cli-mcp-agent:
/// …]` lines at the end of stderr, and whether the shell state was reset.
struct Notes {
    lines: Vec<String>,
    shell_restarted: bool,
}

impl Notes {
    /// Starts with a reset that happened outside any command (an agent restart), if any.
    fn new(pending_reset: Option<String>) -> Self {
        Self {
            shell_restarted: pending_reset.is_some(),
            lines: pending_reset.into_iter().collect(),
        }
    }

    fn note(&mut self, line: impl Into<String>) {
        self.lines.push(line.into());
    }

    /// The shell was replaced, for the reason `line` gives.
    fn reset(&mut self, line: impl Into<String>) {
        self.note(line);
        self.shell_restarted = true;
    }

    /// Puts why the command stopped early first, and returns the exit code that reports it.
    fn stopped(&mut self, stop: Stop, timeout: Duration) -> i32 {
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
    fn append_to(self, stderr: &mut Vec<u8>) -> bool {
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
struct Outcome {
    exit_code: i32,
    cwd: String,
    timed_out: bool,
    shell_restarted: bool,
    started: Instant,
}

fn response(out: Captured, err: Captured, outcome: Outcome) -> ExecResponse {
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

struct Bash {
    pid: i32,
    stdin: pipe::Sender,
    status: pipe::Receiver,
    status_buf: Vec<u8>,
    /// How much of `status_buf` is known to hold no NUL.
    scanned: usize,
    /// The status pipe hit EOF: the process on the other side is no longer our shell.
    status_closed: bool,
    exited: watch::Receiver<Option<ExitCode>>,
}

pub struct Shell {
    opts: ShellOptions,
    reaper: Reaper,
    bash: Option<Bash>,
    seq: u64,
    /// Set when the shell state was lost outside a command (agent restart, shell death
    /// between commands); reported on the next response.
    pending_reset: Option<String>,
    /// `<state-dir>/shell-used`: exists once a command ran in this pod, so a restarted agent
    /// knows that a session's shell state was lost.
    started_marker: PathBuf,
}

impl Shell {
    pub fn new(opts: ShellOptions, reaper: Reaper) -> Result<Self, ShellError> {
        let files_err = |source| ShellError::Files {
            dir: opts.state_dir.clone(),
            source,
        };
        fs::create_dir_all(opts.state_dir.join("cmd")).map_err(files_err)?;
        fs::create_dir_all(opts.state_dir.join("spill")).map_err(files_err)?;
        // Leftovers of a previous agent process are never resumed.
        let _ = fs::remove_dir_all(opts.state_dir.join("cmd"));
        fs::create_dir_all(opts.state_dir.join("cmd")).map_err(files_err)?;
        let started_marker = opts.state_dir.join("shell-used");
        // Whatever is there counts (also a link a command put there: it is never followed).
        let pending_reset = fs::symlink_metadata(&started_marker).is_ok().then(|| {
            "the sandbox agent restarted since the last command; the shell state (working \
             directory, variables, functions) was reset"
                .to_owned()
        });
        Ok(Self {
            opts,
            reaper,
            bash: None,
            seq: 0,
            pending_reset,
            started_marker,
        })
    }

    pub fn options(&self) -> &ShellOptions {
        &self.opts
    }

    /// The answer to a retry of a command that was running when a previous agent process
    /// died. The command is not run again: it may have finished, partly run or not started,
    /// and only the caller can check. The shell it ran in is gone, so this answer also
    /// carries the state reset (and the next command does not report it again).
    pub fn interrupted_by_restart(&mut self, started: std::time::SystemTime) -> ExecResponse {
        self.pending_reset = None;
        let ago = std::time::SystemTime::now()
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
        ExecResponse {
            stdout: String::new(),
            stderr,
            stdout_encoding: Default::default(),
            stderr_encoding: Default::default(),
            exit_code: EXIT_AGENT_RESTARTED,
            duration_ms: 0,
            timed_out: false,
            truncated: false,
            total_bytes: 0,
            cwd: self.opts.workdir.display().to_string(),
            shell_restarted: true,
        }
    }

    /// The answer kept for a request whose command was sent to bash but whose result was
    /// lost to `error` (its output could not be read, or the shell could not be replaced
    /// after it). A retry gets this answer: the command may have run, so it is not run again.
    pub fn lost_after_send(&self, error: &ShellError) -> ExecResponse {
        let stderr = format!(
            "[cli-mcp-agent: this command was sent to the shell, but its result was lost: \
             {error}. The command was not run again. Whether it finished, partly ran or never \
             started is unknown: check its effects before running it again.]\n"
        );
        ExecResponse {
            stdout: String::new(),
            stderr,
            stdout_encoding: Default::default(),
            stderr_encoding: Default::default(),
            exit_code: EXIT_INTERRUPTED,
            duration_ms: 0,
            timed_out: false,
            truncated: false,
            total_bytes: 0,
            cwd: self.opts.workdir.display().to_string(),
            shell_restarted: false,
        }
    }

    /// Recreates the restart marker if it is missing: one `lstat` per call. Never follows
    /// or truncates anything a command put in its place.
    fn keep_marker(&self) {
        if fs::symlink_metadata(&self.started_marker).is_err() {
            let _ = write_new_file(&self.started_marker, b"");
        }
    }

    /// Pid of the current shell, if one runs (for tests and diagnostics).
    pub fn pid(&self) -> Option<i32> {
        self.bash.as_ref().map(|b| b.pid)
    }

    /// Runs `command` to completion, timeout, or `abort` (the caller went away or the agent
    /// is shutting down).
    pub async fn run(
        &mut self,
        command: &str,
        timeout: Duration,
        abort: impl Future<Output = StopReason>,
    ) -> Result<ExecResponse, ShellError> {
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        self.keep_marker();
        let mut notes = Notes::new(self.pending_reset.take());
        let files = self.write_command(command)?;
        let before = self.send(&files.line(), &mut notes).await?;
        let (ended, stop) = self.await_end(&files.nonce, &before, deadline, abort).await;

        // Every error from here on comes after the command line went to bash: it may have run.
        let after_send = |e| ShellError::AfterSend(Box::new(e));
        let (status, cwd) = self
            .status_and_cwd(ended, stop, &mut notes)
            .await
            .map_err(after_send)?;
        let exit_code = match stop {
            Some(stop) => notes.stopped(stop, timeout),
            None => status,
        };
        let (out, mut err) = self.collect_output(&files).map_err(after_send)?;
        self.clean_up(&files, out.spill.is_some() || err.spill.is_some());
        if out.replaced || err.replaced {
            notes.note(
                "the command replaced its output file with something that is not a regular \
                 file; that output was not read",
            );
        }
        let shell_restarted = notes.append_to(&mut err.bytes);
        Ok(response(
            out,
            err,
            Outcome {
                exit_code,
                cwd,
                timed_out: stop == Some(Stop::Timeout),
                shell_restarted,
                started,
            },
        ))
    }

    /// Writes `command` into a fresh, unguessable directory, so nothing can be planted there
    /// in advance.
    fn write_command(&mut self, command: &str) -> Result<CommandFiles, ShellError> {
        self.seq += 1;
        let nonce = random_hex();
        let files = CommandFiles {
            dir: self
                .opts
                .state_dir
                .join("cmd")
                .join(format!("{}-{}", self.seq, &nonce[..16])),
            nonce,
            seq: self.seq,
        };
        if fs::create_dir(&files.dir).is_err() {
            // The state dir is writable by the sandbox user: repair it (off the hot path,
            // only when a command broke it) and try once more.
            self.ensure_dirs();
            fs::create_dir(&files.dir).map_err(|e| files.error(e))?;
        }
        write_new_file(&files.dir.join("cmd"), command.as_bytes()).map_err(|e| files.error(e))?;
        Ok(files)
    }

    /// Hands `line` to bash; a shell that died since the last call, or that does not take
    /// the line, is replaced first. Returns the job groups that existed before the command,
    /// which an interrupt spares.
    async fn send(&mut self, line: &str, notes: &mut Notes) -> Result<BTreeSet<i32>, ShellError> {
        let mut attempts = 0;
        loop {
            if self.shell_gone() {
                if self.bash.is_some() {
                    notes.reset(
                        "the shell had exited since the last command; a new shell was started \
                         (working directory, variables and functions were reset)",
                    );
                }
                self.restart().await?;
            }
            let Some(bash) = self.bash.as_mut() else {
                return Err(ShellError::Unresponsive);
            };
            let before = procs::jobs_before(bash.pid);
            // A stopped shell with a full stdin pipe would block this write forever.
            let grace = self.opts.kill_grace.max(Duration::from_secs(1));
            if let Ok(Ok(())) =
                tokio::time::timeout(grace, bash.stdin.write_all(line.as_bytes())).await
            {
                return Ok(before);
            }
            attempts += 1;
            if attempts >= 2 {
                return Err(ShellError::Unresponsive);
            }
            notes.reset(
                "the shell did not accept the command, so it was restarted (working directory, \
                 variables and functions were reset)",
            );
            self.restart().await?;
        }
    }

    /// Waits for the command to end. One that outlives `deadline` or is aborted is
    /// interrupted; the reason comes back with how it ended.
    async fn await_end(
        &mut self,
        nonce: &str,
        before: &BTreeSet<i32>,
        deadline: tokio::time::Instant,
        abort: impl Future<Output = StopReason>,
    ) -> (Ended, Option<Stop>) {
        tokio::pin!(abort);
        let stop = match self.wait(&[nonce], deadline, abort.as_mut()).await {
            Ended::Stopped(stop) => stop,
            ended => return (ended, None),
        };
        let mut ended = self.interrupt(nonce, before).await;
        if matches!(ended, Ended::Reported { .. }) && !self.settle().await {
            // bash answered the interrupt but then stopped taking input.
            ended = Ended::Stopped(stop);
        }
        (ended, Some(stop))
    }

    /// The command's exit status and the shell's working directory after it. A shell that
    /// exited, or that still did not stop when interrupted, is replaced: the directory is
    /// then the start directory again.
    async fn status_and_cwd(
        &mut self,
        ended: Ended,
        stop: Option<Stop>,
        notes: &mut Notes,
    ) -> Result<(i32, String), ShellError> {
        let status = match ended {
            Ended::Reported { status, cwd } => return Ok((status, cwd)),
            Ended::ShellExited(code) => {
                // A stopped command already has its note; the shell's exit is part of it.
                match stop {
                    None => notes.reset(format!(
                        "the shell exited with status {code}; a new shell was started \
                         (working directory, variables and functions were reset)"
                    )),
                    Some(_) => notes.shell_restarted = true,
                }
                code
            }
            Ended::Stopped(_) => {
                // Still no answer after killing the command's processes: the shell itself
                // is busy (a builtin loop) or no longer ours.
                notes.reset(
                    "the shell itself did not stop (a loop of shell builtins?), so it was \
                     restarted: working directory, variables and functions were reset",
                );
                EXIT_TIMEOUT
            }
        };
        self.restart().await?;
        Ok((status, self.opts.workdir.display().to_string()))
    }

    /// Reads the command's stdout and stderr within the output budget; what is cut is kept
    /// whole in a spill file.
    fn collect_output(&self, files: &CommandFiles) -> Result<(Captured, Captured), ShellError> {
        let spill_dir = self.opts.state_dir.join("spill");
        let capture = |stream: &str, suffix: &str| {
            output::capture(
                &files.dir.join(stream),
                self.opts.output_budget,
                &spill_dir.join(format!("{}.{suffix}", files.seq)),
            )
            .map_err(|e| files.error(e))
        };
        Ok((capture("out", "stdout")?, capture("err", "stderr")?))
    }

    /// Removes the command's directory and restores what the command may have removed.
    fn clean_up(&self, files: &CommandFiles, spilled: bool) {
        let _ = fs::remove_dir_all(&files.dir);
        // Also after the command: it may have removed the marker (`rm -rf /tmp/*`), and a
        // restart before the next command must still be reported.
        self.keep_marker();
        if spilled {
            output::prune_spills(&self.opts.state_dir.join("spill"), SPILLS_KEPT);
        }
    }

    /// Kills the shell and everything it started (agent shutdown).
    pub async fn kill(&mut self) {
        if let Some(bash) = self.bash.take() {
            kill_everything(bash, self.opts.kill_grace).await;
        }
    }

    fn shell_gone(&self) -> bool {
        match &self.bash {
            None => true,
            Some(b) => b.status_closed || b.exited.borrow().is_some(),
        }
    }

    /// Waits for the command's status record, the shell's death, the deadline or `abort`.
    async fn wait(
        &mut self,
        nonces: &[&str],
        deadline: tokio::time::Instant,
        mut abort: std::pin::Pin<&mut impl Future<Output = StopReason>>,
    ) -> Ended {
        let Some(bash) = self.bash.as_mut() else {
            return Ended::ShellExited(-1);
        };
        loop {
            if let Some(code) = *bash.exited.borrow() {
                return Ended::ShellExited(code);
            }
            tokio::select! {
                rec = read_record(&mut bash.status, &mut bash.status_buf, &mut bash.scanned), if !bash.status_closed => match rec {
                    Some((n, status, cwd)) if nonces.contains(&n.as_str()) => {
                        return Ended::Reported { status, cwd }
                    }
                    Some(_) => continue, // a stale record of an interrupted command
                    None => bash.status_closed = true,
                },
                _ = bash.exited.changed() => {
                    let code = (*bash.exited.borrow()).unwrap_or(-1);
                    return Ended::ShellExited(code);
                }
                _ = tokio::time::sleep_until(deadline) => return Ended::Stopped(Stop::Timeout),
                reason = &mut abort => return Ended::Stopped(Stop::Aborted(reason)),
            }
        }
    }

    /// Stops a running command the way Ctrl-C does: SIGINT to its process groups and to bash,
    /// then SIGKILL to groups that ignored it, each followed by a grace period. bash then
    /// abandons the command line; a sync line queued behind it tells us when bash is back
    /// at its top level. Returns `Stopped` if bash never answered (the caller restarts it).
    async fn interrupt(&mut self, nonce: &str, before: &BTreeSet<i32>) -> Ended {
        let grace = self.opts.kill_grace;
        let sync = random_hex();
        let sync_line = format!("builtin printf '\\0%s %s %s\\0' {sync} 130 \"$PWD\" >&3\n");
        let mut never = std::pin::pin!(std::future::pending::<StopReason>());
        for (round, sig) in [Signal::SIGINT, Signal::SIGKILL].into_iter().enumerate() {
            let Some(bash) = self.bash.as_mut() else {
                return Ended::ShellExited(-1);
            };
            if bash.status_closed {
                break;
            }
            let groups = procs::jobs_since(bash.pid, before);
            procs::signal_groups(&groups, sig);
            if round == 0 {
                // Only once: a second SIGINT can land after bash is back at its top level,
                // where an interactive bash discards the input line it is reading.
                let _ =
                    nix::sys::signal::kill(nix::unistd::Pid::from_raw(bash.pid), Signal::SIGINT);
                // bash reads this only once back at its top level; a write error means it is
                // gone, which the wait below reports. Bounded: a stopped shell with a full
                // stdin pipe must not hang us.
                let _ =
                    tokio::time::timeout(grace, bash.stdin.write_all(sync_line.as_bytes())).await;
            }
            let deadline = tokio::time::Instant::now() + grace;
            match self.wait(&[nonce, &sync], deadline, never.as_mut()).await {
                Ended::Stopped(_) => continue,
                other => return other,
            }
        }
        Ended::Stopped(Stop::Timeout)
    }

    /// After an interrupt, proves bash reads commands normally again: a SIGINT that arrived
    /// while it was reading a line makes an interactive bash discard that line, so a sync
    /// line is sent (twice at most, as SIGINTs do not queue) and its record awaited.
    async fn settle(&mut self) -> bool {
        let grace = self.opts.kill_grace.max(Duration::from_millis(500));
        let mut never = std::pin::pin!(std::future::pending::<StopReason>());
        for _ in 0..2 {
            let sync = random_hex();
            let line = format!("builtin printf '\\0%s %s %s\\0' {sync} 0 \"$PWD\" >&3\n");
            let Some(bash) = self.bash.as_mut() else {
                return false;
            };
            if !matches!(
                tokio::time::timeout(grace, bash.stdin.write_all(line.as_bytes())).await,
                Ok(Ok(()))
            ) {
                return false;
            }
            let deadline = tokio::time::Instant::now() + grace;
            match self.wait(&[&sync], deadline, never.as_mut()).await {
                Ended::Reported { .. } => return true,
                Ended::ShellExited(_) => return false,
                Ended::Stopped(_) => continue,
            }
        }
        false
    }

    async fn restart(&mut self) -> Result<(), ShellError> {
        if let Some(old) = self.bash.take() {
            kill_everything(old, self.opts.kill_grace).await;
        }
        // Processes that escaped the old shell (setsid, double fork) were re-parented to the
        // agent (a subreaper); with the shell gone, none of them may outlive it.
        procs::kill_descendants_of_self();
        self.bash = Some(self.spawn().await?);
        Ok(())
    }

    /// Recreates the state directories and gives them back to us if a command removed them,
    /// replaced them or changed their mode (errors surface on the file operations that follow).
    fn ensure_dirs(&self) {
        use std::os::unix::fs::PermissionsExt;
        for sub in ["cmd", "spill"] {
            let d = self.opts.state_dir.join(sub);
            // Something that is not a directory (a file, a link) took its place: remove it.
            if fs::symlink_metadata(&d).is_ok_and(|m| !m.is_dir()) {
                let _ = fs::remove_file(&d);
            }
            let _ = fs::create_dir_all(&d);
            let _ = fs::set_permissions(&d, fs::Permissions::from_mode(0o700));
        }
    }

    async fn spawn(&self) -> Result<Bash, ShellError> {
        let spawn_err = |source| ShellError::Spawn {
            shell: self.opts.shell.clone(),
            source,
        };
        let (status_tx, status_rx) = pipe::pipe().map_err(spawn_err)?;
        let status_w: OwnedFd = status_tx.into_blocking_fd().map_err(spawn_err)?;
        let mut cmd = Command::new(&self.opts.shell);
        cmd.args(["--noprofile", "--norc", "--noediting", "-i"])
            .env_clear()
            .envs(self.opts.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&self.opts.workdir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        prepare_child(&mut cmd, status_w.as_raw_fd());
        let (mut child, exited) = self.reaper.spawn(&mut cmd).map_err(spawn_err)?;
        // Our copy of the write end must go, so that EOF on the pipe means "shell gone".
        drop(status_w);
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| spawn_err(io::Error::other("no stdin pipe")))?;
        let mut stdin = pipe::Sender::from_owned_fd(OwnedFd::from(stdin)).map_err(spawn_err)?;
        stdin
            .write_all(INIT_SCRIPT.as_bytes())
            .await
            .map_err(spawn_err)?;
        Ok(Bash {
            pid: child.id() as i32,
            stdin,
            status: status_rx,
            status_buf: Vec::new(),
            scanned: 0,
            status_closed: false,
            exited,
        })
    }
}

/// Sent once to every new shell: `set -m` puts each job in its own process group; history
/// and `!` expansion are off so `echo "hi!"` means what it says; no prompts.
const INIT_SCRIPT: &str = "set -m +o history +H\nPS1= PS2= PS0=\nunset PROMPT_COMMAND MAILCHECK\n";

/// In the child, before exec: a new session (an interactive bash must never see the agent's
/// controlling terminal, or it would take it over) and the status pipe as fd 3. bash's
/// stderr is /dev/null, so nothing it prints at startup can land on the status pipe.
#[allow(unsafe_code)]
fn prepare_child(cmd: &mut Command, status_fd: RawFd) {
    // SAFETY: the closure runs in the forked child before exec and calls only setsid(2) and
    // dup2(2), both async-signal-safe; it touches no memory shared with the parent.
    // `status_fd` stays open in the parent until after spawn returns.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setsid().map_err(io::Error::from)?;
            // dup2 clears close-on-exec on the new descriptor, so bash keeps fd 3.
            if nix::libc::dup2(status_fd, 3) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Creates `path` (which must not exist, and is never followed if it is a link) with
/// `bytes`.
fn write_new_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)
}

/// The line that runs one command file. Only our paths and nonce appear in it.
fn command_line(dir: &Path, nonce: &str) -> String {
    let q = |name: &str| sh_quote(&dir.join(name).display().to_string());
    format!(
        ". {} </dev/null >{} 2>{} 3>&-; builtin printf '\\0%s %s %s\\0' {nonce} \"$?\" \"$PWD\" >&3\n",
        q("cmd"),
        q("out"),
        q("err"),
    )
}

/// Reads the next `\0<nonce> <status> <cwd>\0` record; `None` on EOF. Records are
/// NUL-delimited on both sides so anything bash printed on the pipe before its init script
/// ran (startup warnings, a first prompt) is a segment of its own that matches no nonce.
async fn read_record(
    status: &mut pipe::Receiver,
    status_buf: &mut Vec<u8>,
    scanned: &mut usize,
) -> Option<(String, i32, String)> {
    loop {
        // Only bytes not yet searched are searched, so a flood stays linear.
        while let Some(off) = status_buf[*scanned..].iter().position(|b| *b == 0) {
            let end = *scanned + off;
            let segment: Vec<u8> = status_buf.drain(..=end).collect();
            *scanned = 0;
            if let Some(rec) = parse_record(&segment[..segment.len() - 1]) {
                return Some(rec);
            }
        }
        *scanned = status_buf.len();
        if status_buf.len() > STATUS_BUF_MAX {
            // No record is this long: drop the junk (keep a tail that may start one).
            let keep = 256;
            status_buf.drain(..status_buf.len() - keep);
            *scanned = status_buf.len();
        }
        let mut buf = [0u8; 4096];
        match status.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => status_buf.extend_from_slice(&buf[..n]),
        }
    }
}

/// Parses `<nonce> <status> <cwd>`; anything else (empty segments, junk) is `None`.
fn parse_record(segment: &[u8]) -> Option<(String, i32, String)> {
    let text = String::from_utf8_lossy(segment);
    let mut parts = text.splitn(3, ' ');
    let nonce = parts.next()?;
    if nonce.len() != 32 || !nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let status = parts.next()?.parse().ok()?;
    let cwd = parts.next()?.to_owned();
    Some((nonce.to_owned(), status, cwd))
}

/// SIGKILLs the shell and every process it started, then waits (bounded) until it is reaped.
async fn kill_everything(mut bash: Bash, grace: Duration) {
    let groups = procs::all_groups(&procs::snapshot(), bash.pid);
    procs::signal_groups(&groups, Signal::SIGKILL);
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(bash.pid), Signal::SIGKILL);
    let _ = tokio::time::timeout(grace, bash.exited.wait_for(Option::is_some)).await;
}

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn random_hex() -> String {
    let bytes: [u8; 16] = rand::random();
    bytes.iter().fold(String::with_capacity(32), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
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
    fn quoting_survives_quotes() {
        assert_eq!(sh_quote("/a b/c'd"), r"'/a b/c'\''d'");
    }

    #[test]
    fn command_line_names_only_our_files() {
        let l = command_line(Path::new("/s/cmd/1"), "abc");
        assert_eq!(
            l,
            ". '/s/cmd/1/cmd' </dev/null >'/s/cmd/1/out' 2>'/s/cmd/1/err' 3>&-; builtin printf '\\0%s %s %s\\0' abc \"$?\" \"$PWD\" >&3\n"
        );
    }

    #[test]
    fn records_parse_and_junk_is_ignored() {
        let n = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            parse_record(format!("{n} 3 /a b").as_bytes()),
            Some((n.to_owned(), 3, "/a b".to_owned()))
        );
        assert_eq!(parse_record(b"bash-5.2# exec 3>&2"), None);
        assert_eq!(parse_record(b""), None);
        assert_eq!(parse_record(format!("{n} x /").as_bytes()), None);
    }

    #[tokio::test]
    async fn a_flood_on_the_status_pipe_stays_bounded_and_records_still_parse() {
        let (mut tx, mut rx) = pipe::pipe().expect("pipe");
        let nonce = "0123456789abcdef0123456789abcdef";
        let writer = tokio::spawn(async move {
            let junk = vec![b'A'; 64 * 1024];
            for _ in 0..64 {
                tx.write_all(&junk).await.expect("write junk");
            }
            tx.write_all(format!("\0{nonce} 5 /w\0").as_bytes())
                .await
                .expect("write record");
        });
        let (mut buf, mut scanned) = (Vec::new(), 0);
        let rec = read_record(&mut rx, &mut buf, &mut scanned).await;
        writer.await.expect("join");
        assert_eq!(rec, Some((nonce.to_owned(), 5, "/w".to_owned())));
        assert!(
            buf.capacity() < 4 * STATUS_BUF_MAX,
            "buffer grew to {}",
            buf.capacity()
        );
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(human_duration(Duration::from_secs(60)), "60s");
        assert_eq!(human_duration(Duration::from_millis(1500)), "1500ms");
    }
}
