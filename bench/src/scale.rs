//! `cli-mcp-bench scale`: what grows with the number of sessions.
//!
//! 1. **Live** (process kubelet, a `/21` pod subnet so 2,045 pods fit): 1,000 sessions started
//!    with one call each and left idle, then 100 more issuing a command a second for a fixed
//!    window while new sessions are claimed from the warm pool. Server and operator RSS,
//!    API writes per minute (the API server's `apiserver_request_total` by verb and resource,
//!    and the operator's own write counter), API server requests per second per session, the
//!    warm claims' latency under that load.
//! 2. **Simulated** (KWOK): session pods exactly as the server builds them (labels,
//!    annotations, a token commitment of the instance's key), created through the API on a
//!    node whose pods KWOK marks Running/Ready without any process, up to 10,000. At each
//!    point: operator and server RSS, the pod watch traffic the API server sent, the
//!    operator's reconcile durations, and warm claims from a small pool of real pods.
//!
//! Bounded: each phase runs under one deadline (`--time-limit-secs` for the whole run) and
//! its private cluster is torn down whatever happened. Measures, never asserts.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::InstanceName;
use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxRole};
use cli_mcp_api::token::{HmacKey, SandboxNonce};
use cli_mcp_api::SessionId;
use cli_mcp_e2e::cluster::KUBECONFIG_ENV;
use cli_mcp_e2e::journey::{hack_bin_dir, sandbox_selector, Env, Mcp};
use cli_mcp_e2e::testing::{wait_for, TestCluster};
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::{json, Value};

use crate::cluster::ClusterSource;
use crate::cluster::{converge_pool, pod_process, the_cluster};
use crate::figures::{at_most, first_errors, mib, row};
use crate::prom::{Buckets, Scrape};

const INSTANCE: &str = "scale";
const OPERATOR_SELECTOR: &str = "app.kubernetes.io/name=cli-mcp-operator";
/// The simulated node, and the annotation KWOK is told to manage nodes by.
const KWOK_NODE: &str = "kwok-node-0";
const KWOK_ANNOTATION: (&str, &str) = ("kwok.x-k8s.io/node", "fake");
/// Simulated pods get addresses in loopback: should anything ever connect to one, the
/// packet stays on this machine.
const KWOK_POD_CIDR: &str = "127.64.0.0/16";
/// Most sessions an instance may have (the CRD's bound on `maxSessions`).
const MAX_SESSIONS: usize = 10_000;

#[derive(clap::Args, Debug, Clone)]
pub struct ScaleArgs {
    #[command(flatten)]
    pub source: ClusterSource,
    /// Sessions started with one call each and then left idle.
    #[arg(long, default_value_t = 1000)]
    pub idle: usize,
    /// Sessions issuing commands during the active window (on top of the idle ones).
    #[arg(long, default_value_t = 100)]
    pub active: usize,
    /// Length of the idle window and of the active window, in seconds.
    #[arg(long, default_value_t = 60)]
    pub window_secs: u64,
    /// An active session's pace: one command every this many milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub interval_ms: u64,
    /// New sessions claimed from the warm pool during the active window, spread evenly.
    #[arg(long, default_value_t = 20)]
    pub claims: usize,
    /// `warmPoolSize` of both phases.
    #[arg(long, default_value_t = 10)]
    pub pool: i32,
    /// Session starts in flight at once while the idle and active sessions are started.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Simulated session pods to measure at (KWOK), e.g. `2500,5000,10000`; the first
    /// measurement is always at 0. An empty value (`--sim-points ''`) skips the simulation.
    #[arg(long, value_delimiter = ',', default_value = "2500,5000,10000")]
    pub sim_points: Vec<String>,
    /// Warm claims timed at each simulation point.
    #[arg(long, default_value_t = 10)]
    pub sim_claims: usize,
    /// Skip the live phase (1,000 idle + 100 active sessions).
    #[arg(long)]
    pub no_live: bool,
    /// KWOK's bin dir (with `stages.yaml` in its parent); default: hack/build-kwok.sh's.
    #[arg(long)]
    pub kwok_bin_dir: Option<PathBuf>,
    /// The whole run stops by then (each phase is cut at this deadline, its cluster torn
    /// down and what was measured so far printed as missing).
    #[arg(long, default_value_t = 3600)]
    pub time_limit_secs: u64,
}

impl ScaleArgs {
    fn points(&self) -> anyhow::Result<Vec<usize>> {
        let mut out = Vec::new();
        for p in self.sim_points.iter().filter(|p| !p.trim().is_empty()) {
            let n: usize = p
                .trim()
                .parse()
                .with_context(|| format!("--sim-points: {p:?} is not a number of pods"))?;
            if n > MAX_SESSIONS {
                bail!("--sim-points: {n} is over {MAX_SESSIONS}, the most sessions an instance may have");
            }
            out.push(n);
        }
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }
}

pub fn scale_bench(args: ScaleArgs) -> anyhow::Result<()> {
    if std::env::var_os(KUBECONFIG_ENV).is_some() {
        bail!(
            "scale needs clusters of its own (a /21 pod subnet, a KWOK node): unset \
             ${KUBECONFIG_ENV} (make bench does)"
        );
    }
    let points = args.points()?;
    if args.idle + args.active + args.claims + args.pool as usize > 2000 {
        bail!("--idle + --active + --claims + --pool must stay under 2,000 (the node's /21 holds 2,045 pods)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(args, points))
}

/// `/proc/loadavg`'s three averages, for the conditions line.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

fn conditions() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| mem_total(&m))
        .unwrap_or_default();
    format!("{cores} cores, {mem}, load average {}", loadavg())
}

