//! The attacks on an instance's boundary, tried on the cluster `make run` gives a user (its
//! real node, its NetworkPolicy enforcer, its admission policies and its sample instance),
//! each as the least identity that could try it:
//!
//! - a hostile sandbox: the shell of an MCP session ([`network`], [`limits`]);
//! - a tenant allowed only to create, get, list and delete pods in the instance's namespace,
//!   acting with a token of its own ([`tenant`]);
//! - a pod of another namespace, and a pod posing as another instance's sandbox ([`network`]).
//!
//! Every attack asserts that it did not get through and says what stopped it; the outcomes
//! are printed as a table at the end.

pub mod limits;
pub mod network;
pub mod tenant;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::pod_security::{restricted_container, restricted_pod};
use cli_mcp_e2e::cluster::ClusterInfo;
use cli_mcp_e2e::jsonrpc;
use cli_mcp_e2e::testing::wait_for;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use kube::runtime::conditions::is_pod_running;
use kube::{Api, Client};
use serde_json::{json, Value};

/// How long a pod of an attacker may take to run, and a session's first call to start.
pub const START_WITHIN: Duration = Duration::from_secs(180);

/// What the attacks are aimed at: `make run`'s instance and the cluster under it.
pub struct Target {
    pub admin: Client,
    pub info: ClusterInfo,
    pub http: reqwest::Client,
    /// The MCP endpoint and the client token `make run` printed.
    pub url: String,
    pub bearer: String,
    pub ns: String,
    pub instance: String,
    /// The instance's sandbox image (what attackers' pods run too: it is on the node).
    pub image: String,
    /// The node's containerd socket (a pod's network namespace is found through it).
    pub socket: PathBuf,
    /// The sandboxes run under gVisor (`make run`'s default where the host can run it).
    pub gvisor: bool,
}

/// One row of the table: the attack and what stopped it.
pub struct Outcome {
    pub attack: &'static str,
    pub stopped_by: String,
}

/// A `bash` tool call's result.
pub struct Shell {
    pub stdout: String,
    pub text: String,
}

impl Target {
    pub async fn new(
        cluster_dir: &Path,
        url: &str,
        bearer: &str,
        ns: &str,
        instance: &str,
    ) -> Self {
        let info = ClusterInfo::load(cluster_dir).expect("make run's cluster.json");
        let admin = info
            .client()
            .await
            .expect("admin client of make run's cluster");
        let socket = info
            .containerd_socket
            .clone()
            .expect("make run's cluster runs the real node");
        let cr = Api::<CliMcpInstance>::namespaced(admin.clone(), ns)
            .get(instance)
            .await
            .expect("the sample instance");
        let gvisor = cr.spec.sandbox.placement.runtime_class_name.as_deref()
            == Some(cli_mcp_e2e::node::gvisor::RUNTIME_CLASS);
        let image = cr
            .status
            .and_then(|s| s.resolved_sandbox_image)
            .expect("the instance's status names its sandbox image");
        let http = cli_mcp_e2e::http::client(None)
            .timeout(Duration::from_secs(330))
            .build()
            .expect("http client");
        Target {
            admin,
            info,
            http,
            url: url.into(),
            bearer: bearer.into(),
            ns: ns.into(),
            instance: instance.into(),
            image,
            socket,
            gvisor,
        }
    }

    /// Runs `command` in `session`'s sandbox, as the MCP client `make run` configured.
    pub async fn bash(&self, session: &str, command: &str) -> Shell {
        self.bash_with(session, json!({"command": command})).await
    }

    pub async fn bash_with(&self, session: &str, arguments: Value) -> Shell {
        let r = jsonrpc::post(&self.http, &self.url, Some(session), Some(&self.bearer))
            .json(&jsonrpc::bash(arguments))
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {} (session {session}): {e}", self.url));
        let body = r.text().await.expect("MCP answer");
        let answer = jsonrpc::response(&body);
        let result = &answer["result"];
        assert!(
            !result.is_null(),
            "session {session}: no tool result: {answer}"
        );
        Shell {
            stdout: jsonrpc::stdout(result).to_owned(),
            text: jsonrpc::text(result),
        }
    }

    /// Ends `session` (its sandbox is deleted).
    pub async fn end(&self, session: &str) {
        let url = self.url.replace("/mcp", &format!("/sessions/{session}"));
        let _ = self.http.delete(url).bearer_auth(&self.bearer).send().await;
    }

