//! The agent under hostile load, as the sandbox's own shell can put it there: health probes
//! while peers hold every connection slot and callers pile up behind a running command, and
//! the agent's memory and disk after `yes` runs for 10 s.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use tokio::io::AsyncReadExt;

use cli_mcp_api::token::Token;

use crate::agent_proc::{start_agent, AgentProc};
use crate::figures::{mib, ms, stats};

/// Idle connections held open (more than the agent's 32 slots), each reopened as soon as
/// the agent closes it.
const IDLE_PEERS: usize = 40;
/// Callers that keep sending `/exec` while a command runs (the agent lets 4 of them wait).
const QUEUED_CALLERS: usize = 8;
/// The kubelet's liveness-probe timeout in a sandbox pod.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

pub fn attacks(bin: &PathBuf, token: &Token, probes: usize, skip_yes: bool) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let commitment = token.commitment().to_hex();
    let agent = start_agent(bin, &commitment)?;
    let (idle, saturated) = rt.block_on(saturated_health(&agent, token, probes))?;
    drop(agent);

    println!("\n### agent under hostile load\n");
    println!("| GET /healthz on a fresh connection (a kubelet probe, 2 s timeout) | median | p99 | failed |");
    println!("|---|---|---|---|");
    for (what, (samples, failed)) in [
        ("idle agent", idle),
        (
            "40 idle connections held (reopened when closed), a command running, 8 callers sending /exec",
            saturated,
        ),
    ] {
        let total = samples.len() + failed;
        if samples.is_empty() {
            println!("| {what} | — | — | {failed} of {total} |");
        } else {
            let s = stats(samples);
            println!(
                "| {what} | {} | {} | {failed} of {total} |",
                ms(s.median),
                ms(s.p99)
            );
        }
    }

    if skip_yes {
        return Ok(());
    }
    let agent = start_agent(bin, &commitment)?;
    let yes = rt.block_on(yes_for_ten_seconds(&agent, token))?;
    println!();
    println!("| `yes` for 10 s (`timeout_ms` 10000) | value |");
    println!("|---|---|");
    println!("| bytes printed (`total_bytes`) | {} |", yes.printed);
    println!("| call duration | {} |", ms(yes.duration));
    println!(
        "| state dir on disk after (spill + reserve) | {} |",
        mib(yes.disk_bytes / 1024)
    );
    println!(
        "| agent RSS before / after / peak | {} / {} / {} |",
        mib(yes.rss_before),
        mib(yes.rss_after),
        mib(yes.rss_peak)
    );
    Ok(())
}

type Series = (Vec<Duration>, usize);

/// Probes the idle agent, then the same agent under load.
async fn saturated_health(
    agent: &AgentProc,
    token: &Token,
    probes: usize,
) -> anyhow::Result<(Series, Series)> {
    let addr = agent.addr.clone();
    let idle = probe_series(&addr, probes).await?;

    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    // A command that runs for the whole measurement; it announces itself with a file.
    let started = agent.state.path().join("bench-started");
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .build()?;
    let exec_url = format!("http://{addr}/exec");
    let running = {
        let http = http.clone();
        let url = exec_url.clone();
        let tok = token.expose().to_owned();
        let cmd = format!("touch {}; sleep 600", started.display());
        tokio::spawn(async move {
            let _ = http
                .post(url)
                .bearer_auth(tok)
                .json(&json!({"command": cmd, "timeout_ms": 300000}))
                .send()
                .await;
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !started.exists() {
        if Instant::now() > deadline {
            anyhow::bail!("the long command did not start");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for _ in 0..IDLE_PEERS {
        tasks.push(tokio::spawn(hold_idle(addr.clone(), stop.clone())));
    }
    for _ in 0..QUEUED_CALLERS {
        let http = http.clone();
        let url = exec_url.clone();
        let tok = token.expose().to_owned();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let sent = http
                    .post(&url)
                    .bearer_auth(&tok)
                    .json(&json!({"command": "true", "timeout_ms": 300000}))
                    .timeout(Duration::from_secs(5))
                    .send()
                    .await;
                // Refused (409 busy) or given up: ask again soon, as an impatient client would.
                if sent.is_ok() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }));
    }
    // Past the agent's 1 s grace for new connections, so the slots are held as in a siege.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let saturated = probe_series(&addr, probes).await?;
    stop.store(true, Ordering::SeqCst);
    running.abort();
    for t in tasks {
        t.abort();
    }
    Ok((idle, saturated))
}

/// `probes` probes, one after the other, each on its own connection.
async fn probe_series(addr: &str, probes: usize) -> anyhow::Result<Series> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .timeout(PROBE_TIMEOUT)
        .build()?;
    let url = format!("http://{addr}/healthz");
    let mut samples = Vec::with_capacity(probes);
    let mut failed = 0;
    for _ in 0..probes {
        let t = Instant::now();
        let answered = match http.get(&url).send().await {
            Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
            _ => false,
        };
        if answered {
            samples.push(t.elapsed());
        } else {
            failed += 1;
        }
    }
    Ok((samples, failed))
}

/// Keeps one connection open without sending a byte, and opens another when the agent
/// closes it.
async fn hold_idle(addr: String, stop: Arc<AtomicBool>) {
    let mut buf = [0u8; 64];
    while !stop.load(Ordering::SeqCst) {
        match tokio::net::TcpStream::connect(&addr).await {
            Ok(mut s) => while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {},
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

struct Yes {
    printed: u64,
    duration: Duration,
    disk_bytes: u64,
    rss_before: u64,
    rss_after: u64,
    rss_peak: u64,
}

async fn yes_for_ten_seconds(agent: &AgentProc, token: &Token) -> anyhow::Result<Yes> {
    let http = reqwest::Client::builder().no_proxy().build()?;
    let url = format!("http://{}/exec", agent.addr);
    let exec = |body: serde_json::Value| {
        http.post(&url)
            .bearer_auth(token.expose())
            .json(&body)
            .send()
    };
    exec(json!({"command": "true"})).await?.bytes().await?;
    let pid = agent.child.id();
    let (rss_before, _) = cli_mcp_e2e::child::rss_kib(pid).context("VmRSS")?;
    let t = Instant::now();
    let resp: serde_json::Value = exec(json!({"command": "yes", "timeout_ms": 10000}))
        .await?
        .json()
        .await?;
    let duration = t.elapsed();
    let (rss_after, rss_peak) = cli_mcp_e2e::child::rss_kib(pid).context("VmRSS")?;
    Ok(Yes {
        printed: resp["total_bytes"].as_u64().unwrap_or(0),
        duration,
        disk_bytes: disk_bytes(agent.state.path()),
        rss_before,
        rss_after,
        rss_peak,
    })
}

/// What `du` counts under `dir`: allocated blocks.
fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match std::fs::symlink_metadata(e.path()) {
            Ok(m) if m.is_dir() => disk_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}
