//! A session's whole life under one sandbox runtime (runc or gVisor), on the real node: the
//! sandbox first proven to run under that runtime, then what a session does that leans on
//! the kernel under it — a persistent shell, a timeout that keeps the shell (process groups
//! and signals), a cancel that stops the command, progress notifications, a spilled output
//! read back as a resource, a workspace file read as a resource, and `DELETE`.
//!
//! gVisor implements Linux's system calls itself (`/proc`, signals, FIFOs, process groups
//! are its own), so the same journey runs under both, never a weaker one under either.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

use super::{sandbox_selector, session_of, stdout, text, Env, Mcp};
use crate::jsonrpc;
use crate::runtime::assert_sandbox_runs_under;
use crate::testing::{wait_for_set, TIMEOUT};
use cli_mcp_api::names::label;

/// The instance of this journey.
const NAME: &str = "rt";
/// How long a timed-out or cancelled `sleep` would run if nothing stopped it: the next call
/// must answer long before.
const SLEEP: u64 = 60;

/// A tool call of `bash` with `arguments`, its JSON-RPC messages (notifications first, the
/// response last) as the server streamed them.
async fn call_raw(mcp: &Mcp, sid: &str, params: Value) -> Vec<Value> {
    let r = jsonrpc::post(
        &mcp.http,
        &format!("{}/mcp", mcp.base),
        Some(sid),
        Some(&mcp.token),
    )
    .json(&jsonrpc::request("tools/call", params))
    .send()
    .await
    .unwrap_or_else(|e| panic!("POST /mcp: {e}"));
    let body = r.text().await.expect("body");
    let messages = jsonrpc::messages(&body);
    assert!(!messages.is_empty(), "not JSON-RPC: {body}");
    messages
}

/// `resources/read` of `uri` in session `sid`; the first content's text.
async fn read_resource(mcp: &Mcp, sid: &str, uri: &str) -> String {
    let v = mcp.rpc(sid, "resources/read", json!({"uri": uri})).await;
    v["result"]["contents"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("resources/read {uri}: {v}"))
        .to_string()
}

/// The journey for `env`'s sandbox runtime (see the module documentation).
pub async fn a_session_lives_under_its_runtime(env: Env) {
    let rt = env.sandbox_runtime;
    let socket = env
        .c
        .info
        .containerd_socket
        .clone()
        .expect("a real node's containerd socket");
    let ready = env.ready_instance(NAME, 1).await;
    // The instance says what its sandboxes run with, class and handler.
    let status = ready.status.and_then(|s| s.sandbox).unwrap_or_default();
    assert_eq!(
        status.runtime_class_name.as_deref(),
        rt.class(),
        "{status:?}"
    );
    let handler = rt.class().map(|_| crate::node::gvisor::HANDLER);
    assert_eq!(status.runtime_handler.as_deref(), handler, "{status:?}");
    let mcp = env.client(NAME).await;
    let first = mcp.bash("life", "export MARK=kept; cd /tmp").await;
    assert_eq!(first["isError"], false, "{}", text(&first));
    let pods: Vec<Pod> = env.list::<Pod>(&sandbox_selector(NAME)).await;
    let pod = pods
        .iter()
        .find(|p| session_of(p) == Some("life"))
        .unwrap_or_else(|| panic!("no sandbox pod serves session life"));
    assert_sandbox_runs_under(rt, &mcp, "life", &socket, pod).await;

    timeout_keeps_the_shell(&mcp).await;
    cancel_stops_the_command(&mcp).await;
    progress_spill_and_workspace(&mcp).await;

    assert_eq!(mcp.delete("life").await, 204);
    wait_for_set(
        env.api::<Pod>(),
        &format!("{}=life", label::SESSION_ID),
        "life's pod gone",
        TIMEOUT,
        |ps: &[Pod]| ps.is_empty(),
    )
    .await
    .expect("session pod deleted");
    eprintln!("{}: a session's life under it holds", rt.name());
    env.finish(Some(NAME)).await;
}

