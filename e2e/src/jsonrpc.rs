//! MCP over HTTP as the tests speak it: the JSON-RPC request, the POST to `/mcp` with its
//! headers, the answer in a JSON body or an SSE stream, and readers of a tool result.

use serde_json::{json, Value};

/// What an MCP client accepts (the server answers JSON; the transport allows SSE).
pub const ACCEPT: &str = "application/json, text/event-stream";

/// A JSON-RPC request with id 1.
pub fn request(method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
}

/// A `tools/call` of the `bash` tool with `arguments` (`{"command": ...}`, maybe more).
pub fn bash(arguments: Value) -> Value {
    request(
        "tools/call",
        json!({"name": "bash", "arguments": arguments}),
    )
}

/// A POST to the MCP endpoint `url` with the headers of an MCP client: `Accept`, and the
/// session id and bearer token when given. The caller adds the body.
pub fn post(
    http: &reqwest::Client,
    url: &str,
    session: Option<&str>,
    bearer: Option<&str>,
) -> reqwest::RequestBuilder {
    let mut req = http.post(url).header("accept", ACCEPT);
    if let Some(s) = session {
        req = req.header("x-session-id", s);
    }
    if let Some(b) = bearer {
        req = req.bearer_auth(b);
    }
    req
}

/// The JSON-RPC messages of a JSON body (one) or of the data lines of an SSE stream (the
/// notifications, then the response), in order.
pub fn messages(text: &str) -> Vec<Value> {
    match serde_json::from_str(text) {
        Ok(v) => vec![v],
        Err(_) => text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .collect(),
    }
}

/// The JSON-RPC response in a JSON body or in the data lines of an SSE stream.
pub fn response(text: &str) -> Value {
    messages(text)
        .into_iter()
        .find(|v| v.get("result").is_some() || v.get("error").is_some())
        .unwrap_or(Value::Null)
}

/// The text of a tool result: its text contents, one a line (the server sends one).
pub fn text(result: &Value) -> String {
    result["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["text"].as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

/// `structuredContent.stdout` of a `bash` tool result.
pub fn stdout(result: &Value) -> &str {
    result["structuredContent"]["stdout"]
        .as_str()
        .unwrap_or_default()
}

/// `structuredContent` of a tool result.
pub fn structured(result: &Value) -> &Value {
    &result["structuredContent"]
}

/// `isError` of a tool result (absent: false).
pub fn is_error(result: &Value) -> bool {
    result["isError"].as_bool().unwrap_or(false)
}
