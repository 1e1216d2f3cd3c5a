//! `make bench` figures of the MCP server (docs/benchmarks.md), printed as a table:
//!
//! - `tools/call` of `true` end to end (client → server → agent → bash → back) on the local
//!   backend, median and p99, next to the agent alone (`POST /exec` of `true`);
//! - server RSS idle, and with 1,000 sessions known (local backend with **stub agents**:
//!   1,000 real agents plus their bash would need several GiB; the server holds the same
//!   per-session state either way);
//! - on the local Kubernetes: a new session by warm claim, and by cold create, each up to
//!   its first `true` done, median and p99 over 50.
//!
//! Run: `cargo build --release -p cli-mcp-agent && cargo bench -p cli-mcp-server --bench server`
//! (add `-- --no-cluster` to skip the Kubernetes part). The cluster part uses
//! `$CLI_MCP_KUBECONFIG` when set, else starts a cluster with target/debug/cli-mcp-cluster
//! (its sandbox pods run the debug agent the cluster maps `cli-mcp-agent:*` to).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use cli_mcp_e2e::child::{start_logged, LocalServer};
use cli_mcp_e2e::http::{self, metric_sum};
use cli_mcp_e2e::jsonrpc;
use serde_json::{json, Value};
use tokio::process::Command;

const SERVER_BIN: &str = env!("CARGO_BIN_EXE_cli-mcp-server");
/// Set in the environment of a server whose agents are stubs (inherited by the children).
const STUB_ENV: &str = "BENCH_STUB_AGENT";

fn main() -> anyhow::Result<()> {
    if std::env::var_os(STUB_ENV).is_some() {
        return stub_agent();
    }
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let calls: usize = value("--calls")
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let sessions: usize = value("--sessions")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let samples: usize = value("--samples")
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let agent = value("--agent").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(SERVER_BIN)
            .parent()
            .unwrap_or(Path::new("."))
            .join("cli-mcp-agent")
    });
    if !agent.is_file() {
        bail!(
            "{} not found; build it first: cargo build --release -p cli-mcp-agent (or pass --agent PATH)",
            agent.display()
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut rows: Vec<Row> = Vec::new();
        eprintln!("bench: tools/call of `true` ({calls} calls) ...");
        rows.push(agent_only(&agent, calls).await?);
        rows.push(tools_call(&agent, calls).await?);
        eprintln!("bench: server RSS idle and with {sessions} sessions ...");
        rows.extend(rss(sessions).await?);
        if !flag("--no-cluster") {
            eprintln!(
                "bench: warm claim and cold create on the local Kubernetes ({samples} each) ..."
            );
            rows.extend(cluster::run(samples).await?);
        }
        print_table(&rows);
        Ok(())
    })
}

struct Row {
    what: String,
    n: usize,
    median: String,
    p99: String,
    note: String,
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn latency_row(what: &str, mut samples: Vec<Duration>, note: &str) -> Row {
    samples.sort();
    let n = samples.len();
    let at = |q: f64| samples[((n as f64 * q).ceil() as usize).clamp(1, n) - 1];
    Row {
        what: what.into(),
        n,
        median: ms(at(0.5)),
        p99: ms(at(0.99)),
        note: note.into(),
    }
}

fn print_table(rows: &[Row]) {
    println!();
    println!(
        "cli-mcp-server (release build; {} CPUs)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    println!(
        "| {:<62} | {:>5} | {:>12} | {:>12} | note |",
        "what", "n", "median", "p99"
    );
    println!(
        "|{:-<64}|{:-<7}|{:-<14}|{:-<14}|{:-<7}|",
        "", "", "", "", ""
    );
    for r in rows {
        println!(
            "| {:<62} | {:>5} | {:>12} | {:>12} | {} |",
            r.what, r.n, r.median, r.p99, r.note
        );
    }
}

fn client() -> anyhow::Result<reqwest::Client> {
    Ok(http::client(None)
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(300))
        .build()?)
}

/// The server on loopback (`addr`, `health`, ...); SIGTERM on drop.
struct Server(LocalServer);

impl std::ops::Deref for Server {
    type Target = LocalServer;
    fn deref(&self) -> &LocalServer {
        &self.0
    }
}

