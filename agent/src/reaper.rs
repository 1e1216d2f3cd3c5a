//! Child reaping for an agent that may be PID 1 of its container.
//!
//! As PID 1 (or a child subreaper) the agent inherits every orphan the shell leaves behind,
//! and must reap them or zombies pile up. A single task reaps all children with
//! `waitpid(-1)` and hands the status of processes we care about (the shell) to whoever
//! spawned them. Spawning goes through [`Reaper::spawn`], which holds the same lock the
//! reaper takes, so a child can never be reaped before it is registered.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};

use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

/// How a watched child ended, as a shell would report it: the exit code, or 128 + signal.
pub type ExitCode = i32;

#[derive(Clone, Default)]
pub struct Reaper {
    watched: Arc<Mutex<HashMap<i32, watch::Sender<Option<ExitCode>>>>>,
}

impl Reaper {
    /// Starts the reaping task. Call once, inside a tokio runtime.
    pub fn start() -> io::Result<Self> {
        // Orphans of the shell become our children even when we are not PID 1, so they are
        // reaped (and can be found and killed) in tests and under any container runtime.
        let _ = nix::sys::prctl::set_child_subreaper(true);
        let mut sigchld = signal(SignalKind::child())?;
        let reaper = Self::default();
        let task = reaper.clone();
        tokio::spawn(async move {
            loop {
                task.reap_all();
                if sigchld.recv().await.is_none() {
                    break;
                }
            }
        });
        Ok(reaper)
    }

    /// Spawns `cmd` and returns it with a receiver that gets its exit code once reaped.
    pub fn spawn(
        &self,
        cmd: &mut Command,
    ) -> io::Result<(Child, watch::Receiver<Option<ExitCode>>)> {
        let mut watched = self.lock();
        let child = cmd.spawn()?;
        let (tx, rx) = watch::channel(None);
        watched.insert(child.id() as i32, tx);
        Ok((child, rx))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i32, watch::Sender<Option<ExitCode>>>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts
        // and removes), so a poisoned lock is still usable.
        self.watched.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn reap_all(&self) {
        let mut watched = self.lock();
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => notify(&mut watched, pid, code),
                Ok(WaitStatus::Signaled(pid, sig, _)) => {
                    notify(&mut watched, pid, 128 + sig as i32)
                }
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
                Ok(_) => continue,
                Err(Errno::EINTR) => continue,
                Err(_) => break,
            }
        }
    }
}

fn notify(watched: &mut HashMap<i32, watch::Sender<Option<ExitCode>>>, pid: Pid, code: ExitCode) {
    if let Some(tx) = watched.remove(&pid.as_raw()) {
        let _ = tx.send(Some(code));
    }
}
