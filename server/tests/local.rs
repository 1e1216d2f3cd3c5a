//! The server with the `local` backend (each session a real `cli-mcp-agent` + bash on
//! loopback), driven by a real MCP client (rmcp's) and by raw JSON-RPC over HTTP.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use rmcp::model::CallToolRequestParams;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::ServiceExt as _;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use cli_mcp_e2e::child::LocalServer;
use support::{fifo, is_error, structured, text, Mcp, Server};

async fn local_server(extra: &[&str]) -> Server {
    support::ensure_built(false);
    let agent = support::agent_bin();
    let agent = agent.to_str().expect("utf-8 path");
    let mut args = LocalServer::local_backend(agent);
    args.extend_from_slice(extra);
    Server::start(&args, &[]).await
}

#[tokio::test]
async fn rmcp_client_initializes_lists_and_calls_bash() {
    let server = local_server(&[]).await;
    let headers = HashMap::from([(
        http::HeaderName::from_static("x-session-id"),
        http::HeaderValue::from_static("rmcp-1"),
    )]);
    let transport = StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(server.url("/mcp")).custom_headers(headers),
    );
    let client = ().serve(transport).await.expect("initialize");
    let info = client.peer_info().expect("server info");
    assert_eq!(
        info.server_info.as_ref().map(|i| i.name.as_str()),
        Some("cli-mcp-server")
    );
    assert!(info.capabilities.tools.is_some());

    let tools = client.list_all_tools().await.expect("tools/list");
    assert_eq!(tools.len(), 1);
    let bash = &tools[0];
    assert_eq!(bash.name, "bash");
    let ann = bash.annotations.as_ref().expect("annotations");
    assert_eq!(ann.read_only_hint, Some(false));
    assert_eq!(ann.destructive_hint, Some(true));
    assert_eq!(ann.open_world_hint, Some(true));
    assert_eq!(bash.input_schema["required"], json!(["command"]));

    let args = json!({"command": "echo hello from rmcp; cd /tmp"});
    let result = client
        .call_tool(
            CallToolRequestParams::new("bash")
                .with_arguments(args.as_object().cloned().expect("object")),
        )
        .await
        .expect("tools/call");
    assert_eq!(result.is_error, Some(false));
    let sc = result.structured_content.expect("structuredContent");
    assert_eq!(sc["stdout"], "hello from rmcp\n");
    assert_eq!(sc["exit_code"], 0);
    assert_eq!(sc["cwd"], "/tmp");
    assert_eq!(sc["new_sandbox"], "local");
    let text = result.content[0]
        .as_text()
        .map(|t| t.text.clone())
        .unwrap_or_default();
    assert!(text.starts_with("hello from rmcp\n[exit 0 |"), "{text}");
    client.cancel().await.expect("close client");
}

#[tokio::test]
async fn raw_jsonrpc_initialize_list_and_call() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("raw-1"));
    let init = mcp
        .rpc(
            "initialize",
            json!({"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "curl", "version": "1"}}),
        )
        .await;
    assert_eq!(init.status, 200, "{}", init.text);
    assert_eq!(init.body["result"]["serverInfo"]["name"], "cli-mcp-server");
    // Stateless: no protocol session id is handed out or needed.
    let list = mcp.rpc("tools/list", json!({})).await;
    assert_eq!(
        list.body["result"]["tools"][0]["name"], "bash",
        "{}",
        list.text
    );
    let r = mcp.bash("printf 'a\\nb'").await;
    assert!(!is_error(&r));
    assert!(text(&r).starts_with("a\nb\n[exit 0 | "), "{}", text(&r));
    assert_eq!(structured(&r)["stdout"], "a\nb");
}

#[tokio::test]
async fn curl_speaks_to_the_endpoint() {
    let server = local_server(&[]).await;
    let body = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "bash", "arguments": {"command": "echo $((6*7))"}}})
    .to_string();
    let out = tokio::process::Command::new("curl")
        .args([
            "-sS",
            "--noproxy",
            "*",
            "-H",
            "Content-Type: application/json",
        ])
        .args(["-H", "Accept: application/json, text/event-stream"])
        .args([
            "-H",
            "X-Session-ID: curl-1",
            "-d",
            &body,
            &server.url("/mcp"),
        ])
        .output()
        .await
        .expect("curl must be installed (apt-get install -y curl)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON answer");
    assert_eq!(v["id"], 7);
    assert_eq!(v["result"]["structuredContent"]["stdout"], "42\n");
}

#[tokio::test]
async fn state_persists_within_a_session() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("persist"));
    mcp.bash("cd /tmp && export GREETING=hi && f() { echo \"fn:$1\"; }")
        .await;
    let r = mcp.bash("echo \"$PWD $GREETING $(f x)\"").await;
    assert_eq!(structured(&r)["stdout"], "/tmp hi fn:x\n");
    assert!(
        structured(&r).get("new_sandbox").is_none(),
        "second call reuses the sandbox"
    );
    assert_eq!(structured(&r)["state_reset"], false);
}

#[tokio::test]
async fn sessions_are_isolated() {
    let server = local_server(&[]).await;
    let a = Mcp::new(&server, Some("iso-a"));
    let b = a.session("iso-b");
    a.bash("export SECRET=only-a; cd /").await;
    let r = b.bash("echo \"[${SECRET:-unset}]\"; pwd").await;
    let out = structured(&r)["stdout"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(out.starts_with("[unset]\n"), "{out}");
    assert_ne!(out.lines().nth(1), Some("/"), "b has its own cwd: {out}");
    let r = a.bash("echo $SECRET").await;
    assert_eq!(structured(&r)["stdout"], "only-a\n");
}

#[tokio::test]
async fn timeout_is_an_error_with_exit_124_and_the_shell_keeps_its_state() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("slow"));
    let r = mcp
        .bash_with(json!({"command": "export KEEP=yes; echo before; sleep 30", "timeout": 1}))
        .await;
    assert!(is_error(&r), "{r}");
    let s = structured(&r);
    assert_eq!(s["timed_out"], true);
    assert_eq!(s["exit_code"], 124);
    assert_eq!(s["stdout"], "before\n", "partial output kept");
    assert!(text(&r).contains("timed out"), "{}", text(&r));
    let r = mcp.bash("echo $KEEP").await;
    assert_eq!(structured(&r)["stdout"], "yes\n");
}

#[tokio::test]
async fn output_over_the_budget_is_truncated_and_says_so() {
    let server = local_server(&["--output-budget", "2048"]).await;
    let mcp = Mcp::new(&server, Some("big"));
    let r = mcp
        .bash("head -c 100000 /dev/zero | tr '\\0' a; echo; echo END")
        .await;
    let s = structured(&r);
    assert_eq!(s["truncated"], true);
    assert_eq!(s["total_bytes"], 100005);
    let out = s["stdout"].as_str().unwrap_or_default();
    assert!(out.len() < 4096, "bounded: {} bytes", out.len());
    assert!(out.ends_with("END\n"), "tail kept");
    assert!(out.contains("truncated"), "marker present");
    assert!(
        text(&r).contains("output truncated: 100005 bytes in total"),
        "{}",
        &text(&r)[text(&r).len() - 300..]
    );
    assert!(!is_error(&r));
}

