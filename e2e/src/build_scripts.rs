//! Where the `hack/build-*.sh` scripts put what they build: each prints its bin dir as the
//! last line of its output, and an environment variable can name a finished one instead.
//! The control plane is located here; the add-ons ([`crate::addons::locate_addons`]) and
//! the project's images ([`crate::project_images::build`]) use the same two readers.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Environment variable naming a directory with prebuilt control-plane binaries.
pub const CONTROL_PLANE_BIN_ENV: &str = "CLI_MCP_CONTROL_PLANE_BIN";

/// The directory with etcd and the kube-* binaries: `dir` if given, else
/// `$CLI_MCP_CONTROL_PLANE_BIN`, else the last line `hack/build-control-plane.sh` prints
/// (it returns at once when its cache has them; a cold build takes many minutes).
pub fn locate_control_plane(dir: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(dir) = dir.or_else(|| std::env::var_os(CONTROL_PLANE_BIN_ENV).map(PathBuf::from)) {
        return Ok(dir);
    }
    let script = build_script();
    let out = std::process::Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| Error::Command {
            command: script.display().to_string(),
            detail: e.to_string(),
        })?;
    bin_dir_from(&script, out, CONTROL_PLANE_BIN_ENV)
}

/// [`locate_control_plane`] for a caller that may give up on it (`cli-mcp-cluster up` on
/// SIGTERM): the script runs in a process group of its own, and dropping the future
/// terminates that group, a control-plane build in progress (`go build`) included.
pub async fn locate_control_plane_async(dir: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(dir) = dir.or_else(|| std::env::var_os(CONTROL_PLANE_BIN_ENV).map(PathBuf::from)) {
        return Ok(dir);
    }
    let script = build_script();
    let mut cmd = tokio::process::Command::new("bash");
    cmd.arg(&script).stderr(std::process::Stdio::inherit());
    bin_dir_from_cancellable(&script, cmd, CONTROL_PLANE_BIN_ENV).await
}

fn build_script() -> PathBuf {
    crate::workspace::workspace_root().join("hack/build-control-plane.sh")
}

/// Runs build script `script` (as `cmd`) for a caller that may give up on it: the script
/// runs in a process group of its own, and dropping the future terminates that group (with
/// SIGTERM, so the script's EXIT trap removes its unfinished build directory). Returns
/// [`bin_dir_from`] its result.
pub(crate) async fn bin_dir_from_cancellable(
    script: &Path,
    mut cmd: tokio::process::Command,
    env: &str,
) -> Result<PathBuf> {
    let spawn_error = |e: std::io::Error| Error::Command {
        command: script.display().to_string(),
        detail: e.to_string(),
    };
    let child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(spawn_error)?;
    /// Terminates the script's process group unless it finished.
    struct Group(Option<u32>);
    impl Drop for Group {
        fn drop(&mut self) {
            if let Some(pid) = self.0 {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
        }
    }
    let mut group = Group(child.id());
    let out = child.wait_with_output().await.map_err(spawn_error)?;
    group.0 = None;
    bin_dir_from(script, out, env)
}

/// The bin dir from a build script's result: its last non-empty stdout line. `env` is the
/// variable that can point at a bin dir instead (named in the error).
pub(crate) fn bin_dir_from(script: &Path, out: std::process::Output, env: &str) -> Result<PathBuf> {
    if !out.status.success() {
        return Err(Error::Prerequisite(format!(
            "{} failed ({}); fix the build or point ${env} at a bin dir",
            script.display(),
            out.status
        )));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .ok_or_else(|| Error::Prerequisite(format!("{} printed no bin dir", script.display())))?;
    Ok(PathBuf::from(last.trim()))
}
