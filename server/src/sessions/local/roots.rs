//! The backend's root directory in the temporary directory, private to the server's user,
//! and the removal of the roots that killed servers left behind.

use std::path::Path;

use nix::sys::signal::kill;
use nix::unistd::Pid;

/// Mode of every directory the backend makes.
pub(super) const PRIVATE_DIR: u32 = 0o700;

/// The backend's root is `<temporary directory>/cli-mcp-local-<random>`.
pub(super) const ROOT_PREFIX: &str = "cli-mcp-local-";
/// The file in a root that names the server process it belongs to: `<pid> <pid namespace>`.
pub(super) const OWNER_FILE: &str = "server";

/// This process as a root's [`OWNER_FILE`] names it.
pub(super) fn owner_line() -> String {
    format!("{} {}", std::process::id(), pid_namespace())
}

fn pid_namespace() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .map(|l| l.display().to_string())
        .unwrap_or_default()
}

/// Removes the roots that servers which are gone left in `tmp`: a server that stops removes
/// its own, one that was killed (SIGKILL, a crash) cannot, and its sessions' workspaces and
/// agent state would stay for good. Only a real directory of this user is touched, and only
/// when it names a server of this pid namespace that no longer runs: a root that names none
/// (another server is making it right now) is left alone. Returns how many were removed.
pub(super) fn remove_abandoned_roots(tmp: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return 0;
    };
    let (uid, ns) = (nix::unistd::geteuid().as_raw(), pid_namespace());
    let mut removed = 0;
    for e in entries.flatten() {
        if !e.file_name().to_string_lossy().starts_with(ROOT_PREFIX) {
            continue;
        }
        // `symlink_metadata`: a link named like a root is not followed (nor removed).
        let ours = std::fs::symlink_metadata(e.path())
            .is_ok_and(|m| m.file_type().is_dir() && m.uid() == uid);
        let Some(owner) = ours
            .then(|| std::fs::read_to_string(e.path().join(OWNER_FILE)).ok())
            .flatten()
        else {
            continue;
        };
        let gone = match owner.trim().split_once(' ') {
            Some((pid, owner_ns)) if owner_ns == ns => {
                pid.parse::<i32>().is_ok_and(|pid| pid > 0 && exited(pid))
            }
            _ => false,
        };
        if gone && std::fs::remove_dir_all(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Whether process `pid` has ended: it no longer exists, or it is a zombie (killed, not yet
/// reaped by its parent).
fn exited(pid: i32) -> bool {
    if kill(Pid::from_raw(pid), None) == Err(nix::errno::Errno::ESRCH) {
        return true;
    }
    // `/proc/<pid>/stat`: the state follows the command name, which ends with the last ')'.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

/// Creates `dir` and its missing parents with [`PRIVATE_DIR`].
pub(super) fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(PRIVATE_DIR)
        .create(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_roots_of_servers_that_ended_here_are_removed() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let dead = child.id();
        child.wait().expect("reap true");
        let ns = pid_namespace();
        let root = |name: &str, owner: Option<String>| {
            let dir = tmp.path().join(name);
            std::fs::create_dir(&dir).expect("mkdir");
            std::fs::write(dir.join("workspace-file"), "x").expect("write");
            if let Some(owner) = owner {
                std::fs::write(dir.join(OWNER_FILE), owner).expect("write owner");
            }
            dir
        };
        let abandoned = root("cli-mcp-local-dead", Some(format!("{dead} {ns}")));
        let running = root("cli-mcp-local-live", Some(owner_line()));
        let elsewhere = root("cli-mcp-local-ns", Some(format!("{dead} pid:[1]")));
        let unnamed = root("cli-mcp-local-none", None);
        let junk = root("cli-mcp-local-junk", Some("not a pid".into()));
        let other = root("not-ours", Some(format!("{dead} {ns}")));
        // A link named like a root, to a directory a dead server owns: neither is touched.
        let target = root("target", Some(format!("{dead} {ns}")));
        std::os::unix::fs::symlink(&target, tmp.path().join("cli-mcp-local-link"))
            .expect("symlink");

        assert_eq!(remove_abandoned_roots(tmp.path()), 1);
        assert!(!abandoned.exists());
        for kept in [&running, &elsewhere, &unnamed, &junk, &other, &target] {
            assert!(kept.join("workspace-file").exists(), "{kept:?} was removed");
        }
        assert!(tmp.path().join("cli-mcp-local-link").is_symlink());
    }
}
