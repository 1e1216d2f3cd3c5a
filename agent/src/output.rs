//! Bounded capture of one output stream.
//!
//! bash writes a command's stdout and stderr straight to files, so the agent never holds
//! more than the budget in memory however much is printed: it reads the head and the tail
//! and, when something was cut, keeps the whole file as a "spill" the caller can `grep`.

use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Spill files kept per agent; older ones are removed so disk use stays bounded.
pub const SPILLS_KEPT: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Captured {
    /// What goes into the response: everything, or head + marker + tail.
    pub bytes: Vec<u8>,
    /// Size of the full stream.
    pub total: u64,
    pub truncated: bool,
    /// Where the full stream was kept, when truncated.
    pub spill: Option<PathBuf>,
    /// The command replaced its output file with something that is not a regular file.
    pub replaced: bool,
}

/// Reads `path` within `budget` bytes. A truncated stream is moved to `spill_path`; an
/// untruncated one is deleted. A missing file is an empty stream.
///
/// The directory is writable by the sandbox user, so the file is treated as hostile: links
/// are not followed, only a regular file is read (a FIFO or device reads as an empty stream
/// with `Captured::replaced` set), and never more than its size at open time.
pub fn capture(path: &Path, budget: usize, spill_path: &Path) -> io::Result<Captured> {
    use std::os::unix::fs::OpenOptionsExt;
    let empty = |replaced| Captured {
        bytes: Vec::new(),
        total: 0,
        truncated: false,
        spill: None,
        replaced,
    };
    let mut file = match File::options()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(empty(false)),
        // ELOOP: the command replaced its output file with a symbolic link; ENOTDIR: it
        // replaced a directory on the way with a file.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(nix::libc::ELOOP | nix::libc::ENOTDIR)
            ) =>
        {
            return Ok(empty(true))
        }
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Ok(empty(true));
    }
    let total = meta.len();
    if total <= budget as u64 {
        let mut bytes = Vec::with_capacity(total as usize);
        (&mut file).take(total).read_to_end(&mut bytes)?;
        drop(file);
        let _ = fs::remove_file(path);
        return Ok(Captured {
            bytes,
            total,
            truncated: false,
            spill: None,
            replaced: false,
        });
    }

    let head_len = budget / 2;
    let tail_len = budget - head_len;
    let mut head = vec![0; head_len];
    file.read_exact(&mut head)?;
    let mut tail = vec![0; tail_len];
    file.seek(SeekFrom::Start(total - tail_len as u64))?;
    file.read_exact(&mut tail)?;
    drop(file);

    let head = trim_partial_char_end(head);
    let tail = trim_partial_char_start(tail);
    let cut = total - head.len() as u64 - tail.len() as u64;

    // A command may have removed the spill directory: recreate it here, where it is needed.
    let moved = fs::rename(path, spill_path).is_ok()
        || (spill_path
            .parent()
            .is_some_and(|d| fs::create_dir_all(d).is_ok())
            && fs::rename(path, spill_path).is_ok());
    let spill = moved.then(|| spill_path.to_path_buf());
    let marker = match &spill {
        Some(p) => format!(
            "\n[… {cut} bytes truncated; full output in {} …]\n",
            p.display()
        ),
        None => format!("\n[… {cut} bytes truncated …]\n"),
    };
    let mut bytes = head;
    bytes.extend_from_slice(marker.as_bytes());
    bytes.extend_from_slice(&tail);
    Ok(Captured {
        bytes,
        total,
        truncated: true,
        spill,
        replaced: false,
    })
}

/// Drops an incomplete UTF-8 sequence at the end of `head`, so a cut through a multi-byte
/// character does not turn valid text into "binary" output.
fn trim_partial_char_end(mut head: Vec<u8>) -> Vec<u8> {
    if let Err(e) = std::str::from_utf8(&head) {
        if e.error_len().is_none() {
            head.truncate(e.valid_up_to());
        }
    }
    head
}

