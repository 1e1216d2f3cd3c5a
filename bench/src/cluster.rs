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

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::InstanceName;
use cli_mcp_api::pod_state;
use cli_mcp_e2e::cluster::{ClusterConfig, KUBECONFIG_ENV};
use cli_mcp_e2e::journey::{
    container_pid, sandbox_selector, server_selector, session_of, Env, Mcp,
};
use cli_mcp_e2e::node::NodeKind;
use cli_mcp_e2e::project_images;
use cli_mcp_e2e::testing::{
    cluster, pod_ip, private_cluster_with, wait_for, wait_for_set, workspace_root, PrivateCluster,
    TestCluster,
};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

use crate::figures::{at_most, first_errors, mib, row, rss_kib};
use crate::prom::{Quantiles, Scrape};

const INSTANCE: &str = "bench";
/// The server Deployment's container, whose log has the server's own breakdown of each start.
const SERVER_CONTAINER: &str = "server";
/// Longest wait for the instance to converge after a change (a pool of 30 on 2 cores).
const CONVERGE: Duration = Duration::from_secs(300);

/// Which cluster a section measures on, and what its pods run.
#[derive(clap::Args, Debug, Clone)]
pub struct ClusterSource {
    /// Directory with the cli-mcp-{server,operator,agent} binaries the cluster's images map
    /// to (default: the directory of this binary, i.e. target/release).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// The process kubelet (default: cli-mcp-kubelet in --bin-dir, else target/debug).
    #[arg(long)]
    pub kubelet: Option<PathBuf>,
    /// Where the pods run: `process` (the process kubelet; images map to the binaries) or
    /// `real` (kubelet + containerd/runc; the project's images are built from the binaries in
    /// --bin-dir and imported). Default: `$CLI_MCP_NODE`, else `process`.
    #[arg(long)]
    pub node: Option<NodeKind>,
}

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

fn default_bin_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this executable")?;
    Ok(exe.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// The cluster to measure on: `$CLI_MCP_KUBECONFIG`'s, or a private one whose images map
/// to the binaries in `bin_dir`, with its run dir `.run/<run_dir>` and a pod subnet of
/// `/pod_prefix` (24 holds 253 pods). Returns it, what its pods run, and the private cluster
/// to keep alive.
pub(crate) async fn the_cluster(
    args: &ClusterSource,
    run_dir: &str,
    pod_prefix: u8,
) -> anyhow::Result<(TestCluster, String, Option<PrivateCluster>)> {
    if std::env::var_os(KUBECONFIG_ENV).is_some() {
        let c = cluster().await?;
        return Ok((
            c,
            format!("the cluster of ${KUBECONFIG_ENV} (its image map decides the build)"),
            None,
        ));
    }
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => default_bin_dir()?,
    };
    let bin_dir = std::path::absolute(&bin_dir).context("--bin-dir")?;
    for b in [
        "cli-mcp-server",
        "cli-mcp-operator",
        "cli-mcp-agent",
        "cli-mcp-proxy",
    ] {
        if !bin_dir.join(b).is_file() {
            bail!(
                "{} is missing: build it (cargo build --release -p {b}) or pass --bin-dir",
                bin_dir.join(b).display()
            );
        }
    }
    let mut cfg = ClusterConfig::local(&bin_dir, workspace_root().join(".run").join(run_dir))?;
    cfg.pod_prefix = pod_prefix;
    cfg.kubelet_bin = match &args.kubelet {
        Some(k) => k.clone(),
        None => {
            let here = bin_dir.join("cli-mcp-kubelet");
            let debug = bin_dir
                .parent()
                .map(|t| t.join("debug/cli-mcp-kubelet"))
                .unwrap_or_default();
            if here.is_file() {
                here
            } else {
                debug
            }
        }
    };
    let profile = bin_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if let Some(node) = args.node {
        cfg.node = node;
    }
    let node = cfg.node;
    // On the real node the pods are containers of the images built from these binaries
    // (seconds when cached); they build while the cluster starts.
    let images = (node == NodeKind::Real).then(|| {
        cfg.images.clear();
        let dir = bin_dir.clone();
        tokio::task::spawn_blocking(move || project_images::build(&dir))
    });
    let pc = private_cluster_with(cfg).await?;
    let mut kind = "process kubelet: pods are host processes";
    if let Some(build) = images {
        let images = build
            .await
            .context("the image build task")?
            .context("building the project's images (hack/build-images.sh)")?;
        pc.cluster
            .import_project_images(&images)
            .context("importing the project's images into the real node")?;
        kind = "real node: containerd/runc containers of the built images";
    }
    let c = pc.test.clone();
    Ok((
        c,
        format!(
            "a private cluster ({kind}); server, operator and agents from {} ({profile} build)",
            bin_dir.display()
        ),
        Some(pc),
    ))
}

