//! Why a command got no answer from the shell, and whether it may have run anyway.

use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ShellError {
    #[error(
        "cannot start the shell {shell:?}: {source}; check --shell and that bash is installed"
    )]
    Spawn { shell: PathBuf, source: io::Error },
    #[error("cannot prepare files for the command in {dir:?}: {source}; check that --state-dir is writable and not full")]
    Files { dir: PathBuf, source: io::Error },
    #[error("the shell stopped reading commands twice in a row; giving up on this command")]
    Unresponsive,
    /// Failed after the command was handed to bash: it may have run, in part or in full.
    #[error("{0}; this happened after the command was sent to the shell, so it may have run")]
    AfterSend(Box<ShellError>),
}

impl ShellError {
    /// False only when the command certainly never reached bash (a retry may run it);
    /// true when it was sent and may have run, so a retry must not run it again.
    pub fn command_may_have_run(&self) -> bool {
        matches!(self, Self::AfterSend(_))
    }

    /// The state dir is full (or over its quota).
    pub(super) fn no_space(&self) -> Option<&io::Error> {
        match self {
            Self::Files { source, .. } if crate::spill::is_no_space(source) => Some(source),
            _ => None,
        }
    }
}
