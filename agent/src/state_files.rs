//! Files in the state dir, which the shell user can write to: nothing there is trusted.
//! Links are never followed, a FIFO never blocks a read or a write, and nothing but a
//! regular file of its own is read or written through.

use std::ffi::OsStr;
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use nix::errno::Errno;
use nix::fcntl::{openat, AtFlags, OFlag, AT_FDCWD};
use nix::sys::stat::{fstat, fstatat, mkdirat, FileStat, Mode, SFlag};
use nix::unistd::{unlinkat, UnlinkatFlags};

/// Mode of the agent's directories: the session's files are nobody else's business.
pub const DIR_MODE: u32 = 0o700;

/// A directory of the agent's in the state dir, held open. Every file the agent creates,
/// writes, lists or removes there is reached through this descriptor (`openat`,
/// `unlinkat`, `mkfifoat`…) and never through the path, so a command that swaps the
/// directory for a link at any moment, also between a check and a use, cannot make the
/// agent touch anything elsewhere: the descriptor stays on the directory the agent made.
/// The path still matters to bash (it is handed paths) and to a restarted agent (it looks
/// there), so [`HeldDir::in_place`] tells whether the path still leads here, and
/// [`HeldDir::reopen`] makes it do so again.
pub struct HeldDir {
    /// The state dir.
    state: PathBuf,
    /// The directory in it, or `None` for the state dir itself.
    sub: Option<&'static str>,
    path: PathBuf,
    fd: Arc<OwnedFd>,
    dev: u64,
    ino: u64,
}

