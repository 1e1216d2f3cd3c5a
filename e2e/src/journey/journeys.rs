//! The user journeys that run on either node (docs/e2e.md): each takes an [`Env`] (the
//! operator installed into a fresh namespace of some cluster) and walks a user's path to
//! the end, asserting what the user sees. `e2e/tests/journeys.rs` runs them on the shared
//! cluster of the test run (the process kubelet), `e2e/tests/journeys_real_node.rs` on a
//! private real-node cluster with the project's images, so both lanes walk the same code.

use std::collections::BTreeSet;

use cli_mcp_api::names::label;
use cli_mcp_api::pod_state::is_deleting;
use k8s_openapi::api::core::v1::Pod;
use kube::api::DeleteParams;
use kube::ResourceExt;
use serde_json::json;

use super::{sandbox_selector, server_starts, session_of, stdout, text, Env};
use crate::testing::{wait_for, wait_for_set, TIMEOUT};
use cli_mcp_api::crd::CliMcpInstance;

/// Journey 1: install, the sample instance with the investigation kubeconfig, Ready with
/// status, tools listed, a read-only `kubectl` that may read and is refused writes, through
/// the instance's (implied) credential proxy: the sandbox holds only the dummy kubeconfig.
pub async fn admin_installs_and_investigates_read_only(mut env: Env) {
    env.investigation_kubeconfig("demo").await;
    env.apply_cr(&env.cr("demo", 1)).await;
    let cr = env.wait_ready("demo").await;
    let s = cr.status.as_ref().expect("status");
    assert_eq!(s.replicas, 1, "{s:?}");
    assert_eq!(s.ready_replicas, 1, "{s:?}");
    assert_eq!((s.warm_pool.ready, s.warm_pool.desired), (1, 1), "{s:?}");
    assert_eq!(s.active_sessions, 0, "{s:?}");

    let mcp = env.client("demo").await;
    let init = mcp
        .rpc(
            "admin-1",
            "initialize",
            json!({"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "cli-mcp-e2e", "version": "0"}}),
        )
        .await;
    assert!(init["result"]["serverInfo"].is_object(), "{init}");
    let tools = mcp.rpc("admin-1", "tools/list", json!({})).await;
    let names: Vec<&str> = tools["result"]["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(names.contains(&"bash"), "{tools}");

    let get = mcp.bash("admin-1", "kubectl get pods -A").await;
    assert_eq!(get["isError"], false, "{get}");
    assert_eq!(get["structuredContent"]["exit_code"], 0, "{get}");
    assert!(stdout(&get).contains(&env.ns.name), "{get}");
    // What made that work: the proxy's variables and the dummy kubeconfig, whose one token
    // is the placeholder; nothing of the Secret's is mounted. (The file, not its directory:
    // the process kubelet makes mount points on the host's filesystem, so an earlier run
    // may have left the directory behind, empty.)
    let held = mcp
        .bash(
            "admin-1",
            "echo \"$KUBECONFIG\"; echo \"$HTTPS_PROXY\"; grep 'token:' \"$KUBECONFIG\"; \
             test -e /etc/cli-mcp/kubeconfig/kubeconfig && echo mounted || echo no-secret",
        )
        .await;
    assert_eq!(held["isError"], false, "{held}");
    let held = stdout(&held);
    let lines: Vec<&str> = held.lines().map(str::trim).collect();
    assert_eq!(
        lines,
        [
            "/etc/cli-mcp/proxy-client/kubeconfig",
            // The agent's relay, which adds the pod's proof of identity for the proxy.
            "http://127.0.0.1:3128",
            "token: cli-mcp-proxy-managed",
            "no-secret",
        ],
        "{held}"
    );

    let pods = env.list::<Pod>(&sandbox_selector("demo")).await;
    let victim = pods
        .iter()
        .find(|p| session_of(p).is_none())
        .or(pods.first())
        .expect("a sandbox pod")
        .name_any();
    let del = mcp
        .bash(
            "admin-1",
            &format!("kubectl -n {} delete pod {victim}", env.ns.name),
        )
        .await;
    assert_eq!(del["isError"], true, "{del}");
    assert_ne!(del["structuredContent"]["exit_code"], 0, "{del}");
    assert!(text(&del).contains("Forbidden"), "{del}");
    // The refusal changed nothing.
    let still = env.api::<Pod>().get_opt(&victim).await.expect("get pod");
    assert!(still.is_some_and(|p| !is_deleting(&p)));

    env.wait_status("demo", "status counts the session", |s| {
        s.active_sessions == 1 && s.warm_pool.ready == 1
    })
    .await;
    drop(mcp);
    env.finish(Some("demo")).await;
}

/// Journey 2: shell state persists within a session, not across sessions; ending a
/// session deletes its pod and the next call with that id starts fresh and says so.
pub async fn agent_session_keeps_state_and_ends_cleanly(env: Env) {
    env.ready_instance("s", 1).await;
    let mcp = env.client("s").await;

    // Without a token the endpoint says so before anything else.
    let anon = mcp
        .http
        .post(format!("{}/mcp", mcp.base))
        .header("x-session-id", "alpha")
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
        .send()
        .await
        .expect("anonymous POST");
    assert_eq!(anon.status(), 401);

    let a = mcp.bash("alpha", "cd /tmp").await;
    assert_eq!(a["isError"], false, "{a}");
    mcp.bash("alpha", "export JOURNEY_VAR=kept-42").await;
    mcp.bash("alpha", "greet() { echo \"hello-$1\"; }").await;
    let r = mcp
        .bash("alpha", "pwd; echo \"[$JOURNEY_VAR]\"; greet there")
        .await;
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(stdout(&r), "/tmp\n[kept-42]\nhello-there\n", "{r}");

    let b = mcp
        .bash(
            "beta",
            "pwd; echo \"[$JOURNEY_VAR]\"; type greet >/dev/null 2>&1 && echo has-greet || echo no-greet",
        )
        .await;
    assert_eq!(b["isError"], false, "{b}");
    let out = stdout(&b);
    assert!(!out.starts_with("/tmp\n"), "{b}");
    assert!(out.contains("[]\n") && out.contains("no-greet"), "{b}");

    let pods = env.list::<Pod>(&sandbox_selector("s")).await;
    let alpha: Vec<_> = pods
        .iter()
        .filter(|p| session_of(p) == Some("alpha"))
        .collect();
    assert_eq!(alpha.len(), 1);
    let alpha_uid = alpha[0].uid();

    assert_eq!(mcp.delete("alpha").await, 204);
    wait_for_set(
        env.api::<Pod>(),
        &format!("{}=alpha", label::SESSION_ID),
        "alpha's pod gone",
        TIMEOUT,
        |ps: &[Pod]| ps.is_empty(),
    )
    .await
    .expect("session pod deleted");

    let again = mcp
        .bash(
            "alpha",
            "pwd; echo \"[$JOURNEY_VAR]\"; type greet >/dev/null 2>&1 || echo no-greet",
        )
        .await;
    assert_eq!(again["isError"], false, "{again}");
    let sc = &again["structuredContent"];
    assert!(
        sc["new_sandbox"].is_string() || sc["state_reset"] == true,
        "the fresh start is reported: {again}"
    );
    let t = text(&again);
    assert!(
        t.contains("new session") || t.contains("reset"),
        "the text says so: {t}"
    );
    assert!(stdout(&again).contains("[]\nno-greet"), "{again}");
    let pods = env.list::<Pod>(&sandbox_selector("s")).await;
    let alpha: Vec<_> = pods
        .iter()
        .filter(|p| session_of(p) == Some("alpha"))
        .collect();
    assert_eq!(alpha.len(), 1);
    assert_ne!(alpha[0].uid(), alpha_uid, "a new sandbox");
    drop(mcp);
    env.finish(Some("s")).await;
}

/// Journey 3: five sessions start warm from a pool of five, the pool refills, and a sixth
/// session beyond the pool still succeeds; no pod serves two sessions.
pub async fn warm_pool_serves_a_burst_and_refills(env: Env) {
    env.ready_instance("w", 5).await;
    let warm: BTreeSet<String> = env
        .list::<Pod>(&sandbox_selector("w"))
        .await
        .iter()
        .filter(|p| session_of(p).is_none())
        .filter_map(|p| p.uid())
        .collect();
    assert_eq!(warm.len(), 5);
    let mcp = env.client("w").await;

    let calls = (1..=5).map(|i| {
        let mcp = &mcp;
        async move { mcp.bash(&format!("burst-{i}"), "echo ok").await }
    });
    let results = futures::future::join_all(calls).await;
    for r in &results {
        assert_eq!(r["isError"], false, "{r}");
        assert_eq!(stdout(r), "ok\n", "{r}");
        assert_eq!(r["structuredContent"]["new_sandbox"], "warm", "{r}");
    }
    let pods = env.list::<Pod>(&sandbox_selector("w")).await;
    for i in 1..=5 {
        let sid = format!("burst-{i}");
        let mine: Vec<&Pod> = pods
            .iter()
            .filter(|p| session_of(p) == Some(sid.as_str()))
            .collect();
        assert_eq!(mine.len(), 1, "{sid}");
        assert_eq!(
            mine[0].labels().get(label::LAUNCH).map(String::as_str),
            Some(label::LAUNCH_WARM)
        );
        assert!(warm.contains(&mine[0].uid().unwrap_or_default()), "{sid}");
    }
    if let Some(n) = server_starts(&env, "w", "warm").await {
        assert_eq!(n, 5.0, "launch=warm count");
    }

    // The pool refills to five.
    env.wait_status("w", "pool refilled", |s| {
        s.warm_pool.ready == 5 && s.active_sessions == 5
    })
    .await;

    let sixth = mcp.bash("burst-6", "echo six").await;
    assert_eq!(sixth["isError"], false, "{sixth}");
    assert_eq!(stdout(&sixth), "six\n");
    assert!(
        sixth["structuredContent"]["new_sandbox"].is_string(),
        "{sixth}"
    );

    let pods = env.list::<Pod>(&sandbox_selector("w")).await;
    let mut uids = BTreeSet::new();
    for i in 1..=6 {
        let sid = format!("burst-{i}");
        let mine: Vec<&Pod> = pods
            .iter()
            .filter(|p| session_of(p) == Some(sid.as_str()))
            .collect();
        assert_eq!(mine.len(), 1, "{sid} has exactly one pod");
        assert!(uids.insert(mine[0].uid()), "a pod serves two sessions");
    }
    drop(mcp);
    env.finish(Some("w")).await;
}

/// Journey 6: deleting the CR with live sessions removes every object labelled with the
/// instance, the cluster-scoped binding included.
pub async fn deleting_the_cr_with_live_sessions_removes_everything(env: Env) {
    env.ready_instance("t", 1).await;
    let mcp = env.client("t").await;
    for sid in ["live-1", "live-2"] {
        let r = mcp.bash(sid, "echo live").await;
        assert_eq!(r["isError"], false, "{r}");
    }
    // The server's and the proxy's TokenReview bindings.
    assert_eq!(env.cluster_bindings("t").await.len(), 2);
    let sel = format!("{}=t", label::INSTANCE);
    assert!(env
        .list::<Pod>(&sel)
        .await
        .iter()
        .any(|p| session_of(p).is_some()));

    let api = env.api::<CliMcpInstance>();
    api.delete("t", &DeleteParams::default())
        .await
        .expect("delete CR");
    let gone = wait_for(
        api,
        "t",
        "instance deleted",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| o.is_none(),
    )
    .await;
    assert!(gone.is_ok(), "{gone:?}\n{}", env.logs("operator"));

    env.assert_nothing_left("t").await;
    drop(mcp);
    env.finish(None).await;
}
