//! The bash process behind a [`super::Shell`]: how it is started, fed lines, waited on and
//! killed.

use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::watch;

use super::framing::StatusPipe;
use super::stop::{Stop, StopReason};
use super::{ShellError, ShellOptions};
use crate::procs;
use crate::reaper::{ExitCode, Reaper};

/// Sent once to every new shell: `set -m` puts each job in its own process group; history
/// and `!` expansion are off so `echo "hi!"` means what it says; no prompts. `TMOUT` is made
/// empty and read-only before any command runs: an interactive bash whose `TMOUT` is set
/// exits when it waits that long for its next line, which for the agent's shell is any idle
/// time between calls. Read-only, a command can neither set it nor make it read-only with a
/// value of its own (the environment's is never passed on). `PROMPT_COMMAND` likewise: bash
/// runs it on its own before it reads each of the agent's lines, so a hook that defined a
/// function named `builtin` turned every later command into a silent no-op (and one that
/// reads would eat the agent's lines); a shell that never prompts has no use for it. And
/// `MAILCHECK` (empty: no mail checks), whose `MAILPATH` messages are expanded there too.
const INIT_SCRIPT: &str =
    "set -m +o history +H\nPS1= PS2= PS0=\nreadonly TMOUT= PROMPT_COMMAND= MAILCHECK=\n";

/// What the wait for a command ended with.
pub(super) enum Ended {
    /// bash reported `status`, its option flags (`$-`) and `cwd` on the status pipe, and the
    /// `DEBUG`/`RETURN` traps it removed (`trap -p`), if any.
    Reported {
        status: i32,
        cwd: String,
        flags: String,
        traps: Option<String>,
    },
    /// The shell process exited (or was replaced through `exec` and then exited).
    ShellExited(ExitCode),
    /// Timeout or interruption before either of the above.
    Stopped(Stop),
    /// bash got past the command's line (it closed the `done` FIFO) without writing a
    /// record: its builtins are broken beyond repair.
    Unreported,
}

pub(super) struct Bash {
    pub pid: i32,
    /// Its `children` file, held open (read before every command).
    pub children: procs::ChildrenFile,
    stdin: pipe::Sender,
    pub status: StatusPipe,
    exited: watch::Receiver<Option<ExitCode>>,
}

/// The directory a new shell starts in: the working directory, made again (mode 0700) if a
/// command removed it, or `/` if it cannot be entered (a command took its permissions away).
/// Without this, a session whose command removed its own working directory and then ended
/// its shell could never start one again: every later call failed, also the one that would
/// have repaired it. A shell started elsewhere reports its directory like any other.
fn start_dir(workdir: &Path) -> PathBuf {
    if !workdir.exists() {
        match std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(workdir)
        {
            Ok(()) => tracing::warn!(workdir = %workdir.display(),
                "the working directory was gone; made it again, empty"),
            Err(e) => tracing::warn!(workdir = %workdir.display(), error = %e,
                "the working directory is gone and cannot be made again"),
        }
    }
    let usable =
        workdir.is_dir() && nix::unistd::access(workdir, nix::unistd::AccessFlags::X_OK).is_ok();
    if usable {
        workdir.to_path_buf()
    } else {
        tracing::warn!(workdir = %workdir.display(),
            "the working directory cannot be entered; the shell starts in /");
        PathBuf::from("/")
    }
}

