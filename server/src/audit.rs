//! The audit trail: one structured log line (target `audit`) per call, carrying who ran
//! what where with which result. The command itself is never logged (it may hold a secret);
//! its SHA-256 prefix lets an admin correlate with the sandbox's own records.

use sha2::{Digest, Sha256};

/// First 16 hex characters of the command's SHA-256 (same scheme as the agent's log).
pub fn command_hash(command: &str) -> String {
    hex::encode(&Sha256::digest(command.as_bytes())[..8])
}

/// One audited call.
#[derive(Debug, Clone, Default)]
pub struct Record<'a> {
    /// `tools/call`, `delete` or `list`.
    pub action: &'a str,
    pub session: Option<&'a str>,
    pub caller: &'a str,
    pub command_sha256: Option<&'a str>,
    pub sandbox: Option<&'a str>,
    pub exit_code: Option<i32>,
    pub timed_out: bool,
    pub bytes: u64,
    pub duration_ms: u64,
    /// `ok`, `failed`, `timed_out`, the error kind, or `abandoned` (the call never returned:
    /// its body panicked, or the server dropped it while stopping).
    pub outcome: &'a str,
}

pub fn log(r: &Record<'_>) {
    tracing::info!(
        target: "audit",
        action = r.action,
        session = r.session.unwrap_or(""),
        caller = r.caller,
        command_sha256 = r.command_sha256.unwrap_or(""),
        sandbox = r.sandbox.unwrap_or(""),
        exit_code = r.exit_code,
        timed_out = r.timed_out,
        bytes = r.bytes,
        duration_ms = r.duration_ms,
        outcome = r.outcome,
        "audit"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_matches_the_agent_scheme() {
        // sha256("true") = b5bea41b6c623f7c…
        assert_eq!(command_hash("true"), "b5bea41b6c623f7c");
    }
}
