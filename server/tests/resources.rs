//! A session's spill files and workspace files as MCP resources (local backend, raw
//! JSON-RPC): the templates, a truncated result naming its spill, chunked binary-safe reads,
//! what a hostile shell plants, and a session that is gone. Another identity's session is
//! refused in `kubernetes.rs` (it needs real callers).

mod support;

use base64::Engine as _;
use serde_json::{json, Value};

use cli_mcp_e2e::child::LocalServer;
use support::{Mcp, Server};

async fn local_server(extra: &[&str]) -> Server {
    support::ensure_built(false);
    let agent = support::agent_bin();
    let mut args = LocalServer::local_backend(agent.to_str().expect("utf-8 path"));
    args.extend_from_slice(extra);
    Server::start(&args, &[]).await
}

/// `resources/read` of `uri`: its one content, or the JSON-RPC error.
async fn read(mcp: &Mcp, uri: &str) -> Result<Value, Value> {
    let a = mcp.rpc("resources/read", json!({ "uri": uri })).await;
    assert_eq!(a.status, 200, "{}", a.text);
    if let Some(e) = a.body.get("error") {
        return Err(e.clone());
    }
    let contents = &a.body["result"]["contents"];
    assert_eq!(contents.as_array().map(Vec::len), Some(1), "{}", a.text);
    Ok(contents[0].clone())
}

/// The bytes of one content: `text` as is, `blob` decoded.
fn bytes_of(content: &Value) -> Vec<u8> {
    match (content.get("text"), content.get("blob")) {
        (Some(t), None) => t.as_str().expect("text").as_bytes().to_vec(),
        (None, Some(b)) => base64::engine::general_purpose::STANDARD
            .decode(b.as_str().expect("blob"))
            .expect("base64"),
        _ => panic!("neither text nor blob: {content}"),
    }
}

/// Reads `uri` whole, chunk after chunk as `_meta.next` says.
async fn read_all(mcp: &Mcp, uri: &str) -> (Vec<u8>, usize) {
    let mut out = Vec::new();
    let mut reads = 0;
    let mut offset = 0u64;
    loop {
        let c = read(mcp, &format!("{uri}?offset={offset}"))
            .await
            .unwrap_or_else(|e| panic!("{uri} at {offset}: {e}"));
        reads += 1;
        assert_eq!(c["_meta"]["offset"], offset, "{c}");
        out.extend(bytes_of(&c));
        match c["_meta"]["next"].as_u64() {
            Some(next) => {
                assert_eq!(next, out.len() as u64, "{}", c["_meta"]);
                offset = next;
            }
            None => {
                assert_eq!(c["_meta"]["size"], out.len() as u64, "{}", c["_meta"]);
                return (out, reads);
            }
        }
    }
}

/// The spill resource URIs a `tools/call` result names (text note and `resource_link`).
fn spill_uris(result: &Value) -> Vec<String> {
    let content = result["content"].as_array().expect("content");
    let links: Vec<String> = content
        .iter()
        .filter(|b| b["type"] == "resource_link")
        .map(|b| b["uri"].as_str().expect("uri").to_owned())
        .collect();
    for uri in &links {
        assert!(
            content.iter().any(|b| b["type"] == "text"
                && b["text"]
                    .as_str()
                    .unwrap_or_default()
                    .contains(uri.as_str())),
            "a text block names {uri} for the model: {result}"
        );
    }
    links
}

fn error_message(e: &Value) -> &str {
    e["message"].as_str().unwrap_or_default()
}

