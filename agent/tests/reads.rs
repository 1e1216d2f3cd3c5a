//! The agent's read-only endpoints beside `/exec`: `GET /exec/progress` (how far a running
//! command is) and `GET /files/spill`, `GET /files/workspace` (a spill or a workspace file
//! read back in chunks), against a real agent and bash, with what a hostile shell can plant.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{session_token, Agent};

/// `GET path` with the session token (or `bearer`); status, headers and body.
async fn get(
    a: &Agent,
    path: &str,
    query: &[(&str, &str)],
    bearer: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, Vec<u8>) {
    let token = session_token();
    let bearer = bearer.unwrap_or(token.expose());
    let res = a
        .http
        .get(a.url(path))
        .query(query)
        .bearer_auth(bearer)
        .send()
        .await
        .expect("request reaches the agent");
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    let body = res.bytes().await.expect("body").to_vec();
    (status, headers, body)
}

fn json_of(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}",
            String::from_utf8_lossy(&body[..body.len().min(500)])
        )
    })
}

async fn progress(a: &Agent, request_id: &str) -> Value {
    let (status, _, body) = get(a, "/exec/progress", &[("request_id", request_id)], None).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    json_of(&body)
}

#[tokio::test]
async fn progress_follows_the_running_request_only() {
    let a = Agent::start();
    // Two gates: stdout and stderr are two pipes, and when both hold data the agent may read
    // either first, so the stderr line is written only after the stdout line was seen.
    let gate = tempfile::tempdir().expect("tempdir");
    let first = gate.path().join("first");
    let fifo = gate.path().join("gate");
    for g in [&first, &fifo] {
        nix::unistd::mkfifo(g, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    }
    let command = format!(
        "printf 'line1\\n'; cat '{}' >/dev/null; printf 'warn\\n\\n' >&2; printf 'partial'; cat '{}' >/dev/null; echo; echo done",
        first.display(),
        fifo.display()
    );
    assert_eq!(
        progress(&a, "r-1").await,
        json!({"running": false, "bytes": 0})
    );
    let exec = {
        let http = a.http.clone();
        let url = a.url("/exec");
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(session_token().expose())
                .json(&json!({"command": command, "request_id": "r-1"}))
                .send()
                .await
                .expect("exec")
                .json::<Value>()
                .await
                .expect("JSON")
        })
    };
    let wait_for = |bytes: u64| {
        let a = &a;
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                let p = progress(a, "r-1").await;
                if p["bytes"] == bytes {
                    return p;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no progress to {bytes} bytes within 20 s: {p}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(
        wait_for(6).await,
        json!({"running": true, "bytes": 6, "last_line": "line1"})
    );
    std::fs::write(&first, b"go\n").expect("open the first gate");
    // The command blocks on the second gate once it has printed 6 + 6 + 7 bytes.
    assert_eq!(
        wait_for(19).await,
        json!({"running": true, "bytes": 19, "last_line": "warn"}),
        "the last complete non-blank line of either stream"
    );
    assert_eq!(
        progress(&a, "other").await,
        json!({"running": false, "bytes": 0}),
        "another request id learns nothing of this command"
    );
    std::fs::write(&fifo, b"go\n").expect("open the gate");
    let done = exec.await.expect("exec task");
    assert_eq!(done["stdout"], "line1\npartial\ndone\n", "{done}");
    assert_eq!(
        progress(&a, "r-1").await,
        json!({"running": false, "bytes": 0})
    );

    let (status, _, body) = get(&a, "/exec/progress", &[("request_id", "r-1")], Some("nope")).await;
    assert_eq!(
        (status, json_of(&body)["code"].clone()),
        (401, json!("unauthorized"))
    );
    let (status, _, body) = get(&a, "/exec/progress", &[], None).await;
    let v = json_of(&body);
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap_or_default()
            .contains("request_id"),
        "{v}"
    );
}

/// The spill file a truncated stream names in its marker.
fn spill_name(stream: &str) -> String {
    let start = stream.find("/spill/").expect("a spill path in the marker") + "/spill/".len();
    stream[start..]
        .split(|c: char| c.is_whitespace() || c == ';')
        .next()
        .expect("a name")
        .to_owned()
}

