//! Density: how many idle sessions the real node holds with the default sandbox requests,
//! and what each costs it. Instance `dense` takes the defaults (no requests of the bench's
//! own), `n` sessions start in waves and each runs one command; then, with every shell idle,
//! the pods' cgroups are read as for the idle rows ([`super::memory`]), and the host's
//! `MemAvailable` before and after says what the node as a whole gave them (the pods, their
//! shims, and the kubelet's and the control plane's share, which run on the same host).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use cli_mcp_api::crd::{CliMcpInstance, DEFAULT_SANDBOX_REQUESTS};
use cli_mcp_api::pod_state::phase;
use cli_mcp_e2e::journey::{sandbox_selector, Env};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use super::memory::{idle_of, IdleMemory, CPU_WINDOW};
use crate::figures::{median, mib};

const NAME: &str = "dense";
/// Sessions started at a time: the node starts pods at its own pace, and all at once would
/// only measure the kubelet's queue.
const WAVE: usize = 20;

pub(super) struct Density {
    pub(super) asked: usize,
    pub(super) started: usize,
    pub(super) errors: Vec<String>,
    /// Sandbox pods of the instance left `Pending` (not placed, or not started).
    pub(super) pending: usize,
    pub(super) took: Duration,
    pub(super) memory: IdleMemory,
    /// How much the host's `MemAvailable` fell while the sessions started, in KiB.
    pub(super) host_drop_kib: Option<u64>,
}

/// The host's `MemAvailable` in KiB.
fn mem_available_kib() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// `n` idle sessions of instance `dense` on the real node (containerd at `socket`).
pub(super) async fn measure(env: &Env, socket: &Path, n: usize) -> anyhow::Result<Density> {
    env.dummy_kubeconfig(NAME).await;
    let mut cr = env.cr(NAME, 0);
    if let Some(sandbox) = cr["spec"]["sandbox"].as_object_mut() {
        sandbox.remove("resources");
    }
    cr["spec"]["sandbox"]["maxSessions"] = json!(n);
    cr["spec"]["server"]["maxSessionsPerClient"] = json!(n);
    cr["spec"]["replicas"] = json!(1);
    env.apply_cr(&cr).await;
    env.wait_ready(NAME).await;
    let svc = env.client(NAME).await;
    let before = mem_available_kib();
    let t0 = Instant::now();
    let results: Vec<_> = futures::stream::iter(0..n)
        .map(|i| {
            let svc = svc.clone();
            async move { svc.try_bash(&format!("idle-{i}"), "true").await }
        })
        .buffer_unordered(WAVE)
        .collect()
        .await;
    let took = t0.elapsed();
    let mut errors = Vec::new();
    let mut started = 0;
    for r in results {
        match r {
            Ok(v) if v["isError"] == false => started += 1,
            Ok(v) => errors.push(v.to_string()),
            Err(e) => errors.push(e.to_string()),
        }
    }
    let memory = idle_of(env, socket, NAME).await;
    let after = mem_available_kib();
    let pending = env
        .list::<Pod>(&sandbox_selector(NAME))
        .await
        .iter()
        .filter(|p| phase(p) == Some("Pending"))
        .count();
    drop(svc);
    env.api::<CliMcpInstance>()
        .delete(NAME, &Default::default())
        .await
        .context("deleting instance dense")?;
    super::no_pods_of(env, NAME).await?;
    Ok(Density {
        asked: n,
        started,
        errors,
        pending,
        took,
        memory,
        host_drop_kib: before.zip(after).map(|(b, a)| b.saturating_sub(a)),
    })
}

impl Density {
    pub(super) fn print(&self) {
        let (cpu, memory) = DEFAULT_SANDBOX_REQUESTS;
        let mib = |kib: Option<u64>| kib.map_or("–".into(), mib);
        let m = &self.memory;
        let cpu_median = median(&m.cpu_millicores).map_or("–".into(), |c| format!("{c:.2}m"));
        println!();
        println!(
            "| density: {} idle sessions under runc, default requests ({cpu}, {memory}) | value |",
            self.asked
        );
        println!("|---|---|");
        println!(
            "| sessions started / asked (errors; sandbox pods left Pending) | {} / {} ({}; {}) |",
            self.started,
            self.asked,
            self.errors.len(),
            self.pending
        );
        println!(
            "| time to start them, {WAVE} at a time | {:.1} s |",
            self.took.as_secs_f64()
        );
        println!(
            "| per idle sandbox: pod cgroup `{}`, median of {} | {} |",
            m.charge_file,
            m.charge.len(),
            mib(median(&m.charge).map(|b| b / 1024))
        );
        println!(
            "| per idle sandbox: its containerd shim outside the pod cgroup, PSS median | {} |",
            mib(median(&m.shim_pss))
        );
        println!(
            "| per idle sandbox: the host's `MemAvailable` drop / sessions started | {} |",
            mib(self
                .host_drop_kib
                .filter(|_| self.started > 0)
                .map(|k| k / self.started as u64))
        );
        println!(
            "| per idle sandbox: CPU over {} s idle, median | {cpu_median} |",
            CPU_WINDOW.as_secs()
        );
        for e in self.errors.iter().chain(&m.errors).take(3) {
            println!("| error | {} |", e.chars().take(200).collect::<String>());
        }
    }
}
