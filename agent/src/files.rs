//! Reading a spill file or a file of the workspace back in bounded chunks (`GET
//! /files/spill`, `GET /files/workspace`), for the server's MCP resources.
//!
//! Both places are the shell's, which is hostile: it can put links, FIFOs, devices or hard
//! links anywhere, and swap them while a read is under way. So:
//! - a spill is opened by its name only (no `/`, no leading `.`) through the descriptor of
//!   the spill directory the agent made and holds, never following a link, and only a
//!   regular file with one name is read (a hard link the shell made to another file has
//!   two);
//! - a workspace file is opened beneath the workspace directory with `openat2`
//!   (`RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`): a `..` or a link that leads out of the
//!   workspace (to `/etc/passwd`, to the state dir, to `/proc/self/…`) fails the open
//!   itself, whenever it is swapped in. Links within the workspace are followed. Where the
//!   kernel has no `openat2` (before Linux 5.6), each component is opened with
//!   `O_NOFOLLOW`, so no link is followed at all;
//! - every open is non-blocking (a FIFO never holds a read) and only regular files are
//!   read, at most `length` bytes (capped at [`FILE_READ_MAX`]) from `offset`.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{openat, openat2, OFlag, OpenHow, ResolveFlag, AT_FDCWD};
use nix::sys::stat::Mode;

pub use cli_mcp_api::wire::FILE_READ_MAX;

use crate::spill::Spills;
use crate::state_files::open_at;

/// Longest workspace path accepted (Linux's `PATH_MAX`).
const PATH_MAX: usize = 4096;

/// One chunk of a file.
#[derive(Debug, PartialEq, Eq)]
pub struct Chunk {
    pub bytes: Vec<u8>,
    /// The file's size when it was opened.
    pub size: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FileError {
    /// The request names no file the agent may read (bad name, `..`, a link out).
    #[error("{0}")]
    Refused(String),
    /// No such file, or not a regular file.
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Io(String),
}

/// Up to `length` bytes from `offset` of the spill `name`.
pub fn read_spill(
    spills: &Spills,
    name: &str,
    offset: u64,
    length: u64,
) -> Result<Chunk, FileError> {
    let valid = !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_');
    if !valid {
        return Err(FileError::Refused(format!(
            "{:?} is not the name of a spill file (names such as `3-1a2b3c4d.stdout`, as a \
             truncation marker gives them)",
            name.chars().take(80).collect::<String>()
        )));
    }
    let dir = spills.held_dir();
    let file = match open_at(dir.as_fd(), name, OFlag::O_RDONLY | OFlag::O_NONBLOCK, 0) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(FileError::NotFound(format!(
                "no spill {name:?}: it was never made, or newer spills needed its room \
                 (--spill-total-bytes)"
            )))
        }
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => {
            return Err(FileError::NotFound(format!(
                "spill {name:?} is a symbolic link, which the agent does not follow"
            )))
        }
        Err(e) => return Err(FileError::Io(format!("cannot open spill {name:?}: {e}"))),
    };
    read_chunk(file, &format!("spill {name:?}"), true, offset, length)
}

/// Up to `length` bytes from `offset` of `path`, relative to the workspace `root`.
pub fn read_workspace(
    root: &Path,
    path: &str,
    offset: u64,
    length: u64,
) -> Result<Chunk, FileError> {
    let rel = path.trim_start_matches('/');
    if rel.is_empty() || rel.len() > PATH_MAX || rel.contains('\0') {
        return Err(FileError::Refused(format!(
            "{:?} is not a file path in the workspace; give a path relative to it, such as \
             `src/main.rs`",
            path.chars().take(80).collect::<String>()
        )));
    }
    if rel.split('/').any(|c| c == "..") {
        return Err(FileError::Refused(format!(
            "{:?} has a `..` component; only files beneath the workspace can be read",
            path.chars().take(200).collect::<String>()
        )));
    }
    let root_fd = openat(
        AT_FDCWD,
        root,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| FileError::Io(format!("cannot open the workspace {}: {e}", root.display())))?;
    let what = format!("{rel:?}");
    let fd = open_beneath(root_fd.as_fd(), rel).map_err(|e| match e {
        Errno::ENOENT | Errno::ENOTDIR => {
            FileError::NotFound(format!("no file {what} in the workspace"))
        }
        Errno::EXDEV | Errno::ELOOP => FileError::Refused(format!(
            "{what} leads out of the workspace (through a symbolic link or `..`); only files \
             beneath it can be read"
        )),
        e => FileError::Io(format!("cannot open {what}: {e}")),
    })?;
    read_chunk(File::from(fd), &what, false, offset, length)
}

