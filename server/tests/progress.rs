//! Progress notifications on the wire (local backend, raw HTTP): a `tools/call` with
//! `_meta.progressToken` is answered as an SSE stream of `notifications/progress` followed
//! by the result, and nothing after it; the same call without a token is answered as before,
//! one `application/json` result. The official SDKs' callbacks are in `sdk.rs`.

mod support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use cli_mcp_e2e::child::LocalServer;
use cli_mcp_e2e::jsonrpc;
use support::Server;

const COMMAND: &str = "for i in 1 2 3; do echo line$i; sleep 1.2; done";

async fn local_server() -> Server {
    support::ensure_built(false);
    let agent = support::agent_bin();
    Server::start(
        &LocalServer::local_backend(agent.to_str().expect("utf-8 path")),
        &[],
    )
    .await
}

/// Posts a `tools/call` of [`COMMAND`] (with `meta` as its `_meta`); the content type, the
/// JSON-RPC messages of the answer in order, and how long it took.
async fn call(
    server: &Server,
    session: &str,
    meta: Option<Value>,
) -> (String, Vec<Value>, Duration) {
    let mut params = json!({"name": "bash", "arguments": {"command": COMMAND}});
    if let Some(meta) = meta {
        params["_meta"] = meta;
    }
    let body = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params});
    let t0 = Instant::now();
    let resp = jsonrpc::post(&support::http(), &server.url("/mcp"), Some(session), None)
        .header("content-type", "application/json")
        .header("mcp-protocol-version", "2025-11-25")
        .body(body.to_string())
        .send()
        .await
        .expect("POST /mcp");
    assert_eq!(resp.status(), 200);
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = resp.text().await.expect("body");
    let took = t0.elapsed();
    let messages = if content_type.starts_with("text/event-stream") {
        text.lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
            .collect()
    } else {
        vec![serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))]
    };
    (content_type, messages, took)
}

#[tokio::test]
async fn progress_notifications_come_before_the_result_and_only_when_asked_for() {
    let server = local_server().await;

    let (content_type, messages, _) = call(&server, "no-token", None).await;
    assert!(
        content_type.starts_with("application/json"),
        "without a token the answer is one JSON result, as before: {content_type}"
    );
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert_eq!(
        messages[0]["result"]["structuredContent"]["stdout"],
        "line1\nline2\nline3\n"
    );

    let (content_type, messages, took) = call(
        &server,
        "with-token",
        Some(json!({"progressToken": "tok-1"})),
    )
    .await;
    assert!(
        content_type.starts_with("text/event-stream"),
        "notifications need a stream: {content_type}"
    );
    let (last, notes) = messages.split_last().expect("messages");
    assert_eq!(last["id"], 7, "the result comes last: {messages:?}");
    assert_eq!(
        last["result"]["structuredContent"]["stdout"],
        "line1\nline2\nline3\n"
    );
    assert!(notes.len() >= 2, "{messages:?}");
    assert!(
        notes.len() as f64 <= took.as_secs_f64().floor(),
        "at most one a second: {} in {took:?}",
        notes.len()
    );
    let mut before = 0.0;
    for n in notes {
        assert_eq!(n["method"], "notifications/progress", "{n}");
        assert_eq!(n["params"]["progressToken"], "tok-1", "{n}");
        let progress = n["params"]["progress"].as_f64().unwrap_or_default();
        assert!(progress > before, "{messages:?}");
        before = progress;
        assert_eq!(
            n["params"]["message"],
            format!("line{}", progress as u64 / 6),
            "{n}"
        );
    }

    // A number token is echoed as a number.
    let (_, messages, _) = call(&server, "number-token", Some(json!({"progressToken": 42}))).await;
    assert_eq!(messages[0]["params"]["progressToken"], 42, "{messages:?}");
}
