//! Helpers for the operator's tests on the local Kubernetes: install the CRD, run the
//! operator binary as a host process scoped to one test namespace, create instances, claim
//! pods the way the server does, and wait on conditions (watches, no sleeps).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::{annotation, label, FIELD_MANAGER};
use cli_mcp_api::token::HmacKey;
use cli_mcp_api::SessionId;
use cli_mcp_e2e::testing::{wait_for, wait_for_set, workspace_root, TestCluster, TestNamespace};
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::ByteString;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

pub const TIMEOUT: Duration = Duration::from_secs(90);
pub const SERVER_IMAGE: &str = "cli-mcp-server:dev";
pub const SANDBOX_IMAGE: &str = "cli-mcp-agent:dev";

/// Installs (server-side applies) the CRD and waits until it is Established.
pub async fn install_crd(c: &TestCluster) {
    let api: Api<CustomResourceDefinition> = Api::all(c.client.clone());
    // Exactly what config/crd and the chart install.
    let yaml = cli_mcp_operator::crdgen::crd_yaml().expect("CRD YAML");
    let crd: CustomResourceDefinition = serde_yaml::from_str(&yaml).expect("CRD parses");
    let name = crd.name_any();
    api.patch(
        &name,
        &PatchParams::apply("cli-mcp-e2e").force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("apply CRD");
    wait_for(
        api,
        &name,
        "CRD Established",
        TIMEOUT,
        |o: Option<&CustomResourceDefinition>| {
            o.and_then(|c| c.status.as_ref())
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                })
        },
    )
    .await
    .expect("CRD established");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// An operator process on the host, watching one namespace. Killed on drop.
pub struct Operator {
    child: Option<Child>,
    pub identity: String,
    pub health: u16,
    pub log: PathBuf,
}

impl Operator {
    pub fn start(c: &TestCluster, ns: &str, identity: &str) -> Operator {
        Self::start_with(c, ns, identity, &[])
    }

    pub fn start_with(c: &TestCluster, ns: &str, identity: &str, env: &[(&str, &str)]) -> Operator {
        let dir = workspace_root().join(".run/operator-tests");
        std::fs::create_dir_all(&dir).expect("log dir");
        let log = dir.join(format!("{ns}-{identity}.log"));
        let out = std::fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let health = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cli-mcp-operator"));
        cmd.env("KUBECONFIG", &c.info.kubeconfig)
            .env("WATCH_NAMESPACE", ns)
            .env("POD_NAMESPACE", ns)
            .env("POD_NAME", identity)
            .env("RELATED_IMAGE_SERVER", SERVER_IMAGE)
            .env("RELATED_IMAGE_SANDBOX", SANDBOX_IMAGE)
            .env("CLI_MCP_HEALTH_LISTEN", format!("127.0.0.1:{health}"))
            .env("CLI_MCP_LEASE_DURATION", "4")
            .env("CLI_MCP_LEASE_GRACE", "2")
            .env("RUST_LOG", "info,cli_mcp_operator=debug")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn cli-mcp-operator");
        Operator {
            child: Some(child),
            identity: identity.into(),
            health,
            log,
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Resident and peak resident memory in KiB (VmRSS, VmHWM).
    pub fn rss_kib(&self) -> Option<(u64, u64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        };
        Some((field("VmRSS:")?, field("VmHWM:")?))
    }

    /// Sum of one metric over all its label sets.
    pub async fn metric(&self, name: &str) -> f64 {
        let Some((_, text)) = self.http("/metrics").await else {
            return 0.0;
        };
        text.lines()
            .filter(|l| l.split(['{', ' ']).next() == Some(name))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum()
    }

    /// Sum of `cli_mcp_operator_reconciles_total` over all results.
    pub async fn reconciles(&self) -> u64 {
        let Some((_, text)) = self.http("/metrics").await else {
            return 0;
        };
        text.lines()
            .filter(|l| l.starts_with("cli_mcp_operator_reconciles_total"))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum::<f64>() as u64
    }

    /// SIGKILL: a crash, no lease release.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// GET a health endpoint.
    pub async fn http(&self, path: &str) -> Option<(u16, String)> {
        let url = format!("http://127.0.0.1:{}{path}", self.health);
        let resp = reqwest::get(url).await.ok()?;
        let code = resp.status().as_u16();
        Some((code, resp.text().await.unwrap_or_default()))
    }

    /// Sum of `cli_mcp_operator_api_writes_total` over all labels.
    pub async fn writes(&self) -> u64 {
        let Some((_, text)) = self.http("/metrics").await else {
            return 0;
        };
        text.lines()
            .filter(|l| l.starts_with("cli_mcp_operator_api_writes_total"))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum::<f64>() as u64
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The sandbox kubeconfig Secret every instance needs (content is not used by the tests).
pub async fn kubeconfig_secret(ns: &TestNamespace, instance: &str) {
    let s = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(format!("cli-mcp-{instance}-kubeconfig")),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            "kubeconfig".to_owned(),
            ByteString(b"apiVersion: v1\nkind: Config\n".to_vec()),
        )])),
        ..Default::default()
    };
    ns.api::<Secret>()
        .create(&PostParams::default(), &s)
        .await
        .expect("create kubeconfig Secret");
}

