//! Spill files: the full stream of a truncated command, kept under `<state-dir>/spill/` for
//! `grep` and `sed -n`, within caps.
//!
//! The state dir is on the pod's `/tmp` emptyDir, whose size limit the kubelet enforces by
//! evicting the pod: the agent's own files must never be what fills it. So each spill keeps
//! at most `max_file` bytes (the start of the stream; the response still carries its real
//! tail), all spills together at most `max_total` bytes and `max_files` files, and the
//! oldest spills are removed first to make room. Only the agent writes spill files (command
//! output reaches it through pipes), so what it counts is what is on disk, unless a command
//! writes there itself.
//!
//! The spill directory is held open ([`HeldDir`]): spills are created, listed and removed
//! through its descriptor (each spill through the one of the directory it was made in),
//! never through the path, so a link a command swaps in for the directory is never
//! followed. When the agent makes the directory again (a command changed its mode, moved or
//! replaced it), the spills it counted stay counted if they are still in the directory the
//! path leads to, and are removed otherwise: forgotten, they would stay on disk outside the
//! caps until the agent restarts, once per `chmod` or `mv` a command repeats.

use std::collections::VecDeque;
use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::fcntl::{AtFlags, OFlag};

use crate::state_files::{dir_id, open_at, remove_file_at, HeldDir};

/// Spill files kept at most, whatever their size.
pub const SPILLS_KEPT: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpillLimits {
    /// Bytes one spill file keeps at most.
    pub max_file: u64,
    /// Bytes all spill files keep together at most.
    pub max_total: u64,
}

/// Why a spill stopped before the end of its stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cut {
    /// The per-spill cap.
    FileCap(u64),
    /// The cap on all spills together, with every older spill already removed.
    TotalCap(u64),
    /// Writing failed (the state dir is full, or was broken by a command).
    Failed(String),
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::FileCap(n) => write!(f, "a spill keeps at most {n} bytes, --spill-max-bytes"),
            Self::TotalCap(n) => write!(
                f,
                "all spills together keep at most {n} bytes, --spill-total-bytes"
            ),
            Self::Failed(e) => write!(f, "writing the spill file failed: {e}"),
        }
    }
}

/// The spill files on disk, oldest first, and the caps they are kept within. Shared by the
/// shell (which frees them when the state dir is full) and the output collectors.
#[derive(Clone)]
pub struct Spills(Arc<Mutex<Store>>);

struct Store {
    dir: HeldDir,
    limits: SpillLimits,
    /// Oldest first: path, bytes written, and whether a stream still writes it.
    files: VecDeque<Entry>,
}

struct Entry {
    /// The directory it is in, and its name there.
    dir: Arc<OwnedFd>,
    name: String,
    path: PathBuf,
    bytes: u64,
    open: bool,
}

impl Entry {
    fn remove(&self) {
        let _ = remove_file_at(self.dir.as_fd(), &self.name);
    }
}