#[tokio::test]
async fn truncated_output_is_read_back_whole_in_chunks() {
    let server = local_server(&["--max-resource-read-bytes", "65536"]).await;
    let mcp = Mcp::new(&server, Some("res-1"));

    let init = mcp
        .rpc(
            "initialize",
            json!({"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "t", "version": "1"}}),
        )
        .await;
    assert!(
        init.body["result"]["capabilities"]["resources"].is_object(),
        "{}",
        init.text
    );
    let templates = mcp.rpc("resources/templates/list", json!({})).await;
    let uris: Vec<&str> = templates.body["result"]["resourceTemplates"]
        .as_array()
        .expect("templates")
        .iter()
        .filter_map(|t| t["uriTemplate"].as_str())
        .collect();
    assert_eq!(
        uris,
        [
            "sandbox://{session}/spill/{name}",
            "sandbox://{session}/workspace/{+path}"
        ]
    );
    let listed = mcp.rpc("resources/list", json!({})).await;
    assert_eq!(
        listed.body["result"]["resources"],
        json!([]),
        "{}",
        listed.text
    );

    // 588895 bytes of text: the result keeps 64 KiB of it and names the spill.
    let r = mcp.bash("seq 1 100000").await;
    let expected: String = (1..=100_000).map(|i| format!("{i}\n")).collect();
    assert_eq!(r["structuredContent"]["truncated"], true, "{r}");
    let uris = spill_uris(&r);
    assert_eq!(uris.len(), 1, "{r}");
    assert!(
        uris[0].starts_with("sandbox://res-1/spill/") && uris[0].ends_with(".stdout"),
        "{uris:?}"
    );
    let (whole, reads) = read_all(&mcp, &uris[0]).await;
    assert_eq!(reads, expected.len().div_ceil(65536), "64 KiB per read");
    assert!(
        whole == expected.as_bytes(),
        "the spill is the whole stream"
    );

    // A length over the server's cap is cut to it, not refused.
    let c = read(
        &mcp,
        &format!("{}?offset=10&length=18446744073709551615", uris[0]),
    )
    .await
    .expect("read");
    assert_eq!(c["_meta"]["length"], 65536, "{}", c["_meta"]);
    assert_eq!(c["_meta"]["next"], 65546);
    let c = read(&mcp, &format!("{}?offset=5&length=7", uris[0]))
        .await
        .expect("read");
    assert_eq!(
        (c["text"].as_str(), c["mimeType"].as_str()),
        (Some("\n4\n5\n6\n"), Some("text/plain"))
    );
    let c = read(&mcp, &format!("{}?offset=99999999", uris[0]))
        .await
        .expect("past the end");
    assert_eq!(
        (bytes_of(&c).len(), c["_meta"]["next"].clone()),
        (0, Value::Null)
    );

    // Bytes that are not UTF-8 come back as a base64 blob, exactly.
    let r = mcp
        .bash("head -c 100000 /dev/zero | tr '\\0' '\\377' >&2")
        .await;
    let uris = spill_uris(&r);
    assert!(uris.len() == 1 && uris[0].ends_with(".stderr"), "{r}");
    let c = read(&mcp, &format!("{}?length=1000", uris[0]))
        .await
        .expect("read");
    assert_eq!(c["mimeType"], "application/octet-stream", "{c}");
    assert_eq!(bytes_of(&c), vec![0xff; 1000]);
}

#[tokio::test]
async fn workspace_files_and_hostile_names() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("res-2"));
    let r = mcp
        .bash(
            "mkdir -p 'src dir' && printf 'hello\\n' > 'src dir/a.txt' && ln -s /etc/passwd passwd \
             && ln -s ../state st && ln -s 'src dir/a.txt' alias && mkfifo pipe && echo ok",
        )
        .await;
    assert_eq!(r["structuredContent"]["stdout"], "ok\n", "{r}");

    let c = read(&mcp, "sandbox://res-2/workspace/src%20dir/a.txt")
        .await
        .expect("read");
    assert_eq!(c["text"], "hello\n");
    assert_eq!(c["_meta"], json!({"offset": 0, "length": 6, "size": 6}));
    let c = read(&mcp, "sandbox://res-2/workspace/alias")
        .await
        .expect("a link within");
    assert_eq!(c["text"], "hello\n");

    for (uri, needle) in [
        ("sandbox://res-2/workspace/passwd", "out of the workspace"),
        (
            "sandbox://res-2/workspace/st/shell-used",
            "out of the workspace",
        ),
        ("sandbox://res-2/workspace/..%2Fstate%2Fshell-used", "`..`"),
        ("sandbox://res-2/workspace/../state/shell-used", "`..`"),
        (
            "sandbox://res-2/spill/..%2F..%2Fworkspace%2Fsrc%20dir%2Fa.txt",
            "not the name of a spill",
        ),
        ("sandbox://res-2/spill/.hidden", "not the name of a spill"),
        ("sandbox://res-2/workspace/pipe", "not a regular file"),
        ("sandbox://res-2/spill/9-nothing.stdout", "no spill"),
        ("sandbox://res-2/workspace/missing", "no file"),
        (
            "sandbox://res-2/elsewhere/x",
            "neither spill/ nor workspace/",
        ),
        ("file:///etc/passwd", "not a sandbox:// URI"),
    ] {
        let e = read(&mcp, uri).await.expect_err(uri);
        assert!(error_message(&e).contains(needle), "{uri}: {e}");
    }
}

#[tokio::test]
async fn a_session_without_a_sandbox_is_gone_and_is_not_started_by_a_read() {
    let server = local_server(&[]).await;
    let mcp = Mcp::new(&server, Some("res-3"));
    let r = mcp.bash("seq 1 100000").await;
    let uri = spill_uris(&r).pop().expect("a spill");
    read(&mcp, &uri)
        .await
        .expect("readable while the session lives");

    let del = support::http()
        .delete(server.url("/sessions/res-3"))
        .send()
        .await
        .expect("DELETE");
    assert_eq!(del.status(), 204);
    for uri in [
        uri.as_str(),
        "sandbox://res-3/workspace/x",
        "sandbox://never-started/spill/1-a.stdout",
    ] {
        let e = read(&mcp, uri).await.expect_err(uri);
        assert_eq!(e["code"], -32002, "resource not found: {e}");
        assert!(error_message(&e).contains("gone with it"), "{uri}: {e}");
    }
    let list: Value = support::http()
        .get(server.url("/sessions"))
        .send()
        .await
        .expect("GET /sessions")
        .json()
        .await
        .expect("JSON");
    assert_eq!(list["sessions"], json!([]), "a read started no sandbox");
    // The next call starts a fresh session, whose spill names are its own.
    let r = mcp.bash("echo fresh").await;
    assert_eq!(r["structuredContent"]["stdout"], "fresh\n");
    let e = read(&mcp, &uri).await.expect_err("the old spill");
    assert!(error_message(&e).contains("no spill"), "{e}");
}
