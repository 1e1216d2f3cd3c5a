//! What the real node needs from the host and holds of it: the tools it runs (checked
//! before anything starts), the host-wide lock (one real node per host), the kernel
//! tunables the kubelet changes.

use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};

use super::image::CATATONIT;
use crate::error::{Error, Result};

/// The sysctls the kubelet sets when they differ (`setupKernelTunables`), saved and restored.
pub const KUBELET_SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// What the real node needs from the host; the error names the fix.
pub fn preflight(bin_dir: &Path) -> Result<()> {
    let mut problems = Vec::new();
    for (tool, pkg) in [
        ("containerd", "containerd"),
        ("ctr", "containerd"),
        ("containerd-shim-runc-v2", "containerd"),
        ("runc", "runc"),
        ("iptables", "iptables"),
        ("conntrack", "conntrack"),
        ("tar", "tar"),
    ] {
        if which(tool).is_none() {
            problems.push(format!("`{tool}` is not on PATH (apt package {pkg})"));
        }
    }
    if !Path::new(CATATONIT).is_file() {
        problems.push(format!(
            "{CATATONIT} is missing (apt package catatonit; the pause image)"
        ));
    }
    if !Path::new(crate::net::CNI_BIN_DIR).join("portmap").is_file() {
        problems.push(format!(
            "{}/portmap is missing (apt package containernetworking-plugins)",
            crate::net::CNI_BIN_DIR
        ));
    }
    if !Path::new("/sys/fs/cgroup/memory").is_dir()
        && !Path::new("/sys/fs/cgroup/cgroup.controllers").is_file()
    {
        problems.push("no memory cgroup controller is mounted under /sys/fs/cgroup".into());
    }
    for b in ["kubelet", "kube-proxy"] {
        if !bin_dir.join(b).is_file() {
            problems.push(format!(
                "{} is missing; build it with hack/build-control-plane.sh",
                bin_dir.join(b).display()
            ));
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(Error::Prerequisite(format!(
        "the real node cannot run here: {}; hack/prereqs.sh installs the packages",
        problems.join("; ")
    )))
}

pub(super) fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// The host-wide lock of the real node (one kube-proxy per host network namespace), waiting
/// at most `wait` for another real-node cluster to release it.
pub(super) async fn lock_host(wait: Duration) -> Result<Flock<File>> {
    let deadline = Instant::now() + wait;
    let dir = Path::new(crate::net::STATE_DIR);
    fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;
    let path = dir.join("real-node.lock");
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io("opening", &path, e))?;
    let mut said = false;
    loop {
        match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(lock),
            Err((back, _)) if Instant::now() < deadline => {
                if !said {
                    eprintln!(
                        "real node: another real-node cluster holds {}; waiting up to {} s for it \
                         to stop",
                        path.display(),
                        wait.as_secs()
                    );
                    said = true;
                }
                f = back;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => {
                return Err(Error::Prerequisite(format!(
                    "another real-node cluster runs on this host (it held {} for {} s; \
                     kube-proxy's iptables chains exist once per host); stop it or use the \
                     process node",
                    path.display(),
                    wait.as_secs()
                )))
            }
        }
    }
}

pub(super) fn read_sysctl(name: &str) -> Option<String> {
    fs::read_to_string(Path::new("/proc/sys").join(name))
        .ok()
        .map(|v| v.trim().to_string())
}
