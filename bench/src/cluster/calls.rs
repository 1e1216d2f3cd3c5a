//! `tools/call` of `true` on a live session, sequentially, on one path (the Service or the
//! server pod's IP).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cli_mcp_e2e::journey::{Env, Mcp};

use super::instance::{no_sessions, server_pod};
use super::INSTANCE;
use crate::figures::rss_kib;

/// The calls on both paths, and the server pod's process they went to.
pub(super) struct Calls {
    /// The server's host pid (for its RSS after the later phases).
    pub(super) server_pid: i32,
    /// The server's RSS before the calls.
    pub(super) rss_idle: u64,
    pub(super) via_svc: Vec<Duration>,
    pub(super) svc_errors: usize,
    pub(super) via_pod: Vec<Duration>,
    pub(super) pod_errors: usize,
}

/// `n` calls on session `calls` through the Service, then `n` on the server pod's IP; then
/// no session is left.
pub(super) async fn both_paths(env: &Env, svc: &Mcp, n: usize) -> anyhow::Result<Calls> {
    let (server_ip, server_pid) = server_pod(env, INSTANCE).await?;
    let rss_idle = rss_kib(server_pid as u32).unwrap_or(0);
    let (via_svc, svc_errors) = calls(svc, "calls", n).await;
    // The same client on the server pod's IP (TLS still names the Service).
    let pod = svc.via(SocketAddr::new(server_ip.parse()?, 8443), true);
    let (via_pod, pod_errors) = calls(&pod, "calls", n).await;
    let _ = svc.try_delete("calls").await;
    no_sessions(env).await?;
    Ok(Calls {
        server_pid,
        rss_idle,
        via_svc,
        svc_errors,
        via_pod,
        pod_errors,
    })
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
