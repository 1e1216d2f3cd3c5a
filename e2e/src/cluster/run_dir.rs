//! The cluster's run directory: locked for the cluster's life, cleared of the previous
//! run at start, the image map written into it, and `cluster.json` / `cluster.env` written
//! once the cluster is ready. Also etcd's data directory on tmpfs, and the sweep of those a
//! dead owner left.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};

use crate::cluster_info::{ClusterInfo, ENV_FILE, INFO_FILE};
use crate::error::{Error, Result};

/// How long `up` waits for a previous cluster with the same run dir to finish tearing down.
pub const RUN_DIR_WAIT: Duration = Duration::from_secs(90);

/// The run dir, locked and emptied, with its `logs` and kubelet state directories.
pub(super) struct RunDir {
    /// Absolute.
    pub path: PathBuf,
    pub lock: Flock<File>,
    pub log_dir: PathBuf,
    pub kubelet_state_dir: PathBuf,
}

impl RunDir {
    /// Lock `run_dir` (waiting for a cluster still tearing down), unmount what a dead real
    /// node left in it, clear it and create the log and kubelet state directories (the
    /// kubelet's state lives under `kubelet_state` in it).
    pub async fn claim(run_dir: &Path, kubelet_state: &str) -> Result<RunDir> {
        let run_dir =
            std::path::absolute(run_dir).map_err(|e| Error::io("resolving", run_dir, e))?;
        let lock = lock_run_dir(&run_dir).await?;
        // A real node whose owner died leaves mounts (volumes, rootfs, netns) in the run dir.
        crate::node::unmount_under(&run_dir);
        clear_run_dir(&run_dir)?;
        let log_dir = run_dir.join("logs");
        let kubelet_state_dir = run_dir.join(kubelet_state);
        for d in [&log_dir, &kubelet_state_dir] {
            fs::create_dir_all(d).map_err(|e| Error::io("creating", d, e))?;
        }
        sweep_stale_shm();
        Ok(RunDir {
            path: run_dir,
            lock,
            log_dir,
            kubelet_state_dir,
        })
    }

    /// Write the image map (pattern -> binary) the process kubelet reads; returns its path.
    pub fn write_image_map(&self, images: &BTreeMap<String, PathBuf>) -> Result<PathBuf> {
        let image_map = self.path.join("images.json");
        for (pattern, path) in images {
            if !path.is_file() {
                tracing::warn!(image = %pattern, path = %path.display(),
                    "mapped binary does not exist (yet); pods using this image will fail to start");
            }
        }
        let images_json = serde_json::to_string_pretty(images)
            .map_err(|e| Error::Other(format!("serialising the image map: {e}")))?;
        fs::write(&image_map, images_json).map_err(|e| Error::io("writing", &image_map, e))?;
        Ok(image_map)
    }
}

/// A fresh directory for etcd's data on tmpfs, named for this process (so that
/// [`sweep_stale_shm`] finds it once the process is gone).
pub(super) fn create_shm_dir() -> Result<PathBuf> {
    static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let shm_dir = PathBuf::from(format!("/dev/shm/cli-mcp-e2e-{}-{seq}", std::process::id()));
    let _ = fs::remove_dir_all(&shm_dir);
    fs::create_dir_all(&shm_dir).map_err(|e| Error::io("creating", &shm_dir, e))?;
    Ok(shm_dir)
}

fn sweep_stale_shm() {
    let Ok(entries) = fs::read_dir("/dev/shm") else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("cli-mcp-e2e-") else {
            continue;
        };
        let pid: i32 = rest
            .split('-')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if pid > 0 && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

async fn lock_run_dir(run_dir: &Path) -> Result<Flock<File>> {
    fs::create_dir_all(run_dir).map_err(|e| Error::io("creating", run_dir, e))?;
    let path = run_dir.join(".lock");
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io("opening", &path, e))?;
    // A previous cluster with this run dir may still be tearing down (a test process that
    // just exited, a `make run` stopped a moment ago): wait as long as a teardown can take
    // (the kubelet 45 s, then 10 s for each control-plane component).
    let deadline = Instant::now() + RUN_DIR_WAIT;
    let mut f = f;
    let mut warned = false;
    loop {
        match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(lock),
            Err((back, _)) if Instant::now() < deadline => {
                f = back;
                if !warned {
                    tracing::info!(run_dir = %run_dir.display(), "waiting for the cluster that holds this run dir to stop");
                    warned = true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_) => {
                return Err(Error::Prerequisite(format!(
                    "another cluster is running with run dir {}; stop it (`cli-mcp-cluster down \
                     --run-dir {0}` or Ctrl-C its `cli-mcp-cluster up`) or choose another --run-dir",
                    run_dir.display()
                )))
            }
        }
    }
}

fn clear_run_dir(run_dir: &Path) -> Result<()> {
    let entries = fs::read_dir(run_dir).map_err(|e| Error::io("reading", run_dir, e))?;
    for e in entries.flatten() {
        if e.file_name() == ".lock" {
            continue;
        }
        let p = e.path();
        let r = if p.is_dir() && !p.is_symlink() {
            fs::remove_dir_all(&p)
        } else {
            fs::remove_file(&p)
        };
        r.map_err(|err| Error::io("removing stale", &p, err))?;
    }
    Ok(())
}

/// Write `cluster.json` and the shell-sourceable `cluster.env` next to it.
pub(super) fn write_info(info: &ClusterInfo) -> Result<()> {
    let json = serde_json::to_string_pretty(info)
        .map_err(|e| Error::Other(format!("serialising cluster info: {e}")))?;
    write_atomic(&info.run_dir.join(INFO_FILE), &json)?;
    let mut env = String::from("# Written by cli-mcp-cluster; `source` it to use the cluster.\n");
    for (k, v) in info.env_vars() {
        env.push_str(&format!("export {k}={}\n", shell_quote(&v)));
    }
    write_atomic(&info.run_dir.join(ENV_FILE), &env)
}

/// Remove what [`write_info`] wrote (the cluster is not ready any more).
pub(super) fn remove_info(run_dir: &Path) {
    let _ = fs::remove_file(run_dir.join(ENV_FILE));
    let _ = fs::remove_file(run_dir.join(INFO_FILE));
}

fn write_atomic(path: &Path, contents: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, contents).map_err(|e| Error::io("writing", &tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| Error::io("renaming into", path, e))
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}