#[tokio::test]
async fn non_zero_exit_is_an_error_result() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("exit"));
    let r = mcp.bash("echo oops >&2; (exit 7)").await;
    assert!(is_error(&r));
    assert_eq!(structured(&r)["exit_code"], 7);
    assert_eq!(structured(&r)["stderr"], "oops\n");
    assert!(
        text(&r).starts_with(&format!(
            "[stderr]\noops\n[exit 7 | {} ms | cwd {}",
            structured(&r)["duration_ms"],
            structured(&r)["cwd"].as_str().unwrap_or_default()
        )),
        "{}",
        text(&r)
    );
    let r = mcp.bash("true").await;
    assert!(!is_error(&r));
}

#[tokio::test]
async fn invalid_utf8_output_is_shown_lossily_and_kept_exactly() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("bytes"));
    let r = mcp.bash("printf 'ok\\377\\n'").await;
    assert!(text(&r).starts_with("ok\u{fffd}\n"), "{}", text(&r));
    assert!(
        text(&r).contains("stdout is not valid UTF-8"),
        "{}",
        text(&r)
    );
    assert_eq!(structured(&r)["stdout_encoding"], "base64");
    assert_eq!(structured(&r)["stdout"], "b2v/Cg==");
}

#[tokio::test]
async fn no_session_header_starts_a_named_session_and_a_bad_one_is_a_clear_tool_error() {
    let server = local_server(&[]).await;
    let none = Mcp::new(&server, None);
    // Without the header (and no MCP session) the call runs in a new session it names.
    let r = none.bash("true").await;
    assert!(!is_error(&r), "{r}");
    assert!(
        r["content"][1]["text"]
            .as_str()
            .is_some_and(|t| t.starts_with("[new session c")),
        "{r}"
    );
    let bad = none.session("Bad_Session");
    let r = bad.bash("true").await;
    assert!(is_error(&r));
    assert!(
        text(&r).contains("invalid X-Session-ID \"Bad_Session\""),
        "{}",
        text(&r)
    );
    let long = none.session(&"a".repeat(64));
    let r = long.bash("true").await;
    assert!(text(&r).contains("64 characters long"), "{}", text(&r));
}

#[tokio::test]
async fn bad_arguments_are_tool_errors() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("args"));
    for (args, needle) in [
        (json!({}), "missing argument `command`"),
        (json!({"command": "true", "timeout": 301}), "maximum is 300"),
        (json!({"command": "true", "timeout": "x"}), "integer"),
        (json!({"command": ["ls"]}), "must be a string"),
    ] {
        let r = mcp.bash_with(args.clone()).await;
        assert!(is_error(&r), "{args}");
        assert!(text(&r).contains(needle), "{args}: {}", text(&r));
    }
}

#[tokio::test]
async fn bad_jsonrpc_gets_a_jsonrpc_error() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("rpc"));
    let a = mcp.post_raw("{not json".into()).await;
    assert_eq!(a.status, 400);
    assert_eq!(a.body["error"]["code"], -32700, "{}", a.text);
    assert!(a.body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("not valid JSON"));
    let a = mcp.post_raw("[1, 2]".into()).await;
    assert_eq!(a.body["error"]["code"], -32600, "{}", a.text);
    assert!(a.text.contains("batches are not supported"), "{}", a.text);
    let a = mcp
        .post_raw(json!({"id": 3, "method": "tools/list"}).to_string())
        .await;
    assert_eq!(a.body["error"]["code"], -32600);
    assert_eq!(a.body["id"], 3);
    assert!(
        a.text.contains("\\\"jsonrpc\\\": \\\"2.0\\\""),
        "{}",
        a.text
    );
}

#[tokio::test]
async fn unknown_tool_is_a_protocol_error() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("unknown"));
    let a = mcp
        .rpc(
            "tools/call",
            json!({"name": "python", "arguments": {"code": "1"}}),
        )
        .await;
    assert_eq!(a.body["error"]["code"], -32602, "{}", a.text);
    assert!(
        a.text
            .contains("unknown tool \\\"python\\\"; this server has one tool: bash"),
        "{}",
        a.text
    );
}

#[tokio::test]
async fn huge_requests_are_rejected_clearly() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("huge"));
    // Over the body limit (1 MiB): 413 before any parsing.
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "bash", "arguments": {"command": "x".repeat(2 * 1024 * 1024)}}});
    let a = mcp.post_raw(body.to_string()).await;
    assert_eq!(a.status, 413, "{}", &a.text[..a.text.len().min(300)]);
    assert!(
        a.text.contains("over the limit of 1048576 bytes"),
        "{}",
        a.text
    );
    // Under the body limit but over the command limit: a tool error.
    let r = mcp.bash(&format!("echo {}", "y".repeat(600 * 1024))).await;
    assert!(is_error(&r));
    assert!(
        text(&r).contains("the limit is 524288 bytes"),
        "{}",
        text(&r)
    );
}

#[tokio::test]
async fn bad_http_headers_are_rejected() {
    let server = local_server(&[]).await;
    let http = support::http();
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).to_string();
    let no_accept = http
        .post(server.url("/mcp"))
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .expect("POST");
    assert_eq!(no_accept.status(), 406);
    assert!(no_accept
        .text()
        .await
        .unwrap_or_default()
        .contains("must accept both"));
    let wrong_type = http
        .post(server.url("/mcp"))
        .header("content-type", "text/plain")
        .header("accept", support::ACCEPT)
        .body(body.clone())
        .send()
        .await
        .expect("POST");
    assert_eq!(wrong_type.status(), 415);
    // A foreign Host on a loopback server (DNS rebinding) is refused.
    let rebinding = http
        .post(server.url("/mcp"))
        .header("content-type", "application/json")
        .header("accept", support::ACCEPT)
        .header("host", "evil.example")
        .body(body)
        .send()
        .await
        .expect("POST");
    assert_eq!(rebinding.status(), 403);
    let huge_header = http
        .post(server.url("/mcp"))
        .header("x-filler", "z".repeat(100 * 1024))
        .send()
        .await
        .expect("answer");
    // hyper answers an over-long request head with 431 or 400, never by reading it all.
    assert!(
        [400, 431].contains(&huge_header.status().as_u16()),
        "request head over 64 KiB: {}",
        huge_header.status()
    );
}

