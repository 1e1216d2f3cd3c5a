//! Finding a pod's cgroup: the kubelet makes `<cgroupRoot>/kubepods/<qos>/pod<uid>` in every
//! hierarchy (cgroupfs driver), so a pod's directory is found by its name under a root.

use std::fs;
use std::path::{Path, PathBuf};

/// The directory named `name` at most `depth` levels under `dir`.
pub(super) fn find_dir(dir: &Path, name: &str, depth: usize) -> Option<PathBuf> {
    let entries = fs::read_dir(dir).ok()?;
    let subdirs: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    if let Some(d) = subdirs
        .iter()
        .find(|d| d.file_name().is_some_and(|n| n == name))
    {
        return Some(d.clone());
    }
    if depth == 0 {
        return None;
    }
    subdirs.iter().find_map(|d| find_dir(d, name, depth - 1))
}
