//! User journeys end to end (docs/e2e.md): the operator installed from
//! `config/default` (a kustomize overlay scoped to the test's namespace, so it never fights
//! other tests' operators), instances applied as a user would, and an MCP client talking
//! JSON-RPC over TLS to the instance's Service through a loopback forward, authenticated
//! with a ServiceAccount token (TokenReview + SubjectAccessReview on climcpinstances/mcp).
//!
//! The admin, session, warm-pool and teardown journeys live in
//! `cli_mcp_e2e::journey::journeys`, shared with `journeys_real_node.rs` (the same code on
//! real containers); the others run here only (the kill journey needs a container's host
//! pid, which only the process kubelet's pods have).

use std::time::Duration;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::label;
use cli_mcp_e2e::journey::{
    container_pid, journeys, kill_when_running, response, stdout, text, Env,
};
use cli_mcp_e2e::testing::{wait_restarted, AfterRestart};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

/// Journey 1: install, the sample instance with the investigation kubeconfig, Ready with
/// status, tools listed, a read-only `kubectl` that may read and is refused writes.
#[tokio::test]
async fn admin_installs_and_investigates_read_only() {
    journeys::admin_installs_and_investigates_read_only(Env::install("j-admin").await).await;
}

/// Journey 2: shell state persists within a session, not across sessions; ending a
/// session deletes its pod and the next call with that id starts fresh and says so.
#[tokio::test]
async fn agent_session_keeps_state_and_ends_cleanly() {
    journeys::agent_session_keeps_state_and_ends_cleanly(Env::install("j-session").await).await;
}

/// Journey 3: five sessions start warm from a pool of five, the pool refills, and a sixth
/// session beyond the pool still succeeds; no pod serves two sessions.
#[tokio::test]
async fn warm_pool_serves_a_burst_and_refills() {
    journeys::warm_pool_serves_a_burst_and_refills(Env::install("j-warm").await).await;
}

