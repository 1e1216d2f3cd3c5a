//! Pod helpers of the journeys: selectors, a pod's session and host process, the server
//! pods' metrics, and faults on host processes.

use std::time::Duration;

use cli_mcp_api::names::InstanceName;
pub use cli_mcp_api::pod_state::session_of;
use k8s_openapi::api::core::v1::Pod;

use super::env::Env;
use crate::http::{self, metric_sum};
use crate::testing::pod_ip;

fn instance_name(instance: &str) -> InstanceName {
    InstanceName::parse(instance).unwrap_or_else(|e| panic!("instance name: {e}"))
}

/// Label selector of an instance's server pods.
pub fn server_selector(instance: &str) -> String {
    instance_name(instance).server_selector()
}

/// Label selector of an instance's sandbox pods.
pub fn sandbox_selector(instance: &str) -> String {
    instance_name(instance).sandbox_selector()
}

/// Sum of `cli_mcp_session_start_seconds_count{launch="<launch>"}` over the server pods,
/// `None` when no server answered.
pub async fn server_starts(env: &Env, instance: &str, launch: &str) -> Option<f64> {
    let client = http::client(None)
        .timeout(Duration::from_secs(5))
        .build()
        .ok()?;
    let series = format!("cli_mcp_session_start_seconds_count{{launch=\"{launch}\"}}");
    let mut total = None;
    for p in env.list::<Pod>(&server_selector(instance)).await {
        let Some(ip) = pod_ip(&p) else { continue };
        let Some((_, body)) = http::get(&client, &format!("http://{ip}:8081/metrics")).await else {
            continue;
        };
        *total.get_or_insert(0.0) += metric_sum(&body, &series).unwrap_or(0.0);
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