impl Bash {
    /// Starts an interactive bash with the status pipe as its fd 3 and sends it the init
    /// script.
    pub async fn spawn(opts: &ShellOptions, reaper: &Reaper) -> Result<Self, ShellError> {
        let spawn_err = |source| ShellError::Spawn {
            shell: opts.shell.clone(),
            source,
        };
        let (status_tx, status_rx) = pipe::pipe().map_err(spawn_err)?;
        let status_w: OwnedFd = status_tx.into_blocking_fd().map_err(spawn_err)?;
        let mut cmd = Command::new(&opts.shell);
        cmd.args(["--noprofile", "--norc", "--noediting", "-i"])
            .env_clear()
            .envs(opts.env.iter().map(|(k, v)| (k, v)))
            .current_dir(start_dir(&opts.workdir))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // The agent's threads count against the uid's limit too: the shell gets its own
        // allowance on top of them. A non-root process cannot raise its hard limit, so one
        // the agent was started with (a container runtime's nproc) caps it, or the shell
        // could not start at all.
        let nproc = opts.max_processes.filter(|_| opts.nproc_rlimit).map(|max| {
            let want = max.saturating_add(procs::own_threads());
            match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NPROC) {
                Ok((_, hard)) => want.min(hard),
                Err(_) => want,
            }
        });
        prepare_child(&mut cmd, status_w.as_raw_fd(), nproc);
        let (mut child, exited) = reaper.spawn(&mut cmd).map_err(spawn_err)?;
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
        let pid = child.id() as i32;
        Ok(Self {
            pid,
            children: procs::ChildrenFile::open(pid),
            stdin,
            status: StatusPipe::new(status_rx),
            exited,
        })
    }

    /// The process exited, or the status pipe hit EOF: whatever is there is not our shell.
    pub fn gone(&self) -> bool {
        self.status.closed || self.exited.borrow().is_some()
    }

    /// Writes `line` to bash's stdin; false if that failed or took longer than `limit` (a
    /// stopped shell with a full stdin pipe would block the write forever).
    pub async fn send_line(&mut self, line: &str, limit: Duration) -> bool {
        matches!(
            tokio::time::timeout(limit, self.stdin.write_all(line.as_bytes())).await,
            Ok(Ok(()))
        )
    }

    fn reported(&self, rec: super::framing::Record) -> Ended {
        let cwd = if rec.cwd.is_empty() {
            self.physical_cwd()
        } else {
            rec.cwd
        };
        Ended::Reported {
            status: rec.status,
            cwd,
            flags: rec.flags,
            traps: rec.traps,
        }
    }

    /// The shell's directory as the kernel knows it: for a shell whose `PWD` a command
    /// unset (the record then carries none).
    fn physical_cwd(&self) -> String {
        std::fs::read_link(format!("/proc/{}/cwd", self.pid))
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    }

    pub fn signal(&self, sig: Signal) {
        let _ = nix::sys::signal::kill(Pid::from_raw(self.pid), sig);
    }

    /// Waits for a status record tagged with one of `nonces`, the shell's death, the
    /// deadline or `abort`; with `done`, also for bash closing the command's `done` FIFO.
    pub async fn wait(
        &mut self,
        nonces: &[&str],
        deadline: tokio::time::Instant,
        mut abort: Pin<&mut impl Future<Output = StopReason>>,
        mut done: Option<&mut pipe::Receiver>,
    ) -> Ended {
        loop {
            let done_ready = async {
                match done.as_deref() {
                    Some(d) => d.readable().await,
                    None => std::future::pending().await,
                }
            };
            if let Some(code) = *self.exited.borrow() {
                return Ended::ShellExited(code);
            }
            tokio::select! {
                rec = self.status.next_record(), if !self.status.closed => match rec {
                    Some(rec) if nonces.contains(&rec.nonce.as_str()) => return self.reported(rec),
                    Some(_) => continue, // a stale record of an interrupted command
                    None => self.status.closed = true,
                },
                _ = self.exited.changed() => {
                    let code = (*self.exited.borrow()).unwrap_or(-1);
                    return Ended::ShellExited(code);
                }
                ready = done_ready => {
                    let mut byte = [0u8; 64];
                    match (ready, done.as_deref().map(|d| d.try_read(&mut byte))) {
                        // EOF: bash has opened and closed `done`, after the record it would
                        // have written.
                        (Ok(()), Some(Ok(0))) => {
                            return match self.status.try_record(nonces) {
                                Some(rec) => self.reported(rec),
                                None => Ended::Unreported,
                            };
                        }
                        // Bytes a command wrote there, or no news yet.
                        (Ok(()), Some(Ok(_))) => {}
                        (Ok(()), Some(Err(e))) if e.kind() == io::ErrorKind::WouldBlock => {}
                        // Not readable after all: stop watching it, the record still counts.
                        _ => done = None,
                    }
                }
                _ = tokio::time::sleep_until(deadline) => return Ended::Stopped(Stop::Timeout),
                reason = &mut abort => return Ended::Stopped(Stop::Aborted(reason)),
            }
        }
    }

    /// SIGKILLs the shell and every process it started, then waits (bounded) until it is
    /// reaped.
    pub async fn kill_everything(mut self, grace: Duration) {
        let groups = procs::all_groups(&procs::snapshot(), self.pid);
        procs::signal_groups(&groups, Signal::SIGKILL);
        self.signal(Signal::SIGKILL);
        let _ = tokio::time::timeout(grace, self.exited.wait_for(Option::is_some)).await;
    }
}

/// In the child, before exec: a new session (an interactive bash must never see the agent's
/// controlling terminal, or it would take it over), SIGKILL when the agent dies (a
/// SIGKILLed agent cannot stop its shell; bash is spawned from a runtime worker thread,
/// which lives as long as the agent, and the signal follows the spawning thread) and the
/// status pipe as fd 3. bash's stderr is /dev/null, so nothing it prints at startup can land
/// on the status pipe. With `nproc`, the shell's process limit (soft and hard, so no command
/// can raise it).
#[allow(unsafe_code)]
fn prepare_child(cmd: &mut Command, status_fd: RawFd, nproc: Option<u64>) {
    let agent = nix::unistd::getpid();
    // SAFETY: the closure runs in the forked child before exec and calls only setsid(2),
    // prctl(2), getppid(2), _exit(2), setrlimit(2), sigaction(2) and dup2(2), all
    // async-signal-safe; it touches no memory shared with the parent. `status_fd` stays open
    // in the parent until after spawn returns.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(n) = nproc {
                use nix::sys::resource::{setrlimit, Resource};
                setrlimit(Resource::RLIMIT_NPROC, n, n).map_err(io::Error::from)?;
            }
            nix::unistd::setsid().map_err(io::Error::from)?;
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(io::Error::from)?;
            // The agent died before the prctl: nobody will send the signal.
            if nix::unistd::getppid() != agent {
                nix::libc::_exit(1);
            }
            // A signal ignored when bash starts can never be trapped or reset in it, and
            // `trap` lists it as set (`trap -- '' SIGQUIT`), on the status pipe after every
            // command: the shell starts with the defaults, however the agent was started
            // (a terminal's job control, a `nohup`). Handlers are reset by exec anyway; only
            // ignored signals survive it.
            for sig in [
                Signal::SIGHUP,
                Signal::SIGINT,
                Signal::SIGQUIT,
                Signal::SIGTERM,
                Signal::SIGTSTP,
                Signal::SIGTTIN,
                Signal::SIGTTOU,
            ] {
                nix::sys::signal::signal(sig, nix::sys::signal::SigHandler::SigDfl)
                    .map_err(io::Error::from)?;
            }
            // dup2 clears close-on-exec on the new descriptor, so bash keeps fd 3.
            if nix::libc::dup2(status_fd, 3) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
