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

use std::fs;
use std::path::Path;

use super::framing::{command_line, inline_command_line, random_hex};
use super::report::Notes;
use super::streams::{self, Streams};
use super::{CommandFiles, Shell, ShellError};
use crate::state_files;

impl Shell {
    /// The files for `command` in a fresh, unguessable directory (nothing can be planted
    /// there in advance), and its output streams (`None`: output discarded).
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
        let reserve = self.reserve.release();
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
            },
            None,
        ))
    }

    pub(super) fn cmd_dir(&self) -> std::path::PathBuf {
        self.opts.state_dir.join("cmd")
    }

    fn command_dir(&self, nonce: &str) -> std::path::PathBuf {
        self.cmd_dir()
            .join(format!("{}-{}", self.seq, &nonce[..16]))
    }

    /// The command's directory, its file (if `from_file`) and its output FIFOs; nothing is
    /// left behind if one of them cannot be made.
    fn make_files(
        &mut self,
        command: &str,
        from_file: bool,
    ) -> Result<(CommandFiles, Streams), ShellError> {
        let nonce = random_hex();
        let dir = self.command_dir(&nonce);
        let line = if from_file {
            command_line(&dir, &nonce)
        } else {
            inline_command_line(command, Some(&dir), &nonce)
        };
        let files = CommandFiles { dir, nonce, line };
        // One lstat per command: a `cmd` replaced with a link would have the command's
        // files made (and later removed) wherever it points.
        if !state_files::is_real_dir(&self.cmd_dir()) {
            self.ensure_dirs();
        }
        if fs::create_dir(&files.dir).is_err() {
            // The state dir is writable by the sandbox user: repair it (off the hot path,
            // only when a command broke it) and try once more.
            self.ensure_dirs();
            fs::create_dir(&files.dir).map_err(|e| files.error(e))?;
        }
        let made = (|| {
            if from_file {
                state_files::write_new_file(&files.dir.join("cmd"), command.as_bytes())?;
            }
            let stem = format!("{}-{}", self.seq, &random_hex()[..8]);
            streams::open(&files.dir, self.opts.output_budget, &self.spills, &stem)
        })();
        match made {
            Ok(streams) => Ok((files, streams)),
            Err(e) => {
                remove_dir(&files.dir);
                Err(files.error(e))
            }
        }
    }
}

fn remove_dir(dir: &Path) {
    let _ = fs::remove_dir_all(dir);
}
