//! gVisor on the real node: `runsc` and its containerd shim `containerd-shim-runsc-v1` (built
//! from the Go module proxy by `hack/build-gvisor.sh`, which says what it patches and why),
//! registered with containerd as the runtime handler `runsc`, and the RuntimeClass `gvisor`
//! that selects it. A pod with `runtimeClassName: gvisor` runs in one gVisor sandbox: its
//! processes talk to gVisor's user-space kernel (the Sentry, on the `systrap` platform), not
//! to the host's.

use std::path::{Path, PathBuf};

use k8s_openapi::api::node::v1::{Overhead, RuntimeClass};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{ObjectMeta, Patch, PatchParams};
use kube::{Api, Client};

use crate::error::{Error, Result};

/// The RuntimeClass a pod names to run under gVisor.
pub const RUNTIME_CLASS: &str = "gvisor";
/// containerd's runtime handler for runsc (the RuntimeClass's `handler`).
pub const HANDLER: &str = "runsc";
/// gVisor's containerd shim: containerd runs `containerd-shim-<name>-<version>` from its
/// `PATH` for the runtime type `io.containerd.<name>.<version>`.
pub const SHIM: &str = "containerd-shim-runsc-v1";
/// Environment variable naming a directory with a prebuilt `runsc` and shim instead of the
/// build script's cache.
pub const GVISOR_BIN_ENV: &str = "CLI_MCP_GVISOR_BIN";
/// What the cluster says (stderr, log) when the host cannot run gVisor; `make run` looks for
/// it to explain its fallback to runc.
pub const UNAVAILABLE: &str = "gVisor unavailable, the real node runs runc only";

/// What a gVisor pod costs beyond its containers, added by the scheduler and the kubelet
/// (`RuntimeClass.overhead.podFixed`): the Sentry and the gofer of an idle sandbox pod (see
/// docs/benchmarks.md, "runc and gVisor side by side"). CPU: an idle Sentry uses next to
/// none, and what it uses for a busy sandbox is accounted in the pod's cgroup anyway; a
/// small fixed request keeps the scheduler honest without costing the 2-CPU quick-start node
/// its sessions (at 50m, `make run`'s attack suite ran out of CPU requests).
pub const OVERHEAD_MEMORY: &str = "64Mi";
pub const OVERHEAD_CPU: &str = "10m";

/// The directory with `runsc` and the shim: `$CLI_MCP_GVISOR_BIN` if set, else the last line
/// `hack/build-gvisor.sh` prints (at once when its cache has it; about two minutes cold).
/// The script runs in a process group that dropping the future terminates.
pub async fn locate_async() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os(GVISOR_BIN_ENV).map(PathBuf::from) {
        return Ok(dir);
    }
    let script = crate::workspace::workspace_root().join("hack/build-gvisor.sh");
    let mut cmd = tokio::process::Command::new("bash");
    cmd.arg(&script).stderr(std::process::Stdio::inherit());
    crate::build_scripts::bin_dir_from_cancellable(&script, cmd, GVISOR_BIN_ENV).await
}

/// `bin_dir`, checked to hold `runsc` and the shim (a clear error instead of pods that never
/// start).
pub fn checked_bin_dir(bin_dir: &Path) -> Result<PathBuf> {
    for name in ["runsc", SHIM] {
        let path = bin_dir.join(name);
        if !path.is_file() {
            return Err(Error::Prerequisite(format!(
                "{} is missing; build it with hack/build-gvisor.sh (or point ${GVISOR_BIN_ENV} \
                 at a directory holding runsc and {SHIM})",
                path.display()
            )));
        }
    }
    Ok(bin_dir.to_path_buf())
}

