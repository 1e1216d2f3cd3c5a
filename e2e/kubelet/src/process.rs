//! Starting container processes (through the `__exec` helper), signalling them, and running
//! commands inside a running container (exec probes, preStop hooks).

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::fcntl::OFlag;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use crate::exec_helper::{ExecSpec, SUBCOMMAND};

/// How long the helper may take between fork and `execve` before it is killed.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// A started container process; its pid is also its process group id.
pub struct Started {
    pub pid: i32,
    pub child: tokio::process::Child,
}

/// Writes the helper's spec (it holds env values, so only root may read it).
pub fn write_spec(path: &Path, spec: &ExecSpec) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    }
    let text = serde_json::to_vec(spec).map_err(|e| format!("encoding exec spec: {e}"))?;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::io::Write::write_all(&mut f, &text)
        .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("renaming {}: {e}", path.display()))
}

fn self_exe() -> PathBuf {
    PathBuf::from("/proc/self/exe")
}

/// Spawns the helper with a status pipe on fd 3 and waits until it has exec'd (or failed).
async fn spawn_helper(
    mut cmd: tokio::process::Command,
    what: &str,
) -> Result<tokio::process::Child, String> {
    let (read_end, write_end) =
        nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    let wfd = write_end.as_raw_fd();
    cmd.process_group(0).kill_on_drop(false);
    // SAFETY: only async-signal-safe libc calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if wfd == 3 {
                if libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(wfd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("spawning {what} helper: {e}"))?;
    drop(write_end);
    let reader = tokio::task::spawn_blocking(move || {
        let mut msg = String::new();
        let _ = File::from(read_end).read_to_string(&mut msg);
        msg
    });
    let msg = match tokio::time::timeout(SETUP_TIMEOUT, reader).await {
        Ok(Ok(msg)) => msg,
        Ok(Err(e)) => format!("status pipe reader failed: {e}"),
        Err(_) => {
            if let Some(pid) = child.id() {
                signal_group(pid as i32, Signal::SIGKILL);
            }
            format!("{what} setup did not finish within {SETUP_TIMEOUT:?}")
        }
    };
    if msg.is_empty() {
        Ok(child)
    } else {
        let _ = child.wait().await;
        Err(msg)
    }
}

/// Opens a container log for appending (stdout and stderr share it).
fn open_log(log: &Path) -> Result<(File, File), String> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(log)
        .map_err(|e| format!("opening log {}: {e}", log.display()))?;
    let g = f
        .try_clone()
        .map_err(|e| format!("duplicating log handle: {e}"))?;
    Ok((f, g))
}

/// Starts a container: the helper enters the namespaces, mounts volumes and execs argv.
pub async fn start_container(spec_path: &Path, log: &Path) -> Result<Started, String> {
    let (out, err) = open_log(log)?;
    let mut cmd = tokio::process::Command::new(self_exe());
    cmd.arg(SUBCOMMAND)
        .arg("--spec")
        .arg(spec_path)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err));
    let child = spawn_helper(cmd, "container").await?;
    let pid = child
        .id()
        .ok_or("container process exited before its pid was read")? as i32;
    Ok(Started { pid, child })
}

/// Result of a command run inside a container.
#[derive(Debug)]
pub struct ExecOutcome {
    pub status: ExitStatus,
    pub output: String,
}

/// Runs `argv` inside the namespaces of container process `pid`, as the container's user and
/// with its environment, killing it after `timeout`.
pub async fn exec_in_container(
    spec_path: &Path,
    pid: i32,
    argv: &[String],
    timeout: Duration,
) -> Result<ExecOutcome, String> {
    let mut cmd = tokio::process::Command::new(self_exe());
    cmd.arg(SUBCOMMAND)
        .arg("--spec")
        .arg(spec_path)
        .arg("--join-pid")
        .arg(pid.to_string())
        .arg("--")
        .args(argv)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = spawn_helper(cmd, "exec").await?;
    let pgid = child.id().map(|p| p as i32);
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Ok(Ok(out)) => {
            let mut output = String::from_utf8_lossy(&out.stdout).into_owned();
            output.push_str(&String::from_utf8_lossy(&out.stderr));
            output.truncate(10 * 1024);
            Ok(ExecOutcome {
                status: out.status,
                output,
            })
        }
        Ok(Err(e)) => Err(format!("waiting for exec: {e}")),
        Err(_) => {
            if let Some(pg) = pgid {
                signal_group(pg, Signal::SIGKILL);
            }
            Err(format!("command timed out after {timeout:?}"))
        }
    }
}

/// Sends `sig` to a process group; a group that is already gone is not an error.
pub fn signal_group(pgid: i32, sig: Signal) {
    if pgid > 1 {
        let _ = killpg(Pid::from_raw(pgid), sig);
    }
}

/// SIGKILLs individual pids (used for processes that left their group).
pub fn kill_pids(pids: &[i32]) {
    for &pid in pids {
        if pid > 1 && pid != std::process::id() as i32 {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// A process held through a pidfd: a signal sent through it reaches that process or none,
/// even once its pid is reused, and it turns readable once the process has exited (after it
/// has left its namespaces).
pub struct PidFd {
    fd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

impl PidFd {
    /// `Err` with `ESRCH` when there is no such process (any more).
    pub fn open(pid: i32) -> std::io::Result<PidFd> {
        use std::os::fd::{FromRawFd, OwnedFd};
        // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_pidfd_open,
                libc::c_long::from(pid),
                libc::c_long::from(0u8),
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is the new descriptor, owned by the OwnedFd from here on, which the
        // AsyncFd owns in turn: open and the same for the AsyncFd's whole life.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        }
        .map_err(|e| e.into_parts().1)?;
        Ok(PidFd { fd })
    }

    pub fn kill(&self) -> std::io::Result<()> {
        // SAFETY: pidfd_send_signal(2) on a pidfd we own, no siginfo, no flags.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                libc::c_long::from(self.fd.as_raw_fd()),
                libc::c_long::from(libc::SIGKILL),
                std::ptr::null::<libc::siginfo_t>(),
                libc::c_long::from(0u8),
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Returns once the process has exited.
    pub async fn exited(&self) -> std::io::Result<()> {
        self.fd.readable().await.map(|_| ())
    }
}

/// The start time (clock ticks since boot) of a pid, to recognise it after a restart.
pub fn start_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22; the command name (field 2) may contain spaces, so skip past its ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Exit code, signal and reason as the API reports them.
pub fn describe_exit(status: &ExitStatus) -> (i32, Option<i32>, &'static str) {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(0), _) => (0, None, "Completed"),
        (Some(code), _) => (code, None, "Error"),
        (None, Some(sig)) => (128 + sig, Some(sig), "Error"),
        (None, None) => (255, None, "Error"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn exit_descriptions() {
        assert_eq!(
            describe_exit(&ExitStatus::from_raw(0)),
            (0, None, "Completed")
        );
        assert_eq!(
            describe_exit(&ExitStatus::from_raw(3 << 8)),
            (3, None, "Error")
        );
        assert_eq!(
            describe_exit(&ExitStatus::from_raw(9)),
            (137, Some(9), "Error")
        );
    }

    #[test]
    fn reads_own_start_time() {
        let me = std::process::id() as i32;
        assert!(start_ticks(me).is_some());
        assert_eq!(start_ticks(me), start_ticks(me));
    }
}
