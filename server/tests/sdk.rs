//! The official MCP SDKs against the real server (local backend, loopback): the Python SDK
//! (`mcp` from PyPI) and the TypeScript SDK (`@modelcontextprotocol/sdk`, and its successor
//! package `@modelcontextprotocol/client`, which adds protocol 2026-07-28), each as a client
//! script committed under `server/tests/sdk/`: the handshake, the `bash` tool, cancel,
//! progress and resources, each the SDK's own way.
//!
//! The scripts print what the SDK saw as JSON; the checks are here. The SDKs are installed
//! once per lock file into `$CLI_MCP_CACHE/mcp-sdk/` (default `/var/cache/cli-mcp`), outside
//! the repository, so a clean checkout installs them once and later runs reuse them.

mod sdk_clients;
mod support;

use serde_json::Value;
use tokio::process::Command;

use cli_mcp_e2e::child::LocalServer;
use sdk_clients::{node_modules, python_interpreter, run_client, sdk_dir, Report};
use support::Server;

/// Text an admin gives with `--instructions` (the operator renders it from
/// `spec.server.instructions`); the SDKs must receive it as sent.
const ADMIN_INSTRUCTIONS: &str =
    "This sandbox has kubectl (context `prod-readonly`, read only) and jq.\nInvestigate; never apply.";

async fn local_server() -> Server {
    support::ensure_built(false);
    let agent = support::agent_bin();
    let agent = agent.to_str().expect("utf-8 path");
    let mut args = LocalServer::local_backend(agent);
    args.extend_from_slice(&["--instructions", ADMIN_INSTRUCTIONS]);
    Server::start(&args, &[]).await
}

async fn python_client(server: &Server, session: &str, mode: &str) -> Report {
    let mut cmd = Command::new(python_interpreter().await);
    cmd.arg(sdk_dir().join("python/client.py")).args([
        "--url",
        &server.url("/mcp"),
        "--session",
        session,
        "--mode",
        mode,
    ]);
    run_client(
        &format!("the Python SDK client (mode {mode})"),
        cmd,
        Some(server),
    )
    .await
}

/// The command line of a stdio server for session `sid`.
fn stdio_server(sid: &str) -> String {
    support::ensure_built(false);
    let agent = support::agent_bin();
    let line = [
        support::SERVER_BIN,
        "--transport",
        "stdio",
        "--session-id",
        sid,
        "--backend",
        "local",
        "--auth",
        "none",
        "--agent-binary",
        agent.to_str().expect("utf-8 path"),
        "--instructions",
        ADMIN_INSTRUCTIONS,
    ];
    serde_json::to_string(&line).expect("JSON")
}

async fn typescript_client(server: &Server, sdk: &str, session: &str, mode: &str) -> Report {
    let mut cmd = Command::new("node");
    cmd.env("NODE_PATH", node_modules().await)
        .arg(sdk_dir().join("typescript/client.cjs"))
        .args(["--sdk", sdk, "--url", &server.url("/mcp")])
        .args(["--session", session, "--mode", mode]);
    run_client(
        &format!("the TypeScript SDK client ({sdk}, mode {mode})"),
        cmd,
        Some(server),
    )
    .await
}

fn first_text(result: &Value) -> &str {
    result["text"][0].as_str().unwrap_or_default()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Http,
    Stdio,
}

