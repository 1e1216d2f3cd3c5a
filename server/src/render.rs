//! Turning an agent's answer into the `bash` tool result: text for the model (stdout, then
//! stderr, then a one-line summary) and `structuredContent` with the exact fields.
//!
//! The server re-applies the output budget (`--output-budget`) whatever the agent did, so
//! the size of a result is bounded by this server's flag.

use base64::Engine as _;
use schemars::JsonSchema;
use serde::Serialize;

use cli_mcp_api::wire::{Encoding, ExecResponse};

use crate::metrics::Launch;
use crate::sessions::ExecOutcome;

/// `structuredContent` of a `bash` result: the agent's `ExecResponse` fields plus what
/// happened to the session.
#[derive(Debug, Clone, Serialize, JsonSchema, PartialEq, Eq)]
#[schemars(transform = crate::schema::standard_formats_only)]
pub struct BashOutput {
    /// The session (X-Session-ID) the command ran in.
    pub session_id: String,
    /// Standard output (UTF-8 text, or base64 when `stdout_encoding` is `base64`).
    pub stdout: String,
    /// Standard error (UTF-8 text, or base64 when `stderr_encoding` is `base64`).
    pub stderr: String,
    /// `base64` when stdout was not valid UTF-8 (then `stdout` holds its exact bytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout_encoding: Option<String>,
    /// `base64` when stderr was not valid UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr_encoding: Option<String>,
    /// Exit status of the command (124 after a timeout).
    pub exit_code: i32,
    pub duration_ms: u64,
    pub timed_out: bool,
    /// True when stdout or stderr was cut to the output budget (head and tail kept).
    pub truncated: bool,
    /// Bytes written to stdout and stderr together, before truncation.
    pub total_bytes: u64,
    /// Working directory of the shell after the command.
    pub cwd: String,
    /// The shell was replaced during or before this command.
    pub shell_restarted: bool,
    /// The session's shell state (cwd, variables, functions) was lost before this command.
    pub state_reset: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_reset_reason: Option<String>,
    /// Set on the call that started the session's sandbox: `warm`, `cold` or `local`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_sandbox: Option<String>,
}

/// The rendered result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    pub structured: BashOutput,
    pub is_error: bool,
}

/// One stream after decoding and the server's budget.
struct Stream {
    /// Exact bytes (after the budget).
    bytes: Vec<u8>,
    /// Lossy text for the model.
    text: String,
    lossy: bool,
    cut: bool,
}

fn stream(text: &str, enc: Encoding, budget: usize) -> Stream {
    let raw = match enc {
        Encoding::Utf8 => text.as_bytes().to_vec(),
        Encoding::Base64 => base64::engine::general_purpose::STANDARD
            .decode(text)
            .unwrap_or_else(|_| text.as_bytes().to_vec()),
    };
    // The agent already kept `budget` bytes as head + tail around its own marker, which names
    // the spill file; leave room for that marker so the path reaches the caller.
    let (bytes, cut) = cap(raw, budget + AGENT_MARKER_ROOM);
    let (text, lossy) = match String::from_utf8(bytes.clone()) {
        Ok(s) => (s, false),
        Err(e) => (String::from_utf8_lossy(e.as_bytes()).into_owned(), true),
    };
    Stream {
        bytes,
        text,
        lossy,
        cut,
    }
}

/// Room above the budget for the agent's `[… N bytes truncated; full output in <path> …]`.
pub const AGENT_MARKER_ROOM: usize = 1024;

/// Keeps head and tail of `bytes` within `budget` (plus a marker), cutting on UTF-8
/// character boundaries when the bytes are text.
pub fn cap(bytes: Vec<u8>, budget: usize) -> (Vec<u8>, bool) {
    if bytes.len() <= budget {
        return (bytes, false);
    }
    let head_len = floor_boundary(&bytes, budget / 2);
    let tail_start = ceil_boundary(&bytes, bytes.len() - (budget - budget / 2));
    let dropped = tail_start - head_len;
    let marker =
        format!("\n[… {dropped} bytes truncated by the MCP server (output budget {budget}) …]\n");
    let mut out = Vec::with_capacity(budget + marker.len());
    out.extend_from_slice(&bytes[..head_len]);
    out.extend_from_slice(marker.as_bytes());
    out.extend_from_slice(&bytes[tail_start..]);
    (out, true)
}

