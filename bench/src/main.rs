//! `cli-mcp-bench`: measures, never asserts. Each section prints a table; docs/benchmarks.md
//! says how to read it. Numbers come from real processes on loopback.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use serde_json::json;

use cli_mcp_api::token::HmacKey;
use cli_mcp_api::SessionId;

mod agent_attacks;
mod agent_mcp;
mod cluster;
mod images;
mod prom;
mod proxy;
mod scale;
mod steps;

#[derive(Parser)]
#[command(about = "cli-mcp benchmarks (printed as tables)")]
struct Cli {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand)]
enum What {
    /// Agent: exec overhead vs a fresh `bash -c true` and a bare HTTP round trip; RSS; MCP
    /// `tools/call` on the local backend vs the agent's exec.
    Agent {
        /// The agent binary to measure (use a release build).
        #[arg(long)]
        agent: PathBuf,
        #[arg(long, default_value_t = 1000)]
        iterations: usize,
        /// Health probes per row of the hostile-load table.
        #[arg(long, default_value_t = 200)]
        probes: usize,
        /// Leave out `yes` for 10 s (an agent without spill caps writes gigabytes).
        #[arg(long)]
        skip_yes: bool,
        /// Where the measured agent's state dir is made: a disk-backed file system, as a
        /// pod's `/tmp` emptyDir is (on tmpfs, the file-system work per command is hidden).
        #[arg(long, default_value = "/var/tmp")]
        state_parent: PathBuf,
        /// Only the latency and memory tables, not the hostile-load ones.
        #[arg(long)]
        no_attacks: bool,
        /// The server binary for the MCP `tools/call` row (default: beside the agent).
        #[arg(long)]
        server: Option<PathBuf>,
    },
    /// Local Kubernetes with the operator and server as pods: warm vs cold session start,
    /// `tools/call` through the Service and on the pod IP, N sessions × M commands at once.
    Cluster(cluster::ClusterArgs),
    /// What grows with sessions: 1,000 idle and 100 active sessions on the local Kubernetes
    /// (RSS, API writes, apiserver requests, warm claims), then up to 10,000 simulated
    /// session pods on a KWOK node (memory, watch traffic, reconcile and claim latency).
    Scale(scale::ScaleArgs),
    /// Sizes of the OCI image archives hack/build-images.sh builds (compressed, uncompressed).
    Images(images::ImagesArgs),
    /// Credential proxy: added latency of a Kubernetes GET (through vs direct), RSS idle and
    /// with many watch streams open.
    Proxy(proxy::ProxyArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().what {
        What::Agent {
            agent,
            iterations,
            probes,
            skip_yes,
            state_parent,
            no_attacks,
            server,
        } => {
            agent_bench(&agent, iterations, &state_parent)?;
            let server = server.unwrap_or_else(|| agent.with_file_name("cli-mcp-server"));
            agent_mcp::mcp_vs_exec(&agent, &server, iterations, &state_parent)?;
            if no_attacks {
                return Ok(());
            }
            agent_attacks::attacks(&agent, &bench_token()?, probes, skip_yes)
        }
        What::Cluster(args) => cluster::cluster_bench(args),
        What::Scale(args) => scale::scale_bench(args),
        What::Images(args) => images::images_bench(args),
        What::Proxy(args) => proxy::proxy_bench(args),
    }
}

struct Stats {
    median: Duration,
    p99: Duration,
}

fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    Stats {
        median: at(0.5),
        p99: at(0.99),
    }
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let (rss, _) = cli_mcp_e2e::child::rss_kib(pid).context("VmRSS missing")?;
    Ok(rss)
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

struct AgentProc {
    child: Child,
    addr: String,
    state: tempfile::TempDir,
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_agent(bin: &PathBuf, commitment: &str) -> anyhow::Result<AgentProc> {
    start_agent_in(bin, commitment, &std::env::temp_dir())
}

fn start_agent_in(bin: &PathBuf, commitment: &str, parent: &Path) -> anyhow::Result<AgentProc> {
    let state = tempfile::Builder::new()
        .prefix("cli-mcp-bench-")
        .tempdir_in(parent)
        .with_context(|| format!("a state dir in {}", parent.display()))?;
    let mut child = Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--log-json", "--state-dir"])
        .arg(state.path())
        .arg("--workdir")
        .arg(state.path())
        .env("TOKEN_SHA256", commitment)
        .env("RUST_LOG", "warn,cli_mcp_agent=info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stderr = child.stderr.take().context("stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let Some(line) = lines.next() else {
            bail!("agent exited before listening")
        };
        let v: serde_json::Value = serde_json::from_str(&line?).unwrap_or_default();
        if let Some(a) = v.get("listen").and_then(|a| a.as_str()) {
            break a.to_owned();
        }
    };
    // Keep draining stderr so the agent never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Ok(AgentProc { child, addr, state })
}

/// The file system type of `dir` as `stat -f` names it (`ext2/ext3` for ext4, `tmpfs`).
fn fs_type(dir: &Path) -> String {
    Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(dir)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

/// The session token every agent section uses.
fn bench_token() -> anyhow::Result<cli_mcp_api::token::Token> {
    let sid = SessionId::parse("bench").context("session id")?;
    Ok(HmacKey::from_bytes([1; 32])
        .session_token(&sid, &cli_mcp_api::token::SandboxNonce::from_bytes([2; 16])))
}

fn agent_bench(bin: &PathBuf, n: usize, state_parent: &Path) -> anyhow::Result<()> {
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
    let (exec_samples, journaled_samples, health_samples) = rt.block_on(async {
        exec("true").await?; // warm up: shell started, connection open
        http.get(&health_url).send().await?.bytes().await?;
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
        }
        anyhow::Ok((e, j, h))
    })?;
    let rss_after_cmds = rss_kib(agent.child.id())?;
    rt.block_on(exec("head -c 10000000 /dev/zero | tr '\\0' x"))?;
    let rss_after_big = rss_kib(agent.child.id())?;

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

    let (e, j, h, s) = (
        stats(exec_samples),
        stats(journaled_samples),
        stats(health_samples),
        stats(spawn),
    );
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
    Ok(())
}
