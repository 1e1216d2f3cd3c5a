//! Named network namespaces (`ip netns`), one per pod: `cm-<first 8 hex digits of the uid>`.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::Duration;

const NETNS_DIR: &str = "/run/netns";

/// The namespace name for a pod uid.
pub fn name_for(uid: &str) -> String {
    let short: String = uid
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(8)
        .collect();
    format!("cm-{short}")
}

pub fn path(name: &str) -> PathBuf {
    PathBuf::from(NETNS_DIR).join(name)
}

pub fn exists(name: &str) -> bool {
    path(name).exists()
}

async fn ip(args: &[&str]) -> Result<(), String> {
    let run = tokio::process::Command::new("ip")
        .args(args)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .map_err(|_| format!("`ip {}` timed out", args.join(" ")))?
        .map_err(|e| format!("cannot run `ip` (install iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Creates the namespace (replacing a stale one of the same name) and brings `lo` up.
pub async fn create(name: &str) -> Result<PathBuf, String> {
    if exists(name) {
        delete(name).await?;
    }
    ip(&["netns", "add", name]).await?;
    ip(&["-n", name, "link", "set", "lo", "up"]).await?;
    Ok(path(name))
}

/// Removes the namespace name. Idempotent.
pub async fn delete(name: &str) -> Result<(), String> {
    if !exists(name) {
        return Ok(());
    }
    ip(&["netns", "delete", name]).await
}

/// Pids of all processes whose network namespace is the file `target` (including ones that
/// left the container's process group).
fn pids_in(target: &std::fs::Metadata) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| in_namespace(pid, target))
        .collect()
}

/// How long the processes of a namespace may take to die before a teardown goes on without
/// them.
pub const KILL_WITHIN: Duration = Duration::from_secs(5);

/// SIGKILLs every process in namespace `name` and waits until none is left there (at most
/// `within`): listed again after each round, since one may fork between a listing and its
/// kill. Each is killed through a pidfd opened before it is checked to be in the namespace,
/// so a pid reused since the listing is never signalled. Returns how many were killed.
pub async fn kill_everything_in(name: &str, within: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + within;
    let me = std::process::id() as i32;
    let mut killed = 0;
    loop {
        let Ok(target) = std::fs::metadata(path(name)) else {
            return killed;
        };
        let held: Vec<(i32, crate::process::PidFd)> = pids_in(&target)
            .into_iter()
            .filter(|&pid| pid > 1 && pid != me)
            .filter_map(|pid| match crate::process::PidFd::open(pid) {
                Ok(fd) => in_namespace(pid, &target).then_some((pid, fd)),
                Err(e) => {
                    if e.raw_os_error() != Some(libc::ESRCH) {
                        tracing::warn!(pid, netns = name, "cannot hold a process to kill it: {e}");
                    }
                    None
                }
            })
            .collect();
        if held.is_empty() {
            return killed;
        }
        for (pid, fd) in &held {
            match fd.kill() {
                Ok(()) => killed += 1,
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => tracing::warn!(pid, netns = name, "SIGKILL failed: {e}"),
            }
        }
        for (pid, fd) in &held {
            match tokio::time::timeout_at(deadline, fd.exited()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(pid, netns = name, "waiting for its exit: {e}"),
                Err(_) => {
                    tracing::warn!(
                        pid,
                        netns = name,
                        "a SIGKILLed process is still there after {within:?}"
                    );
                    return killed;
                }
            }
        }
    }
}

fn in_namespace(pid: i32, target: &std::fs::Metadata) -> bool {
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .is_ok_and(|m| m.ino() == target.ino() && m.dev() == target.dev())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_short_and_stable() {
        assert_eq!(
            name_for("1a2b3c4d-5e6f-7a8b-9c0d-112233445566"),
            "cm-1a2b3c4d"
        );
        assert_eq!(name_for("ab"), "cm-ab");
        assert_eq!(path("cm-x"), PathBuf::from("/run/netns/cm-x"));
    }
}
