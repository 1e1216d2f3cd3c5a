//! Named network namespaces (`ip netns`), one per pod: `cm-<first 8 hex digits of the uid>`.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::Duration;

const NETNS_DIR: &str = "/run/netns";

/// The namespace name for a pod uid.
pub fn name_for(uid: &str) -> String {
    let short: String = uid
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(8)
        .collect();
    format!("cm-{short}")
}

pub fn path(name: &str) -> PathBuf {
    PathBuf::from(NETNS_DIR).join(name)
}

pub fn exists(name: &str) -> bool {
    path(name).exists()
}

async fn ip(args: &[&str]) -> Result<(), String> {
    let run = tokio::process::Command::new("ip")
        .args(args)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .map_err(|_| format!("`ip {}` timed out", args.join(" ")))?
        .map_err(|e| format!("cannot run `ip` (install iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Creates the namespace (replacing a stale one of the same name) and brings `lo` up.
pub async fn create(name: &str) -> Result<PathBuf, String> {
    if exists(name) {
        delete(name).await?;
    }
    ip(&["netns", "add", name]).await?;
    ip(&["-n", name, "link", "set", "lo", "up"]).await?;
    Ok(path(name))
}

/// Removes the namespace name. Idempotent.
pub async fn delete(name: &str) -> Result<(), String> {
    if !exists(name) {
        return Ok(());
    }
    ip(&["netns", "delete", name]).await
}

/// Pids of all processes whose network namespace is `name` (including ones that left the
/// container's process group).
pub fn processes_in(name: &str) -> Vec<i32> {
    let Ok(target) = std::fs::metadata(path(name)) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::metadata(format!("/proc/{pid}/ns/net"))
                .is_ok_and(|m| m.ino() == target.ino() && m.dev() == target.dev())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_short_and_stable() {
        assert_eq!(
            name_for("1a2b3c4d-5e6f-7a8b-9c0d-112233445566"),
            "cm-1a2b3c4d"
        );
        assert_eq!(name_for("ab"), "cm-ab");
        assert_eq!(path("cm-x"), PathBuf::from("/run/netns/cm-x"));
    }
}
