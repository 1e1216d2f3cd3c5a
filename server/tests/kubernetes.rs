//! The server's `kubernetes` backend and auth on the local Kubernetes (real control plane,
//! process kubelet; docs/local-kubernetes.md). Each test has its own namespace and runs the real
//! `cli-mcp-server` binary on the host with the cluster's kubeconfig; sandbox pods run the
//! real agent (`cli-mcp-agent:*` maps to target/debug/cli-mcp-agent).

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;

use futures::future::join_all;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::Subject;
use kube::api::{DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::runtime::wait::conditions::is_deleted;
use kube::ResourceExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use cli_mcp_api::names::{annotation, label, InstanceName, PoolSuffix};
use cli_mcp_api::pod_state::{is_deleting, is_ready, phase};
use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxProxy, SandboxRole};
use cli_mcp_api::token::HmacKey;
use cli_mcp_e2e::testing::{
    self, wait_for, wait_for_set, wait_restarted, AfterRestart, TestCluster, TestNamespace, TIMEOUT,
};
use support::{is_error, seal_pod, structured, text, Mcp, Server};

const INSTANCE: &str = "demo";
const AGENT_IMAGE: &str = "cli-mcp-agent:dev";
/// Prints the pod name: the process kubelet sets the pod's hostname to it.
const WHOAMI: &str = "cat /proc/sys/kernel/hostname";

/// One test's world: a namespace with the instance's sandbox ServiceAccount, a sandbox
/// config, and the instance HMAC key in a file.
struct World {
    cluster: TestCluster,
    ns: TestNamespace,
    cfg: SandboxConfig,
    key: HmacKey,
    dir: tempfile::TempDir,
    key_file: PathBuf,
}

impl World {
    async fn new(prefix: &str) -> World {
        support::ensure_built(true);
        let cluster = testing::cluster()
            .await
            .expect("the local cluster must come up (see docs/local-kubernetes.md)");
        let ns = cluster.namespace(prefix).await.expect("namespace");
        let instance = InstanceName::parse(INSTANCE).expect("valid");
        let sa: ServiceAccount = serde_json::from_value(json!({
            "metadata": {"name": instance.sandbox()},
            "automountServiceAccountToken": false
        }))
        .expect("ServiceAccount");
        ns.api::<ServiceAccount>()
            .create(&PostParams::default(), &sa)
            .await
            .expect("create sandbox ServiceAccount");
        let mut cfg = SandboxConfig::new(instance, ns.name.clone(), AGENT_IMAGE);
        cfg.termination_grace_period_seconds = 5;
        let key = HmacKey::from_bytes(rand::random());
        let dir = tempfile::tempdir().expect("tempdir");
        let key_file = dir.path().join("key");
        std::fs::write(&key_file, key.to_hex()).expect("write key");
        World {
            cluster,
            ns,
            cfg,
            key,
            dir,
            key_file,
        }
    }

    fn base_args(&self) -> Vec<String> {
        vec![
            "--backend".into(),
            "kubernetes".into(),
            "--sandbox-config".into(),
            serde_json::to_string(&self.cfg).expect("config JSON"),
            "--hmac-key-file".into(),
            self.key_file.display().to_string(),
        ]
    }

    async fn server_with(&self, extra: &[&str]) -> Server {
        let mut args = self.base_args();
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let kubeconfig = self.cluster.info.kubeconfig.display().to_string();
        Server::start(&args, &[("KUBECONFIG", &kubeconfig)]).await
    }

    async fn server(&self) -> Server {
        self.server_with(&["--auth", "none"]).await
    }

    fn instance(&self) -> &InstanceName {
        &self.cfg.instance
    }

    /// Creates `n` warm pool pods with the shared builder and seals them (as the operator
    /// does), and waits until all are Ready.
    async fn warm_pods(&self, n: usize) -> Vec<String> {
        let mut names = Vec::new();
        for _ in 0..n {
            let suffix = PoolSuffix::from_random_bytes(rand::random());
            let name = self.instance().pool_pod(&suffix);
            let pod = build_sandbox_pod(
                &self.cfg,
                &SandboxRole::Pool {
                    suffix,
                    assign: self.key.assign_token(&name).commitment(),
                },
                &now(),
            );
            let pods = self.ns.api::<Pod>();
            let created = pods
                .create(&PostParams::default(), &pod)
                .await
                .expect("create warm pod");
            seal_pod(&pods, &created, &self.key).await;
            names.push(name);
        }
        wait_for_set(
            self.ns.api::<Pod>(),
            &self.instance().unassigned_selector(),
            "warm pods Ready",
            TIMEOUT,
            |pods: &[Pod]| pods.len() == n && pods.iter().all(is_ready),
        )
        .await
        .expect("warm pods become Ready");
        names
    }

    /// Waits until session `sid` has exactly one live pod, and returns it.
    async fn one_pod(&self, sid: &str) -> Pod {
        let sel = format!(
            "{},{}={sid}",
            self.instance().sandbox_selector(),
            label::SESSION_ID
        );
        let pods = wait_for_set(
            self.ns.api::<Pod>(),
            &sel,
            "exactly one pod for the session",
            TIMEOUT,
            |pods: &[Pod]| pods.iter().filter(|p| !is_deleting(p)).count() == 1 && pods.len() == 1,
        )
        .await
        .expect("one pod per session");
        pods.into_iter().next().expect("one pod")
    }

