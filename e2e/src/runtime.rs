//! The container runtimes a sandbox can run under on the real node, and the proof that a
//! session's sandbox really runs under the one its instance names: what its shell sees of the
//! kernel, what it cannot see of the host, and which containerd shim runs its container.
//!
//! Real-node isolation tests run once per runtime, so that every claim they prove holds
//! under runc and under gVisor alike; the proof keeps a test from passing under "gVisor"
//! while the pod in fact ran under runc.

use std::path::Path;

use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

use crate::addons::container_runtime;
use crate::journey::{stdout, text, Mcp};
use crate::node::gvisor;

/// A runtime of the real node's sandboxes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SandboxRuntime {
    /// The node's default: runc (no RuntimeClass).
    Runc,
    /// gVisor (the RuntimeClass `gvisor`, containerd's handler `runsc`).
    Gvisor,
}

impl SandboxRuntime {
    pub const ALL: [SandboxRuntime; 2] = [SandboxRuntime::Runc, SandboxRuntime::Gvisor];

    /// Short name, for namespaces and messages.
    pub fn name(self) -> &'static str {
        match self {
            SandboxRuntime::Runc => "runc",
            SandboxRuntime::Gvisor => "gvisor",
        }
    }

    /// The `spec.sandbox.runtimeClassName` selecting it (none: the node's default).
    pub fn class(self) -> Option<&'static str> {
        match self {
            SandboxRuntime::Runc => None,
            SandboxRuntime::Gvisor => Some(gvisor::RUNTIME_CLASS),
        }
    }

    /// The containerd runtime type (shim) its containers run under.
    pub fn containerd_runtime(self) -> &'static str {
        match self {
            SandboxRuntime::Runc => "io.containerd.runc.v2",
            SandboxRuntime::Gvisor => "io.containerd.runsc.v1",
        }
    }

    /// Sets (or, for runc, removes) `spec.sandbox.runtimeClassName` in an instance's JSON.
    pub fn apply_to(self, cr: &mut Value) {
        match self.class() {
            Some(class) => cr["spec"]["sandbox"]["runtimeClassName"] = json!(class),
            None => {
                if let Some(s) = cr["spec"]["sandbox"].as_object_mut() {
                    s.remove("runtimeClassName");
                }
            }
        }
    }
}

/// What a sandbox's shell sees, one line each: `uname -r`; the kernel log's first line (or
/// `no-dmesg`); how many text symbols `/proc/kallsyms` lists (or `no-kallsyms`); the block
/// devices `/sys/block` lists.
const PROBE: &str = "uname -r; \
    (dmesg 2>/dev/null | head -n1 | grep . ) || echo no-dmesg; \
    if [ -r /proc/kallsyms ]; then grep -c ' [Tt] ' /proc/kallsyms; else echo no-kallsyms; fi; \
    ls /sys/block 2>/dev/null | tr '\\n' ' '; echo";

/// The host's view, to compare: its kernel release and its block devices.
fn host_view() -> (String, Vec<String>) {
    let release = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut blocks: Vec<String> = std::fs::read_dir("/sys/block")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.starts_with("loop") && !n.starts_with("ram"))
                .collect()
        })
        .unwrap_or_default();
    blocks.sort();
    (release, blocks)
}

/// Panics unless session `sid`'s sandbox (`pod`, on the real node whose containerd listens on
/// `socket`) runs under `rt`:
/// - gVisor: the shell's kernel is gVisor's (`uname -r`, its boot log), the host's kernel
///   release, kernel symbols and block devices are invisible, and the pod's container runs
///   under the runsc shim;
/// - runc: the shell sees the host's kernel (the positive control of the same probe), and
///   the container runs under the runc shim.
pub async fn assert_sandbox_runs_under(
    rt: SandboxRuntime,
    mcp: &Mcp,
    sid: &str,
    socket: &Path,
    pod: &Pod,
) {
    let r = mcp.bash(sid, PROBE).await;
    assert_eq!(r["isError"], false, "{}", text(&r));
    let out = stdout(&r);
    let lines: Vec<&str> = out.lines().collect();
    let (host_release, host_blocks) = host_view();
    let (release, dmesg, kallsyms, blocks) = match lines.as_slice() {
        [a, b, c, d, ..] => (*a, *b, *c, *d),
        _ => panic!("{sid}: the runtime probe printed {out:?}"),
    };
    let sees_host_block = host_blocks
        .iter()
        .any(|b| blocks.split_whitespace().any(|s| s == b));
    match rt {
        SandboxRuntime::Gvisor => {
            assert!(release.contains("gvisor"), "{sid}: uname -r {release:?}");
            assert_ne!(release, host_release, "{sid}: the host's kernel");
            assert!(dmesg.contains("Starting gVisor"), "{sid}: dmesg {dmesg:?}");
            assert!(
                kallsyms == "no-kallsyms" || kallsyms == "0",
                "{sid}: kernel symbols visible: {kallsyms:?}"
            );
            assert!(
                !sees_host_block,
                "{sid}: host block devices {host_blocks:?} visible: {blocks:?}"
            );
        }
        SandboxRuntime::Runc => {
            assert_eq!(
                release, host_release,
                "{sid}: runc shares the host's kernel"
            );
            assert!(
                kallsyms.parse::<u64>().is_ok_and(|n| n > 0),
                "{sid}: the host's symbols, under runc: {kallsyms:?}"
            );
        }
    }
    let id = crate::peer::container_id(sid, pod);
    let shim = container_runtime(socket, &id).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(shim, rt.containerd_runtime(), "{sid}: containerd's runtime");
    eprintln!(
        "  {sid} runs under {} ({shim}): kernel {release}, host {host_release}",
        rt.name()
    );
}