/// The checks every SDK, protocol mode and transport must pass.
fn check(report: &Report, protocol: &str, transport: Transport) {
    let r = &report.json;
    assert_eq!(r["protocol_version"], protocol, "{r}");
    assert_eq!(r["server_name"], "cli-mcp-server", "{r}");
    assert_eq!(
        r["instructions"],
        cli_mcp_server::mcp::instructions(transport == Transport::Stdio, Some(ADMIN_INSTRUCTIONS)),
        "the server's instructions, then the admin's as written"
    );
    if transport == Transport::Stdio {
        for http_only in ["X-Session-ID", "DELETE", "/sessions"] {
            assert!(
                !r["instructions"]
                    .as_str()
                    .unwrap_or_default()
                    .contains(http_only),
                "a stdio client cannot use {http_only}: {}",
                r["instructions"]
            );
        }
    }
    let instructions = r["instructions"].as_str().unwrap_or_default();
    assert!(
        instructions.contains("`exit` ends the shell") && instructions.contains("(exit N)"),
        "{instructions}"
    );

    let tools = r["tools"].as_array().expect("tools");
    assert_eq!(tools.len(), 1, "{r}");
    assert_eq!(tools[0]["name"], "bash");
    assert_eq!(
        tools[0]["inputSchema"]["required"],
        serde_json::json!(["command"])
    );
    assert_eq!(tools[0]["outputSchema"]["type"], "object");
    let description = tools[0]["description"].as_str().unwrap_or_default();
    assert!(
        description.contains("per chat") && description.contains("`session`"),
        "the tool tells the model how sessions work: {description}"
    );
    assert_eq!(
        tools[0]["inputSchema"]["properties"]["session"]["type"],
        "string"
    );

    let echo = &r["echo"];
    assert_eq!(echo["is_error"], false, "{echo}");
    assert_eq!(echo["structured"]["stdout"], "hi\n", "{echo}");
    assert_eq!(echo["structured"]["exit_code"], 0, "{echo}");
    assert!(first_text(echo).starts_with("hi\n[exit 0 | "), "{echo}");

    assert_eq!(r["set_state"]["is_error"], false, "{}", r["set_state"]);
    assert_eq!(
        r["read_state"]["structured"]["stdout"], "/tmp kept\n",
        "cd and export persist between calls: {}",
        r["read_state"]
    );

    let failed = &r["exit_3"];
    assert_eq!(failed["is_error"], true, "{failed}");
    assert_eq!(failed["structured"]["exit_code"], 3, "{failed}");

    let unknown = &r["unknown_tool"]["mcp_error"];
    assert_eq!(unknown["code"], -32602, "an MCP (JSON-RPC) error: {r}");
    assert!(
        unknown["message"]
            .as_str()
            .is_some_and(|m| m.contains("unknown tool \"no-such-tool\"")),
        "{unknown}"
    );

    let bad = &r["bad_arguments"];
    assert_eq!(bad["is_error"], true, "{bad}");
    assert!(
        first_text(bad).contains("argument `command` must be a string"),
        "{bad}"
    );

    if transport == Transport::Http {
        check_chats(r, protocol);
    }

    assert!(
        !report.stderr.contains("unknown format"),
        "the SDK's JSON Schema validator warned about a non-standard format:\n{}",
        report.stderr
    );
}

/// Two chats from one configuration without X-Session-ID get two shells, and each chat keeps
/// its shell: through the MCP session id issued at initialize (handshake era), or through
/// the handle the first result names and the client passes back as `session` (2026-07-28,
/// where the model does that).
fn check_chats(r: &Value, protocol: &str) {
    let chats = r["chats"].as_array().expect("chats");
    assert_eq!(chats.len(), 2, "{r}");
    let mut sessions = Vec::new();
    for (chat, name) in chats.iter().zip(["a", "b"]) {
        let (first, second) = (&chat["first"], &chat["second"]);
        assert_eq!(
            first["structured"]["stdout"], "fresh\n",
            "a new shell: {chat}"
        );
        assert_eq!(
            second["structured"]["stdout"],
            format!("{name}\n"),
            "the same shell on the next call: {chat}"
        );
        let sid = first["structured"]["session_id"]
            .as_str()
            .unwrap_or_default();
        assert_eq!(second["structured"]["session_id"], sid, "{chat}");
        if protocol == "2026-07-28" {
            assert_eq!(
                chat["handle"], sid,
                "no MCP session: the result names the handle"
            );
        } else {
            assert_eq!(
                chat["handle"],
                Value::Null,
                "the MCP session carries it: {chat}"
            );
            if !chat["mcp_session_id"].is_null() {
                assert_eq!(chat["mcp_session_id"], sid, "{chat}");
            }
        }
        sessions.push(sid.to_owned());
    }
    assert_ne!(sessions[0], sessions[1], "two chats, two shells");
}

#[tokio::test]
async fn python_sdk_legacy_handshake() {
    let server = local_server().await;
    let report = python_client(&server, "py-legacy", "legacy").await;
    check(&report, "2025-11-25", Transport::Http);
}