    async fn done(self) {
        self.ns.delete().await.expect("delete namespace");
    }
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

fn stdout(r: &Value) -> String {
    structured(r)["stdout"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn labels(p: &Pod) -> BTreeMap<String, String> {
    p.labels().clone()
}

fn ann(p: &Pod, key: &str) -> Option<String> {
    p.annotations().get(key).cloned()
}

/// Fail closed: with a credential proxy in the sandbox config, no sandbox is created while
/// the proxy's Deployment has no ready replica (here it does not exist); the call says why
/// and what to do.
#[tokio::test]
async fn no_sandbox_starts_without_a_ready_credential_proxy() {
    let mut w = World::new("srv-noproxy").await;
    w.cfg.proxy = Some(SandboxProxy {
        url: w.instance().proxy_url(&w.ns.name),
        config_map: w.instance().proxy(),
        kubeconfig: false,
    });
    let server = w.server().await;
    let r = Mcp::new(&server, Some("no-proxy-1")).bash("true").await;
    assert!(is_error(&r), "{r}");
    assert!(
        text(&r).contains(&format!(
            "credential proxy (Deployment {}) has no ready replica",
            w.instance().proxy()
        )),
        "{}",
        text(&r)
    );
    let pods =
        w.ns.api::<Pod>()
            .list(&ListParams::default().labels(&w.instance().sandbox_selector()))
            .await
            .expect("list pods");
    assert!(pods.items.is_empty(), "a sandbox pod was created");
    drop(server);
    w.done().await;
}

#[tokio::test]
async fn cold_create_when_the_pool_is_empty() {
    let w = World::new("srv-cold").await;
    let server = w.server().await;
    let mcp = Mcp::new(&server, Some("cold-1"));
    let r = mcp.bash(&format!("cd /tmp; export K=v; {WHOAMI}")).await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(structured(&r)["new_sandbox"], "cold", "{}", text(&r));
    let pod = w.one_pod("cold-1").await;
    assert_eq!(stdout(&r), format!("{}\n", pod.name_any()));
    assert!(pod.name_any().starts_with("cli-mcp-demo-s-cold-1-"));
    assert_eq!(labels(&pod)[label::LAUNCH], "cold");
    let sid = cli_mcp_api::SessionId::parse("cold-1").expect("valid");
    assert!(
        cli_mcp_api::sandbox::session_token_of(&pod, &sid, &w.key).is_some(),
        "the pod commits to the session token of its own nonce: {:?}",
        pod.metadata.annotations
    );
    assert_eq!(
        ann(&pod, annotation::OWNER),
        None,
        "no owner with --auth none"
    );
    // The second call is routed to the same shell.
    let r = mcp.bash("echo $PWD $K").await;
    assert_eq!(stdout(&r), "/tmp v\n");
    assert!(structured(&r).get("new_sandbox").is_none());
    drop(server);
    w.done().await;
}

#[tokio::test]
async fn claims_a_premade_warm_pod() {
    let w = World::new("srv-warm").await;
    let warm = w.warm_pods(1).await;
    let server = w.server().await;
    let mcp = Mcp::new(&server, Some("warm-1"));
    let r = mcp.bash(WHOAMI).await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(structured(&r)["new_sandbox"], "warm", "{}", text(&r));
    assert_eq!(stdout(&r), format!("{}\n", warm[0]));
    let pod = w.one_pod("warm-1").await;
    assert_eq!(pod.name_any(), warm[0]);
    assert_eq!(labels(&pod)[label::LAUNCH], "warm");
    assert_eq!(labels(&pod)[label::SESSION_ID], "warm-1");
    assert!(ann(&pod, annotation::LAST_ACTIVITY).is_some());
    assert_eq!(
        ann(&pod, annotation::CALLER),
        None,
        "no caller with --auth none"
    );
    let sid = cli_mcp_api::SessionId::parse("warm-1").expect("valid");
    assert!(
        cli_mcp_api::sandbox::session_token_of(&pod, &sid, &w.key).is_some(),
        "the pod commits to the session token of its own nonce: {:?}",
        pod.metadata.annotations
    );
    // No cold pod was made.
    let all =
        w.ns.api::<Pod>()
            .list(&ListParams::default().labels(&w.instance().sandbox_selector()))
            .await
            .expect("list");
    assert_eq!(all.items.len(), 1, "only the warm pod exists");
    drop(server);
    w.done().await;
}

/// Warm pods made for another HMAC key (the key was rotated and this replica, or the pool,
/// is outdated) would refuse this replica's `/assign`: they are left alone, not claimed and
/// deleted, and the session starts on demand.
#[tokio::test]
async fn warm_pods_of_another_key_are_left_alone() {
    let w = World::new("srv-otherkey").await;
    let other = HmacKey::from_bytes(rand::random());
    let suffix = PoolSuffix::from_random_bytes(rand::random());
    let name = w.instance().pool_pod(&suffix);
    let pod = build_sandbox_pod(
        &w.cfg,
        &SandboxRole::Pool {
            suffix,
            assign: other.assign_token(&name).commitment(),
        },
        &now(),
    );
    let created =
        w.ns.api::<Pod>()
            .create(&PostParams::default(), &pod)
            .await
            .expect("create warm pod");
    // Sealed as its own (outdated) operator would: what sets it apart is its key alone.
    seal_pod(&w.ns.api::<Pod>(), &created, &other).await;
    wait_for_set(
        w.ns.api::<Pod>(),
        &w.instance().unassigned_selector(),
        "the foreign warm pod Ready",
        TIMEOUT,
        |pods: &[Pod]| pods.len() == 1 && pods.iter().all(is_ready),
    )
    .await
    .expect("warm pod Ready");
    let server = w.server().await;
    let mcp = Mcp::new(&server, Some("otherkey-1"));
    let r = mcp.bash("echo ok").await;
    assert!(!is_error(&r), "{}", text(&r));
    assert_eq!(structured(&r)["new_sandbox"], "cold", "{}", text(&r));
    let still =
        w.ns.api::<Pod>()
            .get_opt(&name)
            .await
            .expect("get")
            .expect("the foreign warm pod still exists");
    assert_eq!(still.uid(), created.uid());
    assert!(!is_deleting(&still));
    assert!(
        !labels(&still).contains_key(label::SESSION_ID),
        "not claimed"
    );
    drop(server);
    w.done().await;
}

#[tokio::test]
async fn fifty_new_sessions_against_twenty_warm_pods() {
    let w = World::new("srv-burst").await;
    let warm: BTreeSet<String> = w.warm_pods(20).await.into_iter().collect();
    let server = w.server().await;
    let base = Mcp::new(&server, None);
    let calls = (0..50).map(|i| {
        let mcp = base.session(&format!("burst-{i}"));
        async move { (format!("burst-{i}"), mcp.bash(WHOAMI).await) }
    });
    let results =
        match tokio::time::timeout(std::time::Duration::from_secs(100), join_all(calls)).await {
            Ok(r) => r,
            Err(_) => panic!(
                "the 50 calls did not finish within 100s; server log:\n{}",
                server.log_text()
            ),
        };
    let mut pod_of: HashMap<String, String> = HashMap::new();
    let mut launches: HashMap<String, usize> = HashMap::new();
    for (sid, r) in &results {
        assert!(!is_error(r), "{sid}: {}", text(r));
        let pod = stdout(r).trim().to_owned();
        *launches
            .entry(
                structured(r)["new_sandbox"]
                    .as_str()
                    .unwrap_or("none")
                    .to_owned(),
            )
            .or_default() += 1;
        pod_of.insert(sid.clone(), pod);
    }
    let distinct: BTreeSet<&String> = pod_of.values().collect();
    assert_eq!(
        distinct.len(),
        50,
        "every session got its own pod: {pod_of:?}"
    );
    // Every session has exactly one pod, and it is the one that answered.
    let pods = wait_for_set(
        w.ns.api::<Pod>(),
        &w.instance().assigned_selector(),
        "50 assigned pods and no duplicates",
        TIMEOUT,
        |pods: &[Pod]| pods.len() == 50,
    )
    .await
    .expect("50 session pods");
    for p in &pods {
        let sid = &labels(p)[label::SESSION_ID];
        assert_eq!(pod_of.get(sid), Some(&p.name_any()), "session {sid}");
    }
    let claimed: BTreeSet<String> = pods
        .iter()
        .filter(|p| labels(p)[label::LAUNCH] == "warm")
        .map(|p| p.name_any())
        .collect();
    assert_eq!(claimed, warm, "all 20 warm pods claimed, each once");
    assert_eq!(launches.get("warm"), Some(&20), "{launches:?}");
    assert_eq!(launches.get("cold"), Some(&30), "{launches:?}");
    let unassigned =
        w.ns.api::<Pod>()
            .list(&ListParams::default().labels(&w.instance().unassigned_selector()))
            .await
            .expect("list");
    assert!(unassigned.items.is_empty());
    let metrics = support::http()
        .get(server.health_url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("cli_mcp_session_start_seconds_count{launch=\"warm\"} 20"),
        "{metrics}"
    );
    drop(server);
    w.done().await;
}

async fn race_two_servers(w: &World, sid: &str) -> (Value, Value) {
    let a = w.server().await;
    let b = w.server().await;
    let ma = Mcp::new(&a, Some(sid));
    let mb = Mcp::new(&b, Some(sid));
    let (ra, rb) = tokio::join!(ma.bash(WHOAMI), mb.bash(WHOAMI));
    // Both keep using the one pod afterwards.
    let (ra2, rb2) = tokio::join!(ma.bash(WHOAMI), mb.bash(WHOAMI));
    assert_eq!(stdout(&ra2), stdout(&rb2), "both servers route to one pod");
    drop((a, b));
    (ra, rb)
}

#[tokio::test]
async fn two_servers_racing_on_one_new_session_make_one_pod() {
    let w = World::new("srv-race").await;
    let (ra, rb) = race_two_servers(&w, "race-cold").await;
    assert!(!is_error(&ra) && !is_error(&rb), "{ra} {rb}");
    assert_eq!(stdout(&ra), stdout(&rb), "same pod");
    let pod = w.one_pod("race-cold").await;
    assert_eq!(stdout(&ra), format!("{}\n", pod.name_any()));
    w.done().await;
}

#[tokio::test]
async fn two_servers_racing_with_one_warm_pod_converge_on_it() {
    let w = World::new("srv-race-warm").await;
    let warm = w.warm_pods(1).await;
    let (ra, rb) = race_two_servers(&w, "race-warm").await;
    assert!(!is_error(&ra) && !is_error(&rb), "{ra} {rb}");
    assert_eq!(stdout(&ra), stdout(&rb), "same pod");
    assert_eq!(
        stdout(&ra),
        format!("{}\n", warm[0]),
        "the older (warm) pod wins"
    );
    let pod = w.one_pod("race-warm").await;
    assert_eq!(pod.name_any(), warm[0]);
    w.done().await;
}

#[tokio::test]
async fn a_deleted_pod_is_replaced_and_the_reset_is_reported() {
    let w = World::new("srv-evict").await;
    let server = w.server().await;
    let mcp = Mcp::new(&server, Some("evict-1"));
    mcp.bash("export MARK=1").await;
    let pod = w.one_pod("evict-1").await;
    let uid = pod.uid().expect("uid");
    w.ns.api::<Pod>()
        .delete(&pod.name_any(), &DeleteParams::default())
        .await
        .expect("delete pod");
    // The server drops its route when it sees the deletion (it never dials a gone pod).
    server
        .wait_log("about the dropped route", |l| {
            l.contains("route dropped") && l.contains("evict-1")
        })
        .await;
    wait_for(
        w.ns.api::<Pod>(),
        &pod.name_any(),
        "pod gone",
        TIMEOUT,
        is_deleted(&uid),
    )
    .await
    .expect("pod deleted");
    let r = mcp.bash("echo \"[${MARK:-}]\"").await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(stdout(&r), "[]\n");
    assert_eq!(structured(&r)["state_reset"], true, "{}", text(&r));
    assert!(text(&r).contains("session state was reset"), "{}", text(&r));
    let new = w.one_pod("evict-1").await;
    assert_ne!(new.uid(), Some(uid));
    drop(server);
    w.done().await;
}

/// Pids of processes whose environment has `POD_NAME` and `POD_NAMESPACE` of `pod` and whose
/// program is the agent. The namespace matters: another test run on this host (its own
/// cluster) names its session pods the same way, but never its namespaces.
fn agent_pids(pod: &Pod) -> Vec<i32> {
    let want = [
        format!("POD_NAME={}", pod.name_any()),
        format!("POD_NAMESPACE={}", pod.namespace().unwrap_or_default()),
    ];
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            want.iter()
                .all(|w| env.split(|b| *b == 0).any(|v| v == w.as_bytes()))
                && String::from_utf8_lossy(&cmd).contains("cli-mcp-agent")
        })
        .collect()
}

#[tokio::test]
async fn a_restarted_agent_is_reported_as_a_reset() {
    let w = World::new("srv-restart").await;
    let server = w.server().await;
    let mcp = Mcp::new(&server, Some("restart-1"));
    mcp.bash("export MARK=1").await;
    let pod = w.one_pod("restart-1").await;
    let pids = agent_pids(&pod);
    assert_eq!(pids.len(), 1, "one agent process for the pod: {pids:?}");
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pids[0].to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    // The kubelet restarts the container (restartPolicy Always); wait until it is Ready again.
    wait_restarted(w.ns.api::<Pod>(), &pod.name_any(), 1.., AfterRestart::Ready)
        .await
        .expect("restart");
    let r = mcp.bash("echo \"[${MARK:-}]\"").await;
    assert!(!is_error(&r), "{r}");
    assert_eq!(stdout(&r), "[]\n");
    assert_eq!(structured(&r)["state_reset"], true, "{}", text(&r));
    assert!(text(&r).contains("session state was reset"), "{}", text(&r));
    assert_eq!(w.one_pod("restart-1").await.uid(), pod.uid(), "same pod");
    drop(server);
    w.done().await;
}

/// Kills the pod's agent process (SIGKILL); returns its pid.
fn kill_agent(pod: &Pod) -> i32 {
    let pids = agent_pids(pod);
    assert_eq!(pids.len(), 1, "one agent process for the pod: {pids:?}");
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pids[0].to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    pids[0]
}

/// A call made while the session's agent is down (between a crash and the kubelet's restart
/// of its container) waits for the agent to come back and says the state was reset, instead
/// of failing as if a new sandbox could not start ("… did not accept /assign").
#[tokio::test]
async fn a_call_while_the_agent_restarts_waits_for_it() {
    let w = World::new("srv-restarting").await;
    let warm = w.warm_pods(1).await;
    let server = w.server().await;
    let mcp = Mcp::new(&server, Some("restarting-1"));
    assert!(!is_error(&mcp.bash("export MARK=1").await));
    let pod = w.one_pod("restarting-1").await;
    assert_eq!(pod.name_any(), warm[0]);
    // The first crash is restarted at once; the second one only after the kubelet's
    // CrashLoopBackOff pause (10 s), which is the window this test calls in.
    kill_agent(&pod);
    wait_restarted(
        w.ns.api::<Pod>(),
        &pod.name_any(),
        1..=1,
        AfterRestart::Ready,
    )
    .await
    .expect("first restart");
    let pid = kill_agent(&pod);
    let t0 = std::time::Instant::now();
    let r = mcp.bash("echo \"[${MARK:-}]\"").await;
    let waited = t0.elapsed();
    assert!(!is_error(&r), "{}", text(&r));
    assert_eq!(stdout(&r), "[]\n");
    assert_eq!(structured(&r)["state_reset"], true, "{}", text(&r));
    assert!(text(&r).contains("session state was reset"), "{}", text(&r));
    let now = w.one_pod("restarting-1").await;
    assert_eq!(now.uid(), pod.uid(), "same pod");
    assert!(!agent_pids(&pod).contains(&pid));
    eprintln!("the call waited {waited:?} for the restarted agent");
    drop(server);
    w.done().await;
}

/// An agent that does not come back within the wait (here `--start-timeout 5` bounds it,
/// under the kubelet's 10 s back-off after a second crash) has its pod replaced: the call
/// says so, and the next call starts a new sandbox and reports the reset.
#[tokio::test]
async fn a_crash_looping_agent_is_replaced_after_the_wait() {
    let w = World::new("srv-crashloop").await;
    w.warm_pods(2).await;
    let server = w
        .server_with(&["--auth", "none", "--start-timeout", "5"])
        .await;
    let mcp = Mcp::new(&server, Some("crashloop-1"));
    assert!(!is_error(&mcp.bash("export MARK=1").await));
    let pod = w.one_pod("crashloop-1").await;
    kill_agent(&pod);
    wait_restarted(
        w.ns.api::<Pod>(),
        &pod.name_any(),
        1..=1,
        AfterRestart::Ready,
    )
    .await
    .expect("first restart");
    kill_agent(&pod);
    let r = mcp.bash("echo \"[${MARK:-}]\"").await;
    assert!(is_error(&r), "{}", text(&r));
    assert!(
        text(&r).contains("keeps crashing") && text(&r).contains("next call starts a new sandbox"),
        "{}",
        text(&r)
    );
    wait_for(
        w.ns.api::<Pod>(),
        &pod.name_any(),
        "the crash-looping pod is gone",
        TIMEOUT,
        is_deleted(&pod.uid().expect("uid")),
    )
    .await
    .expect("pod deleted");
    let next = mcp.bash("echo \"[${MARK:-}]\"").await;
    assert!(!is_error(&next), "{}", text(&next));
    assert_eq!(stdout(&next), "[]\n");
    assert_eq!(structured(&next)["state_reset"], true, "{}", text(&next));
    assert_ne!(w.one_pod("crashloop-1").await.uid(), pod.uid());
    drop(server);
    w.done().await;
}

/// A session pod left in phase Failed (as a kubelet leaves an evicted pod) is never routed
/// to: it is deleted and the session starts afresh, saying its state was reset.
#[tokio::test]
async fn a_failed_session_pod_is_replaced() {
    let w = World::new("srv-failed").await;
    let sid = cli_mcp_api::SessionId::parse("failed-1").expect("valid");
    let mut pod = build_sandbox_pod(
        &w.cfg,
        &SandboxRole::session(
            &w.key,
            sid.clone(),
            cli_mcp_api::token::SandboxNonce::from_bytes([5; 16]),
            None,
        ),
        &now(),
    );
    // The same pod, made to end in phase Failed: its agent exits at once and is not restarted.
    let spec = pod.spec.as_mut().expect("spec");
    spec.restart_policy = Some("Never".into());
    spec.containers[0].args = Some(vec!["--no-such-flag".into()]);
    spec.containers[0].readiness_probe = None;
    let name = pod.name_any();
    let created =
        w.ns.api::<Pod>()
            .create(&PostParams::default(), &pod)
            .await
            .expect("create the session pod");
    // Sealed as the server seals the pods it creates: what sets it apart is its phase alone.
    seal_pod(&w.ns.api::<Pod>(), &created, &w.key).await;
    wait_for(
        w.ns.api::<Pod>(),
        &name,
        "pod Failed",
        TIMEOUT,
        |p: Option<&Pod>| p.and_then(phase) == Some("Failed"),
    )
    .await
    .expect("the pod fails");
    let server = w.server().await;
    let mcp = Mcp::new(&server, Some("failed-1"));
    let r = mcp.bash("echo ok").await;
    assert!(!is_error(&r), "{}", text(&r));
    assert_eq!(stdout(&r), "ok\n");
    assert_eq!(structured(&r)["state_reset"], true, "{}", text(&r));
    assert!(text(&r).contains("session state was reset"), "{}", text(&r));
    wait_for(
        w.ns.api::<Pod>(),
        &name,
        "the Failed pod is gone",
        TIMEOUT,
        |p: Option<&Pod>| p.is_none_or(|p| p.uid() != created.uid()),
    )
    .await
    .expect("the Failed pod is deleted");
    let new = w.one_pod("failed-1").await;
    assert_ne!(new.uid(), created.uid());
    drop(server);
    w.done().await;
}

#[tokio::test]
async fn delete_removes_the_pod() {
    let w = World::new("srv-delete").await;
    let server = w.server().await;
    let mcp = Mcp::new(&server, Some("del-1"));
    mcp.bash("true").await;
    let pod = w.one_pod("del-1").await;
    let http = support::http();
    let list: Value = http
        .get(server.url("/sessions"))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON");
    assert_eq!(list["sessions"][0]["session_id"], "del-1");
    assert_eq!(list["sessions"][0]["sandbox"], pod.name_any());
    let del = http
        .delete(server.url("/sessions/del-1"))
        .send()
        .await
        .expect("DELETE");
    assert_eq!(del.status(), 204);
    wait_for(
        w.ns.api::<Pod>(),
        &pod.name_any(),
        "session pod deleted",
        TIMEOUT,
        is_deleted(&pod.uid().expect("uid")),
    )
    .await
    .expect("pod removed");
    let again = http
        .delete(server.url("/sessions/del-1"))
        .send()
        .await
        .expect("DELETE");
    assert_eq!(again.status(), 204, "idempotent");
    let list: Value = http
        .get(server.url("/sessions"))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON");
    assert_eq!(list["sessions"], json!([]));
    drop(server);
    w.done().await;
}

/// `POST /exec` of `echo bound` straight to a session pod's agent with `token`: the status.
async fn exec_status(pod: &Pod, token: &str) -> u16 {
    let ip = cli_mcp_e2e::testing::pod_ip(pod).expect("pod IP");
    support::http()
        .post(format!(
            "http://{ip}:{}/exec",
            cli_mcp_api::wire::AGENT_PORT
        ))
        .bearer_auth(token)
        .json(&json!({"command": "echo bound"}))
        .send()
        .await
        .expect("POST /exec to the agent")
        .status()
        .as_u16()
}

/// Session tokens are bound to one sandbox (a nonce on its pod): the token of an earlier
/// sandbox of the same session id — which its shell could read from its own agent's memory
/// — never opens the sandbox the session gets next.
#[tokio::test]
async fn a_token_of_an_earlier_sandbox_never_opens_a_later_one() {
    let w = World::new("srv-bind").await;
    let server = w.server().await;
    let sid = cli_mcp_api::SessionId::parse("bind-1").expect("sid");
    let mcp = Mcp::new(&server, Some(sid.as_str()));
    mcp.bash("true").await;
    let first = w.one_pod(sid.as_str()).await;
    let first_token = cli_mcp_api::sandbox::session_token_of(&first, &sid, &w.key)
        .expect("the first pod carries a token of its own nonce");
    assert_eq!(exec_status(&first, first_token.expose()).await, 200);

    let del = support::http()
        .delete(server.url("/sessions/bind-1"))
        .send()
        .await
        .expect("DELETE");
    assert_eq!(del.status(), 204);
    wait_for(
        w.ns.api::<Pod>(),
        &first.name_any(),
        "first session pod deleted",
        TIMEOUT,
        is_deleted(&first.uid().expect("uid")),
    )
    .await
    .expect("first pod removed");

    mcp.bash("true").await;
    let second = w.one_pod(sid.as_str()).await;
    assert_ne!(
        second.uid(),
        first.uid(),
        "a new sandbox for the same session id"
    );
    assert_eq!(
        second.name_any(),
        first.name_any(),
        "same pod name: only the nonce differs"
    );
    let second_token = cli_mcp_api::sandbox::session_token_of(&second, &sid, &w.key)
        .expect("the second pod carries a token of its own nonce");
    assert_ne!(second_token, first_token);
    assert_eq!(
        exec_status(&second, first_token.expose()).await,
        401,
        "the earlier sandbox's token is refused by the later sandbox"
    );
    assert_eq!(exec_status(&second, second_token.expose()).await, 200);
    drop(server);
    w.done().await;
}

/// Waits until the session's pod runs `sleep <marker>` (a host process on the process
/// kubelet); its pid.
async fn started(marker: &str) -> i32 {
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        if let Some(pid) = pids_running(&["sleep", marker]).first() {
            return *pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the command never started"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Pids of processes whose command line is exactly `args` (NUL-separated).
fn pids_running(args: &[&str]) -> Vec<i32> {
    let want: Vec<u8> = args
        .iter()
        .flat_map(|a| [a.as_bytes(), b"\0"].concat())
        .collect();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == want))
        .collect()
}

/// A DELETE while a command runs ends the session for good: the call fails with an error
/// that says so, and its retry does not create a new pod (before, the retry after the agent
/// was killed created one, and `GET /sessions` listed the deleted session again).
#[tokio::test]
async fn a_call_racing_a_delete_fails_and_the_session_stays_deleted() {
    let w = World::new("srv-del-race").await;
    let server = w.server().await;
    let mcp = Mcp::new(&server, Some("race-1"));
    let r = mcp.bash("true").await;
    assert!(!is_error(&r), "{r}");
    let pod = w.one_pod("race-1").await;
    // A duration no other test uses, to find the command among the host's processes.
    let marker = format!(
        "{}.{}",
        600 + rand::random::<u16>() % 100,
        rand::random::<u16>()
    );
    let call = tokio::spawn({
        let mcp = mcp.clone();
        let cmd = format!("sleep {marker}");
        async move { mcp.bash(&cmd).await }
    });
    started(&marker).await;
    let http = support::http();
    let del = http
        .delete(server.url("/sessions/race-1"))
        .send()
        .await
        .expect("DELETE");
    assert_eq!(del.status(), 204);
    let r = tokio::time::timeout(TIMEOUT, call)
        .await
        .expect("the call ends after the DELETE")
        .expect("join");
    assert!(is_error(&r), "{r}");
    assert!(
        text(&r).contains("the session was deleted (DELETE /sessions/{id}) while this command ran"),
        "{}\nserver log:\n{}",
        text(&r),
        server.log_text()
    );
    let list: Value = http
        .get(server.url("/sessions"))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON");
    assert_eq!(
        list["sessions"],
        json!([]),
        "the deleted session was started again"
    );
    let sel = format!(
        "{},{}=race-1",
        w.instance().sandbox_selector(),
        label::SESSION_ID
    );
    let pods =
        w.ns.api::<Pod>()
            .list(&ListParams::default().labels(&sel))
            .await
            .expect("list");
    let live: Vec<_> = pods
        .items
        .iter()
        .filter(|p| !is_deleting(p))
        .map(|p| p.name_any())
        .collect();
    assert!(
        live.is_empty(),
        "a new pod for the deleted session: {live:?} (old {})",
        pod.name_any()
    );
    drop(server);
    w.done().await;
}

/// A `notifications/cancelled` interrupts the command in the session's pod as Ctrl-C does:
/// the command is gone within a second, and the next call answers at once in the same
/// shell, with its directory and variables (before, it waited for the command to end).
#[tokio::test]
async fn a_cancelled_call_interrupts_the_command_in_its_pod() {
    let w = World::new("srv-cancel").await;
    let server = w.server().await;
    let mcp = Mcp::new(&server, Some("cancel-1"));
    let r = mcp.bash("cd /tmp && export KEPT=yes").await;
    assert!(!is_error(&r), "{r}");
    // A duration no other test uses, to find the command among the host's processes.
    let marker = format!(
        "{}.{}",
        700 + rand::random::<u16>() % 100,
        rand::random::<u16>()
    );
    let mut body = cli_mcp_e2e::jsonrpc::bash(json!({ "command": format!("sleep {marker}") }));
    body["id"] = json!(7);
    let call = tokio::spawn({
        let mcp = mcp.clone();
        async move { mcp.post_raw(body.to_string()).await }
    });
    let pid = started(&marker).await;
    let cancel = json!({
        "jsonrpc": "2.0",
        "method": "notifications/cancelled",
        "params": {"requestId": 7, "reason": "the test cancels it"}
    });
    let a = mcp.post_raw(cancel.to_string()).await;
    let cancelled_at = std::time::Instant::now();
    assert_eq!(a.status, 202, "{}", a.text);
    let answer = tokio::time::timeout(std::time::Duration::from_secs(5), call)
        .await
        .expect("the cancelled call answers within 5 s")
        .expect("join");
    assert!(
        text(&answer.body["result"]).contains("cancelled by the client"),
        "{}",
        answer.text
    );
    support::gone_within(pid, std::time::Duration::from_secs(1))
        .await
        .unwrap_or_else(|e| panic!("the cancelled command: {e}"));
    let gone = cancelled_at.elapsed();
    let r = mcp.bash("echo \"ok $PWD $KEPT\"").await;
    let took = cancelled_at.elapsed();
    eprintln!("kubernetes: the command was gone {gone:?} and the next call answered {took:?} after the cancel");
    assert_eq!(stdout(&r), "ok /tmp yes\n", "{r}");
    assert!(
        took < std::time::Duration::from_secs(2),
        "the next call answered {took:?} after the cancel; the limit is 2 s"
    );
    drop(server);
    w.done().await;
}

#[tokio::test]
async fn session_limit_is_enforced() {
    let w = World::new("srv-limit").await;
    let server = w
        .server_with(&["--auth", "none", "--max-sessions", "1"])
        .await;
    let mcp = Mcp::new(&server, Some("lim-1"));
    assert!(!is_error(&mcp.bash("true").await));
    let r = mcp.session("lim-2").bash("true").await;
    assert!(is_error(&r));
    assert!(text(&r).contains("already has 1 sessions"), "{}", text(&r));
    drop(server);
    w.done().await;
}

/// Concurrent new sessions against `--max-sessions`: exactly the limit starts (here from an
/// empty pool, so each start is a create), the others get the limit error, and no pod beyond
/// the limit is ever made. Counting and then creating would let every one of them in.
#[tokio::test]
async fn concurrent_new_sessions_never_overshoot_max_sessions() {
    const MAX: usize = 3;
    let w = World::new("srv-limit-race").await;
    let server = w
        .server_with(&["--auth", "none", "--max-sessions", &MAX.to_string()])
        .await;
    let mcp = Mcp::new(&server, None);
    // Every session pod ever made, seen from a watch that runs through the burst.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let watch = {
        let seen = seen.clone();
        let api = w.ns.api::<Pod>();
        let sel = w.instance().assigned_selector();
        tokio::spawn(async move {
            use futures::StreamExt;
            let cfg = kube::runtime::watcher::Config::default().labels(&sel);
            let stream = kube::runtime::watcher(api, cfg);
            let mut stream = std::pin::pin!(stream);
            while let Some(ev) = stream.next().await {
                if let Ok(
                    kube::runtime::watcher::Event::Apply(p)
                    | kube::runtime::watcher::Event::InitApply(p),
                ) = ev
                {
                    seen.lock().expect("lock").insert(p.name_any());
                }
            }
        })
    };
    let calls = (0..12).map(|i| {
        let mcp = mcp.session(&format!("race-{i}"));
        async move { mcp.bash("echo ok").await }
    });
    let results = join_all(calls).await;
    let texts: Vec<String> = results.iter().map(text).collect();
    let ok = results.iter().filter(|r| !is_error(r)).count();
    assert_eq!(ok, MAX, "exactly the limit starts: {texts:#?}");
    for r in results.iter().filter(|r| is_error(r)) {
        assert!(
            text(r).contains(&format!("already has {MAX} sessions")),
            "{}",
            text(r)
        );
    }
    let pods =
        w.ns.api::<Pod>()
            .list(&ListParams::default().labels(&w.instance().assigned_selector()))
            .await
            .expect("list")
            .items;
    assert_eq!(
        pods.len(),
        MAX,
        "session pods: {:?}",
        pods.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
    watch.abort();
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), MAX, "session pods ever made: {seen:?}");
    drop(server);
    w.done().await;
}