/// Small requests: the local node's allocatable CPU is the host's (2 cores) and tests run
/// in parallel, so the default 100m per sandbox would make pods Unschedulable.
pub fn small_resources() -> serde_json::Value {
    json!({"requests": {"cpu": "5m", "memory": "16Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}})
}

/// A CliMcpInstance; sandbox and server get [`small_resources`] unless the spec sets them.
pub fn instance(name: &str, mut spec: serde_json::Value) -> CliMcpInstance {
    if let Some(obj) = spec.as_object_mut() {
        for part in ["sandbox", "server"] {
            let entry = obj.entry(part).or_insert_with(|| json!({}));
            if let Some(o) = entry.as_object_mut() {
                o.entry("resources").or_insert_with(small_resources);
            }
        }
    }
    serde_json::from_value(json!({
        "apiVersion": "cli-mcp.redhat.com/v1alpha1",
        "kind": "CliMcpInstance",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .expect("valid CliMcpInstance")
}

pub async fn create_instance(
    ns: &TestNamespace,
    name: &str,
    spec: serde_json::Value,
) -> CliMcpInstance {
    kubeconfig_secret(ns, name).await;
    ns.api::<CliMcpInstance>()
        .create(&PostParams::default(), &instance(name, spec))
        .await
        .expect("create CliMcpInstance")
}

pub fn condition(o: &CliMcpInstance, ty: &str) -> Option<(String, String)> {
    o.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == ty)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

pub fn is_true(o: &CliMcpInstance, ty: &str) -> bool {
    condition(o, ty).is_some_and(|(s, _)| s == "True")
}

/// Waits until the instance is Ready=True for its current generation.
pub async fn wait_ready(ns: &TestNamespace, name: &str, op: &Operator) -> CliMcpInstance {
    let r = wait_for(
        ns.api::<CliMcpInstance>(),
        name,
        "instance Ready",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            o.is_some_and(|o| {
                is_true(o, "Ready")
                    && o.status.as_ref().and_then(|s| s.observed_generation)
                        == o.metadata.generation
            })
        },
    )
    .await;
    match r {
        Ok(Some(o)) => o,
        other => panic!(
            "instance {name} not Ready: {other:?}\noperator log:\n{}",
            op.log_tail()
        ),
    }
}

pub async fn hmac_key(ns: &TestNamespace, instance: &str) -> HmacKey {
    let s = ns
        .api::<Secret>()
        .get(&format!("cli-mcp-{instance}-hmac"))
        .await
        .expect("HMAC Secret");
    let bytes = s.data.and_then(|d| d.get("key").cloned()).expect("key").0;
    HmacKey::from_hex(&String::from_utf8_lossy(&bytes)).expect("valid key")
}

pub fn sandbox_selector(instance: &str) -> String {
    format!(
        "{}={instance},{}=sandbox",
        label::INSTANCE,
        label::COMPONENT
    )
}

pub fn unassigned(pods: &[Pod]) -> Vec<&Pod> {
    pods.iter()
        .filter(|p| {
            !p.labels().contains_key(label::SESSION_ID) && p.metadata.deletion_timestamp.is_none()
        })
        .collect()
}

pub fn ready(p: &Pod) -> bool {
    cli_mcp_e2e::testing::pod_is_ready(p)
}

/// Waits until the instance has exactly `n` unassigned, Ready, non-terminating sandboxes
/// and no other unassigned ones.
pub async fn wait_pool(ns: &TestNamespace, instance: &str, n: usize, op: &Operator) -> Vec<Pod> {
    let r = wait_for_set(
        ns.api::<Pod>(),
        &sandbox_selector(instance),
        &format!("{n} ready warm sandboxes"),
        TIMEOUT,
        |pods: &[Pod]| {
            let free = unassigned(pods);
            free.len() == n
                && free.iter().all(|p| ready(p))
                && pods
                    .iter()
                    .filter(|p| p.metadata.deletion_timestamp.is_some())
                    .count()
                    == 0
        },
    )
    .await;
    match r {
        Ok(pods) => pods,
        Err(e) => panic!(
            "pool of {instance} did not reach {n}: {e}\noperator log:\n{}",
            op.log_tail()
        ),
    }
}

/// Claims a warm pod the way the server does: merge patch with the listed resourceVersion.
pub async fn claim(api: &Api<Pod>, pod: &Pod, sid: &str, key: &HmacKey) -> kube::Result<Pod> {
    let sid = SessionId::parse(sid).expect("valid sid");
    let commitment = key.session_token(&sid).commitment().to_hex();
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let patch = json!({"metadata": {
        "resourceVersion": pod.resource_version(),
        "labels": {label::SESSION_ID: sid.as_str(), label::LAUNCH: label::LAUNCH_WARM},
        "annotations": {annotation::TOKEN_SHA256: commitment, annotation::LAST_ACTIVITY: now},
    }});
    api.patch(
        &pod.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
}

/// Deletes the instance while the operator runs, waits for it to be gone, then deletes the
/// namespace. Call at the end of a successful test.
pub async fn finish(ns: TestNamespace, name: &str, op: &Operator) {
    let api = ns.api::<CliMcpInstance>();
    let _ = api.delete(name, &DeleteParams::default()).await;
    let r = wait_for(
        api,
        name,
        "instance deleted",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| o.is_none(),
    )
    .await;
    if let Err(e) = r {
        panic!(
            "instance {name} was not released: {e}\noperator log:\n{}",
            op.log_tail()
        );
    }
    ns.delete().await.expect("delete namespace");
}

pub fn field_manager() -> &'static str {
    FIELD_MANAGER
}