impl Spills {
    /// Takes stock of the spills a previous agent process left in `dir` (oldest first, by
    /// modification time) and removes those over the caps.
    pub fn open(dir: HeldDir, limits: SpillLimits) -> Self {
        let fd = dir.shared_fd();
        let mut found: Vec<(i64, i64, String, u64)> = Vec::new();
        if let Ok(mut listing) = nix::dir::Dir::openat(
            fd.as_fd(),
            ".",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        ) {
            for e in listing.iter().filter_map(Result::ok) {
                let Ok(name) = std::str::from_utf8(e.file_name().to_bytes()) else {
                    continue;
                };
                let Ok(st) =
                    nix::sys::stat::fstatat(fd.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW)
                else {
                    continue;
                };
                let regular = st.st_mode & nix::libc::S_IFMT == nix::libc::S_IFREG;
                if regular {
                    let bytes = u64::try_from(st.st_blocks).unwrap_or(0) * 512;
                    found.push((st.st_mtime, st.st_mtime_nsec, name.to_owned(), bytes));
                }
            }
        }
        found.sort();
        let store = Store {
            limits,
            files: found
                .into_iter()
                .map(|(_, _, name, bytes)| Entry {
                    dir: fd.clone(),
                    path: dir.path().join(&name),
                    name,
                    bytes,
                    open: false,
                })
                .collect(),
            dir,
        };
        let spills = Self(Arc::new(Mutex::new(store)));
        spills.store().make_room(0);
        spills
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn limits(&self) -> SpillLimits {
        self.store().limits
    }

    /// The spill directory the agent holds now, for reading spills back by name (never
    /// through the path, which a command may have swapped for a link).
    pub fn held_dir(&self) -> Arc<OwnedFd> {
        self.store().dir.shared_fd()
    }

    /// Starts a spill file named `name` in the spill dir.
    pub fn create(&self, name: &str) -> Result<SpillFile, Cut> {
        let dir = {
            let mut store = self.store();
            store.keep_dir_real();
            store.dir.shared_fd()
        };
        let (dir, file) = match create_new(&dir, name) {
            Ok(f) => (dir, f),
            // A full state dir is not repaired by recreating anything.
            Err(e) if is_no_space(&e) => return Err(Cut::Failed(e.to_string())),
            // A command may have removed the spill directory, replaced it or taken the access
            // to it (or to the state dir) away: repair it, and try once more.
            Err(_) => {
                let mut store = self.store();
                store.reopen_dir().map_err(|e| Cut::Failed(e.to_string()))?;
                let dir = store.dir.shared_fd();
                drop(store);
                let file = create_new(&dir, name).map_err(|e| Cut::Failed(e.to_string()))?;
                (dir, file)
            }
        };
        let path = {
            let mut store = self.store();
            let path = store.dir.path().join(name);
            store.files.push_back(Entry {
                dir: dir.clone(),
                name: name.to_owned(),
                path: path.clone(),
                bytes: 0,
                open: true,
            });
            store.make_room(0);
            path
        };
        Ok(SpillFile {
            spills: self.clone(),
            dir,
            name: name.to_owned(),
            path,
            file: Some(file),
            written: 0,
            cut: None,
        })
    }

    /// Removes every spill no stream is writing; returns the bytes freed. For a full state
    /// dir: the agent's own files go first.
    pub fn free_all(&self) -> u64 {
        let mut store = self.store();
        let mut freed = 0;
        store.files.retain(|e| {
            if e.open {
                return true;
            }
            e.remove();
            freed += e.bytes;
            false
        });
        freed
    }

    /// How many of `want` more bytes `path` may write, after removing older spills to make
    /// room; `Err` names the cap that stops it.
    fn allow(&self, path: &Path, written: u64, want: u64) -> Result<u64, Cut> {
        let mut store = self.store();
        let limits = store.limits;
        let want = want.min(limits.max_file.saturating_sub(written));
        if want == 0 {
            return Err(Cut::FileCap(limits.max_file));
        }
        store.make_room(want);
        let room = limits.max_total.saturating_sub(store.total());
        let granted = want.min(room);
        if granted == 0 {
            return Err(Cut::TotalCap(limits.max_total));
        }
        if let Some(e) = store.files.iter_mut().find(|e| e.path == path) {
            e.bytes += granted;
        }
        Ok(granted)
    }

    fn closed(&self, path: &Path) {
        if let Some(e) = self.store().files.iter_mut().find(|e| e.path == path) {
            e.open = false;
        }
    }

    /// Stops counting the spill at `path`, which its writer removed.
    fn forget(&self, path: &Path) {
        let mut store = self.store();
        if let Some(i) = store.files.iter().position(|e| e.open && e.path == path) {
            store.files.remove(i);
        }
    }
}

impl Store {
    fn total(&self) -> u64 {
        self.files.iter().map(|e| e.bytes).sum()
    }

