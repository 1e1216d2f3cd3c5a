//! Where the workspace is: scripts, samples and the run directories are found from it.

use std::path::{Path, PathBuf};

/// The workspace root (parent of this crate).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}