#[tokio::test]
async fn python_sdk_negotiates_2026_07_28() {
    let server = local_server().await;
    let report = python_client(&server, "py-modern", "auto").await;
    check(&report, "2026-07-28", Transport::Http);
}

#[tokio::test]
async fn typescript_sdk_legacy_handshake() {
    let server = local_server().await;
    let report = typescript_client(&server, "v1", "ts-v1", "legacy").await;
    check(&report, "2025-11-25", Transport::Http);
    assert_eq!(
        report.json["mcp_session_id"],
        Value::Null,
        "with X-Session-ID the caller names the session: no Mcp-Session-Id is handed out"
    );
}

#[tokio::test]
async fn typescript_client_package_negotiates_2026_07_28() {
    let server = local_server().await;
    let report = typescript_client(&server, "v2", "ts-v2", "auto").await;
    check(&report, "2026-07-28", Transport::Http);
}

#[tokio::test]
async fn python_sdk_over_stdio() {
    let mut cmd = Command::new(python_interpreter().await);
    cmd.arg(sdk_dir().join("python/client.py")).args([
        "--stdio",
        &stdio_server("py-stdio"),
        "--mode",
        "legacy",
    ]);
    let report = run_client("the Python SDK client (stdio)", cmd, None).await;
    check(&report, "2025-11-25", Transport::Stdio);
    assert_eq!(report.json["echo"]["structured"]["session_id"], "py-stdio");
}

#[tokio::test]
async fn typescript_sdk_over_stdio() {
    let mut cmd = Command::new("node");
    cmd.env("NODE_PATH", node_modules().await)
        .arg(sdk_dir().join("typescript/client.cjs"))
        // v2: v1's stdio transport does not expose the negotiated protocol version.
        .args(["--sdk", "v2", "--stdio", &stdio_server("ts-stdio")]);
    let report = run_client("the TypeScript SDK client (stdio)", cmd, None).await;
    check(&report, "2025-11-25", Transport::Stdio);
    assert_eq!(report.json["echo"]["structured"]["session_id"], "ts-stdio");
}

/// Longest time from a client's cancel until its next call on the same session has its
/// answer: the cancelled command must be interrupted (Ctrl-C), not waited for. Before, the
/// next call waited the 30 s of the cancelled `sleep 30`.
const NEXT_CALL_AFTER_CANCEL: f64 = 2.0;

/// How a client cancelled: by `notifications/cancelled` (handshake era, where abandoning the
/// request is not a cancel), or by closing the request (2026-07-28, which has no
/// client-to-server notifications over HTTP).
#[derive(Debug, Clone, Copy)]
enum Cancel {
    Notification,
    Disconnect,
}

/// What every SDK's cancel must show: the call stopped, the command is gone without having
/// finished, and the next call ran at once in the same shell, whose state is kept.
async fn check_cancel(what: &str, report: &Report, marker: &std::path::Path, protocol: &str) {
    let r = &report.json;
    assert_eq!(r["protocol_version"], protocol, "{what}: {r}");
    assert_eq!(r["set_state"]["is_error"], false, "{what}: {r}");
    let pid = r["pid"]
        .as_i64()
        .and_then(|p| i32::try_from(p).ok())
        .unwrap_or_else(|| panic!("{what}: no pid in {r}"));
    let next = &r["next"];
    let after = r["next_answered_after"].as_f64().unwrap_or(f64::MAX);
    eprintln!(
        "{what}: the next call answered {after:.3} s after the cancel (the cancel returned \
         after {:.3} s)",
        r["cancel_returned_after"].as_f64().unwrap_or(f64::NAN)
    );
    assert_eq!(
        next["structured"]["stdout"], "ok /tmp kept\n",
        "{what}: the next call runs in the same shell, with its directory and variables: {r}"
    );
    assert!(
        after < NEXT_CALL_AFTER_CANCEL,
        "{what}: the next call answered {after:.3} s after the cancel; the limit is \
         {NEXT_CALL_AFTER_CANCEL} s: {r}"
    );
    // The agent interrupts before it takes the next command, so the command is gone now.
    if let Err(e) = support::gone_within(pid, std::time::Duration::from_secs(1)).await {
        panic!("{what}: the cancelled command was left running: {e}");
    }
    assert!(
        !marker.exists(),
        "{what}: the cancelled command ran to its end ({} exists)",
        marker.display()
    );
}

