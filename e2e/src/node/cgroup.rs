//! The real node's cgroup subtree (the kubelet's `cgroupRoot`) in every hierarchy: created
//! before the kubelet starts, its processes killed and its directories removed on teardown.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Error, Result};

/// The cgroup v1 hierarchies (and the v2 one) mounted under /sys/fs/cgroup.
fn cgroup_mounts() -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir("/sys/fs/cgroup") else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && !p.is_symlink())
        .collect()
}

/// Create the cgroup `root` in every hierarchy (the kubelet insists that its cgroupRoot
/// exists); cpuset gets its parent's CPUs and memory nodes.
pub(super) fn create_cgroup(root: &str) -> Result<()> {
    let rel = root.trim_start_matches('/');
    for m in cgroup_mounts() {
        let dir = m.join(rel);
        fs::create_dir_all(&dir).map_err(|e| Error::io("creating cgroup", &dir, e))?;
        for f in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(v) = fs::read_to_string(m.join(f)) {
                let cur = fs::read_to_string(dir.join(f)).unwrap_or_default();
                if cur.trim().is_empty() {
                    fs::write(dir.join(f), v.trim())
                        .map_err(|e| Error::io("writing", dir.join(f), e))?;
                }
            }
        }
    }
    Ok(())
}

/// Kill every process in the cgroup subtree `root` (in all hierarchies) and remove its
/// directories, deepest first. Returns how many processes were killed.
pub(super) fn sweep_cgroup(root: &str) -> usize {
    let rel = root.trim_start_matches('/');
    if rel.is_empty() {
        return 0;
    }
    let mut killed = 0;
    let mut dirs = Vec::new();
    for m in cgroup_mounts() {
        let top = m.join(rel);
        if top.is_dir() {
            collect_dirs(&top, &mut dirs);
        }
    }
    for _ in 0..50 {
        let mut any = false;
        for d in &dirs {
            let Ok(procs) = fs::read_to_string(d.join("cgroup.procs")) else {
                continue;
            };
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                any = true;
                if nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .is_ok()
                {
                    killed += 1;
                }
            }
        }
        if !any {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    for d in dirs {
        let _ = fs::remove_dir(&d);
    }
    killed
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                collect_dirs(&p, out);
            }
        }
    }
}