impl Server {
    async fn start(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Server> {
        let bin = Path::new(SERVER_BIN);
        let s = LocalServer::start(bin, args, env, "warn,cli_mcp_server::run=info").await?;
        Ok(Server(s))
    }

    /// The local backend with `agent` as the agent binary, no auth, plus `extra`.
    async fn local(agent: &str, extra: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Server> {
        let mut args = LocalServer::local_backend(agent);
        args.extend_from_slice(extra);
        Server::start(&args, env).await
    }

    fn rss_kib(&self) -> anyhow::Result<u64> {
        let (rss, _) = self
            .0
            .rss_kib()
            .context("no VmRSS (has the server exited?)")?;
        Ok(rss)
    }

    async fn stop(self) {
        let _ = self.0.stop(Duration::from_secs(60)).await;
    }
}

async fn call(
    http: &reqwest::Client,
    url: &str,
    sid: &str,
    command: &str,
) -> anyhow::Result<Value> {
    let body = jsonrpc::bash(json!({ "command": command }));
    let resp = jsonrpc::post(http, url, Some(sid), None)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    let v: Value = resp.json().await?;
    if v["result"]["isError"] != false {
        bail!("tools/call failed: {v}");
    }
    Ok(v)
}

async fn tools_call(agent: &Path, n: usize) -> anyhow::Result<Row> {
    let agent = agent.display().to_string();
    let server = Server::local(&agent, &[], &[]).await?;
    let http = client()?;
    let url = format!("http://{}/mcp", server.addr);
    for _ in 0..50 {
        call(&http, &url, "bench", "true").await?;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        call(&http, &url, "bench", "true").await?;
        samples.push(t0.elapsed());
    }
    server.stop().await;
    Ok(latency_row(
        "MCP tools/call `true`, warm session (local backend, loopback)",
        samples,
        "client → server → agent → bash → back",
    ))
}

async fn agent_only(agent: &Path, n: usize) -> anyhow::Result<Row> {
    let dir = tempfile::tempdir()?;
    let token = "bench-token";
    let commitment = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(token.as_bytes()));
    let mut cmd = Command::new(agent);
    cmd.args(["--listen", "127.0.0.1:0", "--log-json", "--workdir"])
        .arg(dir.path())
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--podinfo-annotations")
        .arg(dir.path().join("none"))
        .env("TOKEN_SHA256", commitment)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true);
    let started = start_logged(cmd, "cli-mcp-agent ready", Duration::from_secs(30)).await?;
    let mut child = started.child;
    let url = format!(
        "http://{}/exec",
        started.ready["listen"].as_str().unwrap_or_default()
    );
    let http = client()?;
    let exec = || async {
        let r = http
            .post(&url)
            .bearer_auth(token)
            .json(&json!({"command": "true"}))
            .send()
            .await?;
        anyhow::ensure!(r.status().is_success(), "agent answered {}", r.status());
        r.bytes().await?;
        anyhow::Ok(())
    };
    for _ in 0..50 {
        exec().await?;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        exec().await?;
        samples.push(t0.elapsed());
    }
    let _ = child.kill().await;
    Ok(latency_row(
        "agent alone: POST /exec `true`",
        samples,
        "for comparison",
    ))
}

async fn rss(sessions: usize) -> anyhow::Result<Vec<Row>> {
    let me = std::env::current_exe()?.display().to_string();
    let max = (sessions + 10).to_string();
    let server = Server::local(&me, &["--max-sessions", &max], &[(STUB_ENV, "1")]).await?;
    let idle = server.rss_kib()?;
    let http = client()?;
    let url = format!("http://{}/mcp", server.addr);
    let t0 = Instant::now();
    let ids: Vec<String> = (0..sessions).map(|i| format!("rss-{i}")).collect();
    for chunk in ids.chunks(16) {
        let calls = chunk.iter().map(|sid| call(&http, &url, sid, "true"));
        for r in futures::future::join_all(calls).await {
            r?;
        }
    }
    let took = t0.elapsed();
    let metrics = http
        .get(format!("http://{}/metrics", server.health))
        .send()
        .await?
        .text()
        .await?;
    let active = metric_sum(&metrics, "cli_mcp_sessions_active")
        .map(|v| v.to_string())
        .unwrap_or_else(|| "?".into());
    let full = server.rss_kib()?;
    server.stop().await;
    let mib = |k: u64| format!("{:.1} MiB", k as f64 / 1024.0);
    Ok(vec![
        Row {
            what: "server RSS, idle (local backend)".into(),
            n: 1,
            median: mib(idle),
            p99: "-".into(),
            note: String::new(),
        },
        Row {
            what: format!("server RSS, {sessions} sessions known (stub agents)"),
            n: 1,
            median: mib(full),
            p99: "-".into(),
            note: format!(
                "sessions_active={active}; created in {:.1} s",
                took.as_secs_f64()
            ),
        },
    ])
}

/// A stand-in agent for the RSS count: prints the agent's ready line, answers every
/// `POST /exec` with a fixed result. Never used for latency figures.
fn stub_agent() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let addr = listener.local_addr()?;
        eprintln!(
            "{}",
            json!({"message": "cli-mcp-agent ready", "listen": addr.to_string()})
        );
        let answer = json!({"stdout": "", "stderr": "", "exit_code": 0, "duration_ms": 0,
            "timed_out": false, "truncated": false, "total_bytes": 0, "cwd": "/",
            "shell_restarted": false});
        let app = axum::Router::new()
            .route(
                "/exec",
                axum::routing::post(move || async move { axum::Json(answer) }),
            )
            .route("/healthz", axum::routing::get(|| async { "ok" }));
        axum::serve(listener, app).await?;
        anyhow::Ok(())
    })
}