async fn python_cancel(server: &Server, session: Option<&str>, mode: &str, how: Cancel) {
    let (dir, fifo) = support::fifo();
    let marker = dir.path().join("finished");
    let mut cmd = Command::new(python_interpreter().await);
    cmd.arg(sdk_dir().join("python/client.py"))
        .args(["--url", &server.url("/mcp"), "--mode", mode, "--cancel"])
        .arg(&fifo)
        .arg(&marker);
    if let Some(session) = session {
        cmd.args(["--session", session]);
    }
    let what = format!("the Python SDK ({mode}, {how:?}, X-Session-ID {session:?})");
    let report = run_client(&what, cmd, Some(server)).await;
    let protocol = if mode == "legacy" {
        "2025-11-25"
    } else {
        "2026-07-28"
    };
    check_cancel(&what, &report, &marker, protocol).await;
    assert_eq!(
        report.json["scope_cancelled"], true,
        "{what}: the call was still running when it was cancelled: {}",
        report.json
    );
}

async fn typescript_cancel(server: &Server, sdk: &str, session: &str, mode: &str, how: Cancel) {
    let (dir, fifo) = support::fifo();
    let marker = dir.path().join("finished");
    let mut cmd = Command::new("node");
    cmd.env("NODE_PATH", node_modules().await)
        .arg(sdk_dir().join("typescript/client.cjs"))
        .args(["--sdk", sdk, "--url", &server.url("/mcp")])
        .args(["--session", session, "--mode", mode, "--cancel"])
        .arg(&fifo)
        .arg("--marker")
        .arg(&marker);
    let what = format!("the TypeScript SDK ({sdk}, {mode}, {how:?})");
    let report = run_client(&what, cmd, Some(server)).await;
    let protocol = if mode == "legacy" {
        "2025-11-25"
    } else {
        "2026-07-28"
    };
    check_cancel(&what, &report, &marker, protocol).await;
    assert!(
        report.json["long_call"]["rejected"].is_string(),
        "{what}: the aborted call rejects: {}",
        report.json
    );
}

#[tokio::test]
async fn python_sdk_cancel_interrupts_the_command_and_frees_the_session() {
    let server = local_server().await;
    python_cancel(&server, Some("py-cancel"), "legacy", Cancel::Notification).await;
}

/// Without X-Session-ID the chat's shell is named by Mcp-Session-Id, which also scopes the
/// cancel notification.
#[tokio::test]
async fn python_sdk_cancel_in_a_chat_without_x_session_id() {
    let server = local_server().await;
    python_cancel(&server, None, "legacy", Cancel::Notification).await;
}

#[tokio::test]
async fn python_sdk_cancel_at_2026_07_28_closes_the_request() {
    let server = local_server().await;
    python_cancel(&server, Some("py-cancel-26"), "auto", Cancel::Disconnect).await;
}

#[tokio::test]
async fn typescript_sdk_abort_signal_interrupts_the_command() {
    let server = local_server().await;
    typescript_cancel(&server, "v1", "ts-cancel", "legacy", Cancel::Notification).await;
}

#[tokio::test]
async fn typescript_client_package_abort_at_2026_07_28_closes_the_request() {
    let server = local_server().await;
    typescript_cancel(&server, "v2", "ts-cancel-26", "auto", Cancel::Disconnect).await;
}

/// Over stdio rmcp itself cancels the call's token on `notifications/cancelled`.
#[tokio::test]
async fn python_sdk_cancel_over_stdio() {
    let (dir, fifo) = support::fifo();
    let marker = dir.path().join("finished");
    let mut cmd = Command::new(python_interpreter().await);
    cmd.arg(sdk_dir().join("python/client.py"))
        .args([
            "--stdio",
            &stdio_server("py-stdio-cancel"),
            "--mode",
            "legacy",
        ])
        .arg("--cancel")
        .arg(&fifo)
        .arg(&marker);
    let what = "the Python SDK over stdio";
    let report = run_client(what, cmd, None).await;
    check_cancel(what, &report, &marker, "2025-11-25").await;
    assert_eq!(report.json["scope_cancelled"], true, "{}", report.json);
}

