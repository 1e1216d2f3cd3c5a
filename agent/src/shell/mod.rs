//! One persistent bash, robust by construction.
//!
//! Protocol (never parses command output):
//! - bash reads *our* lines on its stdin; the command itself is written to a file and run
//!   with `\builtin . file </dev/null >out 2>err 3>&-`, so `cd`, `export` and functions
//!   persist, the command cannot read the control channel, and its output goes to FIFOs the
//!   agent reads (`streams`), within the output budget and the spill caps.
//! - after the command, bash restores the builtins the line uses (a command may have
//!   redefined or disabled them, see `framing`) and writes `<nonce> <status> <flags>
//!   <cwd>\0` to fd 3, a pipe only the agent reads. Output can contain any marker text,
//!   NULs or invalid UTF-8 without effect; completion is only ever signalled on that pipe,
//!   tagged with a fresh nonce, and by bash closing the command's `done` FIFO.
//! - bash runs interactive (`-i`, in its own session, prompts off) with `set -m`, so every
//!   job has its own process group and a timeout works like Ctrl-C in a terminal: SIGINT
//!   to the command's groups and to bash makes bash abandon the rest of the command line
//!   and return to its top level with `cd`, `export` and functions intact. A non-interactive
//!   bash would instead kill itself when its foreground job dies of SIGINT. Jobs that
//!   ignore SIGINT get SIGKILL; only a shell that still does not answer is replaced, and
//!   the response says so.

mod bash;
mod command_dir;
mod error;
mod framing;
mod interrupt;
mod options;
mod prepare;
mod report;
mod reserve;
mod runaway;
mod slots;
mod stop;
mod streams;

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant, SystemTime};

use cli_mcp_api::wire::ExecResponse;

use crate::output::Captured;
use crate::procs;
use crate::progress::Progress;
use crate::reaper::Reaper;
use crate::spill::{SpillLimits, Spills};
use crate::state_files::{self, HeldDir};
use bash::{Bash, Ended};
use command_dir::CommandFiles;
use report::{Notes, Outcome};
use reserve::Reserve;
use slots::{Slot, Slots};
use stop::Stop;
use streams::Lingering;

pub use error::ShellError;
pub use options::ShellOptions;
pub use stop::StopReason;

/// Exit code reported for a command that timed out (as coreutils `timeout` does).
pub const EXIT_TIMEOUT: i32 = 124;
/// Exit code reported for a command interrupted because its caller went away.
pub const EXIT_INTERRUPTED: i32 = 130;
/// Exit code reported for a command that was running when the agent process died: the
/// container's processes, the command included, were killed with it (128 + SIGKILL).
pub const EXIT_AGENT_RESTARTED: i32 = 137;

pub struct Shell {
    opts: ShellOptions,
    reaper: Reaper,
    bash: Option<Bash>,
    seq: u64,
    /// Set when the shell state was lost outside a command (agent restart, shell death
    /// between commands); reported on the next response.
    pending_reset: Option<String>,
    /// The state dir, which holds [`MARKER`] and the reserve.
    root: HeldDir,
    /// `<state-dir>/cmd`, which holds each command's directory.
    cmd: HeldDir,
    /// The last commands' directories, kept for the next commands.
    slots: Slots,
    spills: Spills,
    /// How far the running command is (`GET /exec/progress`).
    progress: Progress,
    /// Output streams of earlier commands that background jobs still write.
    lingering: Lingering,
    /// Space kept aside so that a command can be written to a full state dir.
    reserve: Reserve,
    /// `set -e` was on after the last command: a shell that exits during the next one most
    /// likely did so for a failing command.
    errexit: bool,
    /// The shell's children as the process count before this command found them (by the
    /// shell's pid): the jobs an interrupt spares, without reading them a second time.
    shell_children: Option<(i32, BTreeSet<i32>)>,
}

/// `<state-dir>/shell-used`: exists once a command ran in this pod, so a restarted agent
/// knows that a session's shell state was lost.
const MARKER: &str = "shell-used";

impl Shell {
    pub fn new(mut opts: ShellOptions, reaper: Reaper) -> Result<Self, ShellError> {
        opts.max_processes = opts.max_processes.map(runaway::effective_max);
        let files_err = |source| ShellError::Files {
            dir: opts.state_dir.clone(),
            source,
        };
        let root = HeldDir::open(&opts.state_dir, None).map_err(files_err)?;
        // Leftovers of a previous agent process are never resumed.
        let _ = state_files::remove_all_at(root.fd(), "cmd".as_ref());
        let cmd = HeldDir::open(&opts.state_dir, Some("cmd")).map_err(files_err)?;
        let spill = HeldDir::open(&opts.state_dir, Some("spill")).map_err(files_err)?;
        // Whatever is there counts (also a link a command put there: it is never followed).
        let pending_reset = has_marker(&root).then(|| {
            "the sandbox agent restarted since the last command; the shell state (working \
             directory, variables, functions) was reset"
                .to_owned()
        });
        let spills = Spills::open(
            spill,
            SpillLimits {
                max_file: opts.spill_max_bytes,
                max_total: opts.spill_total_bytes,
            },
        );
        let reserve = Reserve::new(root.fd(), opts.reserve_bytes);
        Ok(Self {
            opts,
            reaper,
            bash: None,
            seq: 0,
            pending_reset,
            root,
            cmd,
            slots: Slots::default(),
            spills,
            progress: Progress::default(),
            lingering: Lingering::default(),
            reserve,
            errexit: false,
            shell_children: None,
        })
    }

