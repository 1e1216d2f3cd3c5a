//! `make bench` figures of the operator, on the local Kubernetes:
//! 1. time from applying a CliMcpInstance with `warmPoolSize: 20` to Ready (and to 20 Ready
//!    warm pods);
//! 2. operator RSS with 50 instances;
//! 3. reconciles and API writes per minute in a steady state (50 instances).
//!
//! Run: `cargo bench -p cli-mcp-operator --bench operator` (release build of the operator).
//! It uses `$CLI_MCP_KUBECONFIG` when set, else starts its own cluster with
//! `$CARGO_TARGET_DIR/debug/cli-mcp-cluster` (build it first: `make build`), whose image
//! map runs the debug agent and server.
//! Figures are printed as a table; nothing is asserted.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_e2e::testing::{cluster, wait_for, workspace_root};
use kube::api::PostParams;
use serde_json::json;

use support::*;

const INSTANCES: usize = 50;
const STEADY_WINDOW: Duration = Duration::from_secs(60);
const BIG_TIMEOUT: Duration = Duration::from_secs(600);
/// Small requests and limits: the local node has the host's 2 CPUs as allocatable and the
/// bench's 50 instances keep pools of their own.
fn small() -> serde_json::Value {
    json!({"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "500m", "memory": "256Mi"}})
}

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if std::env::var_os("CLI_MCP_KUBECONFIG").is_none()
        && std::env::var_os("CLI_MCP_CLUSTER_BIN").is_none()
    {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| workspace_root().join("target"));
        let debug = target.join("debug/cli-mcp-cluster");
        if debug.is_file() {
            std::env::set_var("CLI_MCP_CLUSTER_BIN", debug);
        }
    }
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let mut rows: Vec<(String, String)> = Vec::new();

    // 1. Apply -> Ready with a pool of 20.
    let ns = c.namespace("bench-pool").await.expect("namespace");
    let op = Operator::start_with(&c, &ns.name, "bench", &[("RUST_LOG", "warn")]);
    kubeconfig_secret(&ns, "big").await;
    let start = Instant::now();
    ns.api::<CliMcpInstance>()
        .create(
            &PostParams::default(),
            &instance(
                "big",
                json!({"sandbox": {"warmPoolSize": 20, "resources": small()}}),
            ),
        )
        .await
        .expect("create");
    wait_ready(&ns, "big", &op).await;
    let ready = start.elapsed();
    wait_pool(&ns, "big", 20, &op).await;
    let pool = start.elapsed();
    rows.push((
        "apply -> Ready (warmPoolSize 20)".into(),
        format!("{:.2} s", ready.as_secs_f64()),
    ));
    rows.push((
        "apply -> 20 warm pods Ready".into(),
        format!("{:.2} s", pool.as_secs_f64()),
    ));
    finish(ns, "big", &op).await;
    drop(op);

    // 2./3. Fifty instances.
    let ns = c.namespace("bench-scale").await.expect("namespace");
    let op = Operator::start_with(&c, &ns.name, "bench", &[("RUST_LOG", "warn")]);
    // Idle RSS: once the operator serves /readyz (caches synced, no instance yet).
    for _ in 0..600 {
        if op
            .http("/readyz")
            .await
            .is_some_and(|(code, _)| code == 200)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (rss0, _) = op.rss_kib().unwrap_or_default();
    let start = Instant::now();
    for i in 0..INSTANCES {
        let name = format!("i{i:02}");
        kubeconfig_secret(&ns, &name).await;
        ns.api::<CliMcpInstance>()
            .create(
                &PostParams::default(),
                &instance(
                    &name,
                    json!({"sandbox": {"warmPoolSize": 1, "resources": small()},
                           "server": {"resources": small()}}),
                ),
            )
            .await
            .expect("create");
    }
    for i in 0..INSTANCES {
        let name = format!("i{i:02}");
        wait_for(
            ns.api::<CliMcpInstance>(),
            &name,
            "Ready",
            BIG_TIMEOUT,
            |o: Option<&CliMcpInstance>| o.is_some_and(|o| is_true(o, "Ready")),
        )
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}\n{}", op.log_tail()));
    }
    let all_ready = start.elapsed();
    let (rss, hwm) = op.rss_kib().unwrap_or_default();
    let (r0, w0) = (op.reconciles().await, op.writes().await);
    // The measurement window (not a synchronisation).
    tokio::time::sleep(STEADY_WINDOW).await;
    let (r1, w1) = (op.reconciles().await, op.writes().await);
    let (rss_after, _) = op.rss_kib().unwrap_or_default();
    rows.push((
        format!("{INSTANCES} instances (pool 1 each) -> all Ready"),
        format!("{:.1} s", all_ready.as_secs_f64()),
    ));
    rows.push((
        "operator RSS idle (caches synced)".into(),
        format!("{:.1} MiB", rss0 as f64 / 1024.0),
    ));
    rows.push((
        format!("operator RSS, {INSTANCES} instances Ready"),
        format!(
            "{:.1} MiB (peak {:.1} MiB)",
            rss as f64 / 1024.0,
            hwm as f64 / 1024.0
        ),
    ));
    rows.push((
        format!("operator RSS after {}s steady", STEADY_WINDOW.as_secs()),
        format!("{:.1} MiB", rss_after as f64 / 1024.0),
    ));
    let per_min = |d: u64| d as f64 * 60.0 / STEADY_WINDOW.as_secs_f64();
    rows.push((
        "reconciles / minute, steady".into(),
        format!("{:.1}", per_min(r1 - r0)),
    ));
    rows.push((
        "API writes / minute, steady".into(),
        format!("{:.1}", per_min(w1 - w0)),
    ));
    rows.push(("reconciles total (setup incl.)".into(), format!("{r1}")));

    println!();
    println!(
        "| cli-mcp-operator ({} build) | value |",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    println!("|---|---|");
    for (k, v) in &rows {
        println!("| {k} | {v} |");
    }
    // Teardown of 50 instances is left to namespace deletion with the operator running.
    for i in 0..INSTANCES {
        let _ = ns
            .api::<CliMcpInstance>()
            .delete(&format!("i{i:02}"), &Default::default())
            .await;
    }
    for i in 0..INSTANCES {
        let _ = wait_for(
            ns.api::<CliMcpInstance>(),
            &format!("i{i:02}"),
            "gone",
            BIG_TIMEOUT,
            |o: Option<&CliMcpInstance>| o.is_none(),
        )
        .await;
    }
    ns.delete().await.expect("delete namespace");
}
