//! The agent's HTTP contract: auth, assignment, concurrency, replay, limits, lifecycle.

mod support;

use std::time::Duration;

use serde_json::json;
use support::{assign_token, session_token, Agent, Mode, Opts};

fn fifo(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("started");
    nix::unistd::mkfifo(&p, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    p
}

/// Blocks until a command writes a line into `fifo`: proof that it is running.
async fn wait_started(fifo: std::path::PathBuf) {
    tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo).expect("read fifo"))
        .await
        .expect("join");
}

#[tokio::test]
async fn missing_or_wrong_bearer_is_401_json() {
    let a = Agent::start();
    let (st, v) = a.post("/exec", None, json!({"command": "true"})).await;
    assert_eq!((st, v["code"].as_str()), (401, Some("unauthorized")));
    let (st, v) = a
        .post("/exec", Some("nope"), json!({"command": "true"}))
        .await;
    assert_eq!((st, v["code"].as_str()), (401, Some("unauthorized")));
    let (st, _) = a
        .post(
            "/exec",
            Some(assign_token().expose()),
            json!({"command": "true"}),
        )
        .await;
    assert_eq!(st, 401, "an assign token is not a session token");
}

#[tokio::test]
async fn pool_pod_refuses_exec_until_assigned_then_serves_the_session() {
    let a = Agent::start_with(Opts {
        mode: Mode::Pool,
        ..Default::default()
    });
    let (st, v) = a
        .post(
            "/exec",
            Some(session_token().expose()),
            json!({"command": "true"}),
        )
        .await;
    assert_eq!((st, v["code"].as_str()), (503, Some("not_assigned")));

    let body = json!({"session_id": "s1", "token_sha256": session_token().commitment().to_hex()});
    let (st, v) = a.post("/assign", Some("wrong"), body.clone()).await;
    assert_eq!((st, v["code"].as_str()), (401, Some("unauthorized")));
    let (st, v) = a.post("/assign", None, body.clone()).await;
    assert_eq!(st, 401, "{v}");

    let (st, v) = a
        .post("/assign", Some(assign_token().expose()), body.clone())
        .await;
    assert_eq!((st, v["session_id"].as_str()), (200, Some("s1")));
    // The same assignment again (a lost response) is answered, not refused.
    let (st, _) = a.post("/assign", Some(assign_token().expose()), body).await;
    assert_eq!(st, 200);
    // Any other assignment is a conflict.
    let other = json!({"session_id": "s2", "token_sha256": session_token().commitment().to_hex()});
    let (st, v) = a
        .post("/assign", Some(assign_token().expose()), other)
        .await;
    assert_eq!((st, v["code"].as_str()), (409, Some("already_assigned")));

    assert_eq!(a.exec("echo hi").await["stdout"], "hi\n");
}

#[tokio::test]
async fn assign_rejects_bad_bodies() {
    let a = Agent::start_with(Opts {
        mode: Mode::Pool,
        ..Default::default()
    });
    let tok = assign_token();
    let (st, v) = a
        .post(
            "/assign",
            Some(tok.expose()),
            json!({"session_id": "BAD ID", "token_sha256": "x"}),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap_or_default()
            .contains("session id"),
        "{v}"
    );
    let (st, v) = a
        .post(
            "/assign",
            Some(tok.expose()),
            json!({"session_id": "s1", "token_sha256": "short"}),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    // Still unassigned after the bad attempts.
    let (st, _) = a
        .post(
            "/exec",
            Some(session_token().expose()),
            json!({"command": "true"}),
        )
        .await;
    assert_eq!(st, 503);
}

#[tokio::test]
async fn assigned_pod_refuses_assign() {
    let a = Agent::start();
    let body = json!({"session_id": "s9", "token_sha256": session_token().commitment().to_hex()});
    let (st, v) = a.post("/assign", Some(assign_token().expose()), body).await;
    assert_eq!((st, v["code"].as_str()), (409, Some("already_assigned")));
}

#[tokio::test]
async fn restarted_agent_recovers_its_claim_from_annotations() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ann = dir.path().join("annotations");
    std::fs::write(
        &ann,
        format!(
            "cli-mcp.redhat.com/created-at=\"2026-11-30T00:00:00Z\"\ncli-mcp.redhat.com/token-sha256=\"{}\"\n",
            session_token().commitment().to_hex()
        ),
    )
    .expect("write annotations");
    // Started as a warm pod, but the claim is in the annotations: assigned at once.
    let a = Agent::start_with(Opts {
        mode: Mode::Pool,
        annotations: Some(&ann),
        ..Default::default()
    });
    assert_eq!(a.exec("echo back").await["stdout"], "back\n");
}