/// Waits until the instance reports a ready pool of exactly `warm` and the server ready, and
/// no unassigned sandbox pod is left beyond it.
pub(crate) async fn converge_pool(env: &Env, instance: &str, warm: i32) -> anyhow::Result<()> {
    wait_for(
        env.api::<CliMcpInstance>(),
        instance,
        &format!("a ready pool of {warm}"),
        CONVERGE,
        move |o: Option<&CliMcpInstance>| {
            o.is_some_and(|o| {
                o.status.as_ref().is_some_and(|s| {
                    s.observed_generation == o.metadata.generation
                        && s.ready_replicas >= 1
                        && s.warm_pool.desired == warm
                        && s.warm_pool.ready == warm
                })
            })
        },
    )
    .await?;
    wait_for_set(
        env.api::<Pod>(),
        &sandbox_selector(instance),
        &format!("{warm} unassigned sandbox pods"),
        CONVERGE,
        move |pods: &[Pod]| {
            pods.iter().filter(|p| session_of(p).is_none()).count() == warm as usize
        },
    )
    .await?;
    Ok(())
}

async fn set_pool(env: &Env, cr: &mut Value, warm: i32) -> anyhow::Result<()> {
    cr["spec"]["sandbox"]["warmPoolSize"] = json!(warm);
    env.apply_cr(cr).await;
    converge_pool(env, INSTANCE, warm).await
}

/// Waits until no pod of a session is left (after the sessions were deleted).
async fn no_sessions(env: &Env) -> anyhow::Result<()> {
    wait_for_set(
        env.api::<Pod>(),
        &sandbox_selector(INSTANCE),
        "session pods gone",
        CONVERGE,
        |pods: &[Pod]| pods.iter().all(|p| session_of(p).is_none()),
    )
    .await?;
    Ok(())
}

struct Starts {
    samples: Vec<Duration>,
    launches: std::collections::BTreeMap<String, usize>,
    errors: Vec<String>,
}

/// `n` new sessions one after the other, each timed from its first call to that call's
/// answer; then they are deleted.
async fn starts(svc: &Mcp, prefix: &str, n: usize) -> Starts {
    let mut out = Starts {
        samples: Vec::new(),
        launches: Default::default(),
        errors: Vec::new(),
    };
    for i in 0..n {
        let sid = format!("{prefix}-{i}");
        let t = Instant::now();
        match svc.bash_ok(&sid, "true").await {
            Ok(r) => {
                out.samples.push(t.elapsed());
                let launch = r["structuredContent"]["new_sandbox"]
                    .as_str()
                    .unwrap_or("none")
                    .to_owned();
                *out.launches.entry(launch).or_default() += 1;
            }
            Err(e) => out.errors.push(e.to_string()),
        }
    }
    for i in 0..n {
        // Best effort: the next phase waits until no session is left anyway.
        let _ = svc.try_delete(&format!("{prefix}-{i}")).await;
    }
    out
}

