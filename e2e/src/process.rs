//! Child processes of the harness: each in its own process group, output to a log file,
//! terminated (SIGTERM, then SIGKILL of the whole group) on [`Component::stop`] or drop.
//!
//! Children also get a parent-death signal, so they do not outlive a harness that is killed
//! outright. Linux sends that signal when the *thread* that forked the child exits, so all
//! children are spawned from one dedicated thread that lives as long as the process.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use crate::error::{Error, Result};

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        // The sender lives in a static, so this thread only ends with the process.
        let _ = std::thread::Builder::new()
            .name("cli-mcp-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            });
        Mutex::new(tx)
    })
}

/// Spawn `cmd` from the long-lived spawner thread (see the module docs).
pub fn spawn_detached(cmd: Command) -> std::io::Result<Child> {
    let (reply_tx, reply_rx) = mpsc::channel();
    {
        let tx = spawner()
            .lock()
            .map_err(|_| std::io::Error::other("spawner lock poisoned"))?;
        tx.send((cmd, reply_tx))
            .map_err(|_| std::io::Error::other("spawner thread is gone"))?;
    }
    reply_rx
        .recv()
        .map_err(|_| std::io::Error::other("spawner thread did not answer"))?
}

/// Configure `cmd` to start in its own process group and to receive `death_signal` when
/// the harness dies.
pub fn isolate(cmd: &mut Command, death_signal: Signal) {
    cmd.process_group(0);
    // SAFETY: the closure only calls async-signal-safe functions (prctl, getppid, kill).
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(death_signal).map_err(std::io::Error::from)?;
            // The parent may have died between fork and prctl.
            if nix::unistd::getppid() == Pid::from_raw(1) {
                let _ = kill(nix::unistd::getpid(), death_signal);
            }
            Ok(())
        });
    }
}

/// One running component (etcd, kube-apiserver, ..., the kubelet).
#[derive(Debug)]
pub struct Component {
    name: String,
    child: Option<Child>,
    log: PathBuf,
    /// What was started, so that [`Component::start_again`] can repeat it exactly.
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// How long to wait after SIGTERM before killing the process group.
    grace: Duration,
    /// Send SIGTERM to the whole process group (true) or only to the main process.
    term_group: bool,
}

