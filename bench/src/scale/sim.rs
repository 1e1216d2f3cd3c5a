//! The simulation: session pods added on the KWOK node up to each point, and at each point
//! the snapshot, one reconcile at rest and warm claims from the pool of real pods.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::InstanceName;
use cli_mcp_e2e::journey::{sandbox_selector, Env, Mcp};
use cli_mcp_e2e::testing::{wait_for, TestCluster};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{ListParams, Patch, PatchParams};
use serde_json::json;

use super::kwok::{
    create_kwok_node, create_sim_pods, server_inputs, start_kwok, wait_sim_ready, KWOK_NODE,
};
use super::sim_report::{Point, SimReport};
use super::snap::{metrics_of, rss, snap, Procs};
use super::traffic::pod_watch_events;
use super::{instance_cr, ScaleArgs, INSTANCE, MAX_SESSIONS};
use crate::cluster::converge_pool;
use crate::prom::Buckets;

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

pub(super) async fn simulate(
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
        create_sim_pods(&pods, &cfg, &key, created..target).await?;
        let create_wall = t.elapsed();
        created = target;
        wait_sim_ready(&pods, created).await?;
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
