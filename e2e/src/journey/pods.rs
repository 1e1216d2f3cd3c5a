//! Pod helpers of the journeys: selectors, a pod's session and host process, the server
//! pods' metrics, and faults on host processes.

use std::time::Duration;

use cli_mcp_api::names::label;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::env::Env;
use crate::testing::pod_ip;

/// Label selector of an instance's server pods.
pub fn server_selector(instance: &str) -> String {
    format!(
        "{}={instance},{}={}",
        label::INSTANCE,
        label::COMPONENT,
        label::COMPONENT_SERVER
    )
}

pub fn sandbox_selector(instance: &str) -> String {
    format!(
        "{}={instance},{}={}",
        label::INSTANCE,
        label::COMPONENT,
        label::COMPONENT_SANDBOX
    )
}

pub fn session_of(p: &Pod) -> Option<&str> {
    p.labels().get(label::SESSION_ID).map(String::as_str)
}

/// Sum of `cli_mcp_session_start_seconds_count{launch="<launch>"}` over the server pods,
/// `None` when no server answered.
pub async fn server_starts(env: &Env, instance: &str, launch: &str) -> Option<f64> {
    let selector = server_selector(instance);
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .ok()?;
    let mut total = None;
    for p in env.list::<Pod>(&selector).await {
        let Some(ip) = pod_ip(&p) else { continue };
        let Ok(r) = http.get(format!("http://{ip}:8081/metrics")).send().await else {
            continue;
        };
        let Ok(body) = r.text().await else { continue };
        let key = format!("cli_mcp_session_start_seconds_count{{launch=\"{launch}\"}}");
        let v: f64 = body
            .lines()
            .filter(|l| l.starts_with(&key))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        *total.get_or_insert(0.0) += v;
    }
    total
}

/// The host pid of a pod's first container (the process kubelet's containerID).
pub fn container_pid(p: &Pod) -> i32 {
    let id = p
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .and_then(|c| c.container_id.clone())
        .expect("containerID");
    id.strip_prefix("cli-mcp://")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("unexpected containerID {id}"))
}

/// SIGKILLs host process `pid` as soon as a process with exactly `argv` runs (the command
/// under test has started), polling `/proc` (no event says so) for at most `within`.
pub async fn kill_when_running(argv: &[&str], pid: i32, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while !process_running(argv) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{argv:?} never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap_or_else(|e| panic!("kill {pid}: {e}"));
}

/// Whether a process with exactly this argv runs on the host.
pub fn process_running(argv: &[&str]) -> bool {
    let want: Vec<u8> = argv
        .iter()
        .flat_map(|a| [a.as_bytes(), b"\0"].concat())
        .collect();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| std::fs::read(e.path().join("cmdline")).is_ok_and(|c| c == want))
}
