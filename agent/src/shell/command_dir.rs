//! One command's directory: where its command file and output FIFOs are, and how the agent
//! removes it again without following anything a command swapped in.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use super::ShellError;
use crate::state_files;

/// One command's directory: `cmd` holds the command, `out` and `err` its output.
pub(super) struct CommandFiles {
    pub dir: PathBuf,
    /// Tags the command's status record; also part of the directory's name.
    pub nonce: String,
    /// What bash is sent to run the command.
    pub line: String,
    /// The directory, once made.
    pub made: Option<MadeDir>,
    /// The command is in the directory's `cmd` file (not given to bash inline).
    pub from_file: bool,
}

impl CommandFiles {
    pub fn error(&self, source: io::Error) -> ShellError {
        ShellError::Files {
            dir: self.dir.clone(),
            source,
        }
    }
}

/// A command's directory as the agent made it: removed through these descriptors, so
/// nothing a command swapped in for it, or for `cmd/`, is followed.
pub(super) struct MadeDir {
    /// The `cmd/` it was made in, and its name there.
    pub parent: Arc<OwnedFd>,
    pub name: String,
    pub fd: OwnedFd,
    /// Its device and inode.
    pub id: (u64, u64),
}

impl MadeDir {
    /// Its files by name (one `unlinkat` each, no listing), then the directory; whatever a
    /// command added to it is found by a listing only if the directory is not empty then.
    /// That listing runs on a blocking thread: a command can fill its directory with millions
    /// of entries, and removing them took seconds on a thread that serves requests.
    pub fn remove(self) {
        for name in ["cmd", "out", "err", "done"] {
            let _ = state_files::remove_file_at(self.fd.as_fd(), name);
        }
        if self.rmdir().is_ok() {
            return;
        }
        let rest = move || {
            let _ = state_files::empty_dir(self.fd.as_fd(), 0);
            let _ = self.rmdir();
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(rest)),
            Err(_) => rest(),
        }
    }

    fn rmdir(&self) -> nix::Result<()> {
        nix::unistd::unlinkat(
            self.parent.as_fd(),
            self.name.as_str(),
            nix::unistd::UnlinkatFlags::RemoveDir,
        )
    }
}