/// Skips continuation bytes (at most 3) at the start of `tail`.
fn trim_partial_char_start(tail: Vec<u8>) -> Vec<u8> {
    let skip = tail
        .iter()
        .take(3)
        .take_while(|b| (0x80..0xC0).contains(*b))
        .count();
    if skip > 0 && std::str::from_utf8(&tail[skip..]).is_ok() {
        tail[skip..].to_vec()
    } else {
        tail
    }
}

/// Removes the oldest spill files in `dir` beyond `keep`.
pub fn prune_spills(dir: &Path, keep: usize) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    if files.len() <= keep {
        return;
    }
    files.sort();
    for (_, p) in &files[..files.len() - keep] {
        let _ = fs::remove_file(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        fs::write(&p, bytes).expect("write test file");
        p
    }

    #[test]
    fn small_output_is_whole_and_file_removed() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = write(d.path(), "out", b"hello");
        let c = capture(&p, 10, &d.path().join("spill")).expect("capture");
        assert_eq!(c.bytes, b"hello");
        assert!(!c.truncated);
        assert!(!p.exists());
    }

    #[test]
    fn large_output_keeps_head_and_tail_and_spills() {
        let d = tempfile::tempdir().expect("tempdir");
        let data: Vec<u8> = (0..1000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let p = write(d.path(), "out", &data);
        let spill = d.path().join("spill");
        let c = capture(&p, 100, &spill).expect("capture");
        assert!(c.truncated);
        assert_eq!(c.total, 1000);
        assert!(c.bytes.starts_with(&data[..50]));
        assert!(c.bytes.ends_with(&data[950..]));
        let text = String::from_utf8(c.bytes).expect("utf8");
        assert!(
            text.contains("[… 900 bytes truncated; full output in "),
            "{text}"
        );
        assert_eq!(fs::read(&spill).expect("spill kept"), data);
    }

    #[test]
    fn a_removed_spill_dir_is_recreated() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = write(d.path(), "out", &[b'x'; 100]);
        let spill = d.path().join("gone").join("1.stdout");
        let c = capture(&p, 10, &spill).expect("capture");
        assert_eq!(c.spill.as_deref(), Some(spill.as_path()));
        assert_eq!(fs::read(&spill).expect("spilled").len(), 100);
    }

    #[test]
    fn cuts_never_split_a_character() {
        let d = tempfile::tempdir().expect("tempdir");
        let data = "é".repeat(500); // 2 bytes each
        let p = write(d.path(), "out", data.as_bytes());
        let c = capture(&p, 101, &d.path().join("spill")).expect("capture");
        assert!(String::from_utf8(c.bytes).is_ok());
    }

    #[test]
    fn links_and_fifos_are_never_read() {
        let d = tempfile::tempdir().expect("tempdir");
        let link = d.path().join("out");
        std::os::unix::fs::symlink("/dev/zero", &link).expect("symlink");
        let c = capture(&link, 10, &d.path().join("s1")).expect("capture");
        assert!(c.replaced && c.bytes.is_empty());
        let fifo = d.path().join("err");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
        // Would block forever without O_NONBLOCK, and never end without the file-type check.
        let c = capture(&fifo, 10, &d.path().join("s2")).expect("capture");
        assert!(c.replaced && c.bytes.is_empty());
    }

    #[test]
    fn missing_file_is_empty() {
        let d = tempfile::tempdir().expect("tempdir");
        let c = capture(&d.path().join("nope"), 10, &d.path().join("s")).expect("capture");
        assert_eq!(c.total, 0);
    }

    #[test]
    fn prune_keeps_newest() {
        let d = tempfile::tempdir().expect("tempdir");
        for i in 0..5 {
            let p = write(d.path(), &format!("f{i}"), b"x");
            let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i);
            File::options()
                .write(true)
                .open(&p)
                .and_then(|f| f.set_modified(t))
                .expect("set mtime");
        }
        prune_spills(d.path(), 2);
        let mut left: Vec<_> = fs::read_dir(d.path())
            .expect("read dir")
            .map(|e| e.expect("entry").file_name().into_string().expect("utf8"))
            .collect();
        left.sort();
        assert_eq!(left, vec!["f3", "f4"]);
    }
}
