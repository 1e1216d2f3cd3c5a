//! On-disk state under `--state-dir`, so a restarted kubelet can clean up after a crash.
//!
//! Layout:
//! ```text
//! STATE/cni/ipam/                     host-local IPAM data
//! STATE/pods/<ns>_<pod>_<uid>/
//!     record.json                     netns, container pids, tmpfs mounts (PodRecord)
//!     <container>.log, .log.1         current and previous run's stdout+stderr
//!     exec/<container>.json           helper spec (0600; holds env)
//!     etc/{hosts,resolv.conf,hostname} bind-mounted over /etc/... in every container
//!     volumes/<volume>/               materialised volumes (bind-mount sources)
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use crate::cni::Cni;
use crate::{netns, process};

/// Paths of one pod's directory.
#[derive(Debug, Clone)]
pub struct PodDir {
    pub root: PathBuf,
}

impl PodDir {
    pub fn new(state_dir: &Path, namespace: &str, name: &str, uid: &str) -> PodDir {
        PodDir {
            root: state_dir
                .join("pods")
                .join(format!("{namespace}_{name}_{uid}")),
        }
    }

    pub fn record(&self) -> PathBuf {
        self.root.join("record.json")
    }

    pub fn log(&self, container: &str) -> PathBuf {
        self.root.join(format!("{container}.log"))
    }

    pub fn previous_log(&self, container: &str) -> PathBuf {
        self.root.join(format!("{container}.log.1"))
    }

    pub fn exec_spec(&self, container: &str) -> PathBuf {
        self.root.join("exec").join(format!("{container}.json"))
    }

    pub fn volumes(&self) -> PathBuf {
        self.root.join("volumes")
    }

    pub fn volume(&self, name: &str) -> PathBuf {
        self.volumes().join(name)
    }

    /// Moves the current log aside before a restart (`kubectl logs --previous` semantics).
    pub fn rotate_log(&self, container: &str) {
        let cur = self.log(container);
        if cur.exists() {
            let _ = std::fs::rename(&cur, self.previous_log(container));
        }
    }
}

/// A container process as recorded on disk.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ProcRecord {
    pub pid: i32,
    pub start_ticks: Option<u64>,
}

/// What the kubelet created for a pod that outlives the kubelet process.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct PodRecord {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub netns: String,
    pub processes: BTreeMap<String, ProcRecord>,
    pub tmpfs: Vec<PathBuf>,
}

impl PodRecord {
    pub fn save(&self, dir: &PodDir) -> Result<(), String> {
        std::fs::create_dir_all(&dir.root)
            .map_err(|e| format!("creating {}: {e}", dir.root.display()))?;
        let path = dir.record();
        let tmp = path.with_extension("tmp");
        let text = serde_json::to_vec_pretty(self).map_err(|e| format!("encoding record: {e}"))?;
        std::fs::write(&tmp, text).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &path).map_err(|e| format!("writing {}: {e}", path.display()))
    }

    pub fn load(path: &Path) -> Option<PodRecord> {
        serde_json::from_slice(&std::fs::read(path).ok()?).ok()
    }
}

/// Unmounts a tmpfs (lazily, so a busy mount cannot block cleanup).
pub fn unmount(path: &Path) {
    let _ = nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH);
}

/// Kills recorded processes that are still the same processes (start time matches).
pub fn kill_recorded(record: &PodRecord) {
    for p in record.processes.values() {
        let same = match (p.start_ticks, process::start_ticks(p.pid)) {
            (Some(a), Some(b)) => a == b,
            _ => false,
        };
        if same {
            process::signal_group(p.pid, Signal::SIGKILL);
            process::kill_pids(&[p.pid]);
        }
    }
}

/// Removes everything a pod left behind except its logs.
pub async fn remove_pod_runtime(dir: &PodDir, record: &PodRecord, cni: &Cni) {
    kill_recorded(record);
    if !record.netns.is_empty() {
        netns::kill_everything_in(&record.netns, netns::KILL_WITHIN).await;
        let path = netns::path(&record.netns);
        let ns = netns::exists(&record.netns).then_some(path.as_path());
        if let Err(e) = cni.del(&record.uid, ns).await {
            tracing::warn!(pod = %record.name, "CNI DEL during cleanup: {e}");
        }
        if let Err(e) = netns::delete(&record.netns).await {
            tracing::warn!(pod = %record.name, "{e}");
        }
    }
    for t in &record.tmpfs {
        unmount(t);
    }
    // Any mount left below the volumes dir (tmpfs) must be gone before removing it.
    let _ = std::fs::remove_dir_all(dir.volumes());
    let _ = std::fs::remove_dir_all(dir.root.join("exec"));
    let _ = std::fs::remove_dir_all(dir.root.join("etc"));
    let _ = std::fs::remove_file(dir.record());
}

/// On startup: tear down everything recorded by a previous run (processes, netns, CNI
/// allocations, tmpfs). Pods that still exist are started afresh by their workers.
pub async fn cleanup_previous_run(state_dir: &Path, cni: &Cni) -> usize {
    let pods = state_dir.join("pods");
    let Ok(entries) = std::fs::read_dir(&pods) else {
        return 0;
    };
    let mut n = 0;
    for e in entries.flatten() {
        let dir = PodDir { root: e.path() };
        let Some(record) = PodRecord::load(&dir.record()) else {
            continue;
        };
        tracing::info!(
            pod = %format!("{}/{}", record.namespace, record.name),
            uid = %record.uid,
            netns = %record.netns,
            "cleaning up pod left by a previous kubelet run"
        );
        remove_pod_runtime(&dir, &record, cni).await;
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        let d = PodDir::new(Path::new("/s"), "ns", "web", "u1");
        assert_eq!(d.root, PathBuf::from("/s/pods/ns_web_u1"));
        assert_eq!(d.log("app"), PathBuf::from("/s/pods/ns_web_u1/app.log"));
        assert_eq!(
            d.previous_log("app"),
            PathBuf::from("/s/pods/ns_web_u1/app.log.1")
        );
        assert_eq!(
            d.volume("data"),
            PathBuf::from("/s/pods/ns_web_u1/volumes/data")
        );
    }

    #[test]
    fn record_round_trip_and_rotation() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let d = PodDir::new(tmp.path(), "ns", "p", "u");
        let mut r = PodRecord {
            uid: "u".into(),
            netns: "cm-u".into(),
            ..Default::default()
        };
        r.processes.insert(
            "c".into(),
            ProcRecord {
                pid: 10,
                start_ticks: Some(5),
            },
        );
        r.save(&d).expect("save");
        assert_eq!(PodRecord::load(&d.record()), Some(r));
        std::fs::write(d.log("c"), "one").expect("write log");
        d.rotate_log("c");
        assert!(!d.log("c").exists());
        assert_eq!(
            std::fs::read_to_string(d.previous_log("c")).ok().as_deref(),
            Some("one")
        );
    }
}
