//! Where the workspace is: scripts, samples and the run directories are found from it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The workspace root: the checkout this process runs in, found at run time.
///
/// Not the path this crate was compiled at: binaries live in the target dir, and one target
/// dir can serve several checkouts (a shared `CARGO_TARGET_DIR`, as `.ci/run` uses, or a
/// checkout that was moved). cargo rebuilds nothing when the same sources sit at another
/// path, so a compiled-in path led `make run` to another checkout's scripts, or to none
/// ("hack/build-addons.sh: No such file or directory"). cargo runs tests in their
/// package's directory and the scripts run the binaries from the root, so the nearest
/// directory above the current one that holds this workspace is the one; the compiled-in
/// path is the last resort (a binary started from elsewhere by hand).
pub fn workspace_root() -> PathBuf {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let compiled = Path::new(env!("CARGO_MANIFEST_DIR"));
        let compiled = compiled.parent().unwrap_or(compiled);
        std::env::current_dir()
            .ok()
            .and_then(|cwd| enclosing_workspace(&cwd))
            .unwrap_or_else(|| compiled.to_path_buf())
    })
    .clone()
}

/// The nearest of `dir` and its ancestors that is this project's workspace (a `Cargo.toml`
/// next to the `e2e` crate and the `hack` scripts).
fn enclosing_workspace(dir: &Path) -> Option<PathBuf> {
    dir.ancestors()
        .find(|d| {
            d.join("Cargo.toml").is_file()
                && d.join("e2e/Cargo.toml").is_file()
                && d.join("hack").is_dir()
        })
        .map(Path::to_path_buf)
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

    /// What `enclosing_workspace` recognises a checkout by, at `root`, with `dirs` in it.
    fn fake_checkout(root: &Path, dirs: &[&str]) {
        for dir in ["e2e", "hack"].iter().chain(dirs) {
            std::fs::create_dir_all(root.join(dir)).expect("mkdir");
        }
        for file in ["Cargo.toml", "e2e/Cargo.toml"] {
            std::fs::write(root.join(file), "").expect("write");
        }
    }

    #[test]
    fn the_root_is_found_from_any_directory_inside_a_checkout() {
        let scratch = tempfile::tempdir().expect("a scratch dir");
        let root = scratch.path().join("moved checkout");
        fake_checkout(&root, &["e2e/src", "server/tests"]);
        for inside in ["", "e2e", "e2e/src", "server/tests"] {
            assert_eq!(
                enclosing_workspace(&root.join(inside)).as_deref(),
                Some(root.as_path()),
                "from {inside:?}"
            );
        }
        assert_eq!(enclosing_workspace(scratch.path()), None);
        std::fs::remove_dir_all(root.join("hack")).expect("rm hack");
        assert_eq!(enclosing_workspace(&root.join("e2e")), None);
    }

    /// A binary compiled in one checkout, run in another (a moved checkout, or a target dir
    /// shared by two): this very test binary, started in a scratch checkout, must find that.
    #[test]
    fn a_binary_finds_the_checkout_it_runs_in_not_the_one_it_was_built_in() {
        let scratch = tempfile::tempdir().expect("a scratch dir");
        let root = scratch.path().join("elsewhere");
        fake_checkout(&root, &[]);
        let exe = std::env::current_exe().expect("this test binary");
        let out = std::process::Command::new(exe)
            .args([
                "--exact",
                "workspace::tests::print_root",
                "--ignored",
                "--nocapture",
            ])
            .current_dir(root.join("e2e"))
            .output()
            .expect("run this test binary again");
        assert!(out.status.success(), "{out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let found = stdout
            .lines()
            .find_map(|l| l.strip_prefix("workspace root: "))
            .unwrap_or_else(|| panic!("no root printed: {stdout}"));
        assert_eq!(
            Path::new(found),
            root.canonicalize().expect("canonical root")
        );
    }

    /// Run by the test above, in a scratch checkout.
    #[test]
    #[ignore = "run by a_binary_finds_the_checkout_it_runs_in_not_the_one_it_was_built_in"]
    fn print_root() {
        println!("workspace root: {}", workspace_root().display());
    }

    #[test]
    fn a_test_process_has_them() {
        // This very process runs under cargo test.
        let set = cargo_test_env();
        assert!(set.iter().any(|v| v == "CARGO_MANIFEST_DIR"), "{set:?}");
        assert!(set.iter().any(|v| v == "CARGO_PKG_NAME"), "{set:?}");
    }
}
