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

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cli_mcp_e2e::cluster::KUBECONFIG_ENV;
use cli_mcp_e2e::journey::{hack_bin_dir, Env};
use futures::FutureExt;
use serde_json::{json, Value};

use crate::cluster::{the_cluster, ClusterSource};
use conditions::conditions;
use live::live;
use sim::simulate;

mod conditions;
mod kwok;
mod live;
mod live_report;
mod sim;
mod sim_report;
mod snap;
mod traffic;

const INSTANCE: &str = "scale";
const OPERATOR_SELECTOR: &str = "app.kubernetes.io/name=cli-mcp-operator";
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

#[cfg(test)]
mod tests {
    use super::*;

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
