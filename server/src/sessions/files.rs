//! Reading a session's files (its spills and workspace) beside its commands: from the
//! session's sandbox as it is, after the same owner check as a command, and never by
//! starting one, so that a session that is gone says so instead of showing a fresh, empty
//! sandbox.

use cli_mcp_api::SessionId;

use super::{SessionError, SessionManager};
use crate::agent_client::AgentError;
use crate::auth::Caller;

/// Why a file of a session could not be read.
#[derive(Debug)]
pub enum FileError {
    /// The session has no sandbox now (deleted, idle-collected, evicted, never started).
    Gone,
    /// The session could not be looked up, or is another identity's.
    Session(SessionError),
    /// The sandbox's agent refused the read or could not be reached.
    Agent(AgentError),
}

impl SessionManager {
    /// Reads a chunk of a file of the session's sandbox: `kind` is the agent's file kind
    /// (`spill`, `workspace`), `query` names the file and the chunk. The file's bytes and
    /// its whole size.
    pub async fn read_file(
        &self,
        sid: &SessionId,
        caller: &Caller,
        kind: &str,
        query: &[(&str, String)],
    ) -> Result<(Vec<u8>, u64), FileError> {
        let sandbox = match self.backend.existing(sid, caller).await {
            Ok(Some(s)) => s,
            Ok(None) => return Err(FileError::Gone),
            Err(e) => return Err(FileError::Session(e)),
        };
        self.agent
            .file(&sandbox.endpoint, &sandbox.token, kind, query)
            .await
            .map_err(FileError::Agent)
    }
}
