//! Command directories kept for the next commands. Making one per command (a directory, a
//! file and three FIFOs) and removing it again (five removals) was most of the cost of a
//! fast command on a disk-backed state dir: each is a journaled metadata change.

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::path::PathBuf;

use super::command_dir::MadeDir;

/// Command directories kept for the next commands: the last one, which bash may still be
/// finishing, and the one before, which it is done with.
const SLOTS_KEPT: usize = 2;

/// A command's directory kept for the next command. It is used again only while its FIFOs
/// have no writer and no reader but the agent's, and once bash is done with the last
/// command's line (see [`Slot::bash_is_done`]).
pub(super) struct Slot {
    pub made: MadeDir,
    pub path: PathBuf,
    /// The last command's `done` reader.
    pub done: tokio::net::unix::pipe::Receiver,
}

impl Slot {
    /// Whether bash has opened and closed `done` since the last command's reader was
    /// opened, i.e. has finished that command's line (the agent answers on the status
    /// record, which comes first). A FIFO reports a hang-up only then, and only while
    /// nobody else holds it open; a new reader opened before bash's open would see bash's
    /// close as the *next* command's end.
    pub fn bash_is_done(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = [PollFd::new(self.done.as_fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).is_ok()
            && fds[0]
                .revents()
                .is_some_and(|r| r.contains(PollFlags::POLLHUP))
    }
}

/// The last commands' directories, kept for the next commands (at most [`SLOTS_KEPT`],
/// oldest first).
#[derive(Default)]
pub(super) struct Slots(VecDeque<Slot>);

impl Slots {
    /// A kept directory bash is done with, if there is one. Each command's line ends just
    /// after its record (see `framing::report_status`), but the agent answers on the record,
    /// so the last command's directory may still be in use when the next request comes (on
    /// one CPU, the agent woken by the record runs before bash closes `done`); the one
    /// before it is not (bash runs one line at a time). So with two kept the next command
    /// need not wait: only for the first commands is a new directory made instead.
    pub fn take_ready(&mut self) -> Option<Slot> {
        let ready = self.0.iter().position(Slot::bash_is_done)?;
        self.0.remove(ready)
    }

    /// Keeps `slot`, the directory of the command that just reported, for the next
    /// commands; the oldest kept one beyond [`SLOTS_KEPT`] is removed.
    pub fn keep(&mut self, slot: Slot) {
        // bash runs one line at a time: now that this command reported, every earlier line
        // has ended, and a kept directory whose `done` it did not close never will be (its
        // command removed it, so `<>done` failed; an interrupt cut the line short; the shell
        // was replaced).
        self.remove_where(|slot| !slot.bash_is_done());
        self.0.push_back(slot);
        while self.0.len() > SLOTS_KEPT {
            if let Some(oldest) = self.0.pop_front() {
                oldest.made.remove();
            }
        }
    }

    /// Removes the kept directories `remove` picks.
    pub fn remove_where(&mut self, remove: impl Fn(&Slot) -> bool) {
        let (gone, kept) = std::mem::take(&mut self.0).into_iter().partition(remove);
        self.0 = kept;
        for slot in gone {
            slot.made.remove();
        }
    }
}
