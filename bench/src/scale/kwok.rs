//! The simulated node: the KWOK controller, its node, and session pods exactly as the server
//! builds them, bound to that node.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cli_mcp_api::names::InstanceName;
use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxRole};
use cli_mcp_api::token::{HmacKey, SandboxNonce};
use cli_mcp_api::SessionId;
use cli_mcp_e2e::journey::Env;
use cli_mcp_e2e::testing::{wait_for, TestCluster};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::api::{ListParams, PostParams};
use kube::Api;
use serde_json::json;

use super::INSTANCE;

/// The simulated node, and the annotation KWOK is told to manage nodes by.
pub(super) const KWOK_NODE: &str = "kwok-node-0";
const KWOK_ANNOTATION: (&str, &str) = ("kwok.x-k8s.io/node", "fake");
/// Simulated pods get addresses in loopback: should anything ever connect to one, the
/// packet stays on this machine.
const KWOK_POD_CIDR: &str = "127.64.0.0/16";

/// The KWOK controller, killed when dropped.
pub(super) struct Kwok(pub(super) tokio::process::Child);

pub(super) async fn start_kwok(c: &TestCluster, bin_dir: &Path) -> anyhow::Result<Kwok> {
    let bin = bin_dir.join("kwok");
    let stages = bin_dir
        .parent()
        .map(|p| p.join("stages.yaml"))
        .context("the KWOK bin dir has no parent")?;
    if !bin.is_file() || !stages.is_file() {
        bail!(
            "{} or {} is missing: run hack/build-kwok.sh (or pass --kwok-bin-dir)",
            bin.display(),
            stages.display()
        );
    }
    let log = c.info.log_dir.join("kwok.log");
    let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let child = tokio::process::Command::new(&bin)
        .arg(format!("--kubeconfig={}", c.info.kubeconfig.display()))
        .arg(format!("--config={}", stages.display()))
        .arg(format!(
            "--manage-nodes-with-annotation-selector={}={}",
            KWOK_ANNOTATION.0, KWOK_ANNOTATION.1
        ))
        .arg(format!("--cidr={KWOK_POD_CIDR}"))
        .arg("--node-ip=127.0.0.1")
        .arg("--node-lease-duration-seconds=40")
        .stdout(out.try_clone()?)
        .stderr(out)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    Ok(Kwok(child))
}

/// The simulated node: tainted so the scheduler never places a real pod there (the
/// simulated pods are bound to it by name).
pub(super) async fn create_kwok_node(c: &TestCluster) -> anyhow::Result<()> {
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": KWOK_NODE,
            "annotations": {KWOK_ANNOTATION.0: KWOK_ANNOTATION.1},
            "labels": {"kubernetes.io/hostname": KWOK_NODE, "type": "kwok"},
        },
        "spec": {
            "taints": [{"key": KWOK_ANNOTATION.0, "value": KWOK_ANNOTATION.1, "effect": "NoSchedule"}],
        },
    }))?;
    Api::<Node>::all(c.client.clone())
        .create(&PostParams::default(), &node)
        .await
        .context("creating the KWOK node")?;
    wait_for(
        Api::<Node>::all(c.client.clone()),
        KWOK_NODE,
        "the KWOK node Ready",
        Duration::from_secs(120),
        |n: Option<&Node>| {
            n.and_then(|n| n.status.as_ref())
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        },
    )
    .await?;
    Ok(())
}

/// What the server builds session pods from: its `CLI_MCP_SANDBOX_CONFIG` and the
/// instance's HMAC key.
pub(super) async fn server_inputs(env: &Env) -> anyhow::Result<(SandboxConfig, HmacKey)> {
    let name = InstanceName::parse(INSTANCE)?;
    let d = env
        .api::<Deployment>()
        .get(&name.server())
        .await
        .context("the server Deployment")?;
    let cfg = d
        .spec
        .template
        .spec
        .and_then(|s| s.containers.into_iter().next())
        .and_then(|c| c.env)
        .unwrap_or_default()
        .into_iter()
        .find(|e| e.name == "CLI_MCP_SANDBOX_CONFIG")
        .and_then(|e| e.value)
        .context("the server container has no CLI_MCP_SANDBOX_CONFIG")?;
    let cfg: SandboxConfig =
        serde_json::from_str(&cfg).context("the server's CLI_MCP_SANDBOX_CONFIG")?;
    let secret = env
        .api::<Secret>()
        .get(&name.hmac_secret())
        .await
        .context("the HMAC Secret")?;
    let key = secret
        .data
        .and_then(|d| d.get("key").cloned())
        .context("the HMAC Secret has no key")?;
    let key = HmacKey::from_hex(&String::from_utf8_lossy(&key.0))
        .map_err(|e| anyhow::anyhow!("the HMAC key: {e:?}"))?;
    Ok((cfg, key))
}

