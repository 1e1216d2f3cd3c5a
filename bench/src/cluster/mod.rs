//! `cli-mcp-bench cluster`: the figures on the local Kubernetes, through the real
//! Service (loopback forward, TLS, ServiceAccount token), with the operator and server
//! installed as pods by `cli_mcp_e2e::journey` exactly as the e2e journeys do.
//!
//! - warm vs cold session start: the first call (`true`) of a new session, with a warm pool
//!   larger than the number of sessions, then with `warmPoolSize: 0`;
//! - `tools/call` of `true` on a live session through the Service, and the same call on the
//!   server pod's IP (the forward's share is the difference);
//! - N concurrent sessions each running M commands: throughput, errors, latency;
//! - admission: 200 new sessions at once against `maxSessions: 100`, how long a refused
//!   one waits for its answer.
//!
//! Measures, never asserts: failures are counted and printed.

use std::time::{Duration, Instant};

use cli_mcp_e2e::journey::Env;

use crate::figures::rss_kib;
use admission::burst;
use instance::{no_sessions, set_pool};
use load::load;
use report::Report;

mod admission;
mod calls;
mod instance;
mod load;
mod report;
mod source;
mod starts;

pub(crate) use instance::{converge_pool, pod_process};
pub(crate) use source::{the_cluster, ClusterSource};

const INSTANCE: &str = "bench";
/// The server Deployment's container, whose log has the server's own breakdown of each start.
const SERVER_CONTAINER: &str = "server";
/// Longest wait for the instance to converge after a change (a pool of 30 on 2 cores).
const CONVERGE: Duration = Duration::from_secs(300);

#[derive(clap::Args, Debug)]
pub struct ClusterArgs {
    #[command(flatten)]
    pub source: ClusterSource,
    /// Sessions started per kind (warm, cold).
    #[arg(long, default_value_t = 30)]
    pub starts: usize,
    /// Sequential `tools/call`s of `true` on one session, per path (Service, pod IP).
    #[arg(long, default_value_t = 500)]
    pub calls: usize,
    /// Concurrent sessions of the load phase.
    #[arg(long, default_value_t = 100)]
    pub sessions: usize,
    /// Commands per session in the load phase.
    #[arg(long, default_value_t = 100)]
    pub commands: usize,
    /// `maxSessions` of the admission burst (twice as many new sessions are sent at once).
    #[arg(long, default_value_t = 100)]
    pub admission_limit: usize,
    /// The sandboxes' CPU limit (e.g. `2`), to see what the default 500m costs a call; the
    /// requests stay the defaults.
    #[arg(long)]
    pub sandbox_cpu_limit: Option<String>,
}

pub fn cluster_bench(args: ClusterArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(args))
}

async fn run(args: ClusterArgs) -> anyhow::Result<()> {
    let t_all = Instant::now();
    let (c, what, private) = the_cluster(&args.source, "bench-cluster", 24).await?;
    eprintln!("bench: measuring on {what}");
    let env = Env::install_on(c, "bench").await;
    let mut cr = instance::install(&env, &args).await?;
    let svc = env.client(INSTANCE).await;

    eprintln!("bench: {} warm starts", args.starts);
    let (warm_starts, warm_steps) = starts::measured(&env, &svc, "warm", args.starts).await?;
    eprintln!("bench: draining the pool, then {} cold starts", args.starts);
    set_pool(&env, &mut cr, 0).await?;
    let (cold_starts, cold_steps) = starts::measured(&env, &svc, "cold", args.starts).await?;

    eprintln!(
        "bench: {} calls through the Service and on the pod IP",
        args.calls
    );
    let calls = calls::both_paths(&env, &svc, args.calls).await?;

    eprintln!(
        "bench: {} concurrent sessions × {} commands",
        args.sessions, args.commands
    );
    let l = load(&svc, args.sessions, args.commands).await;
    let rss_loaded = rss_kib(calls.server_pid as u32).unwrap_or(0);
    no_sessions(&env).await?;

    eprintln!(
        "bench: {} new sessions at once against maxSessions {}",
        2 * args.admission_limit,
        args.admission_limit
    );
    let b = burst(&env, args.admission_limit).await?;

    Report {
        what,
        warm_starts,
        warm_steps,
        cold_starts,
        cold_steps,
        calls,
        load: l,
        rss_loaded,
        burst: b,
    }
    .print(&args);
    eprintln!("bench: done in {:.0} s", t_all.elapsed().as_secs_f64());

    drop(svc);
    match private {
        // The whole cluster goes; waiting for the finalizer of 100+ pods adds nothing.
        Some(pc) => tokio::task::spawn_blocking(move || drop(pc)).await?,
        None => env.finish(Some(INSTANCE)).await,
    }
    Ok(())
}