/// `tools/list` as a page of `origin` sends it (none: a non-browser client).
fn tools_list(
    http: &reqwest::Client,
    server: &Server,
    origin: Option<&str>,
) -> reqwest::RequestBuilder {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).to_string();
    let req = http
        .post(server.url("/mcp"))
        .header("content-type", "application/json")
        .header("accept", support::ACCEPT)
        .body(body);
    match origin {
        Some(o) => req.header("origin", o),
        None => req,
    }
}

#[tokio::test]
async fn a_foreign_origin_is_refused_with_403() {
    let server = local_server(&["--allowed-origin", "https://app.example.com"]).await;
    let http = support::http();
    let list = |origin: Option<&str>| tools_list(&http, &server, origin).send();
    for ok in [
        None,
        Some("http://localhost:5173"),
        Some("http://127.0.0.1:8080"),
        Some("https://app.example.com"),
    ] {
        let r = list(ok).await.expect("POST");
        assert_eq!(r.status(), 200, "Origin {ok:?}");
    }
    for bad in [
        "http://evil.example",
        "null",
        "https://app.example.com:8443",
    ] {
        let r = list(Some(bad)).await.expect("POST");
        assert_eq!(r.status(), 403, "Origin {bad}");
        let v: Value = r.json().await.expect("JSON error");
        assert_eq!(v["code"], "forbidden_origin", "{v}");
        assert!(
            v["error"]
                .as_str()
                .is_some_and(|e| e.contains("is not allowed") && e.contains("--allowed-origin")),
            "{v}"
        );
    }
    // The session routes are as exposed to a cross-site page as /mcp.
    let del = http
        .delete(server.url("/sessions/s1"))
        .header("origin", "http://evil.example")
        .send()
        .await
        .expect("DELETE");
    assert_eq!(del.status(), 403);
    let get = http
        .get(server.url("/sessions"))
        .header("origin", "http://evil.example")
        .send()
        .await
        .expect("GET");
    assert_eq!(get.status(), 403);
}

/// A page of an allowed origin can call the server from a browser: its preflight is
/// answered (no token needed, none is sent on it), and the answers carry the CORS headers a
/// browser needs to hand them to the page. A foreign origin's preflight is refused, and a
/// client that sends no Origin is allowed no origin.
#[tokio::test]
async fn an_allowed_origins_page_gets_cors_and_a_foreign_one_does_not() {
    let server = local_server(&["--allowed-origin", "https://app.example.com"]).await;
    let http = support::http();
    let preflight = |origin: &str| {
        http.request(reqwest::Method::OPTIONS, server.url("/mcp"))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization, content-type, mcp-protocol-version, x-session-id",
            )
            .send()
    };
    let header = |r: &reqwest::Response, name: &str| {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let ok = preflight("https://app.example.com").await.expect("OPTIONS");
    assert_eq!(ok.status(), 200);
    assert_eq!(
        header(&ok, "access-control-allow-origin").as_deref(),
        Some("https://app.example.com")
    );
    let methods = header(&ok, "access-control-allow-methods").unwrap_or_default();
    assert!(
        methods.contains("POST") && methods.contains("DELETE"),
        "{methods}"
    );
    let allowed = header(&ok, "access-control-allow-headers").unwrap_or_default();
    for h in [
        "authorization",
        "content-type",
        "mcp-protocol-version",
        "x-session-id",
    ] {
        assert!(allowed.contains(h), "{h} in {allowed}");
    }
    let bad = preflight("http://evil.example").await.expect("OPTIONS");
    assert_eq!(bad.status(), 403);
    assert_eq!(header(&bad, "access-control-allow-origin"), None);

    let post = |origin: Option<&str>| tools_list(&http, &server, origin).send();
    let r = post(Some("https://app.example.com")).await.expect("POST");
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "access-control-allow-origin").as_deref(),
        Some("https://app.example.com")
    );
    assert!(header(&r, "access-control-expose-headers")
        .is_some_and(|e| e.contains("mcp-session-id") && e.contains("www-authenticate")));
    assert!(header(&r, "vary").is_some_and(|v| v.contains("origin")));
    let r = post(None).await.expect("POST");
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "access-control-allow-origin"), None);
}

#[tokio::test]
async fn delete_then_reuse_gives_a_fresh_shell_that_says_so() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("reuse"));
    mcp.bash("export MARK=1").await;
    let http = support::http();
    let list: Value = http
        .get(server.url("/sessions"))
        .send()
        .await
        .expect("GET /sessions")
        .json()
        .await
        .expect("JSON");
    assert_eq!(list["sessions"][0]["session_id"], "reuse");
    for _ in 0..2 {
        let del = http
            .delete(server.url("/sessions/reuse"))
            .send()
            .await
            .expect("DELETE");
        assert_eq!(del.status(), 204, "idempotent");
    }
    let r = mcp.bash("echo \"[${MARK:-}]\"").await;
    assert_eq!(structured(&r)["stdout"], "[]\n");
    assert_eq!(structured(&r)["new_sandbox"], "local");
    assert!(
        text(&r).contains("new session: started a fresh sandbox"),
        "{}",
        text(&r)
    );
    let bad = http
        .delete(server.url("/sessions/Not_Valid"))
        .send()
        .await
        .expect("DELETE");
    assert_eq!(bad.status(), 400);
    assert!(bad
        .text()
        .await
        .unwrap_or_default()
        .contains("invalid session id"));
}

/// Waits until a command has opened `fifo` for writing (opening it for reading completes
/// then); returns what it wrote.
async fn started(fifo: &std::path::Path) -> String {
    let fifo = fifo.to_path_buf();
    tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo)),
    )
    .await
    .expect("the command started within 30 s")
    .expect("join")
    .expect("read fifo")
}

async fn sessions(server: &Server) -> Value {
    support::http()
        .get(server.url("/sessions"))
        .send()
        .await
        .expect("GET /sessions")
        .json::<Value>()
        .await
        .expect("JSON")["sessions"]
        .clone()
}

fn number(s: &str) -> i32 {
    s.trim()
        .parse()
        .unwrap_or_else(|_| panic!("not a pid: {s:?}"))
}

