//! A command's files: its directory, the command file and the output FIFOs, and what the
//! agent does when the state dir has no room for them.
//!
//! A command may fill the pod's `/tmp` (the state dir's volume). The session must stay
//! usable, above all for the command that frees the space again. So when a file cannot be
//! created for lack of space, the agent makes room from its own files first, and otherwise
//! needs less: in order,
//! 1. its spill files are removed;
//! 2. its reserve (space kept allocated for this) is released;
//! 3. the command goes to bash inline (`eval '…'`) instead of from a file, output still
//!    through FIFOs (they hold no data blocks, only inodes);
//! 4. the command runs with its output discarded.
//!
//! Each step taken is said in the response.

use std::os::fd::AsFd;

use super::command_dir::{CommandFiles, MadeDir};
use super::framing::{command_line, inline_command_line, random_hex};
use super::report::Notes;
use super::slots::Slot;
use super::streams::{self, Streams};
use super::{Shell, ShellError};
use crate::state_files;

impl Shell {
    /// The files for `command` in a directory with an unguessable name (an earlier
    /// command's, if nothing but the agent holds its files), and its output streams (`None`:
    /// output discarded).
    pub(super) fn prepare(
        &mut self,
        command: &str,
        notes: &mut Notes,
    ) -> Result<(CommandFiles, Option<Streams>), ShellError> {
        self.seq += 1;
        let error = match self.make_files(command, true) {
            Ok((files, streams)) => return Ok((files, Some(streams))),
            Err(e) => e,
        };
        let Some(why) = error.no_space().map(ToString::to_string) else {
            return Err(error);
        };
        let dir = self.opts.state_dir.display().to_string();
        let spills = self.spills.free_all();
        if spills > 0 {
            if let Ok((files, streams)) = self.make_files(command, true) {
                notes.note(format!(
                    "the state dir {dir} is full ({why}): the agent removed its own spill files \
                     ({spills} bytes) to run this command; free space on that volume"
                ));
                return Ok((files, Some(streams)));
            }
        }
        let reserve = self.reserve.release(self.root.fd());
        if reserve > 0 {
            if let Ok((files, streams)) = self.make_files(command, true) {
                notes.note(format!(
                    "the state dir {dir} is full ({why}): the agent removed its own spill files \
                     ({spills} bytes) and released the {reserve} bytes it keeps in reserve to \
                     run this command; free space on that volume"
                ));
                return Ok((files, Some(streams)));
            }
        }
        let freed = format!(
            "the state dir {dir} is full ({why}), even with the agent's own spill files \
             ({spills} bytes) and its reserve ({reserve} bytes) removed"
        );
        if let Ok((files, streams)) = self.make_files(command, false) {
            notes.note(format!(
                "{freed}, so this command was given to bash inline instead of from a file; \
                 free space on that volume"
            ));
            return Ok((files, Some(streams)));
        }
        notes.note(format!(
            "{freed}: this command ran with its output discarded (not even a pipe could be \
             made for it); free space on that volume"
        ));
        let nonce = random_hex();
        Ok((
            CommandFiles {
                dir: self.command_dir(&nonce),
                line: inline_command_line(command, None, &nonce),
                nonce,
                made: None,
                from_file: false,
            },
            None,
        ))
    }

    fn command_dir(&self, nonce: &str) -> std::path::PathBuf {
        self.cmd.path().join(command_dir_name(self.seq, nonce))
    }

    /// The command's directory, its file (if `from_file`) and its output FIFOs; nothing is
    /// left behind if one of them cannot be made. All are made through descriptors (of
    /// `cmd/`, then of the new directory), so a link swapped in for either is never
    /// followed.
    fn make_files(
        &mut self,
        command: &str,
        from_file: bool,
    ) -> Result<(CommandFiles, Streams), ShellError> {
        if from_file {
            if let Some(slot) = self.slots.take_ready() {
                match self.reuse(slot, command) {
                    Ok(found) => return Ok(found),
                    Err(made) => made.remove(),
                }
            }
        }
        let nonce = random_hex();
        let dir = self.command_dir(&nonce);
        let line = if from_file {
            command_line(&dir, &nonce)
        } else {
            inline_command_line(command, Some(&dir), &nonce)
        };
        let mut files = CommandFiles {
            dir,
            nonce,
            line,
            made: None,
            from_file,
        };
        let name = command_dir_name(self.seq, &files.nonce);
        // One lstat per command: bash goes by the path, so it must lead to the `cmd` the
        // agent holds (a command may have replaced it, or the state dir, with a link).
        if !self.cmd.in_place() {
            self.ensure_dirs();
        }
        if state_files::make_new_dir_at(self.cmd.fd(), &name).is_err() {
            // The state dir is writable by the sandbox user: repair it (off the hot path,
            // only when a command broke it) and try once more.
            self.ensure_dirs();
            state_files::make_new_dir_at(self.cmd.fd(), &name).map_err(|e| files.error(e))?;
        }
        let parent = self.cmd.shared_fd();
        let fd = match state_files::open_dir_at(parent.as_fd(), &name) {
            Ok(fd) => fd,
            Err(e) => {
                let _ = state_files::remove_all_at(parent.as_fd(), name.as_ref());
                return Err(files.error(e));
            }
        };
        let id = match state_files::dir_id(fd.as_fd()) {
            Ok(id) => id,
            Err(e) => {
                let _ = state_files::remove_all_at(parent.as_fd(), name.as_ref());
                return Err(files.error(e));
            }
        };
        let made = MadeDir {
            parent,
            name,
            fd,
            id,
        };
        let result = (|| {
            if from_file {
                state_files::write_new_file_at(made.fd.as_fd(), "cmd", command.as_bytes())?;
            }
            let stem = format!("{}-{}", self.seq, &random_hex()[..8]);
            streams::open(
                made.fd.as_fd(),
                self.opts.output_budget,
                &self.spills,
                &stem,
                true,
                &self.progress,
            )
        })();
        match result {
            Ok(streams) => {
                files.made = Some(made);
                Ok((files, streams))
            }
            Err(e) => {
                made.remove();
                Err(files.error(e))
            }
        }
    }
}

impl Shell {
    /// The last command's directory for `command`: its `cmd` file rewritten in place, its
    /// FIFOs opened again (no `mkdir`, no `mkfifo`, nothing to remove afterwards). `Err`
    /// gives the directory back for removal when it cannot be used: bash is not done with
    /// the last line yet, the path no longer leads to it (one `lstat`), a command changed
    /// its files, or a process still holds a FIFO open.
    fn reuse(&mut self, slot: Slot, command: &str) -> Result<(CommandFiles, Streams), MadeDir> {
        if !slot.bash_is_done() || !state_files::leads_to(&slot.path, slot.made.id) {
            return Err(slot.made);
        }
        let Slot { made, path, done } = slot;
        drop(done);
        if state_files::write_in_place_at(made.fd.as_fd(), "cmd", command.as_bytes()).is_err() {
            return Err(made);
        }
        let stem = format!("{}-{}", self.seq, &random_hex()[..8]);
        let streams = match streams::open(
            made.fd.as_fd(),
            self.opts.output_budget,
            &self.spills,
            &stem,
            false,
            &self.progress,
        ) {
            Ok(s) => s,
            Err(_) => return Err(made),
        };
        let nonce = random_hex();
        Ok((
            CommandFiles {
                line: command_line(&path, &nonce),
                dir: path,
                nonce,
                made: Some(made),
                from_file: true,
            },
            streams,
        ))
    }
}

fn command_dir_name(seq: u64, nonce: &str) -> String {
    format!("{seq}-{}", &nonce[..16])
}