/// What a progress callback must receive for `for i in 1 2 3; do echo line$i; sleep 1.2;
/// done` (3.6 s): at least two notifications, `progress` the bytes so far (each line is 6
/// bytes, so `line<k>` goes with progress 6k) increasing, the message the last line at that
/// count, and at most one a second.
fn check_progress(what: &str, report: &Report, protocol: &str) {
    let r = &report.json;
    assert_eq!(r["protocol_version"], protocol, "{what}: {r}");
    assert_eq!(
        r["with_token"]["structured"]["stdout"], "line1\nline2\nline3\n",
        "{what}: {r}"
    );
    let seen = r["notifications"].as_array().expect("notifications");
    eprintln!("{what}: {seen:?}");
    assert!(seen.len() >= 2, "{what}: {} notifications: {r}", seen.len());
    let mut last = 0.0;
    for n in seen {
        let progress = n["progress"].as_f64().unwrap_or_default();
        assert!(progress > last, "{what}: progress must increase: {seen:?}");
        last = progress;
        assert!(
            progress <= 18.0 && progress % 6.0 == 0.0,
            "{what}: {progress} bytes: {seen:?}"
        );
        assert_eq!(
            n["message"],
            format!("line{}", progress as u64 / 6),
            "{what}: the last line at that count: {seen:?}"
        );
        assert_eq!(n["total"], Value::Null, "{what}: no total is known");
    }
    // The first comes a second after the command started at the earliest, and each next
    // one a second after the one before.
    let took = r["with_token_took"].as_f64().unwrap_or_default();
    assert!(
        seen.len() as f64 <= took.floor(),
        "{what}: {} notifications in {took:.2} s: {seen:?}",
        seen.len()
    );
}

async fn python_progress(target: &[&str], mode: &str) -> Report {
    let mut cmd = Command::new(python_interpreter().await);
    cmd.arg(sdk_dir().join("python/client.py"))
        .args(target)
        .args(["--mode", mode, "--progress"]);
    run_client(&format!("the Python SDK ({mode}, progress)"), cmd, None).await
}

#[tokio::test]
async fn python_sdk_progress_callback_gets_bytes_and_the_last_line() {
    let server = local_server().await;
    let url = server.url("/mcp");
    let legacy = python_progress(&["--url", &url, "--session", "py-progress"], "legacy").await;
    check_progress("Python, handshake era", &legacy, "2025-11-25");
    let modern = python_progress(&["--url", &url, "--session", "py-progress-26"], "auto").await;
    check_progress("Python, 2026-07-28", &modern, "2026-07-28");
}

#[tokio::test]
async fn python_sdk_progress_over_stdio() {
    let stdio = stdio_server("py-stdio-progress");
    let report = python_progress(&["--stdio", &stdio], "legacy").await;
    check_progress("Python over stdio", &report, "2025-11-25");
}

async fn typescript_progress(server: &Server, sdk: &str, session: &str, mode: &str) -> Report {
    let mut cmd = Command::new("node");
    cmd.env("NODE_PATH", node_modules().await)
        .arg(sdk_dir().join("typescript/client.cjs"))
        .args(["--sdk", sdk, "--url", &server.url("/mcp")])
        .args(["--session", session, "--mode", mode, "--progress", "yes"]);
    run_client(
        &format!("the TypeScript SDK ({sdk}, {mode}, progress)"),
        cmd,
        Some(server),
    )
    .await
}

#[tokio::test]
async fn typescript_sdk_onprogress_gets_bytes_and_the_last_line() {
    let server = local_server().await;
    let v1 = typescript_progress(&server, "v1", "ts-progress", "legacy").await;
    check_progress("TypeScript v1, handshake era", &v1, "2025-11-25");
    let v2 = typescript_progress(&server, "v2", "ts-progress-26", "auto").await;
    check_progress("TypeScript v2, 2026-07-28", &v2, "2026-07-28");
}