/// Starts the session's shell with a background job; returns the pids of the agent, the
/// shell and the job.
async fn session_pids(mcp: &Mcp) -> Vec<(&'static str, i32)> {
    let r = mcp.bash("sleep 1000 & echo $PPID $$ $!").await;
    assert!(!is_error(&r), "{r}");
    let out = structured(&r)["stdout"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let pids: Vec<i32> = out.split_whitespace().map(number).collect();
    assert_eq!(pids.len(), 3, "{out:?}");
    vec![
        ("agent", pids[0]),
        ("shell", pids[1]),
        ("background job", pids[2]),
    ]
}

/// A foreground command that writes its pid to `fifo`, then runs for 1000 s.
fn foreground(fifo: &std::path::Path) -> String {
    format!("sh -c 'echo $$ > {}; exec sleep 1000'", fifo.display())
}

/// Waits (up to `within`) until none of `pids` runs; fails naming the ones that still do.
async fn all_gone(pids: &[(&str, i32)], within: Duration) {
    let deadline = std::time::Instant::now() + within;
    loop {
        let alive: Vec<_> = pids
            .iter()
            .filter(|(_, pid)| cli_mcp_e2e::process::running(*pid))
            .collect();
        if alive.is_empty() {
            return;
        }
        if std::time::Instant::now() >= deadline {
            for (_, pid) in &alive {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            panic!("still running {within:?} later (now killed): {alive:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// SIGKILL of the server takes everything it started with it: its agents, their shells,
/// and the shells' foreground commands and background jobs (before, all of them kept
/// running).
#[tokio::test]
async fn a_sigkilled_server_leaves_no_process_behind() {
    let server = local_server(&[]).await;
    let (_dir, fifo) = fifo();
    let mcp = Mcp::new(&server, Some("orphans"));
    let mut pids = session_pids(&mcp).await;
    let call = tokio::spawn({
        let mcp = mcp.clone();
        let cmd = foreground(&fifo);
        async move { mcp.bash_with(json!({"command": cmd})).await }
    });
    pids.push(("foreground command", number(&started(&fifo).await)));
    sigkill_and_wait(&server, pids).await;
    call.abort();
}

/// SIGKILLs the server, then waits until it and `pids` (its session's processes) are gone:
/// each agent drains for at most 2 s (the server sets it), then kills what its shell started.
async fn sigkill_and_wait(server: &Server, mut pids: Vec<(&'static str, i32)>) {
    let server_pid = server.child.id().expect("server pid") as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server_pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL the server");
    pids.push(("server", server_pid));
    all_gone(&pids, Duration::from_secs(15)).await;
}

/// A killed server cannot remove its sessions' root (workspaces, agent state) from the
/// temporary directory: the next server started there does, and leaves a running one's alone.
#[tokio::test]
async fn the_next_server_removes_the_root_a_killed_one_left() {
    support::ensure_built(false);
    let tmp = tempfile::tempdir().expect("tempdir");
    let env = [("TMPDIR", tmp.path().to_str().expect("utf-8 path"))];
    let agent = support::agent_bin();
    let args = LocalServer::local_backend(agent.to_str().expect("utf-8 path"));
    let roots = || -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(tmp.path())
            .expect("list TMPDIR")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("cli-mcp-local-"))
            .collect();
        names.sort();
        names
    };
    let killed = Server::start(&args, &env).await;
    let mcp = Mcp::new(&killed, Some("left-behind"));
    let pids = session_pids(&mcp).await;
    assert!(!is_error(&mcp.bash("echo mine > file").await));
    let left = roots();
    assert_eq!(left.len(), 1, "{left:?}");
    sigkill_and_wait(&killed, pids).await;
    assert_eq!(roots(), left, "a killed server cannot remove its root");

    let next = Server::start(&args, &env).await;
    let now = roots();
    assert!(
        now.len() == 1 && now != left,
        "{left:?} is still there: {now:?}"
    );
    next.wait_log("the removal", |l| {
        l.contains("removed the local sessions' roots") && l.contains("\"removed\":1")
    })
    .await;
    let _third = Server::start(&args, &env).await;
    assert_eq!(roots().len(), 2, "a running server's root is kept");
}

/// A DELETE while a command runs ends the session for good: the call fails with an error
/// that says so, and its retry does not start a new sandbox (before, the retry after the
/// agent was stopped started one, and `GET /sessions` listed the deleted session again).
#[tokio::test]
async fn a_call_racing_a_delete_fails_and_the_session_stays_deleted() {
    let server = local_server(&[]).await;
    let (_dir, fifo) = fifo();
    let mcp = Mcp::new(&server, Some("doomed"));
    let mut pids = session_pids(&mcp).await;
    let call = tokio::spawn({
        let mcp = mcp.clone();
        let cmd = foreground(&fifo);
        async move { mcp.bash(&cmd).await }
    });
    pids.push(("foreground command", number(&started(&fifo).await)));
    let del = support::http()
        .delete(server.url("/sessions/doomed"))
        .send()
        .await
        .expect("DELETE");
    assert_eq!(del.status(), 204);
    let r = tokio::time::timeout(Duration::from_secs(30), call)
        .await
        .expect("the call ends within 30 s of the DELETE")
        .expect("join");
    assert!(is_error(&r), "{r}");
    assert!(
        text(&r).contains("the session was deleted (DELETE /sessions/{id}) while this command ran"),
        "{}",
        text(&r)
    );
    assert_eq!(
        sessions(&server).await,
        json!([]),
        "the deleted session was started again\nserver log:\n{}",
        server.log_text()
    );
    // Nothing of the stopped agent lives on (before, the server SIGKILLed the agent after
    // 5 s while it drained for 20 s, so its shell and commands were left running).
    all_gone(&pids, Duration::from_secs(1)).await;
    // A call made after the DELETE starts a fresh session, and says so.
    let r = mcp.bash("true").await;
    assert!(!is_error(&r), "{r}");
    assert!(
        text(&r).contains("new session: started a fresh sandbox"),
        "{}",
        text(&r)
    );
}

#[tokio::test]
async fn a_dead_agent_is_replaced_and_the_reset_is_reported() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("crash"));
    mcp.bash("export MARK=1").await;
    let list: Value = support::http()
        .get(server.url("/sessions"))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON");
    let pid = list["sessions"][0]["sandbox"]
        .as_str()
        .and_then(|s| s.strip_prefix("local/"))
        .expect("local/<pid>")
        .to_owned();
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    // kill(2) only queues the signal: until the agent has exited, the kernel still accepts
    // connections on its socket, so a call sent now could be written and then broken, which
    // is rightly reported as "may have run". This test is about a sandbox found dead.
    let pid_num: i32 = pid.parse().expect("numeric pid");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while cli_mcp_e2e::process::running(pid_num) {
        assert!(
            std::time::Instant::now() < deadline,
            "agent {pid} still runs 10 s after SIGKILL"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let r = mcp.bash("echo \"[${MARK:-}]\"").await;
    assert!(!is_error(&r), "{r}\nserver log:\n{}", server.log_text());
    assert_eq!(structured(&r)["stdout"], "[]\n");
    assert_eq!(structured(&r)["state_reset"], true);
    assert!(text(&r).contains("session state was reset"), "{}", text(&r));
}

#[tokio::test]
async fn max_sessions_is_a_clear_tool_error() {
    let server = local_server(&["--max-sessions", "1"]).await;
    let a = Mcp::new(&server, Some("one"));
    assert!(!is_error(&a.bash("true").await));
    let r = a.session("two").bash("true").await;
    assert!(is_error(&r));
    assert!(text(&r).contains("already has 1 sessions"), "{}", text(&r));
    // The first one still works.
    assert!(!is_error(&a.bash("true").await));
}

/// Concurrent new sessions are admitted against the limit one at a time: exactly the limit
/// starts, the rest get the limit error (counting, then starting, would let all of them in).
#[tokio::test]
async fn concurrent_new_sessions_never_overshoot_max_sessions() {
    let server = local_server(&["--max-sessions", "4"]).await;
    let mcp = Mcp::new(&server, None);
    let calls = (0..16).map(|i| {
        let mcp = mcp.session(&format!("burst-{i}"));
        async move { mcp.bash("echo ok").await }
    });
    let results = futures::future::join_all(calls).await;
    let ok = results.iter().filter(|r| !is_error(r)).count();
    let limited: Vec<_> = results.iter().filter(|r| is_error(r)).collect();
    let texts: Vec<String> = results.iter().map(text).collect();
    assert_eq!(ok, 4, "exactly the limit starts: {texts:#?}");
    for r in &limited {
        assert!(text(r).contains("already has 4 sessions"), "{}", text(r));
    }
    let list: Value = support::http()
        .get(server.url("/sessions"))
        .send()
        .await
        .expect("GET /sessions")
        .json()
        .await
        .expect("JSON");
    assert_eq!(list["sessions"].as_array().map(Vec::len), Some(4), "{list}");
}

#[tokio::test]
async fn health_and_metrics() {
    let server = local_server(&[]).await;
    let http = support::http();
    // Before any call: every labelled family is there at zero, with build and process facts.
    let fresh = http
        .get(server.health_url("/metrics"))
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(
        fresh.headers().get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/openmetrics-text; version=1.0.0; charset=utf-8"[..])
    );
    let fresh = fresh.text().await.expect("text");
    for needle in [
        "cli_mcp_errors_total{kind=\"agent\"} 0",
        "cli_mcp_exec_duration_seconds_count{outcome=\"timed_out\"} 0",
        "cli_mcp_http_requests_total{listener=\"mcp\",route=\"/mcp\",status=\"5xx\"} 0",
        &format!(
            "cli_mcp_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        ),
        "# TYPE process_cpu_seconds counter",
        "process_resident_memory_bytes ",
        "process_open_fds ",
        "process_start_time_seconds ",
    ] {
        assert!(fresh.contains(needle), "missing {needle} in\n{fresh}");
    }
    assert!(fresh.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
    for path in ["/livez", "/readyz"] {
        let r = http.get(server.health_url(path)).send().await.expect("GET");
        assert_eq!(r.status(), 200, "{path}");
    }
    let mcp = Mcp::new(&server, Some("metrics"));
    mcp.bash("true").await;
    mcp.bash("false").await;
    let m = http
        .get(server.health_url("/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("text");
    for needle in [
        "cli_mcp_sessions_active 1",
        "cli_mcp_session_start_seconds_count{launch=\"local\"} 1",
        "cli_mcp_exec_duration_seconds_count{outcome=\"ok\"} 1",
        "cli_mcp_exec_duration_seconds_count{outcome=\"failed\"} 1",
        "cli_mcp_http_requests_total{listener=\"mcp\",route=\"/mcp\",status=\"2xx\"} 2",
        "cli_mcp_http_requests_total{listener=\"health\",route=\"/livez\",status=\"2xx\"} 1",
        "cli_mcp_http_requests_total{listener=\"health\",route=\"/metrics\",status=\"2xx\"} 1",
    ] {
        assert!(m.contains(needle), "missing {needle} in\n{m}");
    }
    // A scraper that asks for the Prometheus text format gets it.
    let text = http
        .get(server.health_url("/metrics"))
        .header("accept", "text/plain;version=0.0.4;q=0.9,*/*;q=0.1")
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(
        text.headers().get("content-type").map(|v| v.as_bytes()),
        Some(&b"text/plain; version=0.0.4; charset=utf-8"[..])
    );
    let text = text.text().await.expect("text");
    assert!(
        text.contains("# TYPE cli_mcp_errors_total counter")
            && text.contains("cli_mcp_errors_total{kind=\"agent\"} 0")
            && !text.contains("# EOF"),
        "Prometheus text format:\n{text}"
    );
    // The audit line of the calls is in the log.
    let log = server.log_text();
    assert!(
        log.lines().any(|l| l.contains("\"target\":\"audit\"")
            && l.contains("\"session\":\"metrics\"")
            && l.contains("\"exit_code\":1")),
        "no audit line:\n{log}"
    );
}

#[tokio::test]
async fn stdio_transport_serves_one_session() {
    support::ensure_built(false);
    let mut child = tokio::process::Command::new(support::SERVER_BIN)
        .args([
            "--transport",
            "stdio",
            "--session-id",
            "dev-1",
            "--backend",
            "local",
            "--auth",
            "none",
            "--instructions",
            "This sandbox has jq.",
            "--briefing",
            "Sandbox briefing: jq 1.6.",
        ])
        .arg("--agent-binary")
        .arg(support::agent_bin())
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start stdio server");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let send = |v: Value| format!("{v}\n");
    stdin
        .write_all(send(json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})).as_bytes())
        .await
        .expect("write");
    let init: Value =
        serde_json::from_str(&lines.next_line().await.expect("read").expect("line")).expect("JSON");
    assert_eq!(init["result"]["serverInfo"]["name"], "cli-mcp-server");
    let instructions = init["result"]["instructions"].as_str().unwrap_or_default();
    assert_eq!(
        instructions,
        cli_mcp_server::mcp::instructions(
            true,
            Some("Sandbox briefing: jq 1.6."),
            Some("This sandbox has jq.")
        )
    );
    assert!(
        instructions.ends_with("\n\nSandbox briefing: jq 1.6.\n\nThis sandbox has jq.")
            && instructions.contains("(exit N)"),
        "{instructions}"
    );
    for http_only in ["X-Session-ID", "DELETE", "/sessions"] {
        assert!(
            !instructions.contains(http_only),
            "a stdio client cannot use {http_only}: {instructions}"
        );
    }
    stdin
        .write_all(
            send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).as_bytes(),
        )
        .await
        .expect("write");
    for (id, cmd, want) in [(2, "cd /tmp; echo one", "one\n"), (3, "pwd", "/tmp\n")] {
        stdin
            .write_all(
                send(json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                "params": {"name": "bash", "arguments": {"command": cmd}}}))
                .as_bytes(),
            )
            .await
            .expect("write");
        let v: Value = serde_json::from_str(&lines.next_line().await.expect("read").expect("line"))
            .expect("JSON");
        assert_eq!(v["id"], id);
        assert_eq!(v["result"]["structuredContent"]["stdout"], want, "{v}");
        assert_eq!(v["result"]["structuredContent"]["session_id"], "dev-1");
    }
    drop(stdin);
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("exits at end of stdin")
        .expect("wait");
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn sigterm_lets_the_running_call_finish_and_stops_the_agents() {
    let server = local_server(&[]).await;
    let (_dir, fifo) = fifo();
    let mcp = Mcp::new(&server, Some("drain"));
    let list_url = server.url("/sessions");
    let cmd = format!("echo started > {}; sleep 1; echo finished", fifo.display());
    let call = tokio::spawn({
        let mcp = mcp.clone();
        async move { mcp.bash(&cmd).await }
    });
    // Opening the FIFO for reading completes when the command opens it for writing.
    let fifo2 = fifo.clone();
    tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo2))
        .await
        .expect("join")
        .expect("read fifo");
    let list: Value = support::http()
        .get(&list_url)
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON");
    let pid = list["sessions"][0]["sandbox"]
        .as_str()
        .and_then(|s| s.strip_prefix("local/"))
        .expect("local/<pid>")
        .to_owned();
    let status = server.stop().await;
    assert!(status.success(), "clean exit: {status}");
    let r = call.await.expect("join");
    assert_eq!(
        structured(&r)["stdout"],
        "finished\n",
        "the open call completed"
    );
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the session's agent (pid {pid}) was stopped with the server"
    );
}

/// SIGTERM starts a lame-duck phase: /readyz fails at once (the endpoint leaves the
/// Service) while the MCP listener keeps serving, and each response closes its connection
/// (keep-alive clients reconnect to another replica); after `--shutdown-delay` it drains and
/// exits.
#[tokio::test]
async fn sigterm_first_fails_readiness_and_closes_connections_while_still_serving() {
    let server = local_server(&["--shutdown-delay", "3"]).await;
    let http = support::http();
    let ready = http
        .get(server.health_url("/readyz"))
        .send()
        .await
        .expect("GET /readyz");
    assert_eq!(ready.status(), 200);
    let pid = server.child.id().expect("server pid");
    let term = std::process::Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status()
        .expect("kill");
    assert!(term.success());

    // Readiness fails first (bounded wait for the signal to be handled)...
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = http
            .get(server.health_url("/readyz"))
            .send()
            .await
            .expect("the health listener still answers during the shutdown delay");
        if r.status() == 503 {
            assert_eq!(r.text().await.expect("body"), "shutting down\n");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz never failed after SIGTERM"
        );
        tokio::task::yield_now().await;
    }
    // ...while calls are still served, each on a connection that is then closed.
    let r = http
        .post(server.url("/mcp"))
        .header("x-session-id", "lame-duck")
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
        .send()
        .await
        .expect("served during the shutdown delay");
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers().get("connection").map(|v| v.as_bytes()),
        Some(&b"close"[..]),
        "the response closes its connection"
    );
    let status = server.stop().await;
    assert!(status.success(), "clean exit: {status}");
}