/// Journey 7 (GitOps): re-applying the same CR with the user's field manager is a no-op
/// for the CR and for every child, through the reconcile that follows.
#[tokio::test]
async fn reapplying_the_same_cr_changes_nothing() {
    let env = Env::install("j-gitops").await;
    env.dummy_kubeconfig("g").await;
    let cr = env.cr("g", 1);
    let first = env.apply_cr(&cr).await;
    env.wait_ready("g").await;
    // Ready needs one proxy replica; the children are at rest once every replica of both
    // Deployments is (a second proxy replica turning ready later changes its Deployment's
    // status, which is not a change of the operator's).
    for name in ["cli-mcp-g", "cli-mcp-g-proxy"] {
        cli_mcp_e2e::testing::wait_for(
            env.api::<Deployment>(),
            name,
            "every replica ready",
            Duration::from_secs(120),
            |d: Option<&Deployment>| d.is_some_and(settled),
        )
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let before = env.children("g").await;
    for kind in ["Deployment", "Service", "NetworkPolicy", "Secret"] {
        assert!(
            before.keys().any(|k| k.starts_with(&format!("{kind}/"))),
            "{kind} missing: {before:?}"
        );
    }
    let stored = env.api::<CliMcpInstance>().get("g").await.expect("get");

    let again = env.apply_cr(&cr).await;
    assert_eq!(again.metadata.generation, first.metadata.generation);
    assert_eq!(
        again.resource_version(),
        stored.resource_version(),
        "the API server saw a no-op apply"
    );

    // Force a full reconcile pass after the re-apply (a session claims the warm pod and
    // the operator refills the pool), then compare.
    let mcp = env.client("g").await;
    let r = mcp.bash("gitops-1", "true").await;
    assert_eq!(r["isError"], false, "{r}");
    env.wait_status("g", "pool refilled", |s| {
        s.warm_pool.ready == 1 && s.active_sessions == 1
    })
    .await;
    let after = env.children("g").await;
    assert_eq!(before, after, "children changed");
    drop(mcp);
    env.finish(Some("g")).await;
}

/// Journey 6: deleting the CR with live sessions removes every object labelled with the
/// instance, the cluster-scoped binding included.
#[tokio::test]
async fn deleting_the_cr_with_live_sessions_removes_everything() {
    journeys::deleting_the_cr_with_live_sessions_removes_everything(
        Env::install("j-teardown").await,
    )
    .await;
}

/// Fault: a command printing 100 MB comes back truncated (head and tail, bounded); the start
/// of its output is spilled to a file in the sandbox, up to the agent's per-spill cap
/// (64 MiB by default, so a full stream never fills the sandbox's disk), and the marker says
/// where it is and how much was not kept.
// This was ignored for a while after one "error sending request" in ~10 full runs, not seen
// since. A failure now prints the error's source chain and the forward's warnings (no ready
// endpoint, connect errors), which tell a broken forward from a server that closed.
#[tokio::test]
async fn a_100_mb_command_is_truncated_and_spilled() {
    const SPILL_CAP: u64 = 64 << 20;
    let env = Env::install("j-bigout").await;
    env.ready_instance("b", 1).await;
    let mcp = env.client("b").await;
    let r = mcp
        .bash("big", "head -c 100000000 /dev/zero | tr '\\0' x")
        .await;
    let sc = &r["structuredContent"];
    assert_eq!(r["isError"], false, "{sc}");
    assert_eq!(sc["exit_code"], 0);
    assert_eq!(sc["truncated"], true);
    assert_eq!(sc["total_bytes"], 100_000_000);
    let t = text(&r);
    assert!(t.len() < 1_000_000, "result is bounded: {} bytes", t.len());
    assert!(
        t.starts_with("xxxx") && t.contains("truncated"),
        "head kept, cut marked"
    );
    // The agent's marker, naming the spill file and what it did not keep, reaches the caller.
    let kept = format!("the first {SPILL_CAP} bytes are in ");
    let dropped = format!(
        "the {} bytes after them were not kept",
        100_000_000 - SPILL_CAP
    );
    assert!(
        t.contains(&kept) && t.contains(&dropped),
        "spill path and cap shown: {:.400}",
        t.get(t.find("[…").unwrap_or(0)..).unwrap_or(&t)
    );
    // The start of the output was spilled in the sandbox, no more than the cap.
    let spill = mcp
        .bash(
            "big",
            &format!(
                "d=${{CLI_MCP_AGENT_STATE_DIR:-/tmp/cli-mcp-agent}}; \
                 f=$(find \"$d\" -type f -size {SPILL_CAP}c); echo \"$f\" | grep -c . ; rm -f $f"
            ),
        )
        .await;
    assert_eq!(stdout(&spill).trim(), "1", "one 64 MiB spill file: {spill}");
    drop(mcp);
    env.finish(Some("b")).await;
}

/// The command the agent is killed under. The server retries once after a broken
/// connection, with the same request id; the agent's journal (its state dir survives the
/// container restart) must answer that retry "interrupted" instead of running it again — if
/// it ran again, the marker file would make it print `second-run`.
const KILLED: &str = "if [ -e /workspace/.killed-once ]; then echo second-run; \
    else touch /workspace/.killed-once; sleep 31337; echo NEVER-PRINTED; fi";

/// Fault: killing the agent of a live session mid-command gives the caller a clear
/// result, and the next call on the session works and says its state was reset.
#[tokio::test]
async fn killing_the_agent_mid_command_is_reported_and_the_session_recovers() {
    let env = Env::install("j-kill").await;
    env.ready_instance("k", 1).await;
    let mcp = env.client("k").await;
    let r = mcp.bash("victim", "cd /tmp && export KEPT=1").await;
    assert_eq!(r["isError"], false, "{r}");
    let pod = env
        .list::<Pod>(&format!("{}=victim", label::SESSION_ID))
        .await
        .pop()
        .expect("session pod");
    let agent = container_pid(&pod);

    let call = mcp.post_bash("victim", KILLED).send();
    let kill = kill_when_running(&["sleep", "31337"], agent, Duration::from_secs(30));
    let (resp, ()) = tokio::join!(call, kill);
    let resp = resp.expect("the in-flight call gets an HTTP answer");
    let status = resp.status().as_u16();
    let v = response(&resp.text().await.expect("body"));
    // Either an error naming what happened, or (the server retried on the restarted agent)
    // a result that says the session's state was reset; never a silent success.
    let clear = v["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty())
        || (v["result"]["isError"] == true && !text(&v["result"]).is_empty())
        || text(&v["result"]).contains("reset");
    assert!(
        status == 200 && clear,
        "a clear error for the in-flight call: {status} {v}"
    );
    assert!(!v.to_string().contains("NEVER-PRINTED"), "{v}");
    assert!(
        !v.to_string().contains("second-run"),
        "the interrupted command ran again on the restarted agent: {v}"
    );

    // The kubelet restarts the agent (a call made before it is back fails with an error
    // naming the unreachable agent); once the pod is Ready again the session works.
    wait_restarted(env.api::<Pod>(), &pod.name_any(), 1.., AfterRestart::Ready)
        .await
        .expect("agent back");
    let next = mcp.bash("victim", "pwd; echo \"[${KEPT:-}]\"").await;
    assert_eq!(next["isError"], false, "{next}");
    let sc = &next["structuredContent"];
    let said_inflight = text(&v["result"]).contains("reset");
    assert!(
        said_inflight
            || ((sc["state_reset"] == true || sc["shell_restarted"] == true)
                && text(&next).contains("reset")),
        "the reset is reported: {v}\n{next}"
    );
    assert!(stdout(&next).contains("[]"), "{next}");
    drop(mcp);
    env.finish(Some("k")).await;
}

/// Every replica of the Deployment's current generation is ready and available.
fn settled(d: &Deployment) -> bool {
    let want = d.spec.replicas.unwrap_or(1);
    d.status.as_ref().is_some_and(|s| {
        s.observed_generation == d.metadata.generation
            && s.ready_replicas.unwrap_or(0) == want
            && s.available_replicas.unwrap_or(0) == want
            && s.updated_replicas.unwrap_or(0) == want
            && s.replicas.unwrap_or(0) == want
    })
}