async fn calls(ep: &Mcp, sid: &str, n: usize) -> (Vec<Duration>, usize) {
    let mut samples = Vec::with_capacity(n);
    let mut errors = 0;
    // Warm up: the session exists, the connection is open.
    for _ in 0..10 {
        let _ = ep.bash_ok(sid, "true").await;
    }
    for _ in 0..n {
        let t = Instant::now();
        match ep.bash_ok(sid, "true").await {
            Ok(_) => samples.push(t.elapsed()),
            Err(_) => errors += 1,
        }
    }
    (samples, errors)
}

/// The instance's one server pod: its IP, and its host pid (for RSS).
pub(crate) async fn server_pod(env: &Env, instance: &str) -> anyhow::Result<(String, i32)> {
    pod_process(env, &InstanceName::parse(instance)?.server_selector()).await
}

/// The first live pod matching `selector`: its IP, and its first container's host pid.
pub(crate) async fn pod_process(env: &Env, selector: &str) -> anyhow::Result<(String, i32)> {
    let pods = env.list::<Pod>(selector).await;
    let p = pods
        .iter()
        .find(|p| !pod_state::is_deleting(p))
        .with_context(|| format!("no live pod matches {selector}"))?;
    let pid = match &env.c.info.containerd_socket {
        // Real node: the container's init process, from the node's containerd.
        Some(socket) => {
            let id = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|cs| cs.first())
                .and_then(|c| c.container_id.clone())
                .context("the server pod has no containerID yet")?;
            i32::try_from(cli_mcp_e2e::addons::container_task_pid(socket, &id)?)?
        }
        None => container_pid(p),
    };
    Ok((pod_ip(p).context("server pod IP")?, pid))
}

struct Load {
    start: Vec<Duration>,
    start_errors: Vec<String>,
    wall: Duration,
    ok: Vec<Duration>,
    errors: Vec<String>,
}

/// `sessions` sessions started concurrently, then each runs `commands` commands one after
/// the other, all sessions at once.
async fn load(svc: &Mcp, sessions: usize, commands: usize) -> Load {
    let started = futures::future::join_all((0..sessions).map(|i| {
        let svc = svc.clone();
        async move {
            let t = Instant::now();
            svc.bash_ok(&format!("load-{i}"), "true")
                .await
                .map(|_| t.elapsed())
        }
    }))
    .await;
    let mut out = Load {
        start: Vec::new(),
        start_errors: Vec::new(),
        wall: Duration::ZERO,
        ok: Vec::new(),
        errors: Vec::new(),
    };
    for r in started {
        match r {
            Ok(d) => out.start.push(d),
            Err(e) => out.start_errors.push(e.to_string()),
        }
    }
    let t0 = Instant::now();
    let per_session = futures::future::join_all((0..sessions).map(|i| {
        let svc = svc.clone();
        tokio::spawn(async move {
            let sid = format!("load-{i}");
            let mut ok = Vec::with_capacity(commands);
            let mut errors = Vec::new();
            for j in 0..commands {
                let t = Instant::now();
                match svc.bash_ok(&sid, &format!("echo {i}-{j}")).await {
                    Ok(r) if r["structuredContent"]["stdout"] == format!("{i}-{j}\n") => {
                        ok.push(t.elapsed())
                    }
                    Ok(r) => errors.push(format!("{sid}: wrong output: {r}")),
                    Err(e) => errors.push(format!("{sid}: {e}")),
                }
            }
            (ok, errors)
        })
    }))
    .await;
    out.wall = t0.elapsed();
    for r in per_session {
        match r {
            Ok((ok, errors)) => {
                out.ok.extend(ok);
                out.errors.extend(errors);
            }
            Err(e) => out.errors.push(format!("client task: {e}")),
        }
    }
    for i in 0..sessions {
        let _ = svc.try_delete(&format!("load-{i}")).await;
    }
    out
}