/// Runs `uname -r` in a throwaway gVisor sandbox on the `systrap` platform, without network:
/// an error that says why when this host cannot run gVisor (no runsc, ptrace or seccomp
/// restricted, ...), so that the node can go on with runc alone and say so.
pub fn preflight(bin_dir: &Path) -> Result<()> {
    let root = tempfile::tempdir().map_err(|e| Error::io("creating", Path::new("/tmp"), e))?;
    let runsc = bin_dir.join("runsc");
    let out = std::process::Command::new("timeout")
        .arg("30")
        .arg(&runsc)
        .arg(format!("--root={}", root.path().display()))
        .args(["--platform=systrap", "--network=none", "do", "uname", "-r"])
        .output()
        .map_err(|e| Error::io("running", &runsc, e))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() && stdout.contains("gvisor") {
        Ok(())
    } else {
        Err(Error::Prerequisite(format!(
            "`runsc do uname -r` on the systrap platform failed ({}): {}{}",
            out.status,
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// containerd's runtime `runsc` (part of its CRI config): gVisor's shim, reading its options
/// from `runsc_toml` ([`runsc_toml`]).
pub fn containerd_runtime(runsc_toml: &Path) -> String {
    format!(
        r#"    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{HANDLER}]
      runtime_type = "io.containerd.runsc.v1"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{HANDLER}.options]
        TypeUrl = "io.containerd.runsc.v1.options"
        ConfigPath = "{toml}"
"#,
        toml = runsc_toml.display(),
    )
}

/// The shim's options: which `runsc` to run, its state under the node dir, and the `systrap`
/// platform (it needs no hardware virtualization; runsc's KVM platform, faster per system
/// call, is untried here although `/dev/kvm` exists; systrap is runsc's default too, named so
/// that a change of default cannot move the node silently).
pub fn runsc_toml(bin_dir: &Path, root: &Path) -> String {
    format!(
        r#"binary_name = "{runsc}"
root = "{root}"
[runsc_config]
  platform = "systrap"
"#,
        runsc = bin_dir.join("runsc").display(),
        root = root.display(),
    )
}

/// The RuntimeClass `gvisor`.
pub fn runtime_class() -> RuntimeClass {
    RuntimeClass {
        metadata: ObjectMeta {
            name: Some(RUNTIME_CLASS.into()),
            ..Default::default()
        },
        handler: HANDLER.into(),
        overhead: Some(Overhead {
            pod_fixed: Some(
                [
                    ("memory".to_string(), Quantity(OVERHEAD_MEMORY.into())),
                    ("cpu".to_string(), Quantity(OVERHEAD_CPU.into())),
                ]
                .into(),
            ),
        }),
        scheduling: None,
    }
}

/// Creates (or updates) the RuntimeClass `gvisor` by server-side apply.
pub async fn install_runtime_class(client: &Client) -> Result<()> {
    Api::<RuntimeClass>::all(client.clone())
        .patch(
            RUNTIME_CLASS,
            &PatchParams::apply("cli-mcp-e2e").force(),
            &Patch::Apply(runtime_class()),
        )
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_is_gvisors_shim_reading_its_options_from_the_node_dir() {
        let t = containerd_runtime(Path::new("/n/containerd/runsc.toml"));
        assert!(t.contains("runtimes.runsc]"), "{t}");
        assert!(
            t.contains(r#"runtime_type = "io.containerd.runsc.v1""#),
            "{t}"
        );
        assert!(
            t.contains(r#"TypeUrl = "io.containerd.runsc.v1.options""#),
            "{t}"
        );
        assert!(
            t.contains(r#"ConfigPath = "/n/containerd/runsc.toml""#),
            "{t}"
        );
        let o = runsc_toml(Path::new("/c/gvisor/bin"), Path::new("/n/runsc"));
        assert!(o.contains(r#"binary_name = "/c/gvisor/bin/runsc""#), "{o}");
        assert!(o.contains(r#"root = "/n/runsc""#), "{o}");
        assert!(o.contains(r#"platform = "systrap""#), "{o}");
    }

    #[test]
    fn the_runtime_class_names_the_handler_and_its_overhead() {
        let rc = runtime_class();
        assert_eq!(rc.metadata.name.as_deref(), Some("gvisor"));
        assert_eq!(rc.handler, HANDLER);
        let fixed = rc.overhead.and_then(|o| o.pod_fixed).unwrap_or_default();
        assert_eq!(fixed.get("memory"), Some(&Quantity(OVERHEAD_MEMORY.into())));
        assert_eq!(fixed.get("cpu"), Some(&Quantity(OVERHEAD_CPU.into())));
    }

    #[test]
    fn a_runsc_that_cannot_run_here_fails_the_preflight_with_its_own_words() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let runsc = dir.path().join("runsc");
        std::fs::write(
            &runsc,
            "#!/bin/sh\necho 'systrap: ptrace is not permitted' >&2\nexit 1\n",
        )
        .expect("fake runsc");
        std::fs::set_permissions(&runsc, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let e = preflight(dir.path()).expect_err("a runsc that fails");
        assert!(e.to_string().contains("ptrace is not permitted"), "{e}");
        // One that runs but is not gVisor (no gVisor kernel in its answer) fails too.
        std::fs::write(&runsc, "#!/bin/sh\nuname -r\n").expect("fake runsc");
        let e = preflight(dir.path()).expect_err("not gVisor");
        assert!(e.to_string().contains("failed"), "{e}");
    }

    #[test]
    fn a_missing_runsc_is_a_prerequisite_error_that_says_how_to_build_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let e = checked_bin_dir(dir.path()).expect_err("no runsc there");
        assert!(e.to_string().contains("hack/build-gvisor.sh"), "{e}");
    }
}
