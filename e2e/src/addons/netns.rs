//! Traffic from inside a pod's network namespace, for tests: the namespace of a process
//! kubelet's pod or of a real node's container, a thread that joined it, one TCP connect.

use std::fs;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::run_text;
use crate::error::{Error, Result};

/// The network namespace the process kubelet creates for the pod with this uid.
pub fn pod_netns(uid: &str) -> PathBuf {
    let short: String = uid
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(8)
        .collect();
    PathBuf::from("/run/netns").join(format!("cm-{short}"))
}

/// The network namespace of a container on the real node, `/proc/<pid>/ns/net` of its task
/// (found through the node's containerd at `socket`). `container_id` is the pod status's
/// `containerID` (`containerd://<id>`, or the bare id). Valid while the container runs.
pub fn container_netns(socket: &Path, container_id: &str) -> Result<PathBuf> {
    let pid = container_task_pid(socket, container_id)?;
    Ok(PathBuf::from(format!("/proc/{pid}/ns/net")))
}

/// The containerd runtime (shim) a container of the real node runs under, e.g.
/// `io.containerd.runc.v2` or `io.containerd.runsc.v1`; `container_id` as for
/// [`container_netns`].
pub fn container_runtime(socket: &Path, container_id: &str) -> Result<String> {
    let id = container_id
        .strip_prefix("containerd://")
        .unwrap_or(container_id);
    let sock = socket.display().to_string();
    let info = run_text(
        "ctr",
        &[
            "--address",
            &sock,
            "--namespace",
            "k8s.io",
            "containers",
            "info",
            id,
        ],
    )?;
    let v: serde_json::Value = serde_json::from_str(&info)
        .map_err(|e| Error::Other(format!("ctr containers info {id}: {e}: {info}")))?;
    v["Runtime"]["Name"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| Error::Other(format!("ctr containers info {id}: no Runtime.Name")))
}

/// The host pid of a container's task on the real node (its init process), from the node's
/// containerd at `socket`; `container_id` as for [`container_netns`].
pub fn container_task_pid(socket: &Path, container_id: &str) -> Result<u32> {
    let id = container_id
        .strip_prefix("containerd://")
        .unwrap_or(container_id);
    let sock = socket.display().to_string();
    let tasks = run_text(
        "ctr",
        &["--address", &sock, "--namespace", "k8s.io", "tasks", "ls"],
    )?;
    let pid = tasks
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?, w.next()?.parse::<u32>().ok()?))
        })
        .find(|(task, _)| *task == id)
        .map(|(_, pid)| pid)
        .ok_or_else(|| {
            Error::Other(format!(
                "container {id} has no running task in the node's containerd ({sock})"
            ))
        })?;
    Ok(pid)
}

/// Run `f` on a new thread that has joined the network namespace at `netns`: sockets it
/// opens live in that namespace (source address = the pod's IP), exactly like the pod's own.
pub fn in_netns<T, F>(netns: &Path, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let ns = fs::File::open(netns).map_err(|e| Error::io("opening", netns, e))?;
    let path = netns.to_path_buf();
    std::thread::spawn(move || -> Result<T> {
        nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| Error::Other(format!("setns into {}: {e}", path.display())))?;
        Ok(f())
    })
    .join()
    .map_err(|_| Error::Other(format!("thread in {} panicked", netns.display())))?
}

/// The result of one TCP connection attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    Connected,
    /// RST or ICMP unreachable (kube-router REJECTs what policy denies).
    Refused,
    TimedOut,
    Failed(String),
}

/// Connect to `addr` once, at most `timeout`.
pub fn tcp_reach(addr: SocketAddr, timeout: Duration) -> Reach {
    match TcpStream::connect_timeout(&addr, timeout) {
        Ok(_) => Reach::Connected,
        Err(e) => match e.kind() {
            std::io::ErrorKind::ConnectionRefused => Reach::Refused,
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Reach::TimedOut,
            _ => match e.raw_os_error() {
                // EHOSTUNREACH / ENETUNREACH / EACCES / EPERM: an ICMP error or a local drop.
                Some(113) | Some(101) | Some(13) | Some(1) => Reach::Refused,
                _ => Reach::Failed(e.to_string()),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_netns_names_match_the_process_kubelet() {
        assert_eq!(
            pod_netns("1f2e3d4c-5b6a-7980-abcd-ef0123456789"),
            PathBuf::from("/run/netns/cm-1f2e3d4c")
        );
    }
}