/// The admission burst: `2 × limit` new sessions at once against `maxSessions: limit`.
struct Burst {
    limit: usize,
    refused: Vec<Duration>,
    started: Vec<Duration>,
    errors: Vec<String>,
    wall: Duration,
    /// The server's own `cli_mcp_session_admission_seconds` for the burst: admission's cost
    /// without the TLS, auth, lookup and pod start around it.
    decided: [Option<Quantiles>; 2],
}

/// The quantiles of histogram `name{result="<result>"}` summed over several expositions.
fn histogram_quantiles(texts: &[String], name: &str, result: &str) -> Option<Quantiles> {
    Scrape::merge(texts)
        .histogram(name, &[("result", result)])
        .quantiles()
}

/// `/metrics` of every server pod of `instance`.
pub(crate) async fn server_metrics(env: &Env, instance: &str) -> Vec<String> {
    let Ok(http) = cli_mcp_e2e::http::client(None)
        .timeout(Duration::from_secs(5))
        .build()
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in env.list::<Pod>(&server_selector(instance)).await {
        let Some(ip) = pod_ip(&p) else { continue };
        if let Some((200, body)) =
            cli_mcp_e2e::http::get(&http, &format!("http://{ip}:8081/metrics")).await
        {
            out.push(body);
        }
    }
    out
}

