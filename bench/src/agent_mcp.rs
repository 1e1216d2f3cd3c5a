//! MCP `tools/call` of `true` through the server's local backend, next to the agent's own
//! `POST /exec` of `true`, interleaved in the same run: what the server adds to a command
//! (MCP JSON-RPC, the session lookup, its HTTP call to the agent, the result's text blocks)
//! as a ratio that load on the machine hits alike on both sides.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::json;

use cli_mcp_e2e::child::LocalServer;
use cli_mcp_e2e::jsonrpc;

use crate::agent_proc::{bench_token, start_agent_in};
use crate::figures::{ms, stats, Stats};

pub fn mcp_vs_exec(
    agent: &Path,
    server: &Path,
    n: usize,
    state_parent: &Path,
) -> anyhow::Result<()> {
    if !server.is_file() {
        bail!(
            "{} not found; build it first: cargo build --release -p cli-mcp-server (or pass --server PATH)",
            server.display()
        );
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let token = bench_token()?;
    let direct = start_agent_in(
        &agent.to_path_buf(),
        &token.commitment().to_hex(),
        state_parent,
    )?;
    let (mcp, exec) = rt.block_on(async {
        let server = local_server(server, agent, state_parent).await?;
        let http = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .build()?;
        let mcp_url = server.url("/mcp");
        let exec_url = format!("http://{}/exec", direct.addr);
        let call = || async {
            let body = jsonrpc::bash(json!({ "command": "true" }));
            let v: serde_json::Value = jsonrpc::post(&http, &mcp_url, Some("bench"), None)
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await?
                .json()
                .await?;
            if v["result"]["isError"] != false {
                bail!("tools/call failed: {v}");
            }
            anyhow::Ok(())
        };
        let exec = || async {
            let r = http
                .post(&exec_url)
                .bearer_auth(token.expose())
                .json(&json!({ "command": "true" }))
                .send()
                .await?;
            if !r.status().is_success() {
                bail!("exec failed: {}", r.status());
            }
            r.bytes().await?;
            anyhow::Ok(())
        };
        // Warm up: the session's agent and bash started, connections open.
        for _ in 0..20 {
            call().await?;
            exec().await?;
        }
        let mut m = Vec::with_capacity(n);
        let mut e = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            call().await?;
            m.push(t.elapsed());
            let t = Instant::now();
            exec().await?;
            e.push(t.elapsed());
        }
        let _ = server.stop(std::time::Duration::from_secs(30)).await;
        anyhow::Ok((stats(m), stats(e)))
    })?;
    drop(direct);
    print(n, &mcp, &exec);
    Ok(())
}

/// The server with `--backend local`, starting each session's agent from `agent`.
async fn local_server(
    server: &Path,
    agent: &Path,
    state_parent: &Path,
) -> anyhow::Result<LocalServer> {
    // Absolute: the server starts each session's agent from the session's directory.
    let agent_arg = std::fs::canonicalize(agent)?.display().to_string();
    // The local backend makes each session's state dir under TMPDIR: the same file
    // system as the agent measured directly.
    let state_parent = state_parent.display().to_string();
    LocalServer::start(
        server,
        &LocalServer::local_backend(&agent_arg),
        &[("TMPDIR", state_parent.as_str())],
        "warn,cli_mcp_server::run=info",
    )
    .await
    .context("starting the server with --backend local")
}

/// The MCP table: both latencies and the ratio of their medians.
fn print(n: usize, mcp: &Stats, exec: &Stats) {
    println!(
        "\n### MCP tools/call vs the agent ({n} interleaved iterations, local backend, loopback)\n"
    );
    println!("| what | median | p99 |");
    println!("|---|---|---|");
    println!(
        "| MCP `tools/call` `true` (server `--backend local`, warm session) | {} | {} |",
        ms(mcp.median),
        ms(mcp.p99)
    );
    println!(
        "| agent alone: POST /exec `true` | {} | {} |",
        ms(exec.median),
        ms(exec.p99)
    );
    println!(
        "| `tools/call` ÷ agent exec, medians | {:.2}× | |",
        mcp.median.as_secs_f64() / exec.median.as_secs_f64().max(1e-9)
    );
}