// ---- auth ----

/// A ServiceAccount, optionally bound to a Role with `verbs` on climcpinstances/mcp of the
/// instance; returns its token.
async fn identity(w: &World, name: &str, verbs: &[&str]) -> String {
    let sa = ServiceAccount {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    w.ns.api::<ServiceAccount>()
        .create(&PostParams::default(), &sa)
        .await
        .expect("create ServiceAccount");
    if !verbs.is_empty() {
        let sa = Subject {
            kind: "ServiceAccount".into(),
            name: name.into(),
            namespace: Some(w.ns.name.clone()),
            ..Default::default()
        };
        support::grant_mcp(&w.ns, name, INSTANCE, verbs, vec![sa]).await;
    }
    let tr = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    w.ns.api::<ServiceAccount>()
        .create_token_request(name, &PostParams::default(), &tr)
        .await
        .expect("TokenRequest")
        .status
        .expect("token status")
        .token
        .expect("a token")
}

async fn auth_server(w: &World) -> (Server, reqwest::Client) {
    auth_server_with(w, &[]).await
}

async fn auth_server_with(w: &World, extra: &[&str]) -> (Server, reqwest::Client) {
    let pki = support::Pki::new(w.dir.path());
    let (cert, key) = pki.leaf("tls");
    let mut args = vec![
        "--auth",
        "kubernetes",
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--instance",
        INSTANCE,
        "--namespace",
        &w.ns.name,
    ];
    args.extend_from_slice(extra);
    let server = w.server_with(&args).await;
    (server, support::https(&pki.ca_pem))
}

async fn metrics_of(server: &Server) -> String {
    support::http()
        .get(server.health_url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text")
}

/// TokenReviews the server has sent, whatever they answered.
async fn reviews(server: &Server) -> f64 {
    cli_mcp_e2e::http::metric_sum(&metrics_of(server).await, "cli_mcp_token_reviews_total")
        .unwrap_or(0.0)
}

/// `tools/list` with each token, `parallel` at a time; the HTTP statuses.
async fn statuses(
    server: &Server,
    http: &reqwest::Client,
    tokens: &[String],
    parallel: usize,
) -> Vec<u16> {
    use futures::StreamExt;
    futures::stream::iter(tokens.iter().map(|t| {
        let mcp = authed(server, http, t, "junk");
        async move { mcp.rpc("tools/list", json!({})).await.status.as_u16() }
    }))
    .buffered(parallel)
    .collect()
    .await
}

fn junk_tokens(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("junk-{i}-{}", rand::random::<u64>()))
        .collect()
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn authed(server: &Server, http: &reqwest::Client, token: &str, sid: &str) -> Mcp {
    Mcp {
        http: http.clone(),
        url: server.url("/mcp"),
        session: Some(sid.into()),
        bearer: Some(token.into()),
    }
}

#[tokio::test]
async fn auth_allows_bound_identities_and_denies_others() {
    let w = World::new("srv-auth").await;
    let alice = identity(&w, "alice", &["create", "get", "delete"]).await;
    let mallory = identity(&w, "mallory", &[]).await;
    let carol = identity(&w, "carol", &["create"]).await;
    let (server, http) = auth_server(&w).await;

    // No token, a bad token: 401 with a JSON body that says what to send.
    let mut anon = authed(&server, &http, "", "a-1");
    anon.bearer = None;
    let a = anon.rpc("tools/list", json!({})).await;
    assert_eq!(a.status, 401, "{}", a.text);
    assert_eq!(a.body["code"], "unauthorized");
    assert!(a.text.contains("Authorization: Bearer"), "{}", a.text);
    let a = authed(&server, &http, "not-a-token", "a-1")
        .rpc("tools/list", json!({}))
        .await;
    assert_eq!(a.status, 401, "{}", a.text);
    assert!(a.text.contains("not accepted"), "{}", a.text);

    // Authenticated but not authorised: 403 naming the permission.
    let a = authed(&server, &http, &mallory, "a-1")
        .rpc("tools/list", json!({}))
        .await;
    assert_eq!(a.status, 403, "{}", a.text);
    assert!(
        a.text.contains("climcpinstances/mcp") && a.text.contains("mallory"),
        "{}",
        a.text
    );

    // Allowed: the tool runs and the pod records the owner.
    let r = authed(&server, &http, &alice, "a-1").bash("echo hi").await;
    assert_eq!(stdout(&r), "hi\n", "{r}");
    let pod = w.one_pod("a-1").await;
    let user = format!("system:serviceaccount:{}:alice", w.ns.name);
    assert_eq!(
        ann(&pod, annotation::OWNER),
        Some(hex::encode(Sha256::digest(user.as_bytes())))
    );
    // ... and the caller as TokenReview named it, for the credential proxy.
    let caller = ann(&pod, annotation::CALLER)
        .and_then(|a| cli_mcp_api::proxy::SessionCaller::from_annotation(&a))
        .expect("the caller annotation");
    assert_eq!(caller.user, user);
    for g in [
        "system:serviceaccounts".to_owned(),
        format!("system:serviceaccounts:{}", w.ns.name),
        "system:authenticated".to_owned(),
    ] {
        assert!(caller.groups.contains(&g), "{g} in {:?}", caller.groups);
    }

    // Verbs are checked per method: carol may call tools but not DELETE.
    let r = authed(&server, &http, &carol, "c-1").bash("true").await;
    assert!(!is_error(&r), "{r}");
    let del = http
        .delete(server.url("/sessions/c-1"))
        .bearer_auth(&carol)
        .send()
        .await
        .expect("DELETE");
    assert_eq!(del.status(), 403);
    assert!(del
        .text()
        .await
        .unwrap_or_default()
        .contains("may not delete"));
    drop(server);
    w.done().await;
}

/// A burst of first calls with one token costs one TokenReview + SubjectAccessReview: the
/// callers that miss the cache while it runs share its decision (before, 50 calls at once
/// sent 50 pairs of reviews).
#[tokio::test]
async fn concurrent_first_calls_with_one_token_share_one_review() {
    let w = World::new("srv-auth-burst").await;
    let dave = identity(&w, "dave", &["create"]).await;
    let (server, http) = auth_server(&w).await;
    let answers = futures::future::join_all((0..50).map(|_| {
        let mcp = authed(&server, &http, &dave, "d-1");
        async move { mcp.rpc("tools/list", json!({})).await }
    }))
    .await;
    for a in &answers {
        assert_eq!(a.status, 200, "{}", a.text);
    }
    let metrics = support::http()
        .get(server.health_url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let count = |series: &str| cli_mcp_e2e::http::metric_sum(&metrics, series).unwrap_or(0.0);
    let reviewed = count("cli_mcp_auth_decisions_total{result=\"allowed\",cached=\"false\"}");
    let shared = count("cli_mcp_auth_decisions_total{result=\"allowed\",cached=\"true\"}");
    assert_eq!(
        (reviewed, shared),
        (1.0, 49.0),
        "50 concurrent first calls: reviews sent vs decisions shared"
    );
    drop(server);
    w.done().await;
}

#[tokio::test]
async fn a_second_identity_cannot_use_or_delete_the_first_ones_session() {
    let w = World::new("srv-owner").await;
    let alice = identity(&w, "alice", &["create", "get", "delete"]).await;
    let bob = identity(&w, "bob", &["create", "get", "delete"]).await;
    let (server, http) = auth_server(&w).await;
    let r = authed(&server, &http, &alice, "mine")
        .bash("export SECRET=alice")
        .await;
    assert!(!is_error(&r), "{r}");

    // Bob: the session is not his (tool error), not deletable (403), not listed.
    let r = authed(&server, &http, &bob, "mine")
        .bash("echo $SECRET")
        .await;
    assert!(is_error(&r));
    assert!(
        text(&r).contains("belongs to another identity"),
        "{}",
        text(&r)
    );
    let del = http
        .delete(server.url("/sessions/mine"))
        .bearer_auth(&bob)
        .send()
        .await
        .expect("DELETE");
    assert_eq!(del.status(), 403);
    let list: Value = http
        .get(server.url("/sessions"))
        .bearer_auth(&bob)
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON");
    assert_eq!(list["sessions"], json!([]));
    w.one_pod("mine").await;

    // Alice still has it, sees it, and can delete it.
    let r = authed(&server, &http, &alice, "mine")
        .bash("echo $SECRET")
        .await;
    assert_eq!(stdout(&r), "alice\n");
    let list: Value = http
        .get(server.url("/sessions"))
        .bearer_auth(&alice)
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON");
    assert_eq!(list["sessions"][0]["session_id"], "mine");
    let del = http
        .delete(server.url("/sessions/mine"))
        .bearer_auth(&alice)
        .send()
        .await
        .expect("DELETE");
    assert_eq!(del.status(), 204);
    drop(server);
    w.done().await;
}

/// Two identities' first calls with one session id, on two replicas at once: both replicas
/// see a session new to their pod watch and create its pod (one fixed name): the loser of
/// the create finds the winner's pod through its 409. Only the pod's owner may run in it;
/// the other caller is refused — its command never runs in someone else's sandbox.
#[tokio::test]
async fn two_identities_racing_on_one_new_session_id_never_share_its_pod() {
    let w = World::new("srv-owner-race").await;
    let alice = identity(&w, "alice", &["create", "get", "delete"]).await;
    let bob = identity(&w, "bob", &["create", "get", "delete"]).await;
    let (a, http_a) = auth_server(&w).await;
    let (b, http_b) = auth_server(&w).await;
    for round in 0..4 {
        let sid = format!("contested-{round}");
        let as_alice = authed(&a, &http_a, &alice, &sid);
        let as_bob = authed(&b, &http_b, &bob, &sid);
        let (ra, rb) = tokio::join!(
            as_alice.bash("echo ran-as-alice"),
            as_bob.bash("echo ran-as-bob")
        );
        let ran: Vec<&Value> = [&ra, &rb].into_iter().filter(|r| !is_error(r)).collect();
        assert_eq!(
            ran.len(),
            1,
            "round {round}: exactly one identity runs in the session's pod: {ra} {rb}"
        );
        let refused = if is_error(&ra) { &ra } else { &rb };
        assert!(
            text(refused).contains("belongs to another identity"),
            "round {round}: {}",
            text(refused)
        );
        // The pod is the winner's, and stays so on the next calls.
        w.one_pod(&sid).await;
        let (winner, loser) = if is_error(&ra) {
            (&as_bob, &as_alice)
        } else {
            (&as_alice, &as_bob)
        };
        assert!(!is_error(&winner.bash("true").await), "round {round}");
        assert!(is_error(&loser.bash("true").await), "round {round}");
    }
    drop((a, b));
    w.done().await;
}

/// A session's spill is an MCP resource of its owner only, and goes with its pod: another
/// identity's read is refused, a read after `DELETE` says the session is gone (and starts no
/// pod).
#[tokio::test]
async fn spill_resources_belong_to_the_sessions_identity_and_go_with_its_pod() {
    let w = World::new("srv-res").await;
    let alice = identity(&w, "alice", &["create", "get", "delete"]).await;
    let bob = identity(&w, "bob", &["create", "get", "delete"]).await;
    let (server, http) = auth_server(&w).await;
    let mine = authed(&server, &http, &alice, "mine");
    let r = mine.bash("seq 1 100000").await;
    let uri = r["content"]
        .as_array()
        .expect("content")
        .iter()
        .find(|b| b["type"] == "resource_link")
        .and_then(|b| b["uri"].as_str())
        .unwrap_or_else(|| panic!("no spill link in {r}"))
        .to_owned();
    let read = |mcp: Mcp, uri: String| async move {
        mcp.rpc(
            "resources/read",
            json!({ "uri": format!("{uri}?length=12") }),
        )
        .await
        .body
    };
    let own = read(mine.clone(), uri.clone()).await;
    assert_eq!(
        own["result"]["contents"][0]["text"], "1\n2\n3\n4\n5\n6\n",
        "{own}"
    );

    let theirs = read(authed(&server, &http, &bob, "mine"), uri.clone()).await;
    assert!(
        theirs["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("belongs to another identity")),
        "{theirs}"
    );

    let del = http
        .delete(server.url("/sessions/mine"))
        .bearer_auth(&alice)
        .send()
        .await
        .expect("DELETE");
    assert_eq!(del.status(), 204);
    let gone = read(mine.clone(), uri.clone()).await;
    assert_eq!(gone["error"]["code"], -32002, "{gone}");
    assert!(
        gone["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("gone with it")),
        "{gone}"
    );
    let left =
        w.ns.api::<Pod>()
            .list(&ListParams::default().labels("cli-mcp.redhat.com/session-id=mine"))
            .await
            .expect("list pods");
    assert!(
        left.items.iter().all(is_deleting),
        "the read started no pod: {:?}",
        left.items.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
    drop(server);
    w.done().await;
}

#[tokio::test]
async fn readiness_reflects_the_api() {
    let w = World::new("srv-ready").await;
    let server = w.server().await;
    let r = support::http()
        .get(server.health_url("/readyz"))
        .send()
        .await
        .expect("GET /readyz");
    assert_eq!(r.status(), 200);
    drop(server);
    // A server whose kubeconfig points nowhere is not ready, and says why.
    let bad = w.dir.path().join("bad-kubeconfig");
    std::fs::write(
        &bad,
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n\
         users: [{name: u, user: {token: x}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n",
    )
    .expect("write");
    let mut args = w.base_args();
    args.extend(["--auth".to_string(), "none".to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start(&args, &[("KUBECONFIG", bad.to_str().expect("utf-8"))]).await;
    let r = support::http()
        .get(server.health_url("/readyz"))
        .send()
        .await
        .expect("GET /readyz");
    assert_eq!(r.status(), 503);
    assert!(r.text().await.unwrap_or_default().contains("not reachable"));
    drop(server);
    w.done().await;
}

/// Junk tokens cost one review each, once per TTL, and however many there are they never
/// push a real user's decision out of the cache (before, 4,200 junk tokens cleared the whole
/// cache at 4,096 entries, and the user's next call cost a new review).
#[tokio::test]
async fn junk_tokens_never_evict_a_real_users_decision() {
    let w = World::new("srv-auth-junk").await;
    let alice = identity(&w, "alice", &["create"]).await;
    // Long enough for the whole test, so only eviction could drop a decision.
    let (server, http) = auth_server_with(&w, &["--auth-cache-seconds", "600"]).await;
    let pid = server.child.id().expect("server pid");
    let a = authed(&server, &http, &alice, "al-1")
        .rpc("tools/list", json!({}))
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(reviews(&server).await, 1.0);
    let rss_before = rss_kib(pid);
    let junk = junk_tokens(4200);
    let t0 = std::time::Instant::now();
    let answers = statuses(&server, &http, &junk, 8).await;
    let took = t0.elapsed();
    assert!(answers.iter().all(|s| *s == 401), "{answers:?}");
    assert_eq!(reviews(&server).await, 4201.0, "one review per junk token");
    let rss_after = rss_kib(pid);
    eprintln!("4,200 junk tokens in {took:?}: server RSS {rss_before} KiB -> {rss_after} KiB");
    // The most recent junk is still cached: no review again.
    let again = statuses(&server, &http, &junk[3700..], 8).await;
    assert!(again.iter().all(|s| *s == 401), "{again:?}");
    assert_eq!(
        reviews(&server).await,
        4201.0,
        "junk reviewed again within its TTL"
    );
    // The real user's decision survived: no new review.
    let a = authed(&server, &http, &alice, "al-1")
        .rpc("tools/list", json!({}))
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(
        reviews(&server).await,
        4201.0,
        "the real user's decision was evicted by junk tokens"
    );
    drop(server);
    w.done().await;
}

/// A burst of distinct junk tokens never has more reviews in flight than the bound; the
/// requests over it get a quick 503 that says to retry (before, 500 junk tokens at once sent
/// 500 reviews at once).
#[tokio::test]
async fn a_burst_of_junk_tokens_never_exceeds_the_review_bound() {
    let w = World::new("srv-auth-bound").await;
    // Long enough for the whole test, so no refusal expires before it is sent again.
    let (server, http) = auth_server_with(&w, &["--auth-cache-seconds", "600"]).await;
    let junk = junk_tokens(500);
    let t0 = std::time::Instant::now();
    let answers = futures::future::join_all(junk.iter().map(|t| {
        let mcp = authed(&server, &http, t, "junk");
        async move { mcp.rpc("tools/list", json!({})).await }
    }))
    .await;
    let took = t0.elapsed();
    let metrics = metrics_of(&server).await;
    let count = |series: &str| cli_mcp_e2e::http::metric_sum(&metrics, series).unwrap_or(0.0);
    let peak = count("cli_mcp_token_reviews_in_flight_max");
    let sent = count("cli_mcp_token_reviews_total");
    let busy = answers.iter().filter(|a| a.status == 503).count();
    eprintln!(
        "500 junk tokens at once in {took:?}: {sent} reviews sent, {busy} answered busy, \
         at most {peak} in flight"
    );
    assert!(
        (1.0..=16.0).contains(&peak),
        "reviews in flight at once: {peak}"
    );
    for a in &answers {
        match a.status.as_u16() {
            401 => {}
            503 => assert!(a.text.contains("authentication is busy"), "{}", a.text),
            other => panic!("unexpected {other}: {}", a.text),
        }
    }
    assert_eq!(
        sent,
        (500 - busy) as f64,
        "a review per token that was not refused"
    );
    assert_eq!(count("cli_mcp_auth_busy_total"), busy as f64);
    // Refused for being busy is not cached; a refusal is: the same tokens again, one at a
    // time, cost only the reviews of those answered busy before.
    let again = statuses(&server, &http, &junk, 4).await;
    assert!(again.iter().all(|s| *s == 401), "{again:?}");
    assert_eq!(reviews(&server).await, 500.0);
    drop(server);
    w.done().await;
}

/// A token bound to an audience (`kubectl create token <sa> --audience <aud>`) is accepted
/// with `--token-audience <aud>`, and refused, saying why, without it or with another one.
#[tokio::test]
async fn audience_bound_tokens_need_the_servers_audience() {
    let w = World::new("srv-auth-aud").await;
    identity(&w, "erin", &["create"]).await;
    let tr = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(vec!["cli-mcp-test".into()]),
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let bound =
        w.ns.api::<ServiceAccount>()
            .create_token_request("erin", &PostParams::default(), &tr)
            .await
            .expect("TokenRequest")
            .status
            .and_then(|s| s.token)
            .expect("a token");

    let (server, http) = auth_server_with(&w, &["--token-audience", "cli-mcp-test"]).await;
    let a = authed(&server, &http, &bound, "e-1")
        .rpc("tools/list", json!({}))
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    drop(server);

    let (server, http) = auth_server(&w).await;
    let a = authed(&server, &http, &bound, "e-1")
        .rpc("tools/list", json!({}))
        .await;
    assert_eq!(a.status, 401, "{}", a.text);
    assert!(a.text.contains("--token-audience"), "{}", a.text);
    drop(server);

    let (server, http) = auth_server_with(&w, &["--token-audience", "another"]).await;
    let a = authed(&server, &http, &bound, "e-1")
        .rpc("tools/list", json!({}))
        .await;
    assert_eq!(a.status, 401, "{}", a.text);
    assert!(a.text.contains("--audience another"), "{}", a.text);
    drop(server);
    w.done().await;
}
