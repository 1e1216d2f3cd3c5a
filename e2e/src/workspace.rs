//! Where the workspace is: scripts, samples and the run directories are found from it.

use std::path::{Path, PathBuf};

/// The workspace root (parent of this crate).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The variables `cargo test` gives a test process (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, …)
/// that are set in this process now. A test that starts cargo (or a script that does) must
/// remove them from its environment: build scripts track some of them (ring's
/// `rerun-if-env-changed` names `CARGO_MANIFEST_DIR` and `CARGO_PKG_*`), so that cargo would
/// see them changed and rebuild ring and every crate above it (rustls, kube, …) — and the
/// next cargo outside a test would rebuild them back: minutes of CPU and a held build lock
/// in the middle of a test run, with binaries replaced under other tests.
pub fn cargo_test_env() -> Vec<String> {
    std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| is_cargo_test_var(k))
        .collect()
}

fn is_cargo_test_var(name: &str) -> bool {
    ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_EXE_"]
        .iter()
        .any(|p| name.starts_with(p))
        || matches!(
            name,
            "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_TARGET_TMPDIR"
                | "CARGO_RUSTC_CURRENT_DIR"
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_cargo_test_sets_is_removed() {
        for v in [
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_PATH",
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_CRATE_NAME",
            "CARGO_BIN_EXE_cli-mcp-agent",
            "CARGO_TARGET_TMPDIR",
        ] {
            assert!(is_cargo_test_var(v), "{v}");
        }
        // What the user or CI set for every cargo: kept.
        for v in [
            "CARGO",
            "CARGO_TARGET_DIR",
            "CARGO_HOME",
            "CARGO_TERM_COLOR",
            "CARGO_BUILD_JOBS",
            "CARGO_INCREMENTAL",
            "PATH",
        ] {
            assert!(!is_cargo_test_var(v), "{v}");
        }
    }

    #[test]
    fn a_test_process_has_them() {
        // This very process runs under cargo test.
        let set = cargo_test_env();
        assert!(set.iter().any(|v| v == "CARGO_MANIFEST_DIR"), "{set:?}");
        assert!(set.iter().any(|v| v == "CARGO_PKG_NAME"), "{set:?}");
    }
}
