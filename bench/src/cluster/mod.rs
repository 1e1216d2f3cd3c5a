//! `cli-mcp-bench cluster`: the issue's figures on the local Kubernetes, through the real
//! Service (loopback forward, TLS, ServiceAccount token), with the operator and server
//! installed as pods by `cli_mcp_e2e::journey` exactly as the e2e journeys do.
//!
//! - warm vs cold session start: the first call (`true`) of a new session, with a warm pool
//!   larger than the number of sessions, then with `warmPoolSize: 0`;
//! - `tools/call` of `true` on a live session through the Service, and the same call on the
//!   server pod's IP (the forward's share is the difference);
//! - N concurrent sessions each running M commands: throughput, errors, latency;
//! - admission: 200 new sessions at once against `maxSessions: 100`, how long a refused
//!   one waits for its answer;
//! - one command printing 10 MB: how long its result takes, and what it says (truncated,
//!   where the whole output went);
//! - on the real node, what an idle sandbox pod holds in memory, and where a cold start's
//!   time goes (containerd's events against the server's steps).
//!
//! On the real node every phase but the admission burst runs once per sandbox runtime
//! (`--runtimes`, runc and gVisor by default), each on an instance of its own in its own
//! namespace of the same cluster, one runtime after the other so that they do not share the
//! 2 CPUs; the figures are then printed side by side.
//!
//! Measures, never asserts: failures are counted and printed.

use std::time::{Duration, Instant};

use anyhow::bail;
use cli_mcp_e2e::journey::{sandbox_selector, Env, Mcp};
use cli_mcp_e2e::node::NodeKind;
use cli_mcp_e2e::runtime::SandboxRuntime;
use cli_mcp_e2e::testing::wait_for_set;
use k8s_openapi::api::core::v1::Pod;

use crate::figures::rss_kib;
use admission::burst;
use big::BigOutput;
use calls::Calls;
use inside::Inside;
use instance::{no_sessions, set_pool};
use load::{load, Load};
use memory::IdleMemory;
use phases::Phases;
use report::Report;
use starts::Starts;

mod admission;
mod arrivals;
mod big;
mod calls;
mod cgroup;
mod compare;
mod ctr_events;
mod density;
mod idle_cpu;
mod inside;
mod instance;
mod load;
mod memory;
mod phases;
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
    /// Idle sessions of the density phase (real node, runc, the default requests); 0 skips
    /// it. The real node runs at most 250 pods.
    #[arg(long, default_value_t = 0)]
    pub idle: usize,
    /// New sessions a second of the sustained-arrivals phase (first runtime only), against a
    /// warm pool sized by demand; 0 skips it.
    #[arg(long, default_value_t = 0)]
    pub arrivals: u32,
    /// How long the arrivals go on, in seconds.
    #[arg(long, default_value_t = 60)]
    pub arrivals_secs: u32,
    /// The sandboxes' CPU limit (e.g. `2`), to see what the default 500m costs a call; the
    /// requests stay the defaults.
    #[arg(long)]
    pub sandbox_cpu_limit: Option<String>,
    /// Sandbox runtimes to measure side by side, each on an instance of its own in the same
    /// cluster: `runc` (the node's default) and `gvisor` (`runtimeClassName: gvisor`), comma
    /// separated. Default: both on the real node; on the process kubelet, whose pods are host
    /// processes, only its own (`runc` stands for it).
    #[arg(long, value_delimiter = ',', value_parser = parse_runtime)]
    pub runtimes: Vec<SandboxRuntime>,
}

fn parse_runtime(s: &str) -> Result<SandboxRuntime, String> {
    SandboxRuntime::ALL
        .into_iter()
        .find(|rt| rt.name() == s)
        .ok_or_else(|| format!("{s:?}: expected runc or gvisor"))
}