impl HeldDir {
    /// Makes `<state>/<sub>` (or `state` itself) a directory of ours (see [`own_at`]) and
    /// holds it open. The state dir is made ours first, in its parent (which is not ours,
    /// and is reached by its path); `sub` is made ours inside the state dir's descriptor,
    /// so a link in the state dir's place is never followed either.
    pub fn open(state: &Path, sub: Option<&'static str>) -> io::Result<Self> {
        let name = state.file_name().ok_or_else(|| {
            io::Error::other(format!("{}: not a directory name", state.display()))
        })?;
        let parent = match state.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        {
            use std::os::unix::fs::DirBuilderExt;
            fs::DirBuilder::new()
                .recursive(true)
                .mode(DIR_MODE)
                .create(parent)?;
        }
        let parent = openat(
            AT_FDCWD,
            parent,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        let mut fd = own_at(parent.as_fd(), name)?;
        let mut path = state.to_path_buf();
        if let Some(sub) = sub {
            fd = own_at(fd.as_fd(), sub.as_ref())?;
            path = state.join(sub);
        }
        let st = fstat(&fd)?;
        Ok(Self {
            state: state.to_path_buf(),
            sub,
            path,
            fd: Arc::new(fd),
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }

    /// Opens it again from its path, repairing what a command did to it (or to the state
    /// dir): a link or file in its place is removed and a new directory made, a mode the
    /// agent needs is given back.
    pub fn reopen(&mut self) -> io::Result<()> {
        *self = Self::open(&self.state, self.sub)?;
        Ok(())
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The descriptor, for files that are removed later from the directory they were made
    /// in, whatever happened to the path meanwhile.
    pub fn shared_fd(&self) -> Arc<OwnedFd> {
        self.fd.clone()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the path still leads to this directory, with the mode the agent gave it
    /// (one `lstat`). False also when a command changed the mode of a directory on the way
    /// (`chmod 000` of the state dir): bash, which goes by the path, needs it too.
    pub fn in_place(&self) -> bool {
        leads_to(&self.path, (self.dev, self.ino))
    }
}

/// The device and inode of an open directory, for [`leads_to`].
pub fn dir_id(fd: BorrowedFd<'_>) -> io::Result<(u64, u64)> {
    let st = fstat(fd)?;
    Ok((st.st_dev, st.st_ino))
}

/// Whether `path` (not followed if it is a link) is the directory `id`, with the mode the
/// agent gives its directories (one `lstat`). False also when a directory on the way can no
/// longer be searched.
pub fn leads_to(path: &Path, id: (u64, u64)) -> bool {
    fstatat(AT_FDCWD, path, AtFlags::AT_SYMLINK_NOFOLLOW).is_ok_and(|st| {
        (st.st_dev, st.st_ino) == id && (st.st_mode & 0o7777 == DIR_MODE || st.st_uid != euid())
    })
}

fn euid() -> u32 {
    static EUID: OnceLock<u32> = OnceLock::new();
    *EUID.get_or_init(|| nix::unistd::geteuid().as_raw())
}

fn is_dir(st: &FileStat) -> bool {
    st.st_mode & SFlag::S_IFMT.bits() == SFlag::S_IFDIR.bits()
}

/// Makes `name` in `parent` a directory of ours and opens it, never following a link:
/// creates it with [`DIR_MODE`]; replaces a link, file or FIFO a command put there (the
/// entry is removed, never followed); and gives a directory the agent owns its mode back
/// when a command changed it (`chmod 000`). A directory owned by someone else is used as it
/// is.
pub fn own_at(parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<OwnedFd> {
    let mut last = io::Error::other("the directory kept being replaced");
    // A command swapping the entry as we go makes a step fail; a few tries outlast a swap
    // in progress, and every step refuses to follow a link whatever it finds.
    for _ in 0..8 {
        match fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) if is_dir(&st) => {}
            Ok(_) => {
                match unlinkat(parent, name, UnlinkatFlags::NoRemoveDir) {
                    Ok(()) | Err(Errno::ENOENT) => {}
                    Err(e) => return Err(e.into()),
                }
                make_dir_at(parent, name)?;
            }
            Err(Errno::ENOENT) => make_dir_at(parent, name)?,
            Err(e) => return Err(e.into()),
        }
        // O_PATH: opening needs no permission on the directory itself, so one a command
        // made 0000 can still be repaired.
        let handle = match openat(
            parent,
            name,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(h) => h,
            Err(e @ (Errno::ENOTDIR | Errno::ELOOP | Errno::ENOENT)) => {
                last = e.into();
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let st = fstat(&handle)?;
        if st.st_uid == euid() && st.st_mode & 0o7777 != DIR_MODE {
            // fchmod refuses an O_PATH descriptor; its /proc name is that very directory
            // (not whatever now has its name), so the change cannot land elsewhere.
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(
                format!("/proc/self/fd/{}", handle.as_raw_fd()),
                fs::Permissions::from_mode(DIR_MODE),
            )?;
        }
        return openat(
            &handle,
            ".",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(Into::into);
    }
    Err(last)
}

fn make_dir_at(parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    match mkdirat(parent, name, Mode::from_bits_truncate(DIR_MODE)) {
        Ok(()) | Err(Errno::EEXIST) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Opens the directory `name` in `dir` (never a link) for files of its own.
pub fn open_dir_at(dir: BorrowedFd<'_>, name: &str) -> io::Result<OwnedFd> {
    openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(Into::into)
}

/// Makes the directory `name` in `dir`.
pub fn make_new_dir_at(dir: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    mkdirat(dir, name, Mode::from_bits_truncate(DIR_MODE)).map_err(Into::into)
}

/// Opens `name` in `dir` with `flags`, never following a link (and close-on-exec); `mode`
/// for a file it creates.
pub fn open_at(dir: BorrowedFd<'_>, name: &str, flags: OFlag, mode: u32) -> io::Result<fs::File> {
    openat(
        dir,
        name,
        flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(mode),
    )
    .map(fs::File::from)
    .map_err(Into::into)
}

/// Creates `name` in `dir` (it must not exist; a link there is never followed) with
/// `bytes`.
pub fn write_new_file_at(dir: BorrowedFd<'_>, name: &str, bytes: &[u8]) -> io::Result<()> {
    let mut f = open_at(
        dir,
        name,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL,
        0o600,
    )?;
    f.write_all(bytes)
}

/// Writes `bytes` at the start of `name` in `dir` and cuts the file to their length. Never
/// follows a link, never blocks on a FIFO, and refuses anything but a regular file with one
/// name.
pub fn write_in_place_at(dir: BorrowedFd<'_>, name: &str, bytes: &[u8]) -> io::Result<()> {
    let file = open_at(
        dir,
        name,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_NONBLOCK,
        0o600,
    )?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() || meta.nlink() != 1 {
        return Err(io::Error::other("not a regular file of its own"));
    }
    file.write_all_at(bytes, 0)?;
    // Only a shorter write has a tail to cut: a truncate to the same length still costs a
    // metadata update.
    if (bytes.len() as u64) < meta.len() {
        file.set_len(bytes.len() as u64)?;
    }
    Ok(())
}

/// Removes the file (or link, or FIFO: never what it points to) `name` in `dir`.
pub fn remove_file_at(dir: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    unlinkat(dir, name, UnlinkatFlags::NoRemoveDir).map_err(Into::into)
}

/// Directory levels [`remove_all_at`] descends at most: a command can nest directories
/// deeper than any stack.
const REMOVE_DEPTH: usize = 64;

/// Removes `name` in `dir` with everything in it, going only through descriptors: a link
/// anywhere in the tree is removed, never followed. A tree deeper than [`REMOVE_DEPTH`] is
/// left in part (an error).
pub fn remove_all_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    remove_tree(dir, name, 0)
}

fn remove_tree(dir: BorrowedFd<'_>, name: &OsStr, depth: usize) -> io::Result<()> {
    match unlinkat(dir, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => return Ok(()),
        Err(Errno::EISDIR | Errno::EPERM) => {}
        Err(e) => return Err(e.into()),
    }
    let sub = match openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    empty_dir(sub.as_fd(), depth)?;
    match unlinkat(dir, name, UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Names read from a directory at a time while it is emptied. A command can make millions of
/// entries in one directory (its own command directory included); listing them all before
/// removing any took memory in proportion, at every level of the tree. This bounds what
/// one level holds to a batch, and the whole walk to [`REMOVE_DEPTH`] batches.
const REMOVE_BATCH: usize = 256;

/// Listings of one directory [`empty_dir`] makes at most. Entries are removed while the
/// listing goes on, which may skip some (POSIX leaves it open); the next pass finds them. A
/// pass that removes nothing ends it: what is left cannot be removed.
const REMOVE_PASSES: usize = 4;

/// Removes everything in the open directory `dir` (whatever its name is now).
pub fn empty_dir(dir: BorrowedFd<'_>, depth: usize) -> io::Result<()> {
    if depth >= REMOVE_DEPTH {
        return Err(io::Error::other("directories nested too deep"));
    }
    let mut result = Ok(());
    for _ in 0..REMOVE_PASSES {
        let mut listing = nix::dir::Dir::openat(
            dir,
            ".",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        // A read error ends the listing (it would come back on every further read).
        let mut names = listing
            .iter()
            .map_while(Result::ok)
            .map(|e| OsStr::from_bytes(e.file_name().to_bytes()).to_owned())
            .filter(|n| n != "." && n != "..");
        let (mut seen, mut removed) = (false, false);
        loop {
            let batch: Vec<std::ffi::OsString> = names.by_ref().take(REMOVE_BATCH).collect();
            if batch.is_empty() {
                break;
            }
            seen = true;
            for n in batch {
                match remove_tree(dir, &n, depth + 1) {
                    Ok(()) => removed = true,
                    Err(e) => result = Err(e),
                }
            }
        }
        if !seen {
            return Ok(());
        }
        if !removed {
            break;
        }
    }
    result
}

/// Reads the whole file `name` in `dir`, of at most `cap` bytes. `Ok(None)`: no file. `Err`: the file is not
/// one we could have written (a link, a FIFO, too large); the reason is for the log.
pub fn read_capped_at(
    dir: BorrowedFd<'_>,
    name: &str,
    cap: u64,
) -> Result<Option<Vec<u8>>, String> {
    let mut file = match open_at(dir, name, OFlag::O_RDONLY | OFlag::O_NONBLOCK, 0) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => {
            return Err("it is a symbolic link".into())
        }
        Err(e) => return Err(format!("cannot open it: {e}")),
    };
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot stat it: {e}"))?;
    let ft = meta.file_type();
    if !ft.is_file() {
        let what = if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_dir() {
            "a directory"
        } else {
            "not a regular file"
        };
        return Err(format!("it is {what}"));
    }
    if meta.len() > cap {
        return Err(format!(
            "it is {} bytes, over the {cap}-byte cap",
            meta.len()
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // The file may grow after the stat: never read past the cap.
    (&mut file)
        .take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read it: {e}"))?;
    if bytes.len() as u64 > cap {
        return Err(format!("it grew over the {cap}-byte cap"));
    }
    Ok(Some(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removing_a_tree_removes_links_in_it_never_what_they_point_to() {
        let d = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        fs::write(outside.path().join("keep"), "x").expect("seed");
        let tree = d.path().join("t");
        fs::create_dir_all(tree.join("a/b")).expect("mkdir");
        fs::write(tree.join("a/b/f"), "y").expect("file");
        std::os::unix::fs::symlink(outside.path(), tree.join("a/link")).expect("link");
        nix::unistd::mkfifo(&tree.join("fifo"), Mode::S_IRWXU).expect("fifo");
        let dir = HeldDir::open(d.path(), None).expect("held");
        remove_all_at(dir.fd(), "t".as_ref()).expect("removed");
        assert!(!tree.exists());
        assert_eq!(
            fs::read_to_string(outside.path().join("keep")).expect("kept"),
            "x"
        );
    }

    /// Many more entries than one batch, files and directories, all go; what cannot go (a
    /// tree nested deeper than the walk descends) ends the walk with an error instead of
    /// listing it again and again.
    #[test]
    fn emptying_a_directory_goes_by_batches_and_ends_on_what_it_cannot_remove() {
        let d = tempfile::tempdir().expect("tempdir");
        let tree = d.path().join("t");
        fs::create_dir(&tree).expect("mkdir");
        for i in 0..(3 * REMOVE_BATCH + 7) {
            if i % 10 == 0 {
                fs::create_dir_all(tree.join(format!("d{i}/x"))).expect("dir");
            } else {
                fs::write(tree.join(format!("f{i}")), "y").expect("file");
            }
        }
        let held = HeldDir::open(&tree, None).expect("held");
        empty_dir(held.fd(), 0).expect("emptied");
        assert_eq!(fs::read_dir(&tree).expect("ls").count(), 0);

        let mut deep = tree.join("deep");
        for _ in 0..=REMOVE_DEPTH {
            deep.push("d");
        }
        fs::create_dir_all(&deep).expect("deep");
        fs::write(tree.join("f"), "y").expect("file");
        assert!(empty_dir(held.fd(), 0).is_err(), "too deep to remove");
        assert!(!tree.join("f").exists(), "the rest is removed all the same");
        assert!(tree.join("deep").exists());
    }

    #[test]
    fn a_held_dir_replaced_by_a_link_is_not_in_place_and_reopens_as_a_real_one() {
        let d = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        let mut dir = HeldDir::open(d.path(), Some("sub")).expect("held");
        assert!(dir.in_place());
        let sub = d.path().join("sub");
        fs::rename(&sub, d.path().join("moved")).expect("move away");
        std::os::unix::fs::symlink(outside.path(), &sub).expect("link");
        assert!(!dir.in_place());
        // Still the directory the agent made, whatever the path now leads to.
        write_new_file_at(dir.fd(), "f", b"z").expect("write");
        assert_eq!(
            fs::read(d.path().join("moved/f")).expect("in the moved dir"),
            b"z"
        );
        dir.reopen().expect("reopen");
        assert!(dir.in_place());
        assert!(fs::symlink_metadata(&sub).expect("lstat").is_dir());
        assert_eq!(fs::read_dir(outside.path()).expect("ls").count(), 0);
    }
}