fn mem_total(meminfo: &str) -> Option<String> {
    let kib: f64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(format!("{:.0} GiB", kib / 1024.0 / 1024.0))
}

async fn run(args: ScaleArgs, points: Vec<usize>) -> anyhow::Result<()> {
    let t_all = Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.time_limit_secs);
    if !args.no_live {
        let (c, what, private) = the_cluster(&args.source, "bench-scale", 21).await?;
        eprintln!("bench: scale, live phase on {what}");
        let before = conditions();
        // A panic (Env's helpers panic on a failed install) or the deadline still ends in the
        // teardown below.
        let task = std::panic::AssertUnwindSafe(live(c, args.clone())).catch_unwind();
        let r = tokio::time::timeout_at(deadline, task).await;
        let after = conditions();
        match r {
            Ok(Ok(Ok(report))) => report.print(&args, &what, &before, &after),
            Ok(Ok(Err(e))) => eprintln!("bench: scale live phase failed: {e:#}"),
            Ok(Err(_)) => eprintln!("bench: scale live phase panicked (message above)"),
            Err(_) => eprintln!(
                "bench: scale live phase stopped at the time limit ({} s)",
                args.time_limit_secs
            ),
        }
        if let Some(pc) = private {
            tokio::task::spawn_blocking(move || drop(pc)).await?;
        }
    }
    if !points.is_empty() {
        let kwok = match &args.kwok_bin_dir {
            Some(d) => d.clone(),
            None => tokio::task::spawn_blocking(|| hack_bin_dir("build-kwok.sh")).await?,
        };
        let (c, what, private) = the_cluster(&args.source, "bench-scale-sim", 24).await?;
        eprintln!(
            "bench: scale, simulation on {what} with KWOK from {}",
            kwok.display()
        );
        let before = conditions();
        let task =
            std::panic::AssertUnwindSafe(simulate(c, args.clone(), points, kwok)).catch_unwind();
        let r = tokio::time::timeout_at(deadline, task).await;
        let after = conditions();
        match r {
            Ok(Ok(Ok(report))) => report.print(&args, &what, &before, &after),
            Ok(Ok(Err(e))) => eprintln!("bench: scale simulation failed: {e:#}"),
            Ok(Err(_)) => eprintln!("bench: scale simulation panicked (message above)"),
            Err(_) => eprintln!(
                "bench: scale simulation stopped at the time limit ({} s)",
                args.time_limit_secs
            ),
        }
        if let Some(pc) = private {
            tokio::task::spawn_blocking(move || drop(pc)).await?;
        }
    }
    eprintln!(
        "bench: scale done in {:.0} s",
        t_all.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The instance of both phases: a pool of `pool`, room for `max_sessions`, sessions that
/// never idle out during the run, and requests small enough for 1,100 pods on 2 cores.
fn instance_cr(env: &Env, pool: i32, max_sessions: usize) -> Value {
    let mut cr = env.cr(INSTANCE, i64::from(pool));
    cr["spec"]["replicas"] = json!(1);
    cr["spec"]["sandbox"]["maxSessions"] = json!(max_sessions.min(MAX_SESSIONS));
    // One client makes every session (the per-client default is half of maxSessions).
    cr["spec"]["server"]["maxSessionsPerClient"] = json!(10_000);
    cr["spec"]["sandbox"]["idleTimeout"] = json!("168h");
    cr["spec"]["sandbox"]["resources"] = json!({
        "requests": {"cpu": "1m", "memory": "4Mi"},
        "limits": {"cpu": "1", "memory": "256Mi"},
    });
    cr
}

/// The server's and the operator's pod: IP and host pid.
struct Procs {
    server: (String, i32),
    operator: (String, i32),
}

impl Procs {
    async fn find(env: &Env) -> anyhow::Result<Procs> {
        Ok(Procs {
            server: pod_process(env, &InstanceName::parse(INSTANCE)?.server_selector()).await?,
            operator: pod_process(env, OPERATOR_SELECTOR).await?,
        })
    }
}

/// One look at everything: the API server's, operator's and server's metrics, and the RSS
/// (current, peak) of the server and the operator.
struct Snap {
    at: Instant,
    api: Scrape,
    operator: Scrape,
    server: Scrape,
    server_rss: (u64, u64),
    operator_rss: (u64, u64),
}

async fn metrics_of(ip: &str) -> Scrape {
    let Ok(http) = cli_mcp_e2e::http::client(None)
        .timeout(Duration::from_secs(10))
        .build()
    else {
        return Scrape::default();
    };
    match cli_mcp_e2e::http::get(&http, &format!("http://{ip}:8081/metrics")).await {
        Some((200, body)) => Scrape::parse(&body),
        _ => Scrape::default(),
    }
}

async fn apiserver_metrics(c: &TestCluster) -> anyhow::Result<Scrape> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .context("building GET /metrics")?;
    let text = c
        .client
        .request_text(req)
        .await
        .context("GET /metrics of the API server")?;
    Ok(Scrape::parse(&text))
}

fn rss(pid: i32) -> (u64, u64) {
    u32::try_from(pid)
        .ok()
        .and_then(cli_mcp_e2e::child::rss_kib)
        .unwrap_or((0, 0))
}

async fn snap(c: &TestCluster, p: &Procs) -> anyhow::Result<Snap> {
    Ok(Snap {
        at: Instant::now(),
        api: apiserver_metrics(c).await?,
        operator: metrics_of(&p.operator.0).await,
        server: metrics_of(&p.server.0).await,
        server_rss: rss(p.server.1),
        operator_rss: rss(p.operator.1),
    })
}