/// The runtimes to measure on a node of `kind`: those asked for, else every one the node has.
fn chosen_runtimes(
    asked: &[SandboxRuntime],
    kind: NodeKind,
) -> anyhow::Result<Vec<SandboxRuntime>> {
    match (asked, kind) {
        ([], NodeKind::Real) => Ok(SandboxRuntime::ALL.to_vec()),
        ([], NodeKind::Process) => Ok(vec![SandboxRuntime::Runc]),
        (rts, NodeKind::Process) if rts.contains(&SandboxRuntime::Gvisor) => {
            bail!(
                "--runtimes gvisor needs the real node (--node real): the process kubelet runs \
                 pods as host processes"
            )
        }
        (rts, _) => Ok(rts.to_vec()),
    }
}

/// Everything measured on the sandboxes of one runtime, in the order it was measured.
struct Run {
    runtime: SandboxRuntime,
    /// What a sandbox's `uname -r` says (gVisor's own kernel, or the host's).
    kernel: String,
    warm_starts: Starts,
    /// The server's own breakdown of the warm starts (crate::steps), if its log had them.
    warm_steps: Option<String>,
    cold_starts: Starts,
    cold_steps: Option<String>,
    /// Where the cold starts' time went (real node only).
    cold_phases: Option<Phases>,
    calls: Calls,
    /// What the sandbox's own operations cost (real node only).
    inside: Option<Inside>,
    big: BigOutput,
    load: Load,
    /// The server's RSS right after the load phase.
    rss_loaded: u64,
    /// What the warm starts' idle sandbox pods held (real node only).
    memory: Option<IdleMemory>,
    /// The API writes of the warm starts and the pool's refill behind them, by verb and
    /// resource (the API server's own counts), when its metrics could be read.
    warm_writes: Option<Vec<(String, f64)>>,
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
    let runtimes = chosen_runtimes(&args.runtimes, c.info.node)?;
    eprintln!("bench: measuring on {what}");
    let mut runs = Vec::new();
    let mut admission = None;
    let mut density = None;
    let mut arrivals = None;
    for (i, &rt) in runtimes.iter().enumerate() {
        let last = i + 1 == runtimes.len();
        let env = Env::install_on(c.clone(), &format!("bench-{}", rt.name())).await;
        runs.push(measure(&env, &args, rt).await?);
        // Admission does not depend on the sandboxes' runtime: measured once, on the first.
        if i == 0 {
            eprintln!(
                "bench: {} new sessions at once against maxSessions {}",
                2 * args.admission_limit,
                args.admission_limit
            );
            admission = Some(burst(&env, args.admission_limit).await?);
            let socket = env.c.info.containerd_socket.clone();
            let dense = socket.filter(|_| args.idle > 0 && rt == SandboxRuntime::Runc);
            if dense.is_some() || args.arrivals > 0 || !last {
                // What comes next is measured on a quiet node.
                no_pods_of(&env, "admit").await?;
            }
            if args.arrivals > 0 {
                eprintln!(
                    "bench: {} new sessions a second for {} s",
                    args.arrivals, args.arrivals_secs
                );
                arrivals = Some(arrivals::measure(&env, args.arrivals, args.arrivals_secs).await?);
            }
            if let Some(socket) = dense {
                eprintln!("bench: density, {} idle sessions", args.idle);
                density = Some(density::measure(&env, &socket, args.idle).await?);
            } else if args.idle > 0 {
                eprintln!(
                    "bench: no density phase: it needs the real node, with runc first in --runtimes"
                );
            }
        }
        match (&private, last) {
            // The whole cluster goes; waiting for the finalizer of 100+ pods adds nothing.
            (Some(_), true) => {}
            _ => env.finish(Some(INSTANCE)).await,
        }
    }
    let Some(burst) = admission else {
        bail!("no runtime measured")
    };
    Report {
        what,
        real: c.info.node == NodeKind::Real,
        runs,
        burst,
        density,
        arrivals,
    }
    .print(&args);
    eprintln!("bench: done in {:.0} s", t_all.elapsed().as_secs_f64());
    if let Some(pc) = private {
        tokio::task::spawn_blocking(move || drop(pc)).await?;
    }
    Ok(())
}