/// Simulated session `i`: the server's own pod for session `sim-<i>`, bound to the KWOK node.
pub(super) fn sim_pod(
    cfg: &SandboxConfig,
    key: &HmacKey,
    i: usize,
    now: &str,
) -> anyhow::Result<Pod> {
    let sid = SessionId::parse(&format!("sim-{i}")).context("session id")?;
    let mut nonce = [0u8; 16];
    nonce[..8].copy_from_slice(&(i as u64).to_be_bytes());
    let role = SandboxRole::session(key, sid, SandboxNonce::from_bytes(nonce), None);
    let mut pod = build_sandbox_pod(cfg, &role, now);
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = Some(KWOK_NODE.into());
        spec.tolerations
            .get_or_insert_with(Vec::new)
            .push(serde_json::from_value(json!({
                "key": KWOK_ANNOTATION.0, "operator": "Exists", "effect": "NoSchedule"
            }))?);
    }
    Ok(pod)
}

/// Simulated pods that KWOK has marked Ready.
pub(super) async fn ready_sim_pods(pods: &Api<Pod>) -> anyhow::Result<usize> {
    let mut n = 0;
    let mut lp = ListParams::default()
        .fields(&format!("spec.nodeName={KWOK_NODE}"))
        .limit(1000);
    loop {
        let page = pods.list(&lp).await.context("listing the simulated pods")?;
        n += page
            .items
            .iter()
            .filter(|p| cli_mcp_api::pod_state::is_ready(p))
            .count();
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => lp = lp.continue_token(&token),
            None => return Ok(n),
        }
    }
}

/// Simulated sessions `range`, created through the API 16 at a time.
pub(super) async fn create_sim_pods(
    pods: &Api<Pod>,
    cfg: &SandboxConfig,
    key: &HmacKey,
    range: std::ops::Range<usize>,
) -> anyhow::Result<()> {
    let now = cli_mcp_api::activity::stamp_now();
    let batch: Vec<Pod> = range
        .map(|i| sim_pod(cfg, key, i, &now))
        .collect::<anyhow::Result<_>>()?;
    let results: Vec<Result<(), String>> = futures::stream::iter(batch)
        .map(|p| {
            let pods = pods.clone();
            async move {
                pods.create(&PostParams::default(), &p)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    if let Some(e) = results.iter().find_map(|r| r.as_ref().err()) {
        bail!("creating simulated pods: {e}");
    }
    Ok(())
}

/// Waits until KWOK has marked `created` simulated pods Ready (15 min at most).
pub(super) async fn wait_sim_ready(pods: &Api<Pod>, created: usize) -> anyhow::Result<()> {
    let ready_end = Instant::now() + Duration::from_secs(900);
    loop {
        let n = ready_sim_pods(pods).await?;
        if n >= created {
            break;
        }
        if Instant::now() > ready_end {
            bail!("only {n} of {created} simulated pods Ready after 15 min (see kwok.log)");
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli_mcp_api::names::label;
    use cli_mcp_api::pod_state::session_of;

    #[test]
    fn simulated_pods_are_the_servers_session_pods_on_the_kwok_node() {
        let cfg = SandboxConfig::new(InstanceName::parse("scale").expect("name"), "ns", "img");
        let key = HmacKey::from_bytes([7; 32]);
        let p = sim_pod(&cfg, &key, 42, "2026-01-01T00:00:00Z").expect("pod");
        assert_eq!(session_of(&p), Some("sim-42"));
        assert_eq!(
            p.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(label::LAUNCH))
                .map(String::as_str),
            Some("cold")
        );
        let spec = p.spec.as_ref().expect("spec");
        assert_eq!(spec.node_name.as_deref(), Some(KWOK_NODE));
        // A token of the instance's key opens it, so the operator never collects it as stale.
        let sid = SessionId::parse("sim-42").expect("sid");
        assert!(cli_mcp_api::sandbox::session_token_of(&p, &sid, &key).is_some());
        let other = sim_pod(&cfg, &key, 43, "2026-01-01T00:00:00Z").expect("pod");
        assert_ne!(p.metadata.name, other.metadata.name);
    }
}