const WRITE_VERBS: &[&str] = &[
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

/// API writes between two snapshots, by (verb, resource[/subresource]), most first.
fn writes_between(a: &Snap, b: &Snap) -> Vec<(String, f64)> {
    let mut by: std::collections::BTreeMap<String, f64> = Default::default();
    for s in b.api.series("apiserver_request_total", &[]) {
        let verb = s.label("verb").unwrap_or_default();
        if !WRITE_VERBS.contains(&verb) {
            continue;
        }
        let before: f64 = a
            .api
            .0
            .iter()
            .find(|x| x.name == s.name && x.labels == s.labels)
            .map_or(0.0, |x| x.value);
        let d = s.value - before;
        if d <= 0.0 {
            continue;
        }
        let resource = match (s.label("resource"), s.label("subresource")) {
            (Some(r), Some(sub)) if !sub.is_empty() => format!("{r}/{sub}"),
            (Some(r), _) => r.to_owned(),
            _ => "?".into(),
        };
        *by.entry(format!("{verb} {resource}")).or_default() += d;
    }
    let mut v: Vec<_> = by.into_iter().collect();
    v.sort_by(|x, y| y.1.total_cmp(&x.1));
    v
}

fn delta(a: &Scrape, b: &Scrape, name: &str, filter: &[(&str, &str)]) -> f64 {
    (b.sum(name, filter) - a.sum(name, filter)).max(0.0)
}

/// Writes the operator counted itself between two snapshots (`cli_mcp_operator_api_writes_total`).
fn operator_writes(a: &Snap, b: &Snap, filter: &[(&str, &str)]) -> f64 {
    delta(
        &a.operator,
        &b.operator,
        "cli_mcp_operator_api_writes_total",
        filter,
    )
}

/// Writes of pods themselves (not `pods/status`): claims, activity stamps, creates, deletes.
fn pod_writes(a: &Snap, b: &Snap) -> f64 {
    WRITE_VERBS
        .iter()
        .map(|v| {
            delta(
                &a.api,
                &b.api,
                "apiserver_request_total",
                &[("resource", "pods"), ("subresource", ""), ("verb", v)],
            )
        })
        .sum()
}

/// The server's writes: the API server's pod writes less the ones the operator counted
/// (the kubelet writes only `pods/status`; nothing else writes pods during a window).
fn server_writes(a: &Snap, b: &Snap) -> f64 {
    (pod_writes(a, b) - operator_writes(a, b, &[("kind", "Pod")])).max(0.0)
}

fn all_requests(a: &Snap, b: &Snap) -> f64 {
    delta(&a.api, &b.api, "apiserver_request_total", &[])
}

/// Pod watch events the API server sent and their bytes (its watch-cache metrics name the
/// kind in `kind` or, in newer releases, `resource`).
fn pod_watch_events(s: &Scrape) -> (f64, f64) {
    let pick = |name: &str| {
        s.series(name, &[])
            .filter(|x| {
                x.label("kind") == Some("Pod")
                    || (x.label("resource") == Some("pods")
                        && x.label("group").unwrap_or("").is_empty())
            })
            .map(|x| x.value)
            .sum::<f64>()
    };
    (
        pick("apiserver_watch_events_total"),
        pick("apiserver_watch_events_sizes_sum"),
    )
}

fn watches_open(s: &Scrape) -> f64 {
    s.sum("apiserver_longrunning_requests", &[("verb", "WATCH")])
}

fn per_minute(n: f64, d: Duration) -> String {
    format!("{:.1}", n * 60.0 / d.as_secs_f64().max(1e-9))
}

fn rss_cell(kib: (u64, u64)) -> String {
    format!("{} (peak {})", mib(kib.0), mib(kib.1))
}

// ---------------------------------------------------------------------------------------
// Live phase

struct Window {
    from: Snap,
    to: Snap,
    sessions: usize,
}

impl Window {
    fn secs(&self) -> Duration {
        self.to.at.duration_since(self.from.at)
    }
}

struct LiveReport {
    rss_empty: ((u64, u64), (u64, u64)),
    started: Vec<Duration>,
    start_errors: Vec<String>,
    start_wall: Duration,
    idle: Window,
    active: Window,
    commands: Vec<Duration>,
    command_errors: Vec<String>,
    claims: Vec<Duration>,
    claim_launches: std::collections::BTreeMap<String, usize>,
    claim_errors: Vec<String>,
    rss_active_max: (u64, u64),
}

/// Starts `n` sessions `<prefix>-<i>` with one `true` each, `concurrency` at a time.
async fn start_sessions(
    svc: &Mcp,
    prefix: &str,
    n: usize,
    concurrency: usize,
) -> (Vec<Duration>, Vec<String>) {
    let results: Vec<_> = futures::stream::iter(0..n)
        .map(|i| {
            let svc = svc.clone();
            let sid = format!("{prefix}-{i}");
            async move {
                let t = Instant::now();
                svc.bash_ok(&sid, "true")
                    .await
                    .map(|_| t.elapsed())
                    .map_err(|e| format!("{sid}: {e}"))
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let mut ok = Vec::new();
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(d) => ok.push(d),
            Err(e) => errors.push(e),
        }
    }
    (ok, errors)
}

async fn live(c: TestCluster, a: ScaleArgs) -> anyhow::Result<LiveReport> {
    let env = Env::install_on(c.clone(), "scale").await;
    env.dummy_kubeconfig(INSTANCE).await;
    let cr = instance_cr(&env, a.pool, a.idle + a.active + a.claims + 20);
    env.apply_cr(&cr).await;
    env.wait_ready(INSTANCE).await;
    converge_pool(&env, INSTANCE, a.pool).await?;
    let svc = env.client(INSTANCE).await;
    let procs = Procs::find(&env).await?;
    let s0 = snap(&c, &procs).await?;
    let rss_empty = (s0.server_rss, s0.operator_rss);

    eprintln!("bench: starting {} idle sessions", a.idle);
    let t = Instant::now();
    let (started, start_errors) = start_sessions(&svc, "idle", a.idle, a.concurrency).await;
    let start_wall = t.elapsed();
    // The pool refills behind the starts; the idle window begins once it is full again.
    converge_pool(&env, INSTANCE, a.pool).await?;
    let window = Duration::from_secs(a.window_secs);
    eprintln!(
        "bench: {} s with {} idle sessions",
        a.window_secs,
        started.len()
    );
    let s1 = snap(&c, &procs).await?;
    tokio::time::sleep(window).await;
    let s2 = snap(&c, &procs).await?;
    let idle = Window {
        from: s1,
        to: s2,
        sessions: started.len(),
    };

    eprintln!("bench: starting {} active sessions", a.active);
    let (active_started, mut active_errors) =
        start_sessions(&svc, "active", a.active, a.concurrency).await;
    converge_pool(&env, INSTANCE, a.pool).await?;
    eprintln!(
        "bench: {} s of {} active sessions, {} warm claims",
        a.window_secs,
        active_started.len(),
        a.claims
    );
    let s3 = snap(&c, &procs).await?;
    let end = tokio::time::Instant::now() + window;
    let interval = Duration::from_millis(a.interval_ms.max(1));
    let workers = (0..a.active).map(|i| {
        let svc = svc.clone();
        tokio::spawn(async move {
            let sid = format!("active-{i}");
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut ok = Vec::new();
            let mut errors = Vec::new();
            let mut j = 0usize;
            loop {
                tick.tick().await;
                if tokio::time::Instant::now() >= end {
                    break;
                }
                let t = Instant::now();
                match svc.bash_ok(&sid, &format!("echo {i}-{j}")).await {
                    Ok(_) => ok.push(t.elapsed()),
                    Err(e) => errors.push(format!("{sid}: {e}")),
                }
                j += 1;
            }
            (ok, errors)
        })
    });
    let workers: Vec<_> = workers.collect();
    let claimer = {
        let svc = svc.clone();
        let claims = a.claims;
        tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut launches = std::collections::BTreeMap::<String, usize>::new();
            let mut errors = Vec::new();
            let every = window / (claims as u32 + 1);
            for i in 0..claims {
                tokio::time::sleep_until(end - window + every * (i as u32 + 1)).await;
                let sid = format!("claim-{i}");
                let t = Instant::now();
                match svc.bash_ok(&sid, "true").await {
                    Ok(r) => {
                        samples.push(t.elapsed());
                        let l = r["structuredContent"]["new_sandbox"]
                            .as_str()
                            .unwrap_or("none")
                            .to_owned();
                        *launches.entry(l).or_default() += 1;
                    }
                    Err(e) => errors.push(format!("{sid}: {e}")),
                }
            }
            (samples, launches, errors)
        })
    };
    // RSS while the window runs, its highest reading (VmRSS, and VmHWM since start).
    let mut rss_active_max = (0u64, 0u64);
    while tokio::time::Instant::now() < end {
        let s = rss(procs.server.1);
        let o = rss(procs.operator.1);
        rss_active_max = (rss_active_max.0.max(s.0), rss_active_max.1.max(o.0));
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let mut commands = Vec::new();
    for w in workers {
        let (ok, errors) = w.await.context("an active session's task")?;
        commands.extend(ok);
        active_errors.extend(errors);
    }
    let (claims, claim_launches, claim_errors) = claimer.await.context("the claim task")?;
    let s4 = snap(&c, &procs).await?;
    let active = Window {
        from: s3,
        to: s4,
        sessions: started.len() + active_started.len() + claims.len(),
    };
    Ok(LiveReport {
        rss_empty,
        started,
        start_errors,
        start_wall,
        idle,
        active,
        commands,
        command_errors: active_errors,
        claims,
        claim_launches,
        claim_errors,
        rss_active_max,
    })
}

impl LiveReport {
    fn print(&self, a: &ScaleArgs, what: &str, before: &str, after: &str) {
        println!(
            "\n## scale: {} idle + {} active sessions ({what}; {before} at the start, {after} at the end)\n",
            a.idle, a.active
        );
        println!(
            "| RSS (VmRSS, and VmHWM: the highest since the process started) | server | operator |"
        );
        println!("|---|---|---|");
        println!(
            "| instance ready, 0 sessions, pool of {} | {} | {} |",
            a.pool,
            rss_cell(self.rss_empty.0),
            rss_cell(self.rss_empty.1)
        );
        println!(
            "| {} idle sessions (end of the idle window) | {} | {} |",
            self.idle.sessions,
            rss_cell(self.idle.to.server_rss),
            rss_cell(self.idle.to.operator_rss)
        );
        println!(
            "| active window: highest VmRSS read (every 2 s) | {} | {} |",
            mib(self.rss_active_max.0),
            mib(self.rss_active_max.1)
        );
        println!(
            "| end of the active window | {} | {} |",
            rss_cell(self.active.to.server_rss),
            rss_cell(self.active.to.operator_rss)
        );
        println!();
        println!("| API server, per window | idle ({} sessions, {:.0} s) | active ({} sessions, {:.0} s) |",
            self.idle.sessions, self.idle.secs().as_secs_f64(), self.active.sessions, self.active.secs().as_secs_f64());
        println!("|---|---|---|");
        let both = |f: &dyn Fn(&Window) -> String| (f(&self.idle), f(&self.active));
        let (i, x) = both(&|w| per_minute(server_writes(&w.from, &w.to), w.secs()));
        println!("| server writes per minute (pod writes less the operator's) | {i} | {x} |");
        let (i, x) = both(&|w| per_minute(operator_writes(&w.from, &w.to, &[]), w.secs()));
        println!("| operator writes per minute (its own counter) | {i} | {x} |");
        let (i, x) = both(&|w| {
            per_minute(
                delta(
                    &w.from.api,
                    &w.to.api,
                    "apiserver_request_total",
                    &[("resource", "pods"), ("subresource", "status")],
                ),
                w.secs(),
            )
        });
        println!("| kubelet pod status writes per minute | {i} | {x} |");
        let (i, x) = both(&|w| {
            let n = all_requests(&w.from, &w.to);
            format!(
                "{:.1} (per session {:.4})",
                n / w.secs().as_secs_f64(),
                n / w.secs().as_secs_f64() / w.sessions.max(1) as f64
            )
        });
        println!("| API server requests per second, all clients | {i} | {x} |");
        let (i, x) = both(&|w| format!("{:.0}", watches_open(&w.to.api)));
        println!("| watches open at the end | {i} | {x} |");
        for (name, w) in [("idle", &self.idle), ("active", &self.active)] {
            let top: Vec<String> = writes_between(&w.from, &w.to)
                .into_iter()
                .take(8)
                .map(|(k, n)| format!("{k} {}", per_minute(n, w.secs())))
                .collect();
            println!(
                "| writes per minute by verb and resource, {name} | {} | |",
                top.join(", ")
            );
        }
        println!();
        println!("| what | median | p99 |");
        println!("|---|---|---|");
        println!(
            "{}",
            row(
                &format!(
                    "start of an idle session, {} at a time (n={}, {} errors, {:.0} s in all)",
                    a.concurrency,
                    self.started.len(),
                    self.start_errors.len(),
                    self.start_wall.as_secs_f64()
                ),
                &self.started
            )
        );
        println!(
            "{}",
            row(
                &format!(
                    "active session: one command ({} sessions, one every {} ms; n={}, {} errors)",
                    a.active,
                    a.interval_ms,
                    self.commands.len(),
                    self.command_errors.len()
                ),
                &self.commands
            )
        );
        println!(
            "{}",
            row(
                &format!(
                    "**warm claim under load**: first call of a new session (n={}, launches {:?}, {} errors)",
                    self.claims.len(),
                    self.claim_launches,
                    self.claim_errors.len()
                ),
                &self.claims
            )
        );
        let q = self
            .active
            .to
            .server
            .histogram("cli_mcp_session_start_seconds", &[("launch", "warm")])
            .since(
                &self
                    .active
                    .from
                    .server
                    .histogram("cli_mcp_session_start_seconds", &[("launch", "warm")]),
            )
            .quantiles();
        if let Some(q) = q {
            println!(
                "| warm claim, the server's `cli_mcp_session_start_seconds{{launch=\"warm\"}}` in the window (n={}; bucket bounds) | {} | {} |",
                q.n,
                at_most(q.median),
                at_most(q.p99)
            );
        }
        for e in [&self.start_errors, &self.command_errors, &self.claim_errors] {
            first_errors(e);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Simulation

struct Point {
    pods: usize,
    create_wall: Duration,
    ready_wall: Duration,
    snap: Snap,
    /// Reconciles while the pods were created and marked Ready.
    reconciles: Buckets,
    /// One reconcile at rest at this size (the CR touched).
    one_reconcile: Buckets,
    watch_events: f64,
    watch_bytes: f64,
    claims: Vec<Duration>,
    claim_errors: Vec<String>,
}

struct SimReport {
    points: Vec<Point>,
    kwok_rss: Vec<(u64, u64)>,
}

/// The KWOK controller, killed when dropped.
struct Kwok(tokio::process::Child);

async fn start_kwok(c: &TestCluster, bin_dir: &Path) -> anyhow::Result<Kwok> {
    let bin = bin_dir.join("kwok");
    let stages = bin_dir
        .parent()
        .map(|p| p.join("stages.yaml"))
        .context("the KWOK bin dir has no parent")?;
    if !bin.is_file() || !stages.is_file() {
        bail!(
            "{} or {} is missing: run hack/build-kwok.sh (or pass --kwok-bin-dir)",
            bin.display(),
            stages.display()
        );
    }
    let log = c.info.log_dir.join("kwok.log");
    let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let child = tokio::process::Command::new(&bin)
        .arg(format!("--kubeconfig={}", c.info.kubeconfig.display()))
        .arg(format!("--config={}", stages.display()))
        .arg(format!(
            "--manage-nodes-with-annotation-selector={}={}",
            KWOK_ANNOTATION.0, KWOK_ANNOTATION.1
        ))
        .arg(format!("--cidr={KWOK_POD_CIDR}"))
        .arg("--node-ip=127.0.0.1")
        .arg("--node-lease-duration-seconds=40")
        .stdout(out.try_clone()?)
        .stderr(out)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    Ok(Kwok(child))
}

/// The simulated node: tainted so the scheduler never places a real pod there (the
/// simulated pods are bound to it by name).
async fn create_kwok_node(c: &TestCluster) -> anyhow::Result<()> {
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": KWOK_NODE,
            "annotations": {KWOK_ANNOTATION.0: KWOK_ANNOTATION.1},
            "labels": {"kubernetes.io/hostname": KWOK_NODE, "type": "kwok"},
        },
        "spec": {
            "taints": [{"key": KWOK_ANNOTATION.0, "value": KWOK_ANNOTATION.1, "effect": "NoSchedule"}],
        },
    }))?;
    Api::<Node>::all(c.client.clone())
        .create(&PostParams::default(), &node)
        .await
        .context("creating the KWOK node")?;
    wait_for(
        Api::<Node>::all(c.client.clone()),
        KWOK_NODE,
        "the KWOK node Ready",
        Duration::from_secs(120),
        |n: Option<&Node>| {
            n.and_then(|n| n.status.as_ref())
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        },
    )
    .await?;
    Ok(())
}