    /// Puts a real directory back if the path no longer leads to the held spill dir (a
    /// command replaced it with a link, or changed its mode), so that new spills are where
    /// their paths say.
    fn keep_dir_real(&mut self) {
        if !self.dir.in_place() {
            tracing::warn!(path = %self.dir.path().display(),
                "the spill directory was replaced (by a link?) or its mode changed; making it again");
            let _ = self.reopen_dir();
        }
    }

    /// Opens the spill dir again from its path (see [`HeldDir::reopen`]). The finished spills
    /// still in the directory now held (only its mode was changed) stay counted: they are
    /// still on disk. Those in another directory (the command moved or replaced theirs) are
    /// out of the caller's sight, so they are removed, through the descriptor of their own
    /// directory since the path may lead anywhere. Spills still being written stay counted
    /// either way, and are removed the same way once done.
    fn reopen_dir(&mut self) -> io::Result<()> {
        self.dir.reopen()?;
        // Each entry holds its directory open, so its inode cannot be reused by the new one.
        let held = dir_id(self.dir.fd()).ok();
        self.files.retain(|e| {
            if e.open || (held.is_some() && dir_id(e.dir.as_fd()).ok() == held) {
                return true;
            }
            e.remove();
            false
        });
        Ok(())
    }

    /// Removes the oldest closed spills until `more` bytes fit within the total cap and the
    /// file count is within `SPILLS_KEPT`. Each is removed through the descriptor of the
    /// directory it was made in, wherever that directory is now.
    fn make_room(&mut self, more: u64) {
        while self.total() + more > self.limits.max_total || self.files.len() > SPILLS_KEPT {
            let Some(i) = self.files.iter().position(|e| !e.open) else {
                return;
            };
            if let Some(e) = self.files.remove(i) {
                e.remove();
            }
        }
    }
}

fn create_new(dir: &OwnedFd, name: &str) -> io::Result<fs::File> {
    open_at(
        dir.as_fd(),
        name,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL,
        0o600,
    )
}

/// One spill being written: the start of a stream, up to the caps.
pub struct SpillFile {
    spills: Spills,
    /// The directory it was made in, and its name there.
    dir: Arc<OwnedFd>,
    name: String,
    pub path: PathBuf,
    file: Option<fs::File>,
    pub written: u64,
    /// Set once the spill stopped short of the stream.
    pub cut: Option<Cut>,
}

impl SpillFile {
    /// Appends what the caps allow of `bytes`. A write that fails for lack of space is
    /// retried once after the other spills were removed.
    pub fn write(&mut self, bytes: &[u8]) {
        if self.cut.is_some() || bytes.is_empty() {
            return;
        }
        let Some(file) = self.file.as_mut() else {
            return;
        };
        let granted = match self
            .spills
            .allow(&self.path, self.written, bytes.len() as u64)
        {
            Ok(n) => n as usize,
            Err(cut) => {
                self.cut = Some(cut);
                return;
            }
        };
        let chunk = &bytes[..granted];
        let mut result = file.write_all(chunk);
        if result.as_ref().is_err_and(is_no_space) && self.spills.free_all() > 0 {
            // Part of the chunk may be in the file already; the retry writes it again from
            // where the file ends, so nothing is doubled.
            result = self.rewrite_tail(chunk);
        }
        match result {
            Ok(()) => self.written += granted as u64,
            Err(e) => {
                self.cut = Some(Cut::Failed(e.to_string()));
                self.file = None;
            }
        }
        if granted < bytes.len() && self.cut.is_none() {
            let limits = self.spills.limits();
            self.cut = Some(if self.written >= limits.max_file {
                Cut::FileCap(limits.max_file)
            } else {
                Cut::TotalCap(limits.max_total)
            });
        }
    }

    /// Removes the spill (one that kept nothing) from the directory it was made in, never
    /// through its path: a command may have swapped `spill/` for a link meanwhile.
    pub fn discard(self) {
        let _ = remove_file_at(self.dir.as_fd(), &self.name);
        self.spills.forget(&self.path);
    }

