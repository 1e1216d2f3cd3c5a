//! The live phase: idle sessions started and left for a window, then active sessions issuing
//! commands for a window while new sessions are claimed from the warm pool.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use cli_mcp_e2e::journey::{Env, Mcp};
use cli_mcp_e2e::testing::TestCluster;
use futures::StreamExt;
use tokio::task::JoinHandle;

use super::live_report::{LiveReport, Window};
use super::snap::{rss, snap, Procs};
use super::{instance_cr, ScaleArgs, INSTANCE};
use crate::cluster::converge_pool;

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

/// The live phase on cluster `c`: the instance installed with its pool full, then the idle
/// window, then the active window.
pub(super) async fn live(c: TestCluster, a: ScaleArgs) -> anyhow::Result<LiveReport> {
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

    let idle = idle_window(&c, &env, &svc, &procs, &a).await?;
    let active = active_window(&c, &env, &svc, &procs, &a, idle.started.len()).await?;
    Ok(LiveReport {
        rss_empty,
        started: idle.started,
        start_errors: idle.start_errors,
        start_wall: idle.start_wall,
        idle: idle.window,
        active: active.window,
        commands: active.commands,
        command_errors: active.command_errors,
        claims: active.claims,
        claim_launches: active.claim_launches,
        claim_errors: active.claim_errors,
        rss_active_max: active.rss_active_max,
    })
}

/// The idle phase: its sessions' starts, and the window they were then left idle for.
struct Idle {
    started: Vec<Duration>,
    start_errors: Vec<String>,
    start_wall: Duration,
    window: Window,
}

/// `a.idle` sessions started, the pool refilled, then a window of `a.window_secs` with
/// nothing happening but the sessions being there.
async fn idle_window(
    c: &TestCluster,
    env: &Env,
    svc: &Mcp,
    procs: &Procs,
    a: &ScaleArgs,
) -> anyhow::Result<Idle> {
    eprintln!("bench: starting {} idle sessions", a.idle);
    let t = Instant::now();
    let (started, start_errors) = start_sessions(svc, "idle", a.idle, a.concurrency).await;
    let start_wall = t.elapsed();
    // The pool refills behind the starts; the idle window begins once it is full again.
    converge_pool(env, INSTANCE, a.pool).await?;
    let window = Duration::from_secs(a.window_secs);
    eprintln!(
        "bench: {} s with {} idle sessions",
        a.window_secs,
        started.len()
    );
    let s1 = snap(c, procs).await?;
    tokio::time::sleep(window).await;
    let s2 = snap(c, procs).await?;
    let window = Window {
        from: s1,
        to: s2,
        sessions: started.len(),
    };
    Ok(Idle {
        started,
        start_errors,
        start_wall,
        window,
    })
}

/// The active phase: its window, the commands and warm claims made during it, and the
/// highest RSS read while it ran.
struct Active {
    window: Window,
    commands: Vec<Duration>,
    command_errors: Vec<String>,
    claims: Vec<Duration>,
    claim_launches: BTreeMap<String, usize>,
    claim_errors: Vec<String>,
    rss_active_max: (u64, u64),
}

/// `a.active` more sessions started, the pool refilled, then a window of `a.window_secs`
/// in which each issues a command every `a.interval_ms` while `a.claims` new sessions are
/// claimed from the pool, spread evenly. `idle_sessions` are still there.
async fn active_window(
    c: &TestCluster,
    env: &Env,
    svc: &Mcp,
    procs: &Procs,
    a: &ScaleArgs,
    idle_sessions: usize,
) -> anyhow::Result<Active> {
    eprintln!("bench: starting {} active sessions", a.active);
    let (active_started, mut active_errors) =
        start_sessions(svc, "active", a.active, a.concurrency).await;
    converge_pool(env, INSTANCE, a.pool).await?;
    eprintln!(
        "bench: {} s of {} active sessions, {} warm claims",
        a.window_secs,
        active_started.len(),
        a.claims
    );
    let s3 = snap(c, procs).await?;
    let window = Duration::from_secs(a.window_secs);
    let end = tokio::time::Instant::now() + window;
    let interval = Duration::from_millis(a.interval_ms.max(1));
    let workers = spawn_active_sessions(svc, a.active, interval, end);
    let claimer = spawn_claimer(svc, a.claims, window, end);
    let rss_active_max = highest_rss(procs, end).await;
    let mut commands = Vec::new();
    for w in workers {
        let (ok, errors) = w.await.context("an active session's task")?;
        commands.extend(ok);
        active_errors.extend(errors);
    }
    let (claims, claim_launches, claim_errors) = claimer.await.context("the claim task")?;
    let s4 = snap(c, procs).await?;
    let window = Window {
        from: s3,
        to: s4,
        sessions: idle_sessions + active_started.len() + claims.len(),
    };
    Ok(Active {
        window,
        commands,
        command_errors: active_errors,
        claims,
        claim_launches,
        claim_errors,
        rss_active_max,
    })
}

/// Sessions `active-<i>`, each a task issuing `echo` every `interval` until `end`; each
/// task's answer times and errors.
fn spawn_active_sessions(
    svc: &Mcp,
    active: usize,
    interval: Duration,
    end: tokio::time::Instant,
) -> Vec<JoinHandle<(Vec<Duration>, Vec<String>)>> {
    (0..active)
        .map(|i| {
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
        })
        .collect()
}

/// What the claim task returns: the claims' times, their launches, the errors.
type Claims = (Vec<Duration>, BTreeMap<String, usize>, Vec<String>);

/// A task making `claims` new sessions `claim-<i>`, spread evenly over the window that ends
/// at `end`.
fn spawn_claimer(
    svc: &Mcp,
    claims: usize,
    window: Duration,
    end: tokio::time::Instant,
) -> JoinHandle<Claims> {
    let svc = svc.clone();
    tokio::spawn(async move {
        let mut samples = Vec::new();
        let mut launches = BTreeMap::<String, usize>::new();
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
}

/// The highest VmRSS read while the window runs: the server's and the operator's, in that order.
async fn highest_rss(procs: &Procs, end: tokio::time::Instant) -> (u64, u64) {
    let mut rss_active_max = (0u64, 0u64);
    while tokio::time::Instant::now() < end {
        let s = rss(procs.server.1);
        let o = rss(procs.operator.1);
        rss_active_max = (rss_active_max.0.max(s.0), rss_active_max.1.max(o.0));
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    rss_active_max
}