/// What the server builds session pods from: its `CLI_MCP_SANDBOX_CONFIG` and the
/// instance's HMAC key.
async fn server_inputs(env: &Env) -> anyhow::Result<(SandboxConfig, HmacKey)> {
    let name = InstanceName::parse(INSTANCE)?;
    let d = env
        .api::<Deployment>()
        .get(&name.server())
        .await
        .context("the server Deployment")?;
    let cfg = d
        .spec
        .template
        .spec
        .and_then(|s| s.containers.into_iter().next())
        .and_then(|c| c.env)
        .unwrap_or_default()
        .into_iter()
        .find(|e| e.name == "CLI_MCP_SANDBOX_CONFIG")
        .and_then(|e| e.value)
        .context("the server container has no CLI_MCP_SANDBOX_CONFIG")?;
    let cfg: SandboxConfig =
        serde_json::from_str(&cfg).context("the server's CLI_MCP_SANDBOX_CONFIG")?;
    let secret = env
        .api::<Secret>()
        .get(&name.hmac_secret())
        .await
        .context("the HMAC Secret")?;
    let key = secret
        .data
        .and_then(|d| d.get("key").cloned())
        .context("the HMAC Secret has no key")?;
    let key = HmacKey::from_hex(&String::from_utf8_lossy(&key.0))
        .map_err(|e| anyhow::anyhow!("the HMAC key: {e:?}"))?;
    Ok((cfg, key))
}