/// What `seq 1 200000` prints: 1,288,895 bytes, over the 64 KiB a result keeps and over the
/// 1 MiB a read returns by default.
fn seq_output() -> Vec<u8> {
    let out = std::process::Command::new("seq")
        .args(["1", "200000"])
        .output()
        .expect("run seq");
    assert!(out.status.success(), "seq failed");
    out.stdout
}

/// The offset of the first byte where `a` and `b` differ (or where the shorter ends).
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

/// Checks the chunks a client read one resource in: contiguous, `_meta` consistent, each
/// of `kind`, the last without `next`, `size` bytes in all.
fn check_chunks(what: &str, chunks: &Value, kind: &str, size: u64) {
    let chunks = chunks
        .as_array()
        .unwrap_or_else(|| panic!("{what}: no chunks"));
    let mut offset = 0;
    for (i, c) in chunks.iter().enumerate() {
        let meta = &c["meta"];
        assert_eq!(c["kind"], kind, "{what}: chunk {i}: {c}");
        assert_eq!(meta["offset"], offset, "{what}: chunk {i}: {c}");
        assert_eq!(meta["size"], size, "{what}: chunk {i}: {c}");
        let length = meta["length"].as_u64().unwrap_or_default();
        assert!(length > 0, "{what}: chunk {i} is empty: {c}");
        offset += length;
        if i + 1 < chunks.len() {
            assert_eq!(meta["next"], offset, "{what}: chunk {i}: {c}");
        } else {
            assert_eq!(meta.get("next"), None, "{what}: the last chunk: {c}");
        }
    }
    assert_eq!(offset, size, "{what}: {chunks:?}");
}

/// What every SDK must see of the resources: both templates; a truncated `seq` whose result
/// links its spill, read back whole in chunks and equal byte for byte to what `seq` prints
/// (written by the client to `spill`); a 300,000-byte random workspace file read back as
/// base64 blobs with the sha256 the sandbox computed; paths out of the workspace refused.
fn check_resources(what: &str, report: &Report, spill: &std::path::Path, protocol: &str) {
    let r = &report.json;
    assert_eq!(r["protocol_version"], protocol, "{what}");
    assert_eq!(
        r["templates"],
        serde_json::json!([
            "sandbox://{session}/spill/{name}",
            "sandbox://{session}/workspace/{+path}"
        ]),
        "{what}"
    );

    let seq = &r["seq"];
    let sid = seq["structured"]["session_id"].as_str().unwrap_or_default();
    assert_eq!(
        seq["structured"]["truncated"],
        true,
        "{what}: {:?}",
        seq["text"][0].as_str().map(|t| t.len())
    );
    let links = r["seq_links"].as_array().expect("seq_links");
    assert_eq!(
        links.len(),
        1,
        "{what}: one resource_link: {links:?}; the texts after the output: {:?}",
        seq["text"].as_array().and_then(|t| t.get(1..))
    );
    let uri = links[0]["uri"].as_str().unwrap_or_default();
    assert!(
        uri.starts_with(&format!("sandbox://{sid}/spill/")) && uri.ends_with(".stdout"),
        "{what}: {uri}"
    );
    let texts = seq["text"].as_array().expect("text");
    assert!(
        texts.iter().any(|t| t
            .as_str()
            .is_some_and(|t| t.contains(uri) && t.contains("resources/read"))),
        "{what}: a text block tells the model where the whole output is: {:?}",
        texts.get(1..)
    );
    let expected = seq_output();
    check_chunks(
        &format!("{what}, the spill"),
        &r["spill_chunks"],
        "text",
        expected.len() as u64,
    );
    assert_eq!(
        r["spill_chunks"][0]["meta"]["length"],
        cli_mcp_server::cli::DEFAULT_RESOURCE_READ,
        "{what}: a read without length gets the server's cap"
    );
    let got = std::fs::read(spill).unwrap_or_else(|e| panic!("{what}: {}: {e}", spill.display()));
    if let Some(at) = first_difference(&got, &expected) {
        panic!(
            "{what}: the spill read back differs from what seq printed at byte {at} (read {} \
             bytes, seq printed {})",
            got.len(),
            expected.len()
        );
    }

    let binary = &r["binary"];
    assert_eq!(binary["is_error"], false, "{what}: {binary}");
    let stdout = binary["structured"]["stdout"].as_str().unwrap_or_default();
    let in_sandbox = stdout.split_whitespace().next().unwrap_or_default();
    assert_eq!(in_sandbox.len(), 64, "{what}: sha256sum printed {stdout:?}");
    assert_eq!(
        r["binary_size"], 300_000,
        "{what}: the bytes of rand.bin read back"
    );
    assert_eq!(
        r["binary_sha256"], in_sandbox,
        "{what}: the file read back has the sha256 the sandbox computed"
    );
    check_chunks(
        &format!("{what}, rand.bin"),
        &r["binary_chunks"],
        "blob",
        300_000,
    );
    for c in r["binary_chunks"].as_array().into_iter().flatten() {
        assert_eq!(c["mime_type"], "application/octet-stream", "{what}: {c}");
    }

    let escapes = r["escapes"].as_array().expect("escapes");
    assert_eq!(escapes.len(), 3, "{what}: {escapes:?}");
    for e in escapes {
        let error = &e["mcp_error"];
        let message = error["message"].as_str().unwrap_or_default();
        assert_eq!(
            error["code"], -32602,
            "{what}: refused as invalid params: {e}"
        );
        assert!(
            message.contains("out of the workspace") || message.contains("`..`"),
            "{what}: the refusal says why: {e}"
        );
    }
}