/// A command past its timeout is stopped, process group and all, and the shell with its
/// state goes on.
async fn timeout_keeps_the_shell(mcp: &Mcp) {
    let t = Instant::now();
    let r = call_raw(
        mcp,
        "life",
        json!({"name": "bash", "arguments": {
            "command": format!("sleep {SLEEP} & sleep {SLEEP}; echo not-reached"),
            "timeout": 2}}),
    )
    .await;
    let result = &r.last().expect("a response")["result"];
    assert_eq!(result["isError"], true, "{result}");
    assert_eq!(result["structuredContent"]["timed_out"], true, "{result}");
    let after = mcp
        .bash(
            "life",
            "echo \"$MARK $PWD\"; pgrep -x sleep >/dev/null && echo sleeping || echo no-sleep",
        )
        .await;
    assert_eq!(after["isError"], false, "{}", text(&after));
    assert_eq!(stdout(&after), "kept /tmp\nno-sleep\n", "{}", text(&after));
    assert!(
        t.elapsed() < Duration::from_secs(SLEEP / 2),
        "{:?}",
        t.elapsed()
    );
}

/// A call whose client goes away (the 2026-07-28 way to cancel) stops its command: the next
/// call answers at once, the rest of the command never ran, the shell kept its state.
async fn cancel_stops_the_command(mcp: &Mcp) {
    let cancelled = mcp
        .post_bash(
            "life",
            &format!("touch started; sleep {SLEEP}; touch finished"),
        )
        .timeout(Duration::from_secs(3))
        .send()
        .await;
    assert!(
        cancelled.as_ref().is_err_and(|e| e.is_timeout()),
        "the call was to outlive its client: {cancelled:?}"
    );
    let t = Instant::now();
    let after = mcp
        .bash(
            "life",
            "ls started finished 2>&1; echo \"$MARK\"; \
             pgrep -x sleep >/dev/null && echo sleeping || echo no-sleep",
        )
        .await;
    let out = stdout(&after);
    assert!(out.contains("started\n"), "the command had started: {out}");
    assert!(
        out.contains("cannot access 'finished'"),
        "never finished: {out}"
    );
    assert!(out.ends_with("kept\nno-sleep\n"), "{out}");
    assert!(
        t.elapsed() < Duration::from_secs(SLEEP / 2),
        "the next call waited {:?}",
        t.elapsed()
    );
}

/// Progress while a command runs; an output past the budget spilled and read back; a
/// workspace file read as a resource.
async fn progress_spill_and_workspace(mcp: &Mcp) {
    let r = call_raw(
        mcp,
        "life",
        json!({"name": "bash",
               "arguments": {"command": "for i in 1 2 3; do echo line$i; sleep 1.2; done"},
               "_meta": {"progressToken": "p"}}),
    )
    .await;
    let (last, notes) = r.split_last().expect("messages");
    assert_eq!(
        last["result"]["structuredContent"]["stdout"], "line1\nline2\nline3\n",
        "{r:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n["method"] == "notifications/progress"),
        "progress before the result: {r:?}"
    );

    let big = mcp
        .bash("life", "seq 1 100000; echo note > /workspace/note.txt")
        .await;
    assert_eq!(
        big["structuredContent"]["truncated"],
        true,
        "{}",
        text(&big)
    );
    let uri = big.to_string();
    let uri = uri
        .split('"')
        .find(|s| s.starts_with("sandbox://life/spill/"))
        .unwrap_or_else(|| panic!("no spill link: {big}"))
        .to_string();
    let spilled = read_resource(mcp, "life", &uri).await;
    assert!(
        spilled.starts_with("1\n2\n3\n"),
        "{}",
        &spilled[..40.min(spilled.len())]
    );
    let note = read_resource(mcp, "life", "sandbox://life/workspace/note.txt").await;
    assert_eq!(note, "note\n");
}