#[tokio::test]
async fn malformed_and_oversize_bodies_are_clear_json_errors() {
    let a = Agent::start_with(Opts {
        extra_args: &["--max-body-bytes", "1024"],
        ..Default::default()
    });
    let tok = session_token();
    let raw = |body: String| {
        a.http
            .post(a.url("/exec"))
            .bearer_auth(tok.expose())
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let res = raw("{not json".into()).await.expect("reaches agent");
    assert_eq!(res.status(), 400);
    let v: serde_json::Value = res.json().await.expect("json");
    assert_eq!(v["code"], "bad_request");
    assert!(
        v["error"]
            .as_str()
            .unwrap_or_default()
            .contains("invalid JSON"),
        "{v}"
    );

    let big = format!("{{\"command\": \"{}\"}}", "x".repeat(4096));
    let res = raw(big).await.expect("reaches agent");
    assert_eq!(res.status(), 413);
    let v: serde_json::Value = res.json().await.expect("json");
    assert_eq!(v["code"], "payload_too_large");

    for (body, needle) in [
        (json!({"cmd": "x"}), "unknown field"),
        (json!({"command": ""}), "empty"),
        (json!({"command": "a\u{0}b"}), "NUL"),
        (json!({"command": "true", "timeout_ms": 0}), "at least 1"),
        (json!({"command": "true", "timeout_ms": 300_001}), "maximum"),
    ] {
        let (st, v) = a.post("/exec", Some(tok.expose()), body).await;
        assert_eq!(st, 400, "{v}");
        assert!(
            v["error"].as_str().unwrap_or_default().contains(needle),
            "{v}"
        );
    }
    let res = a
        .http
        .get(a.url("/nope"))
        .send()
        .await
        .expect("reaches agent");
    assert_eq!(res.status(), 404);
    // Nothing above disturbed the shell.
    assert_eq!(a.exec("echo fine").await["stdout"], "fine\n");
}

#[tokio::test]
async fn concurrent_call_waits_within_its_timeout_then_gets_busy() {
    let a = Agent::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let started = fifo(dir.path());
    let tok = session_token();
    let first = {
        let http = a.http.clone();
        let url = a.url("/exec");
        let cmd = format!("echo go > {}; sleep 2; echo first", started.display());
        let tok = tok.expose().to_owned();
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(tok)
                .json(&json!({"command": cmd, "timeout_ms": 20000}))
                .send()
                .await
                .expect("first reaches agent")
                .json::<serde_json::Value>()
                .await
                .expect("json")
        })
    };
    wait_started(started).await;
    let (st, v) = a
        .post(
            "/exec",
            Some(tok.expose()),
            json!({"command": "echo second", "timeout_ms": 200}),
        )
        .await;
    assert_eq!((st, v["code"].as_str()), (409, Some("busy")));
    // A caller willing to wait gets its turn after the first command.
    let v = a
        .exec_with(json!({"command": "echo third", "timeout_ms": 20000}))
        .await;
    assert_eq!(v["stdout"], "third\n");
    assert_eq!(first.await.expect("join")["stdout"], "first\n");
}

#[tokio::test]
async fn repeated_request_id_returns_the_last_response_without_running_again() {
    let a = Agent::start();
    let body = json!({"command": "echo x >> count; wc -l < count", "request_id": "r-1"});
    let one = a.exec_with(body.clone()).await;
    let two = a.exec_with(body).await;
    assert_eq!(one, two);
    assert_eq!(one["stdout"], "1\n");
    let three = a
        .exec_with(json!({"command": "echo x >> count; wc -l < count", "request_id": "r-2"}))
        .await;
    assert_eq!(three["stdout"], "2\n");
}

#[tokio::test]
async fn client_disconnect_interrupts_the_command() {
    let a = Agent::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let started = fifo(dir.path());
    let marker = dir.path().join("finished");
    let tok = session_token();
    let req = {
        let http = a.http.clone();
        let url = a.url("/exec");
        let cmd = format!(
            "echo go > {}; sleep 30; touch {}",
            started.display(),
            marker.display()
        );
        let tok = tok.expose().to_owned();
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(tok)
                .json(&json!({"command": cmd, "timeout_ms": 60000}))
                .send()
                .await
        })
    };
    wait_started(started).await;
    req.abort(); // drops the connection mid-request
    let _ = req.await;
    // Without the interruption this call would wait 30 s for the shell and get 409.
    let v = a
        .exec_with(json!({"command": "echo next", "timeout_ms": 10000}))
        .await;
    assert_eq!(v["stdout"], "next\n");
    assert!(
        !marker.exists(),
        "the interrupted command must not have gone on"
    );
}

