//! The agent process a section measures: started on loopback with a state dir of its own,
//! killed when dropped, and the session token every agent section uses.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context};

use cli_mcp_api::token::HmacKey;
use cli_mcp_api::SessionId;

pub(crate) struct AgentProc {
    pub(crate) child: Child,
    pub(crate) addr: String,
    pub(crate) state: tempfile::TempDir,
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn start_agent(bin: &PathBuf, commitment: &str) -> anyhow::Result<AgentProc> {
    start_agent_in(bin, commitment, &std::env::temp_dir())
}

pub(crate) fn start_agent_in(
    bin: &PathBuf,
    commitment: &str,
    parent: &Path,
) -> anyhow::Result<AgentProc> {
    let state = tempfile::Builder::new()
        .prefix("cli-mcp-bench-")
        .tempdir_in(parent)
        .with_context(|| format!("a state dir in {}", parent.display()))?;
    let mut child = Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--log-json", "--state-dir"])
        .arg(state.path())
        .arg("--workdir")
        .arg(state.path())
        .env("TOKEN_SHA256", commitment)
        .env("RUST_LOG", "warn,cli_mcp_agent=info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stderr = child.stderr.take().context("stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let Some(line) = lines.next() else {
            bail!("agent exited before listening")
        };
        let v: serde_json::Value = serde_json::from_str(&line?).unwrap_or_default();
        if let Some(a) = v.get("listen").and_then(|a| a.as_str()) {
            break a.to_owned();
        }
    };
    // Keep draining stderr so the agent never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Ok(AgentProc { child, addr, state })
}

/// The file system type of `dir` as `stat -f` names it (`ext2/ext3` for ext4, `tmpfs`).
pub(crate) fn fs_type(dir: &Path) -> String {
    Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(dir)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

/// The session token every agent section uses.
pub(crate) fn bench_token() -> anyhow::Result<cli_mcp_api::token::Token> {
    let sid = SessionId::parse("bench").context("session id")?;
    Ok(HmacKey::from_bytes([1; 32])
        .session_token(&sid, &cli_mcp_api::token::SandboxNonce::from_bytes([2; 16])))
}
