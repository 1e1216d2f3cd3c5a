//! A peer agent measured beside ours in the same interleaved rounds: any binary speaking the
//! Go original's agent wire (`--peer BINARY`), such as that agent itself. Its wire, as the
//! original defines it: the session token in `SANDBOX_AUTH_TOKEN` (assigned at start), plain
//! HTTP on `:8090`, `GET /health` → 200 once bash runs, `POST /exec` with `{"command": …}`
//! and `Authorization: Bearer <token>` → 200 `{"stdout", "stderr", "exit_code",
//! "duration_ms"}`.
//!
//! The original listens on `:8090` whatever it is told; `--peer-addr` says where to reach
//! it, and `CLI_MCP_BENCH_PEER_PORT` carries that port for a peer that can take one.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::json;

/// How long a peer may take to answer its first `GET /health`.
const STARTUP: Duration = Duration::from_secs(10);
/// The token the peer is started with (any non-empty string: the original compares it as is).
const TOKEN: &str = "cli-mcp-bench-peer-token";

/// A running peer, killed when dropped.
pub(crate) struct Peer {
    child: Child,
    /// `host:port` it answers on.
    pub(crate) addr: String,
    /// The binary's file name, for the table.
    pub(crate) name: String,
    _workdir: tempfile::TempDir,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Peer {
    /// Starts `bin` in a scratch directory and waits until `GET /health` on `addr` answers
    /// 200. Fails at once if the peer exits, and after [`STARTUP`] if it never answers.
    pub(crate) async fn start(
        bin: &Path,
        addr: &str,
        http: &reqwest::Client,
    ) -> anyhow::Result<Peer> {
        let port = addr.rsplit_once(':').map_or("8090", |(_, p)| p);
        let workdir = tempfile::Builder::new()
            .prefix("cli-mcp-bench-peer-")
            .tempdir()?;
        let child = Command::new(bin)
            .current_dir(workdir.path())
            .env("SANDBOX_AUTH_TOKEN", TOKEN)
            .env("CLI_MCP_BENCH_PEER_PORT", port)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting the peer {}", bin.display()))?;
        let name = bin
            .file_name()
            .map_or("peer".into(), |n| n.to_string_lossy().into_owned());
        let mut peer = Peer {
            child,
            addr: addr.to_owned(),
            name,
            _workdir: workdir,
        };
        let url = format!("http://{addr}/health");
        let deadline = Instant::now() + STARTUP;
        loop {
            if let Some(status) = peer.child.try_wait()? {
                bail!(
                    "the peer {} exited before answering ({status})",
                    bin.display()
                );
            }
            if let Ok(r) = http.get(&url).send().await {
                if r.status().is_success() {
                    return Ok(peer);
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "the peer {} did not answer GET {url} within {STARTUP:?}; is --peer-addr where it listens?",
                    bin.display()
                );
            }
            // A process starting up: polled, not awaited (it announces nothing).
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `POST /exec` of `command`; its exit code.
    pub(crate) async fn exec(&self, http: &reqwest::Client, command: &str) -> anyhow::Result<i64> {
        let r = http
            .post(format!("http://{}/exec", self.addr))
            .bearer_auth(TOKEN)
            .json(&json!({ "command": command }))
            .send()
            .await?;
        let status = r.status();
        let body: serde_json::Value = r.json().await.context("the peer's answer is not JSON")?;
        if !status.is_success() {
            bail!("the peer answered {status}: {body}");
        }
        body["exit_code"]
            .as_i64()
            .with_context(|| format!("the peer's answer has no exit_code: {body}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in speaking the original's wire (a Python script), to prove the harness; it
    /// is not the original and the bench never reports it as one.
    #[tokio::test]
    async fn a_peer_speaking_the_original_wire_runs_commands() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/go_wire_peer.py");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("client");
        let peer = Peer::start(&script, &format!("127.0.0.1:{port}"), &http)
            .await
            .expect("the stand-in starts");
        assert_eq!(peer.exec(&http, "true").await.expect("true"), 0);
        assert_eq!(peer.exec(&http, "exit 3").await.expect("exit 3"), 3);
        // A wrong token is refused, as the original refuses it.
        let r = http
            .post(format!("http://{}/exec", peer.addr))
            .bearer_auth("wrong")
            .json(&json!({"command": "true"}))
            .send()
            .await
            .expect("answer");
        assert_eq!(r.status().as_u16(), 401);
    }

    #[tokio::test]
    async fn a_peer_that_never_listens_is_a_clear_error() {
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("client");
        let e = Peer::start(Path::new("/bin/true"), "127.0.0.1:9", &http)
            .await
            .err()
            .expect("refused");
        assert!(e.to_string().contains("exited before answering"), "{e}");
    }
}