#[tokio::test]
async fn sigterm_interrupts_a_long_command_answers_it_and_exits() {
    let mut a = Agent::start_with(Opts {
        extra_args: &["--drain-timeout-ms", "300"],
        ..Default::default()
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let started = fifo(dir.path());
    let tok = session_token();
    let req = {
        let http = a.http.clone();
        let url = a.url("/exec");
        let cmd = format!("echo go > {}; sleep 100", started.display());
        let tok = tok.expose().to_owned();
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(tok)
                .json(&json!({"command": cmd, "timeout_ms": 120000}))
                .send()
                .await
                .expect("answered before exit")
                .json::<serde_json::Value>()
                .await
                .expect("json")
        })
    };
    wait_started(started).await;
    let status = tokio::task::spawn_blocking(move || a.terminate())
        .await
        .expect("join");
    assert!(status.success(), "agent exit status {status:?}");
    let v = tokio::time::timeout(Duration::from_secs(30), req)
        .await
        .expect("response delivered")
        .expect("join");
    assert_eq!(v["exit_code"], 130, "{v}");
}

#[tokio::test]
async fn healthz_reports_assignment() {
    let a = Agent::start_with(Opts {
        mode: Mode::Pool,
        ..Default::default()
    });
    let v: serde_json::Value = a
        .http
        .get(a.url("/healthz"))
        .send()
        .await
        .expect("reaches agent")
        .json()
        .await
        .expect("json");
    assert_eq!(v, json!({"status": "ok", "assigned": false}));
}

#[test]
fn start_without_any_commitment_fails_with_a_clear_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = support::agent_command(dir.path())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--podinfo-annotations",
            "/nonexistent",
        ])
        .env_remove("TOKEN_SHA256")
        .env_remove("ASSIGN_SHA256")
        .output()
        .expect("run agent");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("neither TOKEN_SHA256"), "{err}");
}

/// Sends request headers announcing `len` body bytes, never sends the body, and returns what
/// the agent answers (or `None` if it waits for the body).
async fn headers_only(
    addr: std::net::SocketAddr,
    path: &str,
    bearer: &str,
    len: usize,
) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {bearer}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.expect("write headers");
    let mut buf = vec![0u8; 4096];
    match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
        Ok(Ok(n)) if n > 0 => Some(String::from_utf8_lossy(&buf[..n]).into_owned()),
        _ => None,
    }
}

#[tokio::test]
async fn unauthenticated_callers_are_refused_before_any_body_is_read() {
    let a = Agent::start_with(Opts {
        mode: Mode::Pool,
        ..Default::default()
    });
    // The body is announced but never sent: an answer proves it was not waited for.
    let exec = headers_only(a.addr, "/exec", "wrong", 1 << 20).await;
    assert!(
        exec.as_deref()
            .is_some_and(|r| r.starts_with("HTTP/1.1 503")),
        "{exec:?}"
    );
    let assign = headers_only(a.addr, "/assign", "wrong", 1 << 20).await;
    assert!(
        assign
            .as_deref()
            .is_some_and(|r| r.starts_with("HTTP/1.1 401")),
        "{assign:?}"
    );
}

#[tokio::test]
async fn reused_request_id_with_another_command_is_refused() {
    let a = Agent::start();
    a.exec_with(json!({"command": "echo one", "request_id": "r"}))
        .await;
    let (st, v) = a
        .post(
            "/exec",
            Some(session_token().expose()),
            json!({"command": "echo two", "request_id": "r"}),
        )
        .await;
    assert_eq!(st, 409, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap_or_default()
            .contains("different command"),
        "{v}"
    );
}

#[tokio::test]
async fn wrong_method_is_a_json_error() {
    let a = Agent::start();
    let res = a
        .http
        .get(a.url("/exec"))
        .send()
        .await
        .expect("reaches agent");
    assert_eq!(res.status(), 405);
    let v: serde_json::Value = res.json().await.expect("JSON body");
    assert_eq!(v["code"], "bad_request");
}

#[tokio::test]
async fn a_peer_that_never_finishes_its_request_cannot_delay_shutdown_forever() {
    let mut a = Agent::start_with(Opts {
        extra_args: &["--drain-timeout-ms", "200"],
        ..Default::default()
    });
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(a.addr)
        .await
        .expect("connect");
    let req = format!(
        "POST /exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: 100\r\n\r\n{{",
        session_token().expose()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    // The agent now waits for the rest of the body (up to its 10 s body timeout). SIGTERM
    // must still end it within drain + kill grace + 2 s, not after the peer gives up.
    let status = tokio::task::spawn_blocking(move || a.terminate())
        .await
        .expect("join");
    assert!(status.success(), "{status:?}");
    drop(s);
}