/// Kills every process with `marker` in its arguments when dropped, so that a failed test
/// leaves none of its hostile jobs behind.
struct KillMarked(String);

impl Drop for KillMarked {
    fn drop(&mut self) {
        // Several passes: a respawner may fork again between the scan and its kill.
        for _ in 0..20 {
            let left = cli_mcp_e2e::process::processes_with_arg(&self.0);
            if left.is_empty() {
                return;
            }
            for (pid, _) in left {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Starts jobs in the session that do all they can to escape their shell — `setsid nohup …
/// & disown`, a double fork so that their parent is gone, and a respawner that keeps forking
/// new sessions (a single sweep of the agent's descendants misses what it forks meanwhile) —
/// and waits until each kind runs. Every process they start carries `marker` in its
/// arguments.
async fn start_escapees(mcp: &Mcp, marker: &str) {
    let sleeper = |kind: &str| format!("exec -a {marker}-{kind} sleep 1000");
    let hostile = format!(
        "setsid nohup bash -c '{}' >/dev/null 2>&1 & disown; \
         ( setsid bash -c '( setsid bash -c \"{}\" & ); {}' >/dev/null 2>&1 & ); \
         setsid bash -c 'while :; do ( setsid bash -c \"{}\" & ); sleep 0.05; done' \
           {marker}-respawner >/dev/null 2>&1 & disown; \
         echo started",
        sleeper("nohup"),
        sleeper("grandchild"),
        sleeper("double"),
        sleeper("spawned"),
    );
    let r = mcp.bash(&hostile).await;
    assert!(!is_error(&r), "{r}");
    let kinds = ["-nohup", "-grandchild", "-double", "-respawner", "-spawned"];
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let argv: Vec<String> = cli_mcp_e2e::process::processes_with_arg(marker)
            .into_iter()
            .flat_map(|(_, argv)| argv)
            .collect();
        let missing: Vec<_> = kinds
            .iter()
            .filter(|k| !argv.iter().any(|a| a.ends_with(*k)))
            .collect();
        if missing.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the hostile jobs {missing:?} did not start within 20 s: {argv:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits up to `within` until no process with `marker` in its arguments runs; fails with
/// how many still do and what they are.
async fn none_left(marker: &str, within: Duration, after: &str) {
    let deadline = std::time::Instant::now() + within;
    let left = loop {
        let left: Vec<(i32, Vec<String>)> = cli_mcp_e2e::process::processes_with_arg(marker)
            .into_iter()
            .filter(|(pid, _)| cli_mcp_e2e::process::running(*pid))
            .collect();
        if left.is_empty() || std::time::Instant::now() >= deadline {
            break left;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        left.is_empty(),
        "{} processes of the session still run {within:?} after {after} (now killed): {left:?}",
        left.len()
    );
}

/// Escaped jobs (see [`start_escapees`]) die with the session when the server is SIGKILLed:
/// the agent, told by the kernel, stops its shell and sweeps what is left below it until
/// nothing is.
#[tokio::test]
async fn a_sigkilled_server_leaves_no_escaped_job_behind() {
    let marker = format!("cli-mcp-escapee-{}", std::process::id());
    let _cleanup = KillMarked(marker.clone());
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("escapees"));
    start_escapees(&mcp, &marker).await;
    let server_pid = server.child.id().expect("server pid") as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server_pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL the server");
    // The agent drains for 2 s, then stops its shell and everything left; 10 s is generous.
    none_left(&marker, Duration::from_secs(10), "the server was SIGKILLed").await;
}

/// A SIGKILLed agent cannot stop anything: its shell dies with it (a parent-death signal),
/// but jobs that escaped the shell were re-parented to it and now to init. The server kills
/// them through the session's cgroup (before, they ran on after the session was replaced).
#[tokio::test]
async fn a_sigkilled_agent_leaves_no_escaped_job_behind() {
    let marker = format!("cli-mcp-orphan-{}", std::process::id());
    let _cleanup = KillMarked(marker.clone());
    let server = local_server(&[]).await;
    if server
        .log_text()
        .contains("local sessions run without a cgroup")
    {
        eprintln!("SKIPPED: no cgroup v2 this server may create cgroups in");
        return;
    }
    let mcp = Mcp::new(&server, Some("orphans-of-a-killed-agent"));
    start_escapees(&mcp, &marker).await;
    let list = sessions(&server).await;
    let agent: i32 = list[0]["sandbox"]
        .as_str()
        .and_then(|s| s.strip_prefix("local/"))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no local/<pid> sandbox in {list}"));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL the agent");
    none_left(&marker, Duration::from_secs(10), "the agent was SIGKILLed").await;
    // The session goes on in a new sandbox, and says so.
    let r = mcp.bash("echo again").await;
    assert!(!is_error(&r), "{r}\nserver log:\n{}", server.log_text());
    assert_eq!(structured(&r)["stdout"], "again\n");
    assert_eq!(structured(&r)["state_reset"], true);
}

/// Longest time from a cancel until the session's next call has its answer (before, the
/// next call waited for the cancelled `sleep 30` to end).
const NEXT_CALL_AFTER_CANCEL: Duration = Duration::from_secs(2);
/// Longest time from a cancel until the command is interrupted.
const INTERRUPTED_AFTER_CANCEL: Duration = Duration::from_secs(1);

/// The next call on a session whose call was just cancelled (at `cancelled_at`): it runs at
/// once, in the same shell, which kept its state (`cd /tmp && export KEPT=yes` before).
async fn next_call_runs_at_once(mcp: &Mcp, cancelled_at: std::time::Instant, what: &str) {
    let r = tokio::time::timeout(Duration::from_secs(40), mcp.bash("echo \"ok $PWD $KEPT\""))
        .await
        .unwrap_or_else(|_| panic!("{what}: the next call got no answer within 40 s"));
    let took = cancelled_at.elapsed();
    eprintln!("{what}: the next call answered {took:?} after the cancel");
    assert_eq!(
        structured(&r)["stdout"],
        "ok /tmp yes\n",
        "{what}: the same shell, state kept: {r}"
    );
    assert!(
        took < NEXT_CALL_AFTER_CANCEL,
        "{what}: the next call answered {took:?} after the cancel; the limit is \
         {NEXT_CALL_AFTER_CANCEL:?}"
    );
}

/// The command of a cancelled call is interrupted within a second and never reaches its
/// end (`… && touch marker`).
async fn interrupted(
    pid: i32,
    marker: &std::path::Path,
    cancelled_at: std::time::Instant,
    what: &str,
) {
    if let Err(e) = support::gone_within(pid, INTERRUPTED_AFTER_CANCEL).await {
        panic!("{what}: the cancelled command was not interrupted: {e}");
    }
    eprintln!(
        "{what}: the command was gone {:?} after the cancel",
        cancelled_at.elapsed()
    );
    assert!(
        !marker.exists(),
        "{what}: the cancelled command ran to its end"
    );
}

/// A client that abandons its HTTP request (the connection closes mid-call) cancels the
/// call: the agent interrupts the command as Ctrl-C does, the shell keeps its state, and
/// the session's next call runs at once. (2026-07-28 clients cancel this way too; the SDK
/// tests cover that era.)
#[tokio::test]
async fn abandoning_the_http_request_interrupts_the_command_and_frees_the_session() {
    let server = local_server(&[]).await;
    let sid = "abandon";
    let mcp = Mcp::new(&server, Some(sid));
    let r = mcp.bash("cd /tmp && export KEPT=yes").await;
    assert!(!is_error(&r), "{r}");
    let (dir, fifo) = fifo();
    let marker = dir.path().join("finished");
    let body = jsonrpc_bash(&support::long_command(&fifo, &marker));
    let request = cli_mcp_e2e::jsonrpc::post(&mcp.http, &mcp.url, Some(sid), None)
        .header("content-type", "application/json")
        .body(body.to_string());
    let call = tokio::spawn(request.send());
    let pid = number(&started(&fifo).await);
    // Aborting the task drops the request mid-flight: its connection is closed.
    call.abort();
    let cancelled_at = std::time::Instant::now();
    assert!(call.await.is_err_and(|e| e.is_cancelled()));
    let what = "abandoned request";
    interrupted(pid, &marker, cancelled_at, what).await;
    next_call_runs_at_once(&mcp, cancelled_at, what).await;
}

fn jsonrpc_bash(command: &str) -> Value {
    cli_mcp_e2e::jsonrpc::bash(json!({ "command": command }))
}

fn cancelled(request_id: Value) -> String {
    json!({
        "jsonrpc": "2.0",
        "method": "notifications/cancelled",
        "params": {"requestId": request_id, "reason": "the test cancels it"}
    })
    .to_string()
}

/// A handshake-era client cancels with `notifications/cancelled` on a POST of its own, while
/// the call's POST stays open: the named call ends with a tool error that says it was
/// cancelled, its command is interrupted, and the session's next call runs at once in the
/// same shell. A notification that names no running call of this client and session
/// cancels nothing.
#[tokio::test]
async fn a_cancel_notification_interrupts_the_call_it_names() {
    let server = local_server(&[]).await;
    let sid = "notified";
    let mcp = Mcp::new(&server, Some(sid));
    let r = mcp.bash("cd /tmp && export KEPT=yes").await;
    assert!(!is_error(&r), "{r}");
    let (dir, fifo) = fifo();
    let marker = dir.path().join("finished");
    let mut body = jsonrpc_bash(&support::long_command(&fifo, &marker));
    body["id"] = json!(7);
    let call = tokio::spawn({
        let mcp = mcp.clone();
        async move { mcp.post_raw(body.to_string()).await }
    });
    let pid = number(&started(&fifo).await);

    let no_session = Mcp {
        session: None,
        ..mcp.clone()
    };
    for (client, notification, why) in [
        (&mcp, cancelled(json!(8)), "another request id"),
        (&mcp, cancelled(json!("7")), "the id as a string"),
        (
            &mcp.session("elsewhere"),
            cancelled(json!(7)),
            "another session",
        ),
        (&no_session, cancelled(json!(7)), "no session header"),
        (
            &mcp,
            json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {}})
                .to_string(),
            "no request id",
        ),
    ] {
        let a = client.post_raw(notification).await;
        assert_eq!(a.status, 202, "{why}: {}", a.text);
    }
    // A call on another session takes long enough for a wrongly cancelled command to be
    // gone by its answer.
    assert!(!is_error(&mcp.session("bystander").bash("true").await));
    assert!(
        cli_mcp_e2e::process::running(pid) && !call.is_finished(),
        "a notification that names another call cancelled this one"
    );

    let a = mcp.post_raw(cancelled(json!(7))).await;
    let cancelled_at = std::time::Instant::now();
    assert_eq!(a.status, 202, "{}", a.text);
    let answer = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("the cancelled call answers within 5 s")
        .expect("join");
    let result = &answer.body["result"];
    assert!(is_error(result), "{}", answer.text);
    assert!(
        text(result).contains("cancelled by the client")
            && text(result).contains("the shell kept its state"),
        "{}",
        answer.text
    );
    let what = "notifications/cancelled";
    interrupted(pid, &marker, cancelled_at, what).await;
    next_call_runs_at_once(&mcp, cancelled_at, what).await;

    let metrics = support::http()
        .get(server.health_url("/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("cli_mcp_exec_duration_seconds_count{outcome=\"cancelled\"} 1"),
        "a cancel is counted as an outcome:\n{metrics}"
    );
}

/// The local backend behind a loopback proxy that breaks the first connection to the agent:
/// it reads the whole request and closes without an answer, as a connection that fails
/// mid-call does. Later connections go through to the agent.
mod broken_first_connection {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use async_trait::async_trait;
    use cli_mcp_api::SessionId;
    use cli_mcp_server::agent_client::AgentError;
    use cli_mcp_server::auth::Caller;
    use cli_mcp_server::sessions::local::LocalBackend;
    use cli_mcp_server::sessions::{Activity, Backend, Sandbox, SessionError, SessionSummary};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    pub struct Proxied {
        pub inner: Arc<LocalBackend>,
        /// `http://…` of the agent the proxy stands in front of, and of the proxy.
        pub agent: String,
        pub proxy: String,
    }

    impl Proxied {
        fn through_proxy(&self, mut s: Sandbox) -> Sandbox {
            if s.endpoint == self.agent {
                s.endpoint = self.proxy.clone();
            }
            s
        }
    }

    #[async_trait]
    impl Backend for Proxied {
        async fn acquire(
            &self,
            sid: &SessionId,
            caller: &Caller,
            after: Option<&Sandbox>,
        ) -> Result<Sandbox, SessionError> {
            let s = self.inner.acquire(sid, caller, after).await?;
            Ok(self.through_proxy(s))
        }
        fn invalidate(&self, sid: &SessionId, sandbox: &Sandbox, why: &AgentError) {
            self.inner.invalidate(sid, sandbox, why)
        }
        fn activity(&self, sid: &SessionId, sandbox: &Sandbox, event: Activity) {
            self.inner.activity(sid, sandbox, event)
        }
        fn ended(&self, sid: &SessionId, sandbox: &Sandbox) -> bool {
            self.inner.ended(sid, sandbox)
        }
        async fn delete(&self, sid: &SessionId, caller: &Caller) -> Result<(), SessionError> {
            self.inner.delete(sid, caller).await
        }
        async fn list(&self, caller: &Caller) -> Result<Vec<SessionSummary>, SessionError> {
            self.inner.list(caller).await
        }
        async fn ready(&self) -> Result<(), String> {
            self.inner.ready().await
        }
        async fn shutdown(&self) {
            self.inner.shutdown().await
        }
    }

    /// Starts the proxy to `agent` (`http://host:port`); returns its `http://host:port`, and
    /// a flag set once it has broken the first connection.
    pub async fn proxy(agent: &str) -> (String, Arc<AtomicBool>) {
        let upstream = agent.trim_start_matches("http://").to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let broke = Arc::new(AtomicBool::new(false));
        let broke_first = broke.clone();
        tokio::spawn(async move {
            let Ok((mut first, _)) = listener.accept().await else {
                return;
            };
            read_request(&mut first).await;
            let _ = first.shutdown().await;
            drop(first);
            broke_first.store(true, Ordering::SeqCst);
            while let Ok((mut conn, _)) = listener.accept().await {
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    if let Ok(mut up) = TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut conn, &mut up).await;
                    }
                });
            }
        });
        (format!("http://{addr}"), broke)
    }