async fn python_resources(target: &[&str], mode: &str) -> (Report, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let spill = dir.path().join("spill");
    let mut cmd = Command::new(python_interpreter().await);
    cmd.arg(sdk_dir().join("python/client.py"))
        .args(target)
        .args(["--mode", mode, "--resources"])
        .arg(&spill);
    let report = run_client(&format!("the Python SDK ({mode}, resources)"), cmd, None).await;
    (report, dir)
}

#[tokio::test]
async fn python_sdk_reads_a_spill_and_a_binary_workspace_file() {
    let server = local_server().await;
    let url = server.url("/mcp");
    let (legacy, dir) = python_resources(&["--url", &url, "--session", "py-res"], "legacy").await;
    check_resources(
        "Python, handshake era",
        &legacy,
        &dir.path().join("spill"),
        "2025-11-25",
    );
    let (modern, dir) = python_resources(&["--url", &url, "--session", "py-res-26"], "auto").await;
    check_resources(
        "Python, 2026-07-28",
        &modern,
        &dir.path().join("spill"),
        "2026-07-28",
    );
}

#[tokio::test]
async fn python_sdk_reads_resources_over_stdio() {
    let stdio = stdio_server("py-stdio-res");
    let (report, dir) = python_resources(&["--stdio", &stdio], "legacy").await;
    check_resources(
        "Python over stdio",
        &report,
        &dir.path().join("spill"),
        "2025-11-25",
    );
}

async fn typescript_resources(server: &Server, sdk: &str, session: &str, mode: &str) {
    let dir = tempfile::tempdir().expect("temp dir");
    let spill = dir.path().join("spill");
    let mut cmd = Command::new("node");
    cmd.env("NODE_PATH", node_modules().await)
        .arg(sdk_dir().join("typescript/client.cjs"))
        .args(["--sdk", sdk, "--url", &server.url("/mcp")])
        .args(["--session", session, "--mode", mode, "--resources"])
        .arg(&spill);
    let what = format!("the TypeScript SDK ({sdk}, {mode}, resources)");
    let report = run_client(&what, cmd, Some(server)).await;
    let protocol = if mode == "legacy" {
        "2025-11-25"
    } else {
        "2026-07-28"
    };
    check_resources(&what, &report, &spill, protocol);
}

#[tokio::test]
async fn typescript_sdk_reads_a_spill_and_a_binary_workspace_file() {
    let server = local_server().await;
    typescript_resources(&server, "v1", "ts-res", "legacy").await;
    typescript_resources(&server, "v2", "ts-res-26", "auto").await;
}