/// Every phase but the admission burst, on instance `bench` of `env` with its sandboxes
/// under `rt`.
async fn measure(env: &Env, args: &ClusterArgs, rt: SandboxRuntime) -> anyhow::Result<Run> {
    let name = rt.name();
    let socket = env.c.info.containerd_socket.clone();
    let mut cr = instance::install(env, args, rt).await?;
    let svc = env.client(INSTANCE).await;

    eprintln!("bench [{name}]: {} warm starts", args.starts);
    let before = crate::apiserver::metrics(&env.c).await.ok();
    let (warm_starts, warm_steps) = starts::measured(env, &svc, "warm", args.starts).await;
    // Everything a warm start causes, the pool's refill behind it included.
    converge_pool(env, INSTANCE, args.starts as i32).await?;
    let after = crate::apiserver::metrics(&env.c).await.ok();
    let warm_writes = before
        .zip(after)
        .map(|(a, b)| crate::apiserver::writes_between(&a, &b));
    let memory = match &socket {
        Some(s) => Some(memory::idle(env, s).await),
        None => None,
    };
    let kernel = kernel(&svc).await;
    starts::end(env, &svc, "warm", args.starts).await?;

    eprintln!(
        "bench [{name}]: draining the pool, then {} cold starts",
        args.starts
    );
    set_pool(env, &mut cr, 0).await?;
    let events = match &socket {
        Some(s) => Some(ctr_events::Recorder::start(s).await?),
        None => None,
    };
    let (cold_starts, cold_steps) = starts::measured(env, &svc, "cold", args.starts).await;
    let cold_phases = match (events, &socket) {
        (Some(ev), Some(s)) => Some(phases::cold(env, s, ev.stop().await, &cold_starts).await),
        _ => None,
    };
    starts::end(env, &svc, "cold", args.starts).await?;

    eprintln!(
        "bench [{name}]: {} calls through the Service and on the pod IP",
        args.calls
    );
    let calls = calls::both_paths(env, &svc, args.calls).await?;
    let inside = match &socket {
        Some(_) => Some(inside::measured(env, &svc).await?),
        None => None,
    };
    eprintln!("bench [{name}]: a 10 MB output");
    let big = big::ten_megabytes(env, &svc).await?;
    eprintln!(
        "bench [{name}]: {} concurrent sessions × {} commands",
        args.sessions, args.commands
    );
    let l = load(&svc, args.sessions, args.commands).await;
    let rss_loaded = rss_kib(calls.server_pid as u32).unwrap_or(0);
    no_sessions(env).await?;
    Ok(Run {
        runtime: rt,
        kernel,
        warm_starts,
        warm_steps,
        cold_starts,
        cold_steps,
        cold_phases,
        calls,
        inside,
        big,
        load: l,
        rss_loaded,
        memory,
        warm_writes,
    })
}

/// What session `warm-0`'s sandbox says its kernel is: the proof of the runtime it runs under.
async fn kernel(svc: &Mcp) -> String {
    let mut failed = String::new();
    // A shell that could not report on a command is replaced and the output lost: tried
    // again, up to three times.
    for _ in 0..3 {
        match svc.bash_ok("warm-0", "uname -r").await {
            Ok(r) => {
                let out = r["structuredContent"]["stdout"].as_str().unwrap_or("");
                return out.trim().to_owned();
            }
            Err(e) => failed = e.to_string(),
        }
    }
    format!(
        "(uname -r failed: {})",
        failed.chars().take(120).collect::<String>()
    )
}

/// Waits until no sandbox pod of `instance` is left (its instance was deleted).
async fn no_pods_of(env: &Env, instance: &str) -> anyhow::Result<()> {
    wait_for_set(
        env.api::<Pod>(),
        &sandbox_selector(instance),
        &format!("the pods of instance {instance} gone"),
        CONVERGE,
        |pods: &[Pod]| pods.is_empty(),
    )
    .await?;
    Ok(())
}