#[tokio::test]
async fn a_spill_is_read_back_in_chunks_and_nothing_else_is() {
    let a = Agent::start_with(support::Opts {
        extra_args: &["--output-budget", "1024"],
        ..Default::default()
    });
    // 100 000 bytes that are not UTF-8.
    let v = a.exec("head -c 100000 /dev/zero | tr '\\0' '\\377'").await;
    assert_eq!(v["truncated"], true, "{v}");
    let resp: cli_mcp_api::wire::ExecResponse = serde_json::from_value(v).expect("an answer");
    let out = String::from_utf8_lossy(&resp.stdout_bytes().expect("stdout")).into_owned();
    let name = spill_name(&out);
    let (status, headers, body) = get(
        &a,
        "/files/spill",
        &[("name", &name), ("offset", "99990"), ("length", "100")],
        None,
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(body, vec![0xff; 10]);
    assert_eq!(headers["x-file-size"], "100000");
    assert_eq!(headers["content-type"], "application/octet-stream");

    // A huge length is capped by the agent (4 MiB), not refused.
    let (status, _, body) = get(
        &a,
        "/files/spill",
        &[("name", &name), ("length", "18446744073709551615")],
        None,
    )
    .await;
    assert_eq!((status, body.len()), (200, 100000));

    // The shell plants a link to a secret as a spill, and asks for names that climb out.
    a.exec(&format!(
        "ln -s /etc/passwd '{}/spill/evil.stdout'; echo secret > '{}/secret'",
        a.state_dir.display(),
        a.state_dir.display()
    ))
    .await;
    for (name, status, code) in [
        ("evil.stdout", 404, "no_such_file"),
        ("../secret", 400, "bad_request"),
        ("..%2Fsecret", 400, "bad_request"),
        ("missing.stdout", 404, "no_such_file"),
    ] {
        let (got, _, body) = get(&a, "/files/spill", &[("name", name)], None).await;
        let v = json_of(&body);
        assert_eq!(
            (got, v["code"].as_str()),
            (status, Some(code)),
            "{name}: {v}"
        );
    }
    let (status, _, _) = get(&a, "/files/spill", &[("name", &name)], Some("wrong")).await;
    assert_eq!(status, 401);
    let (status, _, body) = get(
        &a,
        "/files/spill",
        &[("name", &name), ("offset", "-1")],
        None,
    )
    .await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
}

#[tokio::test]
async fn workspace_files_are_read_beneath_the_workspace_only() {
    let a = Agent::start();
    let v = a
        .exec(&format!(
            "mkdir -p src && printf 'fn main() {{}}\\n' > src/main.rs && ln -s /etc/passwd passwd \
             && ln -s '{}' state && ln -s ../.. up && mkfifo pipe && echo ok",
            a.state_dir.display()
        ))
        .await;
    assert_eq!(v["stdout"], "ok\n", "{v}");
    let (status, headers, body) = get(
        &a,
        "/files/workspace",
        &[("path", "src/main.rs"), ("offset", "3"), ("length", "4")],
        None,
    )
    .await;
    assert_eq!((status, body.as_slice()), (200, &b"main"[..]));
    assert_eq!(headers["x-file-size"], "13");
    for path in [
        "passwd",
        "state/shell-used",
        "up/etc/passwd",
        "../../etc/passwd",
        "/../etc/passwd",
    ] {
        let (status, _, body) = get(&a, "/files/workspace", &[("path", path)], None).await;
        let v = json_of(&body);
        assert_eq!(status, 400, "{path}: {v}");
        assert!(
            v["error"]
                .as_str()
                .unwrap_or_default()
                .contains("workspace"),
            "{path}: {v}"
        );
    }
    // A FIFO would block a plain read: it is refused at once.
    let (status, _, body) = tokio::time::timeout(
        Duration::from_secs(10),
        get(&a, "/files/workspace", &[("path", "pipe")], None),
    )
    .await
    .expect("a FIFO does not hold the read");
    assert_eq!(
        (status, json_of(&body)["code"].clone()),
        (404, json!("no_such_file"))
    );
    let (status, _, _) = get(
        &a,
        "/files/workspace",
        &[("path", "src/main.rs")],
        Some("x"),
    )
    .await;
    assert_eq!(status, 401);
}
