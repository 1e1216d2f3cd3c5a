//! Helpers for the operator's tests on the local Kubernetes: install the CRD, run the
//! operator binary as a host process scoped to one test namespace, create instances, claim
//! pods the way the server does, and wait on conditions (watches, no sleeps). What is not
//! about the host operator process is `cli_mcp_e2e::instance`'s, re-exported here.

// Each test binary (and the operator bench) uses a part of this module.
#![allow(dead_code, unused_imports)]

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::FIELD_MANAGER;
use cli_mcp_api::pod_state::{is_deleting, is_ready};
use cli_mcp_e2e::http::{self, metric_sum};
use cli_mcp_e2e::instance::{self, delete_instance, is_ready_for_generation, wait_instance};
use cli_mcp_e2e::testing::{
    wait_for, wait_for_set, wait_gone, workspace_root, TestCluster, TestNamespace,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};

pub use cli_mcp_e2e::instance::{
    claim, condition, hmac_key, instance, is_true, unassigned, PROXY_IMAGE, SANDBOX_IMAGE,
    SERVER_IMAGE,
};
pub use cli_mcp_e2e::journey::sandbox_selector;
pub use cli_mcp_e2e::testing::TIMEOUT;

/// Installs (server-side applies) the CRD and waits until it is Established.
pub async fn install_crd(c: &TestCluster) {
    // Exactly what config/crd and the chart install.
    let yaml = cli_mcp_operator::crdgen::crd_yaml().expect("CRD YAML");
    apply_crd(c, serde_yaml::from_str(&yaml).expect("CRD parses")).await;
}

/// Server-side applies `crd` and waits until it is Established.
pub async fn apply_crd(c: &TestCluster, crd: CustomResourceDefinition) {
    let api: Api<CustomResourceDefinition> = Api::all(c.client.clone());
    let name = crd.name_any();
    api.patch(
        &name,
        &PatchParams::apply("cli-mcp-e2e").force(),
        &Patch::Apply(&crd),
    )
    .await
    .unwrap_or_else(|e| panic!("apply CRD {name}: {e}"));
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
    .unwrap_or_else(|e| panic!("CRD {name} not established: {e}"));
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
        let health = cli_mcp_e2e::net::free_port(Ipv4Addr::LOCALHOST).expect("free port");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cli-mcp-operator"));
        cmd.env("KUBECONFIG", &c.info.kubeconfig)
            .env("WATCH_NAMESPACE", ns)
            .env("POD_NAMESPACE", ns)
            .env("POD_NAME", identity)
            .env("RELATED_IMAGE_SERVER", SERVER_IMAGE)
            .env("RELATED_IMAGE_SANDBOX", SANDBOX_IMAGE)
            .env("RELATED_IMAGE_PROXY", instance::PROXY_IMAGE)
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
        cli_mcp_e2e::child::rss_kib(self.pid()?)
    }

    /// Sum of one metric over all its label sets (0 without an answer or a sample).
    pub async fn metric(&self, name: &str) -> f64 {
        let Some((_, text)) = self.http("/metrics").await else {
            return 0.0;
        };
        metric_sum(&text, name).unwrap_or(0.0)
    }

    /// Sum of `cli_mcp_operator_reconciles_total` over all results.
    pub async fn reconciles(&self) -> u64 {
        self.metric("cli_mcp_operator_reconciles_total").await as u64
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
        let client = http::client(None).build().ok()?;
        http::get(&client, &format!("http://127.0.0.1:{}{path}", self.health)).await
    }

    /// Sum of `cli_mcp_operator_api_writes_total` over all labels.
    pub async fn writes(&self) -> u64 {
        self.metric("cli_mcp_operator_api_writes_total").await as u64
    }

    /// The value, or a panic with the error and the tail of this operator's log (what it
    /// did instead is usually the reason a wait failed).
    pub fn ok<T, E: std::fmt::Display>(&self, r: Result<T, E>) -> T {
        r.unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", self.log_tail()))
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

/// The kubeconfig Secret every instance's credential proxy holds (a valid one whose token
/// opens nothing).
pub async fn kubeconfig_secret(ns: &TestNamespace, instance: &str) {
    instance::kubeconfig_secret(ns, instance, instance::DUMMY_KUBECONFIG).await;
}

/// The proxy's kubeconfig Secret and the instance.
pub async fn create_instance(
    ns: &TestNamespace,
    name: &str,
    spec: serde_json::Value,
) -> CliMcpInstance {
    kubeconfig_secret(ns, name).await;
    ns.api::<CliMcpInstance>()
        .create(&Default::default(), &instance(name, spec))
        .await
        .expect("create CliMcpInstance")
}

/// Waits until the instance is Ready=True for its current generation.
pub async fn wait_ready(ns: &TestNamespace, name: &str, op: &Operator) -> CliMcpInstance {
    wait_instance(
        ns.api::<CliMcpInstance>(),
        name,
        "instance Ready",
        TIMEOUT,
        is_ready_for_generation,
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "instance {name} not Ready: {e}\noperator log:\n{}",
            op.log_tail()
        )
    })
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
            free.len() == n && free.iter().all(|p| is_ready(p)) && !pods.iter().any(is_deleting)
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

