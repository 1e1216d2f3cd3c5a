//! The mounts a real node makes under its directory (volumes, rootfs, netns), found in
//! `/proc/self/mountinfo` and unmounted on teardown (or by the next cluster of the run dir).

use std::fs;
use std::path::{Path, PathBuf};

/// Mount points at or below `dir`, deepest first (from /proc/self/mountinfo; octal escapes
/// such as `\040` decoded).
pub fn mounts_under(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape_mount(m)))
        .filter(|m| m.starts_with(dir))
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    v.dedup();
    v
}

fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            if let Ok(n) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                out.push(n);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Unmount everything at or below `dir` (lazily, deepest first). Returns how many.
pub fn unmount_under(dir: &Path) -> usize {
    let mut n = 0;
    // Unmounting one can reveal another (stacked mounts): repeat until none is left.
    for _ in 0..10 {
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mounts = mounts_under(&info, dir);
        if mounts.is_empty() {
            break;
        }
        for m in mounts {
            if nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH).is_ok() {
                n += 1;
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_under_picks_only_the_node_dir_deepest_first() {
        let info = "\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 27 0:50 / /r/node/kubelet rw shared:9 - ext4 /dev/vda rw
31 30 0:51 / /r/node/kubelet/pods/u/volumes/x rw - tmpfs tmpfs rw
32 27 0:52 / /r/node2/other rw - tmpfs tmpfs rw
33 27 0:53 / /r/node/with\\040space rw - tmpfs tmpfs rw
";
        let m = mounts_under(info, Path::new("/r/node"));
        assert_eq!(
            m,
            [
                PathBuf::from("/r/node/kubelet/pods/u/volumes/x"),
                PathBuf::from("/r/node/kubelet"),
                PathBuf::from("/r/node/with space"),
            ]
        );
    }
}
