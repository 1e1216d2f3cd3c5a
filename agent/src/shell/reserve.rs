//! Disk space the agent keeps aside in its state dir, so that a command can still be written
//! there when a command filled the volume (the `rm` that would free it, say).
//!
//! `<state-dir>/reserve` is a file of allocated, unwritten blocks (`fallocate`). When the
//! state dir is full and the agent's spill files are gone already, it is removed to make
//! room, and allocated again after a command once there is space.

use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::MetadataExt;

use nix::fcntl::OFlag;

use crate::state_files::{open_at, remove_file_at};

/// Its name in the state dir, reached through the agent's descriptor of the state dir.
const NAME: &str = "reserve";

pub(super) struct Reserve {
    bytes: u64,
    /// Whether the file was in place, whole, the last time the agent looked.
    held: bool,
}

impl Reserve {
    /// Allocates the reserve if it is not there already (best effort: a full volume gets it
    /// later).
    pub fn new(state: BorrowedFd<'_>, bytes: u64) -> Self {
        let mut r = Self { bytes, held: false };
        r.keep(state);
        r
    }

    /// Allocates the reserve again if it was released or could not be allocated before: no
    /// system call when it is held.
    pub fn keep(&mut self, state: BorrowedFd<'_>) {
        if self.held || self.bytes == 0 {
            return;
        }
        match self.allocate(state) {
            Ok(()) => self.held = true,
            Err(e) => {
                // A part-allocated file would hold space without being of use.
                let _ = remove_file_at(state, NAME);
                tracing::debug!(error = %e, "cannot allocate the state dir reserve yet");
            }
        }
    }

    fn allocate(&self, state: BorrowedFd<'_>) -> io::Result<()> {
        let mut file = open_at(
            state,
            NAME,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_NONBLOCK,
            0o600,
        )?;
        let mut meta = file.metadata()?;
        if !meta.is_file() || meta.nlink() != 1 {
            // Another name for the file (a hard link a command made to a file of its choice)
            // would have `fallocate` grow that file, and removing `reserve` would then free
            // nothing: the reserve must be a file of its own.
            remove_file_at(state, NAME)?;
            file = open_at(
                state,
                NAME,
                OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NONBLOCK,
                0o600,
            )?;
            meta = file.metadata()?;
        }
        if meta.blocks() * 512 >= self.bytes {
            return Ok(());
        }
        let len = i64::try_from(self.bytes).map_err(io::Error::other)?;
        nix::fcntl::fallocate(&file, nix::fcntl::FallocateFlags::empty(), 0, len)
            .map_err(io::Error::from)
    }

    /// Removes the reserve to make room; the bytes freed (0 if it was not held).
    pub fn release(&mut self, state: BorrowedFd<'_>) -> u64 {
        if !self.held {
            return 0;
        }
        self.held = false;
        match remove_file_at(state, NAME) {
            Ok(()) => self.bytes,
            Err(_) => 0,
        }
    }
}
