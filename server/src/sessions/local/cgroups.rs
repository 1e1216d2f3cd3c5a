//! Each agent in a cgroup (v2) of its own, and the cgroup killed once the agent is gone.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use cli_mcp_api::SessionId;

/// How long killing a session's cgroup may take before the server gives up on it (the
/// kernel delivers SIGKILL at once; exiting takes a process a few milliseconds).
const CGROUP_KILL_WAIT: Duration = Duration::from_secs(5);

/// Each agent in a cgroup (v2) of its own, below the server's: whatever its processes do
/// (`setsid`, double forks, `disown`), they stay in that cgroup, and once the agent has
/// exited — also by SIGKILL, which leaves it no chance to stop its shell — the server kills
/// everything still in it. Without a writable cgroup v2 (an unprivileged user without a
/// delegated subtree, cgroup v1 only), agents run without one, and only the agent's own
/// stop (the shell, then repeated sweeps of the processes below it) ends the session's
/// processes.
#[derive(Debug)]
pub(super) struct Cgroups {
    /// The server's own cgroup, where the agents' cgroups are made.
    pub(super) parent: PathBuf,
}

impl Cgroups {
    /// The server's cgroup v2 directory, if there is one it can make cgroups in; else why
    /// not.
    pub(super) fn detect() -> Result<Self, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
        let own = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .ok_or("this process is in no cgroup v2 hierarchy")?
            .trim()
            .to_owned();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
        let (root, mount) = mounts
            .lines()
            .find_map(cgroup2_mount)
            .ok_or("no cgroup2 file system is mounted")?;
        // The mount shows the hierarchy from `root` down (a container's namespace).
        let rel = Path::new(&own)
            .strip_prefix(&root)
            .map_err(|_| format!("this process's cgroup {own} is outside the mount of {root}"))?;
        let parent = Path::new(&mount).join(rel);
        // Probe: making one is the only test of whether we may.
        let probe = parent.join(format!("cli-mcp-probe-{}", std::process::id()));
        std::fs::create_dir(&probe)
            .map_err(|e| format!("cannot create a cgroup in {}: {e}", parent.display()))?;
        let _ = std::fs::remove_dir(&probe);
        remove_stale_cgroups(&parent);
        Ok(Self { parent })
    }

    /// A new cgroup for agent `uid` of `sid`.
    pub(super) fn create(&self, sid: &SessionId, uid: u64) -> std::io::Result<PathBuf> {
        let dir = self
            .parent
            .join(format!("cli-mcp-{}-{sid}-{uid}", std::process::id()));
        std::fs::create_dir(&dir)?;
        Ok(dir)
    }
}

/// Removes the empty cgroups that servers which no longer run left in `parent` (a SIGKILLed
/// server empties none; its agents stop by themselves). `rmdir` removes only an empty
/// cgroup, so one still in use, or a live server's, is never touched.
fn remove_stale_cgroups(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("cli-mcp-"))
            .and_then(|n| n.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(e.path());
        }
    }
}

/// `(root, mount point)` of a cgroup2 line of `/proc/self/mountinfo`.
fn cgroup2_mount(line: &str) -> Option<(String, String)> {
    let (fields, fs) = line.split_once(" - ")?;
    if fs.split_whitespace().next()? != "cgroup2" {
        return None;
    }
    let mut f = fields.split_whitespace().skip(3);
    Some((f.next()?.to_owned(), f.next()?.to_owned()))
}

/// Moves `pid` into the cgroup `dir`.
pub(super) fn join_cgroup(dir: &Path, pid: u32) -> std::io::Result<()> {
    std::fs::write(dir.join("cgroup.procs"), pid.to_string())
}

/// Whether any process is left in the cgroup `dir` (an unreadable one counts as populated).
fn populated(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.events"))
        .map(|e| !e.lines().any(|l| l == "populated 0"))
        .unwrap_or(true)
}

/// SIGKILLs everything in the cgroup `dir`, waits (bounded) until it is empty and removes
/// it. `cgroup.kill` (Linux 5.14) kills the whole cgroup at once, forks racing it included;
/// on older kernels each listed process is killed, again until none is left.
pub(super) async fn kill_cgroup(dir: &Path) {
    let deadline = Instant::now() + CGROUP_KILL_WAIT;
    let has_kill = std::fs::write(dir.join("cgroup.kill"), "1").is_ok();
    while populated(dir) {
        if Instant::now() >= deadline {
            let left = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            tracing::warn!(cgroup = %dir.display(), left = %left.split_whitespace().collect::<Vec<_>>().join(" "),
                "processes of a stopped session's cgroup are still alive");
            return;
        }
        if !has_kill {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.split_whitespace().filter_map(|p| p.parse().ok()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if let Err(e) = std::fs::remove_dir(dir) {
        tracing::warn!(cgroup = %dir.display(), "cannot remove a stopped session's cgroup: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_mount_is_found_in_mountinfo() {
        let v1 = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu";
        let v2 = "41 31 0:38 /kubepods/pod1 /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw";
        assert_eq!(cgroup2_mount(v1), None);
        assert_eq!(
            cgroup2_mount(v2),
            Some(("/kubepods/pod1".into(), "/sys/fs/cgroup".into()))
        );
        assert_eq!(cgroup2_mount("garbage"), None);
    }
}
