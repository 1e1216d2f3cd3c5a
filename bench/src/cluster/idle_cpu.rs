//! The CPU an idle sandbox pod uses: its pod cgroup's CPU time over a quiet window, in
//! millicores, what a CPU request is counted in. The kubelet makes the pod cgroup
//! `<cgroupRoot>/kubepods/<qos>/pod<uid>` in every hierarchy ([`super::cgroup`]).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::cgroup::find_dir;

/// Reads a cgroup's CPU time in nanoseconds.
type Usage = fn(&Path) -> Option<u64>;

/// The CPU hierarchy's root and the reader of its cgroups' CPU time.
fn cpu_hierarchy() -> Option<(PathBuf, Usage)> {
    for v1 in ["/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup/cpu,cpuacct"] {
        let root = PathBuf::from(v1);
        if root.join("cpuacct.usage").is_file() {
            return Some((root, v1_usage));
        }
    }
    let v2 = PathBuf::from("/sys/fs/cgroup");
    v2.join("cgroup.controllers")
        .is_file()
        .then_some((v2, v2_usage as Usage))
}

fn v1_usage(dir: &Path) -> Option<u64> {
    fs::read_to_string(dir.join("cpuacct.usage"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn v2_usage(dir: &Path) -> Option<u64> {
    let stat = fs::read_to_string(dir.join("cpu.stat")).ok()?;
    let usec: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("usage_usec "))?
        .trim()
        .parse()
        .ok()?;
    Some(usec * 1000)
}

/// Each pod's CPU use over `window` (millicores), for the pods with these uids; and what
/// could not be read.
pub(super) async fn millicores(uids: &[String], window: Duration) -> (Vec<f64>, Vec<String>) {
    let mut errors = Vec::new();
    let Some((root, usage)) = cpu_hierarchy() else {
        errors.push("no CPU accounting cgroup hierarchy under /sys/fs/cgroup".into());
        return (Vec::new(), errors);
    };
    let mut dirs = Vec::new();
    for uid in uids {
        match find_dir(&root, &format!("pod{uid}"), 4) {
            Some(d) => dirs.push(d),
            None => errors.push(format!("no CPU cgroup pod{uid}")),
        }
    }
    let before: Vec<Option<u64>> = dirs.iter().map(|d| usage(d)).collect();
    let t0 = Instant::now();
    // A measurement window, not a wait for an event: the sessions are idle throughout.
    tokio::time::sleep(window).await;
    let secs = t0.elapsed().as_secs_f64();
    let mut out = Vec::new();
    for (d, b) in dirs.iter().zip(before) {
        match (b, usage(d)) {
            (Some(b), Some(a)) => out.push(a.saturating_sub(b) as f64 / 1e6 / secs),
            _ => errors.push(format!("{}: CPU time unreadable", d.display())),
        }
    }
    (out, errors)
}