impl Component {
    /// Start `program args...` with stdout and stderr written to `log` (truncated first).
    pub fn start(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, String)],
        log: &Path,
        grace: Duration,
        term_group: bool,
    ) -> Result<Component> {
        let mut c = Component {
            name: name.to_string(),
            child: None,
            log: log.to_path_buf(),
            program: program.to_path_buf(),
            args: args.to_vec(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            grace,
            term_group,
        };
        c.spawn(false)?;
        Ok(c)
    }

    /// Start the same program with the same arguments and environment again, appending to
    /// the same log (a restart keeps the previous run's lines, like a container's log).
    /// Fails if it is still running.
    pub fn start_again(&mut self) -> Result<()> {
        if self
            .child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
        {
            return Err(Error::Other(format!(
                "{} is still running; stop it before starting it again",
                self.name
            )));
        }
        if let Some(mut old) = self.child.take() {
            let _ = old.wait();
        }
        self.spawn(true)
    }

    fn spawn(&mut self, append: bool) -> Result<()> {
        let program = &self.program;
        if !program.is_file() {
            return Err(Error::Prerequisite(format!(
                "{}: binary {} does not exist",
                self.name,
                program.display()
            )));
        }
        let log = &self.log;
        let out = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(log)
            .map_err(|e| Error::io("creating", log, e))?;
        let err = out.try_clone().map_err(|e| Error::io("opening", log, e))?;
        let mut cmd = Command::new(program);
        cmd.args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        // The kubelet gets SIGTERM so that it can still clean up its pods' network
        // namespaces; the control plane has nothing worth saving.
        isolate(
            &mut cmd,
            if self.term_group {
                Signal::SIGKILL
            } else {
                Signal::SIGTERM
            },
        );
        let child = spawn_detached(cmd).map_err(|e| Error::Command {
            command: format!("{} {}", program.display(), self.args.join(" ")),
            detail: e.to_string(),
        })?;
        tracing::debug!(component = %self.name, pid = child.id(), log = %log.display(), "started");
        self.child = Some(child);
        Ok(())
    }

    /// Name of the component.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Path of its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Process id of the main process, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `Some(status)` if the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// An error describing that this component exited, with the tail of its log.
    pub fn exited_error(&mut self) -> Option<Error> {
        let status = self.exited()?;
        Some(Error::ComponentExited {
            component: self.name.clone(),
            status: status.to_string(),
            log: self.log.clone(),
            tail: log_tail(&self.log, 30),
        })
    }

    /// Send SIGTERM without waiting.
    pub fn signal_term(&mut self) {
        if let Some(child) = &mut self.child {
            if child.try_wait().ok().flatten().is_some() {
                return;
            }
            let pid = Pid::from_raw(child.id() as i32);
            let _ = if self.term_group {
                killpg(pid, Signal::SIGTERM)
            } else {
                kill(pid, Signal::SIGTERM)
            };
        }
    }

    /// Wait for the process to exit after [`Component::signal_term`]; when the grace
    /// period is over, SIGKILL its whole process group. Always reaps the child.
    pub fn wait_or_kill(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pgid = Pid::from_raw(child.id() as i32);
        let deadline = Instant::now() + self.grace;
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => {
                    tracing::warn!(component = %self.name, "did not stop in {:?}; killing its process group", self.grace);
                    let _ = killpg(pgid, Signal::SIGKILL);
                    let _ = child.wait();
                    break;
                }
            }
        }
        // Leftovers in the group (e.g. grandchildren) go too.
        let _ = killpg(pgid, Signal::SIGKILL);
    }

    /// Like [`Component::stop`] without blocking the async runtime: SIGTERM, wait up to the
    /// grace period, then SIGKILL the group. Returns how the process ended and how long that
    /// took (`None` when it was not running).
    pub async fn stop_async(&mut self) -> Option<(ExitStatus, Duration)> {
        let started = Instant::now();
        self.signal_term();
        let mut child = self.child.take()?;
        let pgid = Pid::from_raw(child.id() as i32);
        let deadline = started + self.grace;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                // No exit notification exists for a child spawned by another thread: poll.
                Ok(None) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                _ => {
                    tracing::warn!(component = %self.name, "did not stop in {:?}; killing its process group", self.grace);
                    let _ = killpg(pgid, Signal::SIGKILL);
                    break child.wait().ok();
                }
            }
        };
        let _ = killpg(pgid, Signal::SIGKILL);
        status.map(|s| (s, started.elapsed()))
    }

    /// SIGTERM, wait up to the grace period, then SIGKILL the group.
    pub fn stop(&mut self) {
        self.signal_term();
        self.wait_or_kill();
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The last `lines` lines of a log file (empty if it cannot be read).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    // Only look at the last 64 KiB.
    if let Ok(len) = f.seek(SeekFrom::End(0)) {
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    }
    let all: Vec<String> = BufReader::new(f).lines().map_while(|l| l.ok()).collect();
    let start = all.len().saturating_sub(lines);
    all[start..].join("\n")
}

/// The processes on this host, other than this one, with an argument that contains `needle`
/// (pid and argv, from `/proc`): e.g. every process of a cluster, by its run dir.
pub fn processes_with_arg(needle: &str) -> Vec<(i32, Vec<String>)> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let argv: Vec<String> = cmdline
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            (pid != me && argv.iter().any(|a| a.contains(needle))).then_some((pid, argv))
        })
        .collect()
}

/// Whether process `pid` runs: any of its threads exists and is not a zombie. An orphan that
/// exited is reaped by init, which may take its time, so its `/proc` entry outlives it. The
/// main thread alone is not enough: under SIGKILL it can be a zombie while other threads are
/// still exiting and still hold the process's files (a listening socket keeps accepting).
pub fn running(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // `tid (comm) state ...`; comm may contain anything, so read after its last ')'.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state != "Z" && state != "X")
        })
    })
}

/// Run `cmd`; its stdout, or an error naming the command (with its stderr when it failed).
pub fn run_ok(cmd: &mut Command) -> Result<String> {
    let command = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| Error::Command {
        command: command.clone(),
        detail: e.to_string(),
    })?;
    if !out.status.success() {
        return Err(Error::Command {
            command,
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zombie_does_not_run_and_a_reaped_child_is_gone() {
        assert!(running(std::process::id() as i32));
        let mut child = Command::new("true").spawn().expect("spawn true");
        let pid = child.id() as i32;
        // Exited but not waited for: a zombie until reaped.
        let deadline = Instant::now() + Duration::from_secs(10);
        while running(pid) {
            assert!(Instant::now() < deadline, "`true` still runs after 10 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            Path::new(&format!("/proc/{pid}")).exists(),
            "a zombie keeps its /proc entry"
        );
        child.wait().expect("wait");
        assert!(!running(pid));
    }
}
