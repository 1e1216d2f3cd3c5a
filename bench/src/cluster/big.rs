//! One command printing 10 MB on a live session: how long its result takes to come back, and
//! what the result says of the output (cut to the output budget, and where the whole of it
//! went: a spill file the result names as an MCP resource).

use std::time::{Duration, Instant};

use cli_mcp_e2e::journey::{Env, Mcp};
use serde_json::Value;

use super::instance::no_sessions;

/// 10,000,000 bytes of stdout, one line of base64 (text, so no stream is re-encoded).
const COMMAND: &str = "head -c 10000000 /dev/urandom | base64 -w0 | head -c 10000000";
/// Timed calls of [`COMMAND`] (after the session's start, untimed).
const CALLS: usize = 3;
const SESSION: &str = "big";

/// The 10 MB calls: each one's time to its result, the command's own time as the agent
/// measured it, and what the last result said.
pub(super) struct BigOutput {
    pub(super) samples: Vec<Duration>,
    pub(super) command_ms: Vec<Duration>,
    pub(super) result: String,
    pub(super) errors: Vec<String>,
}

/// [`CALLS`] calls of [`COMMAND`] on a new session; then no session is left.
pub(super) async fn ten_megabytes(env: &Env, svc: &Mcp) -> anyhow::Result<BigOutput> {
    let mut out = BigOutput {
        samples: Vec::new(),
        command_ms: Vec::new(),
        result: "–".into(),
        errors: Vec::new(),
    };
    if let Err(e) = svc.bash_ok(SESSION, "true").await {
        out.errors.push(format!("starting the session: {e}"));
    }
    for _ in 0..CALLS {
        let t = Instant::now();
        match svc.bash_ok(SESSION, COMMAND).await {
            Ok(r) => {
                out.samples.push(t.elapsed());
                let s = &r["structuredContent"];
                out.command_ms.push(Duration::from_millis(
                    s["duration_ms"].as_u64().unwrap_or(0),
                ));
                out.result = summary(&r);
            }
            Err(e) => out.errors.push(e.to_string()),
        }
    }
    let _ = svc.try_delete(SESSION).await;
    no_sessions(env).await?;
    Ok(out)
}

/// What a result says of its output, in a table cell: cut or whole, the bytes written and
/// returned, and the resource holding the whole stream.
fn summary(r: &Value) -> String {
    let s = &r["structuredContent"];
    let returned = s["stdout"].as_str().map_or(0, str::len);
    let spill = r["content"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "resource_link")
        .and_then(|c| c["uri"].as_str())
        .map_or("no spill named".to_owned(), |u| format!("spilled to `{u}`"));
    format!(
        "{}; {} bytes written, {} bytes of stdout returned; {spill}; result {} KiB of JSON",
        if s["truncated"] == true {
            "truncated"
        } else {
            "whole"
        },
        s["total_bytes"].as_u64().unwrap_or(0),
        returned,
        r.to_string().len() / 1024,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_summary_names_the_cut_and_the_spill() {
        let r = json!({
            "content": [
                {"type": "text", "text": "…"},
                {"type": "resource_link", "uri": "sandbox://big/spill/3-ab.stdout", "name": "x"}
            ],
            "structuredContent": {"truncated": true, "total_bytes": 10_000_000, "stdout": "abcd"},
            "isError": false
        });
        let s = summary(&r);
        assert!(
            s.starts_with("truncated; 10000000 bytes written, 4 bytes"),
            "{s}"
        );
        assert!(
            s.contains("spilled to `sandbox://big/spill/3-ab.stdout`"),
            "{s}"
        );
        let whole = summary(&json!({"structuredContent": {"truncated": false}}));
        assert!(whole.starts_with("whole;"), "{whole}");
        assert!(whole.contains("no spill named"), "{whole}");
    }
}