fn is_continuation(b: u8) -> bool {
    b & 0b1100_0000 == 0b1000_0000
}

fn floor_boundary(b: &[u8], mut i: usize) -> usize {
    // At most 3 steps back: a UTF-8 character is at most 4 bytes.
    for _ in 0..3 {
        if i == 0 || i >= b.len() || !is_continuation(b[i]) {
            break;
        }
        i -= 1;
    }
    i
}

fn ceil_boundary(b: &[u8], mut i: usize) -> usize {
    for _ in 0..3 {
        if i >= b.len() || !is_continuation(b[i]) {
            break;
        }
        i += 1;
    }
    i
}

fn encode(s: &Stream) -> (String, Option<String>) {
    if s.lossy {
        (
            base64::engine::general_purpose::STANDARD.encode(&s.bytes),
            Some("base64".into()),
        )
    } else {
        (s.text.clone(), None)
    }
}

/// Renders `outcome` of session `sid` with the server's per-stream `budget`.
pub fn render(sid: &str, outcome: &ExecOutcome, budget: usize) -> Rendered {
    let r: &ExecResponse = &outcome.response;
    let out = stream(&r.stdout, r.stdout_encoding, budget);
    let err = stream(&r.stderr, r.stderr_encoding, budget);
    let truncated = r.truncated || out.cut || err.cut;

    let mut text = String::with_capacity(out.text.len() + err.text.len() + 256);
    text.push_str(&out.text);
    if !out.text.is_empty() && !out.text.ends_with('\n') {
        text.push('\n');
    }
    if !err.text.is_empty() {
        text.push_str("[stderr]\n");
        text.push_str(&err.text);
        if !err.text.ends_with('\n') {
            text.push('\n');
        }
    }
    let mut notes = vec![
        format!("exit {}", r.exit_code),
        format!("{} ms", r.duration_ms),
        format!("cwd {}", r.cwd),
    ];
    if r.timed_out {
        notes.push(format!(
            "timed out after {} ms; the command was killed, the shell kept its state",
            r.duration_ms
        ));
    }
    if truncated {
        notes.push(format!(
            "output truncated: {} bytes in total, head and tail kept (the marker names the file with the full output)",
            r.total_bytes
        ));
    }
    if let Some(why) = &outcome.reset {
        notes.push(format!("session state was reset: {why}"));
    } else if let Some(launch) = outcome.started {
        notes.push(format!(
            "new session: started a fresh sandbox ({})",
            launch.as_str()
        ));
    }
    for (name, s) in [("stdout", &out), ("stderr", &err)] {
        if s.lossy {
            notes.push(format!(
                "{name} is not valid UTF-8: shown lossily; its exact bytes are base64 in structuredContent.{name}"
            ));
        }
    }
    text.push('[');
    text.push_str(&notes.join(" | "));
    text.push(']');

    let (stdout, stdout_encoding) = encode(&out);
    let (stderr, stderr_encoding) = encode(&err);
    Rendered {
        is_error: r.exit_code != 0 || r.timed_out,
        structured: BashOutput {
            session_id: sid.to_owned(),
            stdout,
            stderr,
            stdout_encoding,
            stderr_encoding,
            exit_code: r.exit_code,
            duration_ms: r.duration_ms,
            timed_out: r.timed_out,
            truncated,
            total_bytes: r.total_bytes,
            cwd: r.cwd.clone(),
            shell_restarted: r.shell_restarted,
            state_reset: outcome.reset.is_some(),
            state_reset_reason: outcome.reset.clone(),
            new_sandbox: outcome.started.map(|l: Launch| l.as_str().to_owned()),
        },
        text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(stdout: &str, stderr: &str, exit: i32) -> ExecOutcome {
        ExecOutcome {
            response: ExecResponse {
                stdout: stdout.into(),
                stderr: stderr.into(),
                stdout_encoding: Encoding::Utf8,
                stderr_encoding: Encoding::Utf8,
                exit_code: exit,
                duration_ms: 7,
                timed_out: false,
                truncated: false,
                total_bytes: (stdout.len() + stderr.len()) as u64,
                cwd: "/w".into(),
                shell_restarted: false,
            },
            started: None,
            reset: None,
            sandbox: "p".into(),
        }
    }

    #[test]
    fn stdout_then_stderr_then_summary() {
        let r = render("s1", &outcome("out", "err\n", 0), 1024);
        assert_eq!(r.text, "out\n[stderr]\nerr\n[exit 0 | 7 ms | cwd /w]");
        assert!(!r.is_error);
        assert_eq!(r.structured.stdout, "out");
        assert_eq!(r.structured.session_id, "s1");
        let r = render("s1", &outcome("", "", 3), 1024);
        assert_eq!(r.text, "[exit 3 | 7 ms | cwd /w]");
        assert!(r.is_error);
    }

    #[test]
    fn timeout_reset_and_new_sandbox_are_stated() {
        let mut o = outcome("partial", "", 124);
        o.response.timed_out = true;
        o.reset = Some("the sandbox was replaced".into());
        let r = render("s", &o, 1024);
        assert!(r.is_error);
        assert!(r.text.contains("timed out"), "{}", r.text);
        assert!(
            r.text
                .contains("session state was reset: the sandbox was replaced"),
            "{}",
            r.text
        );
        assert!(r.structured.state_reset);
        let mut o = outcome("", "", 0);
        o.started = Some(Launch::Warm);
        let r = render("s", &o, 1024);
        assert!(
            r.text
                .contains("new session: started a fresh sandbox (warm)"),
            "{}",
            r.text
        );
        assert_eq!(r.structured.new_sandbox.as_deref(), Some("warm"));
    }

    #[test]
    fn invalid_utf8_is_lossy_in_text_and_exact_in_structure() {
        let raw = vec![b'a', 0xff, b'b'];
        let mut o = outcome("", "", 0);
        o.response.stdout = base64::engine::general_purpose::STANDARD.encode(&raw);
        o.response.stdout_encoding = Encoding::Base64;
        let r = render("s", &o, 1024);
        assert!(r.text.starts_with("a\u{fffd}b\n"), "{}", r.text);
        assert!(r.text.contains("stdout is not valid UTF-8"), "{}", r.text);
        assert_eq!(r.structured.stdout_encoding.as_deref(), Some("base64"));
        let back = base64::engine::general_purpose::STANDARD
            .decode(&r.structured.stdout)
            .expect("base64");
        assert_eq!(back, raw);
    }

    #[test]
    fn the_agents_truncation_marker_survives_the_server_budget() {
        let budget = 1024;
        let mut agent_out = vec![b'a'; budget / 2];
        agent_out.extend_from_slice(
            "\n[… 99998976 bytes truncated; full output in /tmp/cli-mcp-agent/spill/7.stdout …]\n"
                .as_bytes(),
        );
        agent_out.extend(vec![b'z'; budget / 2]);
        let s = stream(
            &String::from_utf8(agent_out).expect("utf8"),
            Encoding::Utf8,
            budget,
        );
        assert!(!s.cut, "the server must not cut the agent's marker");
        assert!(s
            .text
            .contains("full output in /tmp/cli-mcp-agent/spill/7.stdout"));
        // Far larger input (an agent with a bigger budget) is still capped.
        let big = stream(&"x".repeat(10 * budget), Encoding::Utf8, budget);
        assert!(big.cut && big.text.len() < 2 * budget + AGENT_MARKER_ROOM);
    }

    #[test]
    fn the_server_budget_applies_on_char_boundaries() {
        let big = "é".repeat(3000); // 6000 bytes
        let r = render("s", &outcome(&big, "", 0), 1001);
        assert!(r.structured.truncated);
        assert!(
            r.text.contains("bytes truncated by the MCP server"),
            "marker"
        );
        assert!(r.structured.stdout.len() < 1200 + AGENT_MARKER_ROOM);
        assert!(r.text.contains("output truncated"), "summary");
        // Still valid UTF-8 (no base64 fallback).
        assert_eq!(r.structured.stdout_encoding, None);
    }

    #[test]
    fn cap_keeps_short_input() {
        assert_eq!(cap(b"abc".to_vec(), 3), (b"abc".to_vec(), false));
        let (out, cut) = cap(b"0123456789".to_vec(), 4);
        assert!(cut);
        let s = String::from_utf8(out).expect("utf8");
        assert!(
            s.starts_with("01\n[… 6 bytes truncated") && s.ends_with("89"),
            "{s}"
        );
    }
}
