//! The measured instance and its pods: its pool converged to a size, its sessions gone, its
//! server pod's address and process, and its servers' metrics.

use std::time::Duration;

use anyhow::Context;
use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::InstanceName;
use cli_mcp_api::pod_state;
use cli_mcp_e2e::journey::{container_pid, sandbox_selector, server_selector, session_of, Env};
use cli_mcp_e2e::runtime::SandboxRuntime;
use cli_mcp_e2e::testing::{pod_ip, wait_for, wait_for_set};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

use super::{ClusterArgs, CONVERGE, INSTANCE};

/// Instance `bench` with a warm pool of `--starts`, room for every phase's sessions, its
/// sandboxes under runtime `rt`, and their CPU limit if one was given; returns its CR once
/// its pool is full.
pub(super) async fn install(
    env: &Env,
    args: &ClusterArgs,
    rt: SandboxRuntime,
) -> anyhow::Result<Value> {
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
    rt.apply_to(&mut cr);
    env.apply_cr(&cr).await;
    env.wait_ready(INSTANCE).await;
    converge_pool(env, INSTANCE, warm).await?;
    Ok(cr)
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

pub(super) async fn set_pool(env: &Env, cr: &mut Value, warm: i32) -> anyhow::Result<()> {
    cr["spec"]["sandbox"]["warmPoolSize"] = json!(warm);
    env.apply_cr(cr).await;
    converge_pool(env, INSTANCE, warm).await
}

/// Waits until no pod of a session is left (after the sessions were deleted).
pub(super) async fn no_sessions(env: &Env) -> anyhow::Result<()> {
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

/// The instance's one server pod: its IP, and its host pid (for RSS).
pub(super) async fn server_pod(env: &Env, instance: &str) -> anyhow::Result<(String, i32)> {
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

/// `/metrics` of every server pod of `instance`.
pub(super) async fn server_metrics(env: &Env, instance: &str) -> Vec<String> {
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