mod cluster {
    use super::*;
    use cli_mcp_api::names::{InstanceName, PoolSuffix};
    use cli_mcp_api::pod_state::is_ready;
    use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxRole};
    use cli_mcp_api::token::HmacKey;
    use cli_mcp_e2e::testing::{self, wait_for_set};
    use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
    use kube::api::PostParams;

    pub async fn run(samples: usize) -> anyhow::Result<Vec<Row>> {
        if std::env::var_os("CLI_MCP_KUBECONFIG").is_none()
            && std::env::var_os(testing::CLUSTER_BIN_ENV).is_none()
        {
            let debug = testing::workspace_root().join("target/debug/cli-mcp-cluster");
            anyhow::ensure!(
                debug.is_file(),
                "{} not found: build it (cargo build -p cli-mcp-e2e -p cli-mcp-kubelet -p cli-mcp-agent --bins), set $CLI_MCP_KUBECONFIG, or pass --no-cluster",
                debug.display()
            );
            std::env::set_var(testing::CLUSTER_BIN_ENV, debug);
        }
        let c = testing::cluster().await?;
        let ns = c.namespace("bench-srv").await?;
        let instance = InstanceName::parse("bench")?;
        let sa: ServiceAccount = serde_json::from_value(json!({
            "metadata": {"name": instance.sandbox()}, "automountServiceAccountToken": false}))?;
        ns.api::<ServiceAccount>()
            .create(&PostParams::default(), &sa)
            .await?;
        let mut cfg = SandboxConfig::new(instance.clone(), ns.name.clone(), "cli-mcp-agent:dev");
        cfg.termination_grace_period_seconds = 5;
        cfg.resources = serde_json::from_value(cli_mcp_e2e::instance::small_resources())?;
        let key = HmacKey::from_bytes(rand::random());
        let dir = tempfile::tempdir()?;
        let key_file = dir.path().join("key");
        std::fs::write(&key_file, key.to_hex())?;
        let cfg_json = serde_json::to_string(&cfg)?;
        let key_path = key_file.display().to_string();
        let kubeconfig = c.info.kubeconfig.display().to_string();
        let server = Server::start(
            &[
                "--backend",
                "kubernetes",
                "--auth",
                "none",
                "--sandbox-config",
                &cfg_json,
                "--hmac-key-file",
                &key_path,
                "--max-sessions",
                "1000",
            ],
            &[("KUBECONFIG", &kubeconfig)],
        )
        .await?;
        let http = client()?;
        let url = format!("http://{}/mcp", server.addr);

        // Warm: a full pool first, then new sessions one after another.
        for _ in 0..samples {
            let suffix = PoolSuffix::from_random_bytes(rand::random());
            let name = instance.pool_pod(&suffix);
            let pod = build_sandbox_pod(
                &cfg,
                &SandboxRole::Pool {
                    suffix,
                    assign: key.assign_token(&name).commitment(),
                },
                "2026-01-01T00:00:00Z",
            );
            ns.api::<Pod>().create(&PostParams::default(), &pod).await?;
        }
        wait_for_set(
            ns.api::<Pod>(),
            &instance.unassigned_selector(),
            "warm pool Ready",
            Duration::from_secs(180),
            |p: &[Pod]| p.len() == samples && p.iter().all(is_ready),
        )
        .await?;
        // `n` new sessions `<launch>-<i>` one after another, each timed up to its first
        // `true` done, each started the way `launch` says.
        let starts = |launch: &'static str, n: usize| {
            let (http, url) = (&http, &url);
            async move {
                let mut samples = Vec::new();
                for i in 0..n {
                    let t0 = Instant::now();
                    let v = call(http, url, &format!("{launch}-{i}"), "true").await?;
                    samples.push(t0.elapsed());
                    anyhow::ensure!(
                        v["result"]["structuredContent"]["new_sandbox"] == launch,
                        "not a {launch} start: {v}"
                    );
                }
                anyhow::Ok(samples)
            }
        };
        let warm = starts("warm", samples).await?;
        let cold = starts("cold", samples).await?;
        server.stop().await;
        ns.delete().await?;
        Ok(vec![
            latency_row(
                "new session: warm claim + first `true` (local Kubernetes)",
                warm,
                "patch + /assign + exec; debug agent in pods",
            ),
            latency_row(
                "new session: cold create + first `true` (local Kubernetes)",
                cold,
                "create → Ready (watch) + exec; debug agent in pods",
            ),
        ])
    }
}