/// Instance `admit` (`maxSessions: limit`, no warm pool): `2 × limit` new sessions at once,
/// each timed from its first call to that call's answer, sorted by what they got: a session,
/// or the limit error (admission's answer, nothing started).
async fn burst(env: &Env, limit: usize) -> anyhow::Result<Burst> {
    const NAME: &str = "admit";
    env.dummy_kubeconfig(NAME).await;
    let mut cr = env.cr(NAME, 0);
    cr["spec"]["sandbox"]["maxSessions"] = json!(limit);
    // One client makes every session: the instance's bound is measured, so the per-client
    // one (half of maxSessions by default) is set past anything the burst reaches.
    cr["spec"]["server"]["maxSessionsPerClient"] = json!(10_000);
    cr["spec"]["replicas"] = json!(1);
    env.apply_cr(&cr).await;
    env.wait_ready(NAME).await;
    let svc = env.client(NAME).await;
    let t0 = Instant::now();
    let answers = futures::future::join_all((0..2 * limit).map(|i| {
        let svc = svc.clone();
        async move {
            let t = Instant::now();
            let r = svc.try_bash(&format!("burst-{i}"), "true").await;
            (t.elapsed(), r)
        }
    }))
    .await;
    let wall = t0.elapsed();
    let texts = server_metrics(env, NAME).await;
    let decided = ["admitted", "refused"]
        .map(|r| histogram_quantiles(&texts, "cli_mcp_session_admission_seconds", r));
    let mut out = Burst {
        limit,
        refused: Vec::new(),
        started: Vec::new(),
        errors: Vec::new(),
        wall,
        decided,
    };
    let full = format!("already has {limit} sessions");
    for (took, r) in answers {
        match r {
            Ok(v) if v["isError"] == false => out.started.push(took),
            Ok(v) if v["isError"] == true && v.to_string().contains(&full) => {
                out.refused.push(took)
            }
            Ok(v) => out.errors.push(v.to_string()),
            Err(e) => out.errors.push(e.to_string()),
        }
    }
    drop(svc);
    // Its sessions go with it (the operator's teardown); nothing waits for that.
    env.api::<CliMcpInstance>()
        .delete(NAME, &Default::default())
        .await
        .context("deleting instance admit")?;
    Ok(out)
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
    env.dummy_kubeconfig(INSTANCE).await;
    let warm = i32::try_from(args.starts).context("--starts")?;
    let mut cr = env.cr(INSTANCE, i64::from(warm));
    // Room for the load phase plus what is still being deleted from the earlier phases.
    let room = (args.sessions + args.starts + 10).max(110);
    cr["spec"]["sandbox"]["maxSessions"] = json!(room);
    // One client makes every session (the per-client default is half of maxSessions).
    cr["spec"]["server"]["maxSessionsPerClient"] = json!(10_000);
    if let Some(cpu) = &args.sandbox_cpu_limit {
        cr["spec"]["sandbox"]["resources"] = json!({
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"cpu": cpu, "memory": "512Mi"},
        });
    }
    env.apply_cr(&cr).await;
    env.wait_ready(INSTANCE).await;
    converge_pool(&env, INSTANCE, warm).await?;
    let svc = env.client(INSTANCE).await;

    eprintln!("bench: {} warm starts", args.starts);
    let warm_starts = starts(&svc, "warm", args.starts).await;
    // Read before the later phases' starts crowd the log.
    let server_log = env.c.pod_logs(&env.ns.name, SERVER_CONTAINER, usize::MAX);
    let warm_steps = crate::steps::table(&server_log, "warm");
    no_sessions(&env).await?;
    eprintln!("bench: draining the pool, then {} cold starts", args.starts);
    set_pool(&env, &mut cr, 0).await?;
    let cold_starts = starts(&svc, "cold", args.starts).await;
    let server_log = env.c.pod_logs(&env.ns.name, SERVER_CONTAINER, usize::MAX);
    let cold_steps = crate::steps::table(&server_log, "cold");
    no_sessions(&env).await?;

    eprintln!(
        "bench: {} calls through the Service and on the pod IP",
        args.calls
    );
    let (server_ip, server_pid) = server_pod(&env, INSTANCE).await?;
    let rss_idle = rss_kib(server_pid as u32).unwrap_or(0);
    let (via_svc, svc_errors) = calls(&svc, "calls", args.calls).await;
    // The same client on the server pod's IP (TLS still names the Service).
    let pod = svc.via(SocketAddr::new(server_ip.parse()?, 8443), true);
    let (via_pod, pod_errors) = calls(&pod, "calls", args.calls).await;
    let _ = svc.try_delete("calls").await;
    no_sessions(&env).await?;

    eprintln!(
        "bench: {} concurrent sessions × {} commands",
        args.sessions, args.commands
    );
    let l = load(&svc, args.sessions, args.commands).await;
    let rss_loaded = rss_kib(server_pid as u32).unwrap_or(0);
    no_sessions(&env).await?;

    eprintln!(
        "bench: {} new sessions at once against maxSessions {}",
        2 * args.admission_limit,
        args.admission_limit
    );
    let b = burst(&env, args.admission_limit).await?;

    println!(
        "\n## cluster (local Kubernetes; operator and server as pods; {what}; through the \
         Service: loopback forward, TLS, ServiceAccount token)\n"
    );
    println!("| what | median | p99 |");
    println!("|---|---|---|");
    println!(
        "{}",
        row(
            &format!(
                "warm start: first call of a new session (n={}, launches {:?})",
                warm_starts.samples.len(),
                warm_starts.launches
            ),
            &warm_starts.samples
        )
    );
    println!(
        "{}",
        row(
            &format!(
                "cold start: first call of a new session, `warmPoolSize: 0` (n={}, launches {:?})",
                cold_starts.samples.len(),
                cold_starts.launches
            ),
            &cold_starts.samples
        )
    );
    println!(
        "{}",
        row(
            &format!(
                "`tools/call` `true`, live session, through the Service (n={})",
                via_svc.len()
            ),
            &via_svc
        )
    );
    println!(
        "{}",
        row(
            &format!(
                "`tools/call` `true`, live session, server pod IP (n={})",
                via_pod.len()
            ),
            &via_pod
        )
    );
    println!(
        "{}",
        row(
            &format!(
                "load: session start, {} at once (n={})",
                args.sessions,
                l.start.len()
            ),
            &l.start
        )
    );
    println!(
        "{}",
        row(
            &format!(
                "load: one command, {} sessions at once (n={})",
                args.sessions,
                l.ok.len()
            ),
            &l.ok
        )
    );
    println!(
        "{}",
        row(
            &format!(
                "admission burst: {} new sessions at once against `maxSessions: {}`, answer of a refused one (n={})",
                2 * b.limit,
                b.limit,
                b.refused.len()
            ),
            &b.refused
        )
    );
    println!(
        "{}",
        row(
            &format!(
                "admission burst: first call of an admitted one, cold (n={}; {} errors; burst {:.1} s)",
                b.started.len(),
                b.errors.len(),
                b.wall.as_secs_f64()
            ),
            &b.started
        )
    );
    for (what, q) in ["admitted", "refused"].iter().zip(b.decided) {
        match q {
            Some(q) => println!(
                "| admission burst: the server's admission decision, {what} (n={}; histogram bucket bounds) | {} | {} |",
                q.n,
                at_most(q.median),
                at_most(q.p99)
            ),
            None => println!("| admission burst: the server's admission decision, {what} | – | – |"),
        }
    }
    let total = args.sessions * args.commands;
    println!();
    println!(
        "| load: {} sessions × {} commands | value |",
        args.sessions, args.commands
    );
    println!("|---|---|");
    println!("| commands completed / sent | {} / {total} |", l.ok.len());
    println!(
        "| throughput | {:.0} commands/s ({:.1} s wall) |",
        l.ok.len() as f64 / l.wall.as_secs_f64(),
        l.wall.as_secs_f64()
    );
    println!(
        "| errors (commands + session starts) | {} + {} |",
        l.errors.len(),
        l.start_errors.len()
    );
    println!(
        "| errors of the other phases (warm, cold, Service calls, pod-IP calls) | {}, {}, {}, {} |",
        warm_starts.errors.len(),
        cold_starts.errors.len(),
        svc_errors,
        pod_errors
    );
    println!(
        "| server RSS before the calls / after the load | {} / {} |",
        mib(rss_idle),
        mib(rss_loaded)
    );
    for t in [warm_steps, cold_steps].into_iter().flatten() {
        println!("\n{t}");
    }
    for errors in [
        &warm_starts.errors,
        &cold_starts.errors,
        &l.start_errors,
        &l.errors,
        &b.errors,
    ] {
        first_errors(errors);
    }
    eprintln!("bench: done in {:.0} s", t_all.elapsed().as_secs_f64());

    drop(svc);
    match private {
        // The whole cluster goes; waiting for the finalizer of 100+ pods adds nothing.
        Some(pc) => tokio::task::spawn_blocking(move || drop(pc)).await?,
        None => env.finish(Some(INSTANCE)).await,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_the_bucket_bounds_summed_over_replicas() {
        let one = "# TYPE cli_mcp_session_admission_seconds histogram
cli_mcp_session_admission_seconds_bucket{le=\"0.000005\",result=\"refused\"} 60
cli_mcp_session_admission_seconds_bucket{le=\"0.00001\",result=\"refused\"} 99
cli_mcp_session_admission_seconds_bucket{le=\"+Inf\",result=\"refused\"} 100
cli_mcp_session_admission_seconds_bucket{le=\"0.000005\",result=\"admitted\"} 0
cli_mcp_session_admission_seconds_bucket{le=\"+Inf\",result=\"admitted\"} 3
"
        .to_string();
        let q = histogram_quantiles(
            &[one.clone(), one],
            "cli_mcp_session_admission_seconds",
            "refused",
        )
        .expect("refused");
        assert_eq!(
            q,
            Quantiles {
                n: 200,
                median: 0.000005,
                p99: 0.00001
            }
        );
        assert_eq!(at_most(q.median), "≤ 5.0 µs");
        let a = histogram_quantiles(&[], "cli_mcp_session_admission_seconds", "admitted");
        assert_eq!(a, None, "no exposition, no figure");
    }
}