/// Opens `rel` beneath `root`, never leaving it.
fn open_beneath(root: BorrowedFd<'_>, rel: &str) -> Result<OwnedFd, Errno> {
    let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
    let how = OpenHow::new()
        .flags(flags)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    match openat2(root, rel, how) {
        Err(Errno::ENOSYS) => open_each_component(root, rel, flags),
        // Interrupted by a rename elsewhere on the system (the kernel asks to retry).
        Err(Errno::EAGAIN) => openat2(root, rel, how),
        other => other,
    }
}

/// Without `openat2`: one component at a time, none of them a link.
fn open_each_component(root: BorrowedFd<'_>, rel: &str, flags: OFlag) -> Result<OwnedFd, Errno> {
    let parts: Vec<&str> = rel
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    let Some((last, dirs)) = parts.split_last() else {
        return Err(Errno::ENOENT);
    };
    let mut dir: Option<OwnedFd> = None;
    for part in dirs {
        let at = dir.as_ref().map_or(root, |d| d.as_fd());
        dir = Some(openat(
            at,
            *part,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?);
    }
    let at = dir.as_ref().map_or(root, |d| d.as_fd());
    openat(at, *last, flags | OFlag::O_NOFOLLOW, Mode::empty())
}

fn read_chunk(
    file: File,
    what: &str,
    single_name: bool,
    offset: u64,
    length: u64,
) -> Result<Chunk, FileError> {
    let meta = file
        .metadata()
        .map_err(|e| FileError::Io(format!("cannot stat {what}: {e}")))?;
    if !meta.file_type().is_file() {
        return Err(FileError::NotFound(format!(
            "{what} is not a regular file (a directory, FIFO or device); only files can be read"
        )));
    }
    if single_name && meta.nlink() != 1 {
        return Err(FileError::NotFound(format!(
            "{what} has another name (a hard link); it is not a file the agent wrote"
        )));
    }
    let size = meta.len();
    let want = length.min(FILE_READ_MAX).min(size.saturating_sub(offset));
    let mut bytes = vec![0u8; want as usize];
    let mut got = 0usize;
    // The file may shrink meanwhile: stop at its end.
    while got < bytes.len() {
        match file.read_at(&mut bytes[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FileError::Io(format!("cannot read {what}: {e}"))),
        }
    }
    bytes.truncate(got);
    Ok(Chunk { bytes, size })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;
    use crate::spill::SpillLimits;
    use crate::state_files::HeldDir;

    fn spills(state: &Path) -> Spills {
        Spills::open(
            HeldDir::open(state, Some("spill")).expect("spill dir"),
            SpillLimits {
                max_file: 1 << 20,
                max_total: 1 << 20,
            },
        )
    }

    #[test]
    fn a_spill_is_read_in_chunks_binary_safe() {
        let d = tempfile::tempdir().expect("tempdir");
        let s = spills(d.path());
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let mut f = s.create("1-abcd.stdout").expect("create");
        f.write(&data);
        drop(f);
        let c = read_spill(&s, "1-abcd.stdout", 0, 300).expect("read");
        assert_eq!((c.bytes.as_slice(), c.size), (&data[..300], 1000));
        let c = read_spill(&s, "1-abcd.stdout", 900, u64::MAX).expect("read");
        assert_eq!(c.bytes, &data[900..]);
        let c = read_spill(&s, "1-abcd.stdout", 5000, 10).expect("past the end");
        assert_eq!((c.bytes.len(), c.size), (0, 1000));
    }

    #[test]
    fn hostile_spill_names_and_files_are_refused() {
        let d = tempfile::tempdir().expect("tempdir");
        let s = spills(d.path());
        let secret = d.path().join("secret");
        std::fs::write(&secret, "token").expect("secret");
        for name in ["../secret", "..", ".hidden", "a/b", "", "x\0y"] {
            assert!(
                matches!(read_spill(&s, name, 0, 10), Err(FileError::Refused(_))),
                "{name:?}"
            );
        }
        let dir = d.path().join("spill");
        symlink(&secret, dir.join("link.stdout")).expect("link");
        std::fs::hard_link(&secret, dir.join("hard.stdout")).expect("hard link");
        nix::unistd::mkfifo(&dir.join("fifo.stdout"), Mode::S_IRWXU).expect("fifo");
        for name in ["link.stdout", "hard.stdout", "fifo.stdout", "none.stdout"] {
            let e = read_spill(&s, name, 0, 10).expect_err(name);
            assert!(matches!(e, FileError::NotFound(_)), "{name}: {e:?}");
        }
        // The spill dir replaced by a link to elsewhere: reads stay in the held directory.
        let mut f = s.create("real.stdout").expect("create");
        f.write(b"mine");
        drop(f);
        std::fs::rename(&dir, d.path().join("moved")).expect("move");
        let elsewhere = d.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).expect("mkdir");
        std::fs::write(elsewhere.join("real.stdout"), "forged").expect("forged");
        symlink(&elsewhere, &dir).expect("swap in a link");
        let c = read_spill(&s, "real.stdout", 0, 100).expect("read");
        assert_eq!(c.bytes, b"mine");
    }

    #[test]
    fn workspace_files_are_read_beneath_the_workspace_only() {
        let d = tempfile::tempdir().expect("tempdir");
        let root = d.path().join("workspace");
        std::fs::create_dir_all(root.join("src")).expect("mkdir");
        std::fs::write(root.join("src/main.rs"), "fn main() {}\n").expect("file");
        std::fs::write(d.path().join("outside"), "secret").expect("outside");
        symlink("main.rs", root.join("src/alias.rs")).expect("link within");
        symlink("/etc/passwd", root.join("passwd")).expect("link out");
        symlink(d.path().join("outside"), root.join("out")).expect("link out");
        symlink("../outside", root.join("up")).expect("relative link out");
        symlink("/proc/self/environ", root.join("environ")).expect("magic link");
        symlink(d.path(), root.join("parent")).expect("dir link out");
        nix::unistd::mkfifo(&root.join("fifo"), Mode::S_IRWXU).expect("fifo");

        let c = read_workspace(&root, "src/main.rs", 3, 4).expect("read");
        assert_eq!((c.bytes.as_slice(), c.size), (&b"main"[..], 13));
        assert_eq!(
            read_workspace(&root, "/src/./alias.rs", 0, 100)
                .expect("a link within is followed")
                .bytes,
            b"fn main() {}\n"
        );
        for path in [
            "passwd",
            "out",
            "up",
            "environ",
            "parent/outside",
            "../outside",
            "src/../../outside",
        ] {
            let e = read_workspace(&root, path, 0, 100).expect_err(path);
            assert!(matches!(e, FileError::Refused(_)), "{path}: {e:?}");
        }
        for path in ["fifo", "src", "missing", "src/main.rs/x"] {
            let e = read_workspace(&root, path, 0, 100).expect_err(path);
            assert!(matches!(e, FileError::NotFound(_)), "{path}: {e:?}");
        }
        for path in ["", "/", "a\0b"] {
            let e = read_workspace(&root, path, 0, 100).expect_err(path);
            assert!(matches!(e, FileError::Refused(_)), "{path:?}: {e:?}");
        }
        // Without openat2 no link is followed at all, and none leads out.
        let root_fd = openat(
            AT_FDCWD,
            &root,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY,
            Mode::empty(),
        )
        .expect("root");
        let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK;
        assert!(open_each_component(root_fd.as_fd(), "src/main.rs", flags).is_ok());
        for path in ["passwd", "src/alias.rs", "parent/outside"] {
            // A link as a directory on the way fails O_DIRECTORY first.
            let e = open_each_component(root_fd.as_fd(), path, flags).map(drop);
            assert!(
                matches!(e, Err(Errno::ELOOP | Errno::ENOTDIR)),
                "{path}: {e:?}"
            );
        }
        // The workspace itself replaced by a link: nothing is read through it.
        let moved = d.path().join("moved");
        std::fs::rename(&root, &moved).expect("move");
        symlink(d.path(), &root).expect("link");
        assert!(matches!(
            read_workspace(&root, "outside", 0, 100),
            Err(FileError::Io(_))
        ));
    }

    #[test]
    fn a_huge_length_is_capped() {
        let d = tempfile::tempdir().expect("tempdir");
        let big = vec![b'x'; (FILE_READ_MAX + 10) as usize];
        std::fs::write(d.path().join("big"), &big).expect("big");
        let c = read_workspace(d.path(), "big", 0, u64::MAX).expect("read");
        assert_eq!(
            (c.bytes.len() as u64, c.size),
            (FILE_READ_MAX, FILE_READ_MAX + 10)
        );
        let c = read_workspace(d.path(), "big", u64::MAX, u64::MAX).expect("read");
        assert!(c.bytes.is_empty());
    }
}