    pub fn options(&self) -> &ShellOptions {
        &self.opts
    }

    /// The running command's progress, which the output collectors keep up to date.
    pub fn progress(&self) -> Progress {
        self.progress.clone()
    }

    /// The spill files, for reading them back (`GET /files/spill/…`).
    pub fn spills(&self) -> Spills {
        self.spills.clone()
    }

    /// The answer to a retry of a command that was running when a previous agent process
    /// died. It carries the state reset, so the next command does not report it again.
    pub fn interrupted_by_restart(&mut self, started: SystemTime) -> ExecResponse {
        self.pending_reset = None;
        report::interrupted_by_restart(&self.opts.workdir, started)
    }

    /// The answer kept for a request whose command was sent to bash but whose result was
    /// lost to `error`; a retry gets it instead of a second run.
    pub fn lost_after_send(&self, error: &ShellError) -> ExecResponse {
        report::lost_after_send(&self.opts.workdir, error)
    }

    /// Recreates the restart marker if it is missing: one `lstat` per call. Never follows
    /// or truncates anything a command put in its place.
    fn keep_marker(&self) {
        if !has_marker(&self.root) {
            let _ = state_files::write_new_file_at(self.root.fd(), MARKER, b"");
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
        // Before the command, so that it finds room to fork.
        self.stop_runaway(&mut notes).await;
        let (files, mut streams) = self.prepare(command, &mut notes)?;
        let mut done = streams.as_mut().and_then(|s| s.done.take());
        let before = self.send(&files.line, &mut notes).await?;
        // Output is read while the command runs, in this task; the end of the wait tells the
        // collector to take what is left.
        let (finish, finished) = tokio::sync::oneshot::channel();
        let collecting = async move {
            match streams {
                Some(streams) => Some(streams.collect(finished).await),
                None => None,
            }
        };
        let ((ended, stop), collected) = tokio::join!(
            async {
                let end = self
                    .await_end(
                        &files.nonce,
                        &before,
                        deadline,
                        abort,
                        done.as_mut(),
                        &mut notes,
                    )
                    .await;
                let _ = finish.send(());
                end
            },
            collecting
        );

        // Every error from here on comes after the command line went to bash: it may have run.
        let after_send = |e| ShellError::AfterSend(Box::new(e));
        // Only a line that ran to its record goes on to close `done`: an interrupted one was
        // abandoned by bash, and a replaced shell never opens it.
        let line_ends = stop.is_none() && matches!(ended, Ended::Reported { .. });
        let (status, cwd) = self
            .status_and_cwd(ended, stop, &mut notes)
            .await
            .map_err(after_send)?;
        let exit_code = match stop {
            Some(stop) => {
                // Killing the command's groups misses processes whose group leader is gone.
                self.stop_runaway(&mut notes).await;
                notes.stopped(stop, timeout)
            }
            None => status,
        };
        let mut all_closed = false;
        let (out, mut err) = match collected {
            Some(collected) => {
                all_closed = collected.all_closed();
                collected.into_captures(&mut self.lingering)
            }
            None => (Captured::empty(), Captured::empty()),
        };
        self.clean_up(files, done.filter(|_| all_closed && line_ends));
        let shell_restarted = notes.append_to(&mut err.bytes);
        Ok(report::response(
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
            let counted = self.shell_children.take();
            let Some(bash) = self.bash.as_mut() else {
                return Err(ShellError::Unresponsive);
            };
            let before = match counted {
                Some((pid, children)) if pid == bash.pid => children,
                _ => procs::jobs_before(bash.pid),
            };
            let grace = self.opts.kill_grace.max(Duration::from_secs(1));
            if bash.send_line(line, grace).await {
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
        done: Option<&mut tokio::net::unix::pipe::Receiver>,
        notes: &mut Notes,
    ) -> (Ended, Option<Stop>) {
        tokio::pin!(abort);
        let stop = match self.wait(&[nonce], deadline, abort.as_mut(), done).await {
            Ended::Stopped(stop) => stop,
            ended => return (ended, None),
        };
        let mut ended = self.interrupt(nonce, before, notes).await;
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
            Ended::Reported {
                status,
                cwd,
                flags,
                traps,
            } => {
                self.errexit = flags.contains('e');
                if let Some(traps) = traps {
                    notes.note(removed_traps(&traps));
                }
                return Ok((status, cwd));
            }
            Ended::ShellExited(code) => {
                // A stopped command already has its note; the shell's exit is part of it.
                let why = if self.errexit {
                    "`set -e` was on (set by an earlier command) and a command failed"
                } else {
                    "an `exit`, a failing command under `set -e`, an `exec`, or its input or \
                     status channel closed"
                };
                match stop {
                    None => notes.reset(format!(
                        "the shell exited with status {code} ({why}); a new shell was started \
                         (working directory, variables, functions and options were reset)"
                    )),
                    Some(_) => notes.shell_restarted = true,
                }
                code
            }
            Ended::Unreported => {
                notes.reset(
                    "the shell ran the command but could not report on it: its builtins are \
                     broken beyond repair (a read-only function named builtin, or enable -n \
                     enable?) or its status channel (fd 3, kept by bash while a command runs) \
                     was closed, so it was replaced (working directory, variables and \
                     functions were reset); the command's exit status is unknown",
                );
                1
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

    /// Keeps the command's directory for the next command, or removes it; and restores
    /// what the command may have removed. `done`: the command's `done` reader, when both
    /// its streams reached their end (no process holds them any more).
    fn clean_up(&mut self, files: CommandFiles, done: Option<tokio::net::unix::pipe::Receiver>) {
        if let Some(made) = files.made {
            match done {
                Some(done) if files.from_file => self.slots.keep(Slot {
                    made,
                    path: files.dir,
                    done,
                }),
                _ => made.remove(),
            }
        }
        if !self.cmd.in_place() {
            // The command replaced or removed `cmd` (or the state dir): bash, which goes by
            // the path, must find the next command's files.
            self.slots.remove_where(|_| true);
            self.ensure_dirs();
        }
        // Also after the command: it may have removed the marker (`rm -rf /tmp/*`), and a
        // restart before the next command must still be reported.
        self.keep_marker();
        self.reserve.keep(self.root.fd());
    }

    /// Kills the shell and everything it started (agent shutdown).
    pub async fn kill(&mut self) {
        if let Some(bash) = self.bash.take() {
            bash.kill_everything(self.opts.kill_grace).await;
        }
    }

    fn shell_gone(&self) -> bool {
        self.bash.as_ref().is_none_or(Bash::gone)
    }

    /// Waits for a record tagged with one of `nonces`, the shell's death, the deadline or
    /// `abort`.
    async fn wait(
        &mut self,
        nonces: &[&str],
        deadline: tokio::time::Instant,
        abort: Pin<&mut impl Future<Output = StopReason>>,
        done: Option<&mut tokio::net::unix::pipe::Receiver>,
    ) -> Ended {
        match self.bash.as_mut() {
            Some(bash) => bash.wait(nonces, deadline, abort, done).await,
            None => Ended::ShellExited(-1),
        }
    }

    async fn restart(&mut self) -> Result<(), ShellError> {
        self.errexit = false;
        if let Some(old) = self.bash.take() {
            old.kill_everything(self.opts.kill_grace).await;
        }
        // Processes that escaped the old shell (setsid, double fork) were re-parented to the
        // agent (a subreaper); with the shell gone, none of them may outlive it.
        let left = procs::kill_descendants_of_self(self.opts.kill_grace).await;
        if left > 0 {
            tracing::warn!(
                left,
                "processes of the old shell still alive after the sweep"
            );
        }
        self.bash = Some(Bash::spawn(&self.opts, &self.reaper).await?);
        Ok(())
    }

    /// Recreates the state dir and `cmd/` and gives them back to us if a command removed
    /// them, replaced them or changed their mode (errors surface on the file operations
    /// that follow); the spill dir and the journal see to their own. The state dir first:
    /// without access to it nothing inside can be repaired.
    fn ensure_dirs(&mut self) {
        let _ = self.root.reopen();
        let _ = self.cmd.reopen();
    }
}

/// Whether the restart marker is there (whatever it is: a link is never followed).
fn has_marker(root: &HeldDir) -> bool {
    nix::sys::stat::fstatat(root.fd(), MARKER, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW).is_ok()
}

/// The note for `DEBUG`/`RETURN` traps the framing removed; `listing` is their `trap -p`.
fn removed_traps(listing: &str) -> String {
    let names: Vec<&str> = ["DEBUG", "RETURN"]
        .into_iter()
        .filter(|n| listing.lines().any(|l| l.ends_with(&format!(" {n}"))))
        .collect();
    format!(
        "the {} trap this command set was removed: it would run before the agent's own \
         commands too (DEBUG before every command, RETURN after every call), making later \
         calls slow or time out; set it inside the command that needs it ({})",
        names.join(" and "),
        listing.lines().collect::<Vec<_>>().join("; ")
    )
}