/// Simulated session `i`: the server's own pod for session `sim-<i>`, bound to the KWOK node.
fn sim_pod(cfg: &SandboxConfig, key: &HmacKey, i: usize, now: &str) -> anyhow::Result<Pod> {
    let sid = SessionId::parse(&format!("sim-{i}")).context("session id")?;
    let mut nonce = [0u8; 16];
    nonce[..8].copy_from_slice(&(i as u64).to_be_bytes());
    let role = SandboxRole::session(key, sid, SandboxNonce::from_bytes(nonce), None);
    let mut pod = build_sandbox_pod(cfg, &role, now);
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = Some(KWOK_NODE.into());
        spec.tolerations
            .get_or_insert_with(Vec::new)
            .push(serde_json::from_value(json!({
                "key": KWOK_ANNOTATION.0, "operator": "Exists", "effect": "NoSchedule"
            }))?);
    }
    Ok(pod)
}

/// Simulated pods that KWOK has marked Ready.
async fn ready_sim_pods(pods: &Api<Pod>) -> anyhow::Result<usize> {
    let mut n = 0;
    let mut lp = ListParams::default()
        .fields(&format!("spec.nodeName={KWOK_NODE}"))
        .limit(1000);
    loop {
        let page = pods.list(&lp).await.context("listing the simulated pods")?;
        n += page
            .items
            .iter()
            .filter(|p| cli_mcp_api::pod_state::is_ready(p))
            .count();
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => lp = lp.continue_token(&token),
            None => return Ok(n),
        }
    }
}