    /// Reads one HTTP/1 request with a `Content-Length` body.
    async fn read_request(conn: &mut TcpStream) {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let length = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                if buf.len() >= end + 4 + length {
                    return;
                }
            }
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

/// A connection to a session's agent that breaks mid-call (the request sent, no answer)
/// does not cost the session its shell while the agent still answers: the retry goes to the
/// same agent, as it goes to the same pod in a cluster, and the shell keeps its state. The
/// agent never got the first request, so the retry runs the command once.
#[tokio::test]
async fn a_broken_connection_to_a_healthy_local_agent_keeps_the_shell() {
    use std::sync::Arc;

    use cli_mcp_api::SessionId;
    use cli_mcp_server::agent_client::{AgentClient, AgentError};
    use cli_mcp_server::auth::Caller;
    use cli_mcp_server::cli::Limits;
    use cli_mcp_server::metrics::Metrics;
    use cli_mcp_server::sessions::local::LocalBackend;
    use cli_mcp_server::sessions::{Backend as _, SessionManager};
    use tokio_util::sync::CancellationToken;

    support::ensure_built(false);
    let metrics = Arc::new(Metrics::new());
    let client = AgentClient::new(0).expect("agent client");
    let local = LocalBackend::new(
        support::agent_bin(),
        Limits::default(),
        client.clone(),
        metrics.clone(),
    )
    .expect("local backend");
    let (sid, caller) = (
        SessionId::parse("kept").expect("session id"),
        Caller::anonymous(),
    );
    let (timeout, cancel) = (Duration::from_secs(30), CancellationToken::new());
    let direct = SessionManager::new(local.clone(), client.clone(), metrics.clone());
    let first = direct
        .exec(&sid, &caller, "export MARK=kept".into(), timeout, &cancel)
        .await
        .expect("first command");
    let agent = local
        .acquire(&sid, &caller, None)
        .await
        .expect("the session's agent");
    let (proxy, broke) = broken_first_connection::proxy(&agent.endpoint).await;
    let proxied = SessionManager::new(
        Arc::new(broken_first_connection::Proxied {
            inner: local.clone(),
            agent: agent.endpoint.clone(),
            proxy,
        }),
        client,
        metrics,
    );

    let after = proxied
        .exec(&sid, &caller, "echo \"$MARK\"".into(), timeout, &cancel)
        .await
        .expect("the retry on the same agent");
    assert!(
        broke.load(std::sync::atomic::Ordering::SeqCst),
        "the call went through without a broken connection: nothing was tested"
    );
    assert_eq!(after.response.stdout, "kept\n");
    assert_eq!(after.reset, None);
    assert_eq!(after.sandbox, first.sandbox, "the agent was replaced");

    // An agent that answered that it cannot serve (401, 503) is replaced all the same: its
    // /healthz would not tell.
    let refused = AgentError::Status {
        status: reqwest::StatusCode::SERVICE_UNAVAILABLE,
        code: None,
        message: "shutting down".into(),
    };
    local.invalidate(&sid, &agent, &refused);
    let next = local
        .acquire(&sid, &caller, None)
        .await
        .expect("a new agent");
    assert!(next.uid != agent.uid && next.replaced, "{next:?}");
    local.shutdown().await;
}
