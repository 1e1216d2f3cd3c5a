//! The agent's own cost: `POST /exec` of `true` on its persistent bash (with and without the
//! journal a request id makes), next to a fresh `bash -c true` and a bare HTTP round trip on
//! the same connection; and the agent's RSS idle, after the commands and after a big output.
//! With `--peer`, another agent's `POST /exec` of `true` runs in the same rounds
//! ([`crate::agent_peer`]), and the ratio of the medians is printed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::json;

use crate::agent_peer::Peer;
use crate::agent_proc::{bench_token, fs_type, start_agent_in};
use crate::figures::{mib, ms, rss_kib, stats, Stats};

/// What the agent table prints: the latencies' medians and p99s, and the RSS readings.
struct AgentFigures {
    exec: Stats,
    /// The peer's name and its `true`, when one was given.
    peer: Option<(String, Stats)>,
    journaled: Stats,
    health: Stats,
    spawn: Stats,
    idle_rss: u64,
    rss_after_cmds: u64,
    rss_after_big: u64,
}

/// Both agent tables: the interleaved latencies, then `bash -c true` spawned `n` times, then
/// the RSS readings taken along the way.
pub(crate) fn agent_bench(
    bin: &PathBuf,
    n: usize,
    state_parent: &Path,
    peer: Option<(&Path, &str)>,
) -> anyhow::Result<()> {
    let token = bench_token()?;
    let agent = start_agent_in(bin, &token.commitment().to_hex(), state_parent)?;
    let state_fs = fs_type(agent.state.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let exec_url = format!("http://{}/exec", agent.addr);
    let health_url = format!("http://{}/healthz", agent.addr);
    let idle_rss = rss_kib(agent.child.id())?;

    // `request_id` is what the server always sends: the agent journals the request in its
    // state dir before running it (replay after a crash), so that row shows the journal's cost.
    let exec_as = |cmd: &'static str, request_id: Option<String>| {
        let http = http.clone();
        let url = exec_url.clone();
        let tok = token.expose().to_owned();
        async move {
            let body = match request_id {
                Some(id) => json!({ "command": cmd, "request_id": id }),
                None => json!({ "command": cmd }),
            };
            let r = http.post(url).bearer_auth(tok).json(&body).send().await?;
            if !r.status().is_success() {
                bail!("exec failed: {}", r.status());
            }
            r.bytes().await?;
            anyhow::Ok(())
        }
    };

    let exec = |cmd: &'static str| exec_as(cmd, None);
    let (exec_samples, journaled_samples, health_samples, peer) = rt.block_on(async {
        let peer = match peer {
            Some((bin, addr)) => Some(Peer::start(bin, addr, &http).await?),
            None => None,
        };
        exec("true").await?; // warm up: shell started, connection open
        http.get(&health_url).send().await?.bytes().await?;
        if let Some(p) = &peer {
            p.exec(&http, "true").await?;
        }
        let mut p_samples = Vec::with_capacity(if peer.is_some() { n } else { 0 });
        // Interleaved, so a burst of load from other processes hits all three alike: the
        // ratio of `true` to the bare round trip is what the agent adds, on this machine.
        let mut e = Vec::with_capacity(n);
        let mut j = Vec::with_capacity(n);
        let mut h = Vec::with_capacity(n);
        for i in 0..n {
            let t = Instant::now();
            exec("true").await?;
            e.push(t.elapsed());
            let t = Instant::now();
            exec_as("true", Some(format!("bench-{i}"))).await?;
            j.push(t.elapsed());
            let t = Instant::now();
            http.get(&health_url).send().await?.bytes().await?;
            h.push(t.elapsed());
            if let Some(p) = &peer {
                let t = Instant::now();
                let code = p.exec(&http, "true").await?;
                p_samples.push(t.elapsed());
                if code != 0 {
                    bail!("the peer's `true` exited {code}");
                }
            }
        }
        let peer = peer.map(|p| (p.name.clone(), stats(p_samples)));
        anyhow::Ok((e, j, h, peer))
    })?;
    let rss_after_cmds = rss_kib(agent.child.id())?;
    rt.block_on(exec("head -c 10000000 /dev/zero | tr '\\0' x"))?;
    let rss_after_big = rss_kib(agent.child.id())?;

    let spawn = fresh_bash_samples(n)?;

    AgentFigures {
        exec: stats(exec_samples),
        peer,
        journaled: stats(journaled_samples),
        health: stats(health_samples),
        spawn: stats(spawn),
        idle_rss,
        rss_after_cmds,
        rss_after_big,
    }
    .print(n, &state_fs);
    Ok(())
}

/// `n` fresh `bash -c true`, each timed from its spawn to its exit.
fn fresh_bash_samples(n: usize) -> anyhow::Result<Vec<Duration>> {
    let mut spawn = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let ok = Command::new("bash")
            .args(["-c", "true"])
            .status()?
            .success();
        spawn.push(t.elapsed());
        if !ok {
            bail!("bash -c true failed");
        }
    }
    Ok(spawn)
}

impl AgentFigures {
    fn print(&self, n: usize, state_fs: &str) {
        let (e, j, h, s) = (&self.exec, &self.journaled, &self.health, &self.spawn);
        let (idle_rss, rss_after_cmds, rss_after_big) =
            (self.idle_rss, self.rss_after_cmds, self.rss_after_big);
        println!("\n## agent ({n} iterations, loopback, release build, state dir on {state_fs})\n");
        println!("| what | median | p99 |");
        println!("|---|---|---|");
        println!(
            "| POST /exec `true` (persistent bash) | {} | {} |",
            ms(e.median),
            ms(e.p99)
        );
        println!(
            "| POST /exec `true` with a request_id (journaled) | {} | {} |",
            ms(j.median),
            ms(j.p99)
        );
        println!(
            "| `bash -c true`, spawned fresh | {} | {} |",
            ms(s.median),
            ms(s.p99)
        );
        println!(
            "| GET /healthz (bare HTTP round trip) | {} | {} |",
            ms(h.median),
            ms(h.p99)
        );
        match &self.peer {
            Some((name, p)) => {
                println!(
                    "| POST /exec `true`, peer `{name}` (same rounds) | {} | {} |",
                    ms(p.median),
                    ms(p.p99)
                );
                let r = e.median.as_secs_f64() / p.median.as_secs_f64().max(1e-9);
                println!("| ours ÷ peer, medians | {r:.2}× | |");
            }
            None => println!(
                "| POST /exec `true`, peer | no peer (`--peer BINARY`: an agent speaking the Go original's /exec) | |"
            ),
        }
        let ratio = |a: Duration| a.as_secs_f64() / h.median.as_secs_f64().max(1e-9);
        println!(
            "| `true` ÷ GET /healthz, medians (without / with a request_id) | {:.2}× / {:.2}× | |",
            ratio(e.median),
            ratio(j.median)
        );
        println!();
        println!("| agent RSS | value |");
        println!("|---|---|");
        println!("| idle (before any command) | {} |", mib(idle_rss));
        println!("| after {n} commands | {} |", mib(rss_after_cmds));
        println!(
            "| after {n} commands + one 10 MB output | {} |",
            mib(rss_after_big)
        );
    }
}
