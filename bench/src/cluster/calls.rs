//! `tools/call` of `true` on a live session, sequentially, on one path (the Service or the
//! server pod's IP); and, to tell the sandbox's share from the rest, the command's time as the
//! agent measured it and a bare `GET /healthz` from the node to that session's agent.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cli_mcp_api::wire::AGENT_PORT;
use cli_mcp_e2e::journey::{sandbox_selector, session_of, Env, Mcp};
use cli_mcp_e2e::testing::pod_ip;
use k8s_openapi::api::core::v1::Pod;

use super::instance::{no_sessions, server_pod};
use super::INSTANCE;
use crate::figures::rss_kib;

const SESSION: &str = "calls";

/// The calls on both paths, and the server pod's process they went to.
pub(super) struct Calls {
    /// The server's host pid (for its RSS after the later phases).
    pub(super) server_pid: i32,
    /// The server's RSS before the calls.
    pub(super) rss_idle: u64,
    pub(super) via_svc: Vec<Duration>,
    pub(super) svc_errors: usize,
    /// The agent's `duration_ms` of each call through the Service (whole milliseconds).
    pub(super) agent_ms: Vec<Duration>,
    pub(super) via_pod: Vec<Duration>,
    pub(super) pod_errors: usize,
    /// `GET /healthz` from the node to the session's agent (its pod IP): the bare round trip
    /// into the sandbox, no shell, no server; and how many failed.
    pub(super) healthz: Vec<Duration>,
    pub(super) healthz_errors: usize,
}

/// `n` calls on session `calls` through the Service, then `n` on the server pod's IP, then
/// `n` `GET /healthz` to its agent; then no session is left.
pub(super) async fn both_paths(env: &Env, svc: &Mcp, n: usize) -> anyhow::Result<Calls> {
    let (server_ip, server_pid) = server_pod(env, INSTANCE).await?;
    let rss_idle = rss_kib(server_pid as u32).unwrap_or(0);
    let (via_svc, agent_ms, svc_errors) = calls(svc, n).await;
    // The same client on the server pod's IP (TLS still names the Service).
    let pod = svc.via(SocketAddr::new(server_ip.parse()?, 8443), true);
    let (via_pod, _, pod_errors) = calls(&pod, n).await;
    let (healthz, healthz_errors) = healthz(env, n).await;
    let _ = svc.try_delete(SESSION).await;
    no_sessions(env).await?;
    Ok(Calls {
        server_pid,
        rss_idle,
        via_svc,
        svc_errors,
        agent_ms,
        via_pod,
        pod_errors,
        healthz,
        healthz_errors,
    })
}

/// `n` calls of `true` on session [`SESSION`]: each one's time, the agent's `duration_ms`
/// of it, and how many failed.
async fn calls(ep: &Mcp, n: usize) -> (Vec<Duration>, Vec<Duration>, usize) {
    let mut samples = Vec::with_capacity(n);
    let mut agent = Vec::with_capacity(n);
    let mut errors = 0;
    // Warm up: the session exists, the connection is open.
    for _ in 0..10 {
        let _ = ep.bash_ok(SESSION, "true").await;
    }
    for _ in 0..n {
        let t = Instant::now();
        match ep.bash_ok(SESSION, "true").await {
            Ok(r) => {
                samples.push(t.elapsed());
                let ms = r["structuredContent"]["duration_ms"].as_u64().unwrap_or(0);
                agent.push(Duration::from_millis(ms));
            }
            Err(_) => errors += 1,
        }
    }
    (samples, agent, errors)
}

/// `n` sequential `GET /healthz` on one kept-alive connection from the node to the agent of
/// session [`SESSION`]; all failed when the node cannot reach it.
async fn healthz(env: &Env, n: usize) -> (Vec<Duration>, usize) {
    let pods = env.list::<Pod>(&sandbox_selector(INSTANCE)).await;
    let ip = pods
        .iter()
        .find(|p| session_of(p) == Some(SESSION))
        .and_then(pod_ip);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build();
    let (Some(ip), Ok(client)) = (ip, client) else {
        return (Vec::new(), n);
    };
    let url = format!("http://{ip}:{AGENT_PORT}/healthz");
    let (mut samples, mut errors) = (Vec::with_capacity(n), 0);
    for _ in 0..n {
        let t = Instant::now();
        match client.get(&url).send().await {
            Ok(r) if r.status().is_success() => {
                let _ = r.bytes().await;
                samples.push(t.elapsed());
            }
            _ => errors += 1,
        }
        if errors >= 3 && samples.is_empty() {
            // Unreachable from the node (a NetworkPolicy): no point in waiting n times.
            return (samples, n);
        }
    }
    (samples, errors)
}