    /// The network namespace of `pod`'s first container, for connections made from inside it.
    pub fn netns(&self, pod: &Pod) -> PathBuf {
        let id = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .and_then(|c| c.container_id.clone())
            .unwrap_or_else(|| panic!("pod {:?} has no running container", pod.metadata.name));
        cli_mcp_e2e::addons::container_netns(&self.socket, &id).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The pod `session` runs in (by its session label).
    pub async fn session_pod(&self, session: &str) -> Pod {
        let pods = Api::<Pod>::namespaced(self.admin.clone(), &self.ns)
            .list(&kube::api::ListParams::default().labels(&format!(
                "{}={session}",
                cli_mcp_api::names::label::SESSION_ID
            )))
            .await
            .expect("listing session pods");
        pods.items
            .into_iter()
            .find(|p| p.metadata.deletion_timestamp.is_none())
            .unwrap_or_else(|| panic!("session {session} has no pod"))
    }
}

/// A pod that only sleeps, in the sandbox image, meeting Pod Security `restricted` (so only
/// what the attack adds is judged), with `labels`.
pub fn sleeper(name: &str, image: &str, labels: &[(&str, &str)]) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Default::default()
        },
        spec: Some(PodSpec {
            automount_service_account_token: Some(false),
            termination_grace_period_seconds: Some(0),
            security_context: Some(restricted_pod(Some(1001))),
            containers: vec![Container {
                name: "sleeper".into(),
                image: Some(image.into()),
                command: Some(vec!["sleep".into(), "infinity".into()]),
                security_context: Some(restricted_container()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Creates `pod` in `ns` as `client` and waits until it runs.
pub async fn run_pod(client: &Client, ns: &str, pod: &Pod) -> Pod {
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    let name = pod.metadata.name.clone().unwrap_or_default();
    api.create(&PostParams::default(), pod)
        .await
        .unwrap_or_else(|e| panic!("creating pod {ns}/{name}: {e}"));
    wait_for(api, &name, "running", START_WITHIN, is_pod_running())
        .await
        .unwrap_or_else(|e| panic!("pod {ns}/{name}: {e}"))
        .unwrap_or_else(|| panic!("pod {ns}/{name} is gone"))
}

/// Deletes a pod at once, if it exists.
pub async fn remove_pod(client: &Client, ns: &str, name: &str) {
    let _ = Api::<Pod>::namespaced(client.clone(), ns)
        .delete(name, &DeleteParams::default().grace_period(0))
        .await;
}

/// Every attack, one after the other; each outcome is printed as it comes (so a failure
/// shows what held before it), and the table of all of them at the end.
pub async fn run_all(t: &Target) -> Vec<Outcome> {
    isolation_reported_in_force(t).await;
    let mut outcomes = Vec::new();
    for part in [
        network::run(t).await,
        tenant::run(t).await,
        limits::run(t).await,
    ] {
        outcomes.extend(part);
    }
    eprintln!("\n| attack | stopped by |\n|---|---|");
    for o in &outcomes {
        eprintln!("| {} | {} |", o.attack, o.stopped_by.replace('\n', " "));
    }
    outcomes
}

impl Outcome {
    /// The outcome, said at once.
    pub fn new(attack: &'static str, stopped_by: String) -> Self {
        eprintln!("attack held: {attack}: {stopped_by}");
        Outcome { attack, stopped_by }
    }
}

/// The instance itself says that the boundary the attacks meet is in force: its operator's
/// probes found NetworkPolicy and Pod Security `restricted` enforced.
async fn isolation_reported_in_force(t: &Target) {
    let enforced = |cr: Option<&CliMcpInstance>| {
        let conditions = cr.and_then(|c| c.status.as_ref()).map(|s| &s.conditions);
        ["NetworkPolicyEnforced", "PodSecurityEnforced"]
            .iter()
            .all(|ty| {
                conditions
                    .into_iter()
                    .flatten()
                    .any(|c| c.type_ == *ty && c.status == "True" && c.reason == "Enforced")
            })
    };
    let api = Api::<CliMcpInstance>::namespaced(t.admin.clone(), &t.ns);
    let found = wait_for(
        api.clone(),
        &t.instance,
        "isolation enforced",
        START_WITHIN,
        enforced,
    )
    .await;
    if let Err(e) = found {
        let conditions = api
            .get(&t.instance)
            .await
            .ok()
            .and_then(|c| c.status)
            .map(|s| s.conditions);
        panic!("the instance does not report NetworkPolicy and Pod Security enforced ({e}): {conditions:?}");
    }
    eprintln!("the instance reports NetworkPolicyEnforced and PodSecurityEnforced True");
}