/// Waits until the operator's reconcile count stops moving (three reads a second apart).
async fn operator_quiet(ip: &str, within: Duration) {
    let end = Instant::now() + within;
    let mut last = -1.0;
    let mut same = 0;
    while Instant::now() < end && same < 3 {
        let n = metrics_of(ip)
            .await
            .sum("cli_mcp_operator_reconciles_total", &[]);
        if n == last {
            same += 1;
        } else {
            same = 0;
            last = n;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

const RECONCILE: &str = "cli_mcp_operator_reconcile_duration_seconds";

/// Annotates the instance's kubeconfig Secret (a change the operator's Secret watch passes
/// on to the instance that names it, and that changes nothing the operator decides; the
/// instance's own annotations are ignored by its predicate, and its cache of sandbox pods
/// keeps none of a pod's other labels) and waits for one more reconcile; its duration's
/// bucket.
async fn one_reconcile(env: &Env, ip: &str, k: usize) -> anyhow::Result<Buckets> {
    let secret = InstanceName::parse(INSTANCE)?.kubeconfig_secret();
    let before = metrics_of(ip).await.histogram(RECONCILE, &[]);
    env.api::<Secret>()
        .patch(
            &secret,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {"bench.cli-mcp/poke": k.to_string()}}}),
            ),
        )
        .await
        .with_context(|| format!("annotating Secret {secret}"))?;
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let now = metrics_of(ip).await.histogram(RECONCILE, &[]);
        if now.count() > before.count() || Instant::now() > end {
            return Ok(now.since(&before));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `n` warm claims one after the other (each a new session's first call), then their
/// deletion and the pool refilled.
async fn sim_claims(
    env: &Env,
    svc: &Mcp,
    pool: i32,
    k: usize,
    n: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<String>)> {
    let mut ok = Vec::new();
    let mut errors = Vec::new();
    for i in 0..n {
        let sid = format!("claim-{k}-{i}");
        let t = Instant::now();
        match svc.bash_ok(&sid, "true").await {
            Ok(r) if r["structuredContent"]["new_sandbox"] == "warm" => ok.push(t.elapsed()),
            Ok(r) => errors.push(format!(
                "{sid}: not a warm claim: {}",
                r["structuredContent"]["new_sandbox"]
            )),
            Err(e) => errors.push(format!("{sid}: {e}")),
        }
        // The next claim finds a full pool again (the refill is not what is measured).
        converge_pool_or_note(env, pool, &mut errors).await;
    }
    for i in 0..n {
        let _ = svc.try_delete(&format!("claim-{k}-{i}")).await;
    }
    let real = sandbox_selector(INSTANCE);
    let end = Instant::now() + Duration::from_secs(120);
    while Instant::now() < end {
        let left = env
            .api::<Pod>()
            .list_metadata(
                &ListParams::default()
                    .labels(&real)
                    .fields(&format!("spec.nodeName!={KWOK_NODE}")),
            )
            .await
            .map(|l| l.items.len())
            .unwrap_or(usize::MAX);
        if left <= pool as usize {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    converge_pool_or_note(env, pool, &mut errors).await;
    Ok((ok, errors))
}

async fn converge_pool_or_note(env: &Env, pool: i32, errors: &mut Vec<String>) {
    if let Err(e) = wait_pool(env, pool).await {
        errors.push(format!("pool not refilled: {e}"));
    }
}

/// Waits until the instance reports a full ready pool (the simulated pods are assigned, so
/// they never count as pool pods).
async fn wait_pool(env: &Env, pool: i32) -> anyhow::Result<()> {
    wait_for(
        env.api::<CliMcpInstance>(),
        INSTANCE,
        &format!("a ready pool of {pool}"),
        Duration::from_secs(180),
        move |o: Option<&CliMcpInstance>| {
            o.and_then(|o| o.status.as_ref())
                .is_some_and(|s| s.warm_pool.ready >= pool)
        },
    )
    .await?;
    Ok(())
}

async fn simulate(
    c: TestCluster,
    a: ScaleArgs,
    points: Vec<usize>,
    kwok_bin: PathBuf,
) -> anyhow::Result<SimReport> {
    let env = Env::install_on(c.clone(), "sim").await;
    env.dummy_kubeconfig(INSTANCE).await;
    let cr = instance_cr(&env, a.pool, MAX_SESSIONS);
    env.apply_cr(&cr).await;
    env.wait_ready(INSTANCE).await;
    converge_pool(&env, INSTANCE, a.pool).await?;
    let svc = env.client(INSTANCE).await;
    let procs = Procs::find(&env).await?;
    let kwok = start_kwok(&c, &kwok_bin).await?;
    let kwok_pid = kwok.0.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
    create_kwok_node(&c).await?;
    let (cfg, key) = server_inputs(&env).await?;
    let pods = env.api::<Pod>();
    let mut report = SimReport {
        points: Vec::new(),
        kwok_rss: Vec::new(),
    };
    let mut created = 0usize;
    let mut prev = snap(&c, &procs).await?;
    for (k, target) in std::iter::once(0).chain(points).enumerate() {
        // Room for the claims: the instance's sessions stay within maxSessions.
        let target = target.min(MAX_SESSIONS - a.sim_claims);
        eprintln!("bench: simulation, {created} → {target} session pods");
        let t = Instant::now();
        let now = cli_mcp_api::activity::stamp_now();
        let batch: Vec<Pod> = (created..target)
            .map(|i| sim_pod(&cfg, &key, i, &now))
            .collect::<anyhow::Result<_>>()?;
        let results: Vec<Result<(), String>> = futures::stream::iter(batch)
            .map(|p| {
                let pods = pods.clone();
                async move {
                    pods.create(&PostParams::default(), &p)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                }
            })
            .buffer_unordered(16)
            .collect()
            .await;
        if let Some(e) = results.iter().find_map(|r| r.as_ref().err()) {
            bail!("creating simulated pods: {e}");
        }
        let create_wall = t.elapsed();
        created = target;
        let ready_end = Instant::now() + Duration::from_secs(900);
        loop {
            let n = ready_sim_pods(&pods).await?;
            if n >= created {
                break;
            }
            if Instant::now() > ready_end {
                bail!("only {n} of {created} simulated pods Ready after 15 min (see kwok.log)");
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let ready_wall = t.elapsed();
        operator_quiet(&procs.operator.0, Duration::from_secs(120)).await;
        let s = snap(&c, &procs).await?;
        let reconciles = s
            .operator
            .histogram(RECONCILE, &[])
            .since(&prev.operator.histogram(RECONCILE, &[]));
        let (e0, b0) = pod_watch_events(&prev.api);
        let (e1, b1) = pod_watch_events(&s.api);
        let one = one_reconcile(&env, &procs.operator.0, k).await?;
        let (claims, claim_errors) = sim_claims(&env, &svc, a.pool, k, a.sim_claims).await?;
        report.kwok_rss.push(rss(kwok_pid));
        let after = snap(&c, &procs).await?;
        report.points.push(Point {
            pods: created,
            create_wall,
            ready_wall,
            snap: s,
            reconciles,
            one_reconcile: one,
            watch_events: e1 - e0,
            watch_bytes: b1 - b0,
            claims,
            claim_errors,
        });
        prev = after;
    }
    drop(kwok);
    Ok(report)
}

impl SimReport {
    fn print(&self, a: &ScaleArgs, what: &str, before: &str, after: &str) {
        println!(
            "\n## scale: simulated session pods (KWOK node; {what}; {before} at the start, {after} at the end)\n"
        );
        println!("| session pods | server RSS | operator RSS | KWOK RSS | pod watch events / bytes sent while they were added (per pod) | watches open | reconciles while added: n, median, p99 | one reconcile at rest | warm claim median / p99 (n) | created / Ready after |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for (p, kwok) in self.points.iter().zip(&self.kwok_rss) {
            let added = self
                .points
                .iter()
                .take_while(|q| q.pods < p.pods)
                .last()
                .map_or(p.pods, |q| p.pods - q.pods)
                .max(1);
            let rq = p.reconciles.quantiles();
            let one = p.one_reconcile.quantiles();
            let claims = if p.claims.is_empty() {
                format!("– ({} errors)", p.claim_errors.len())
            } else {
                let s = crate::figures::stats(p.claims.clone());
                format!(
                    "{} / {} ({}{})",
                    crate::figures::ms(s.median),
                    crate::figures::ms(s.p99),
                    p.claims.len(),
                    if p.claim_errors.is_empty() {
                        String::new()
                    } else {
                        format!(", {} errors", p.claim_errors.len())
                    }
                )
            };
            println!(
                "| {} | {} | {} | {} | {:.0} / {:.1} MiB ({:.1} / {:.1} KiB) | {:.0} | {} | {} | {} | {:.1} s / {:.1} s |",
                p.pods,
                rss_cell(p.snap.server_rss),
                rss_cell(p.snap.operator_rss),
                mib(kwok.0),
                p.watch_events,
                p.watch_bytes / 1024.0 / 1024.0,
                p.watch_events / added as f64,
                p.watch_bytes / 1024.0 / added as f64,
                watches_open(&p.snap.api),
                rq.map_or("–".into(), |q| format!("{}, {}, {}", q.n, at_most(q.median), at_most(q.p99))),
                one.map_or("–".into(), |q| at_most(q.p99)),
                claims,
                p.create_wall.as_secs_f64(),
                p.ready_wall.as_secs_f64(),
            );
        }
        // The curve: what 1,000 more session pods cost, from the first to the last point.
        if let (Some(first), Some(last)) = (self.points.first(), self.points.last()) {
            let k = (last.pods - first.pods) as f64 / 1000.0;
            if k > 0.0 {
                let per = |a: u64, b: u64| (b as f64 - a as f64) / 1024.0 / k;
                println!();
                println!(
                    "| per 1,000 session pods (from {} to {}) | value |",
                    first.pods, last.pods
                );
                println!("|---|---|");
                println!(
                    "| server RSS | {:+.1} MiB |",
                    per(first.snap.server_rss.0, last.snap.server_rss.0)
                );
                println!(
                    "| operator RSS | {:+.1} MiB |",
                    per(first.snap.operator_rss.0, last.snap.operator_rss.0)
                );
            }
        }
        for p in &self.points {
            first_errors(&p.claim_errors);
        }
        let _ = a;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli_mcp_api::names::label;
    use cli_mcp_api::pod_state::session_of;

    #[test]
    fn simulated_pods_are_the_servers_session_pods_on_the_kwok_node() {
        let cfg = SandboxConfig::new(InstanceName::parse("scale").expect("name"), "ns", "img");
        let key = HmacKey::from_bytes([7; 32]);
        let p = sim_pod(&cfg, &key, 42, "2026-01-01T00:00:00Z").expect("pod");
        assert_eq!(session_of(&p), Some("sim-42"));
        assert_eq!(
            p.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(label::LAUNCH))
                .map(String::as_str),
            Some("cold")
        );
        let spec = p.spec.as_ref().expect("spec");
        assert_eq!(spec.node_name.as_deref(), Some(KWOK_NODE));
        // A token of the instance's key opens it, so the operator never collects it as stale.
        let sid = SessionId::parse("sim-42").expect("sid");
        assert!(cli_mcp_api::sandbox::session_token_of(&p, &sid, &key).is_some());
        let other = sim_pod(&cfg, &key, 43, "2026-01-01T00:00:00Z").expect("pod");
        assert_ne!(p.metadata.name, other.metadata.name);
    }

    #[test]
    fn sim_points_are_checked() {
        let mut a = ScaleArgs {
            source: ClusterSource {
                bin_dir: None,
                kubelet: None,
                node: None,
            },
            idle: 1,
            active: 1,
            window_secs: 1,
            interval_ms: 1,
            claims: 1,
            pool: 1,
            concurrency: 1,
            sim_points: vec!["5000".into(), " 2500".into(), "".into(), "2500".into()],
            sim_claims: 1,
            no_live: false,
            kwok_bin_dir: None,
            time_limit_secs: 1,
        };
        assert_eq!(a.points().expect("points"), vec![2500, 5000]);
        a.sim_points = vec!["10001".into()];
        assert!(a
            .points()
            .unwrap_err()
            .to_string()
            .contains("most sessions"));
        a.sim_points = vec!["lots".into()];
        assert!(a.points().unwrap_err().to_string().contains("not a number"));
    }
}