    /// After a short write: writes what of `chunk` is not in the file yet.
    fn rewrite_tail(&mut self, chunk: &[u8]) -> io::Result<()> {
        let Some(file) = self.file.as_mut() else {
            return Err(io::Error::other("spill file closed"));
        };
        let len = file.metadata()?.len();
        let done = usize::try_from(len.saturating_sub(self.written))
            .unwrap_or(usize::MAX)
            .min(chunk.len());
        file.write_all(&chunk[done..])
    }
}

impl Drop for SpillFile {
    fn drop(&mut self) {
        self.spills.closed(&self.path);
    }
}

pub fn is_no_space(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(nix::libc::ENOSPC | nix::libc::EDQUOT)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_file: u64, max_total: u64) -> SpillLimits {
        SpillLimits {
            max_file,
            max_total,
        }
    }

    /// Spills in `<state>/spill`.
    fn open(state: &Path, limits: SpillLimits) -> Spills {
        Spills::open(
            HeldDir::open(state, Some("spill")).expect("spill dir"),
            limits,
        )
    }

    fn names(state: &Path) -> Vec<String> {
        let dir = state.join("spill");
        let mut v: Vec<String> = fs::read_dir(dir)
            .expect("read dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_spill_keeps_the_start_of_its_stream_up_to_its_cap() {
        let d = tempfile::tempdir().expect("tempdir");
        let spills = open(d.path(), limits(10, 100));
        let mut f = spills.create("a").expect("create");
        f.write(b"0123456");
        f.write(b"789abc");
        assert_eq!(f.cut, Some(Cut::FileCap(10)));
        f.write(b"more");
        assert_eq!(f.written, 10);
        assert_eq!(
            fs::read(d.path().join("spill/a")).expect("read"),
            b"0123456789"
        );
    }

    #[test]
    fn the_oldest_spills_make_room_for_a_new_one() {
        let d = tempfile::tempdir().expect("tempdir");
        let spills = open(d.path(), limits(10, 25));
        for name in ["a", "b", "c"] {
            let mut f = spills.create(name).expect("create");
            f.write(&[b'x'; 10]);
            assert_eq!(f.cut, None, "{name}");
        }
        assert_eq!(names(d.path()), ["b", "c"]);
        // The only spill left open is never removed for another: it stops at the total cap.
        let spills = open(d.path(), limits(100, 25));
        spills.free_all();
        let mut f = spills.create("d").expect("create");
        f.write(&[b'y'; 30]);
        assert_eq!((f.written, f.cut.clone()), (25, Some(Cut::TotalCap(25))));
    }

    #[test]
    fn spills_left_by_a_previous_process_count_and_go_first() {
        let d = tempfile::tempdir().expect("tempdir");
        for (i, name) in ["old", "new"].iter().enumerate() {
            fs::create_dir_all(d.path().join("spill")).expect("mkdir");
            let p = d.path().join("spill").join(name);
            fs::write(&p, vec![b'z'; 8192]).expect("write");
            let t =
                std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i as u64);
            fs::File::options()
                .write(true)
                .open(&p)
                .and_then(|f| f.set_modified(t))
                .expect("set mtime");
        }
        let spills = open(d.path(), limits(8192, 12288));
        assert_eq!(names(d.path()), ["new"]);
        let mut f = spills.create("next").expect("create");
        f.write(&[b'x'; 8192]);
        assert_eq!(names(d.path()), ["next"]);
    }

    #[test]
    fn at_most_spills_kept_files_are_kept() {
        let d = tempfile::tempdir().expect("tempdir");
        let spills = open(d.path(), limits(10, 1 << 20));
        for i in 0..SPILLS_KEPT + 3 {
            let mut f = spills.create(&format!("{i:02}")).expect("create");
            f.write(b"x");
        }
        let left = names(d.path());
        assert_eq!(left.len(), SPILLS_KEPT);
        assert_eq!(left[0], "03");
    }
}