/// Waits until instance `name` is gone: its finalizer released it.
pub async fn wait_released(ns: &TestNamespace, name: &str, op: &Operator) {
    op.ok(wait_gone(
        ns.api::<CliMcpInstance>(),
        name,
        "instance released",
        TIMEOUT,
    )
    .await);
}

/// Deletes instance `name` and waits until its finalizer released it.
pub async fn delete_released(ns: &TestNamespace, name: &str, op: &Operator) {
    op.ok(delete_instance(ns.api::<CliMcpInstance>(), name, TIMEOUT).await);
}

/// Deletes the instance while the operator runs, waits for it to be gone, then deletes the
/// namespace. Call at the end of a successful test.
pub async fn finish(ns: TestNamespace, name: &str, op: &Operator) {
    delete_released(&ns, name, op).await;
    ns.delete().await.expect("delete namespace");
}

/// Condition `ty` of the instance's status.
pub fn find_condition<'a>(o: &'a CliMcpInstance, ty: &str) -> Option<&'a Condition> {
    o.status.as_ref()?.conditions.iter().find(|c| c.type_ == ty)
}

/// Annotation `key` of Deployment `d`'s pod template.
pub fn template_annotation(d: &Deployment, key: &str) -> Option<String> {
    d.spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.as_ref())
        .and_then(|a| a.get(key).cloned())
}

/// Waits until Deployment `name`'s template annotation `key` is set and no longer `before`:
/// the Deployment rolls.
pub async fn wait_rolled(
    ns: &TestNamespace,
    name: &str,
    key: &str,
    before: Option<&str>,
    op: &Operator,
) -> Deployment {
    let d = wait_for(
        ns.api::<Deployment>(),
        name,
        &format!("{name} rolled (a new {key})"),
        TIMEOUT,
        |d: Option<&Deployment>| {
            let now = d.and_then(|d| template_annotation(d, key));
            now.is_some() && now.as_deref() != before
        },
    )
    .await;
    op.ok(d).expect("Deployment")
}

/// A finalizer of the tests' own: on an object, it cannot go away.
pub const HOLD: &str = "e2e.cli-mcp/hold";

/// Sets (`on`) or clears every finalizer of an object: [`HOLD`] alone, or none.
pub async fn hold<K>(api: Api<K>, name: &str, on: bool)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let f = if on {
        serde_json::json!([HOLD])
    } else {
        serde_json::Value::Null
    };
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"finalizers": f}})),
    )
    .await
    .expect("set finalizers");
}

pub fn field_manager() -> &'static str {
    FIELD_MANAGER
}

/// Creates a raw object (typed structs cannot even express an invalid enum value).
pub async fn rejected(
    c: &cli_mcp_e2e::testing::TestCluster,
    ns: &cli_mcp_e2e::testing::TestNamespace,
    name: &str,
    spec: serde_json::Value,
) -> String {
    let ar = kube::api::ApiResource::erase::<CliMcpInstance>(&());
    let api: Api<kube::api::DynamicObject> = Api::namespaced_with(c.client.clone(), &ns.name, &ar);
    let obj: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "cli-mcp.redhat.com/v1alpha1",
        "kind": "CliMcpInstance",
        "metadata": {"name": name},
        "spec": spec.clone(),
    }))
    .expect("object");
    let err = api
        .create(&kube::api::PostParams::default(), &obj)
        .await
        .expect_err(&format!("{name} with {spec} must be rejected"));
    err.to_string()
}
