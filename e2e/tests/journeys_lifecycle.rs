//! Lifecycle journeys end to end (docs/e2e.md): idle collection, scale and a rolling
//! restart under load, and a GitOps image change.
//! Same setup as `journeys.rs`: the operator installed from `config/default` into the test's
//! namespace, the CR applied as the user, MCP over TLS through a loopback Service forward.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::label;
use cli_mcp_api::pod_state::{is_deleting, is_ready};
use cli_mcp_e2e::journey::{
    sandbox_selector, server_selector, session_of, stdout, text, CallError, Env, Mcp,
};
use cli_mcp_e2e::testing::{wait_for, wait_for_set, TIMEOUT};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::ResourceExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// The annotation `kubectl rollout restart` puts on the pod template.
const RESTARTED_AT: &str = "kubectl.kubernetes.io/restartedAt";

fn image_of(p: &Pod) -> Option<&str> {
    p.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.image.as_deref())
}

/// The one live pod of session `sid`.
async fn session_pod(env: &Env, sid: &str) -> Pod {
    let mut pods: Vec<Pod> = env
        .list::<Pod>(&format!("{}={sid}", label::SESSION_ID))
        .await
        .into_iter()
        .filter(|p| !is_deleting(p))
        .collect();
    assert_eq!(pods.len(), 1, "session {sid} has exactly one pod: {pods:?}");
    pods.remove(0)
}

/// The real `kubectl` from PATH against the test cluster, in the test namespace.
async fn kubectl(env: &Env, args: &[&str]) -> String {
    let out = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&env.c.info.kubeconfig)
        .arg("-n")
        .arg(&env.ns.name)
        .args(args)
        .output()
        .await
        .expect("run kubectl from PATH");
    assert!(
        out.status.success(),
        "kubectl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `command_sha256` (as in the server's audit log) of a command.
fn command_hash(cmd: &str) -> String {
    hex::encode(&Sha256::digest(cmd.as_bytes())[..8])
}

/// Which server pod audited each `tools/call` that reached a sandbox: command hash →
/// (pod name, outcome), from the container logs the kubelet keeps (also of pods deleted
/// since).
fn audited_calls(env: &Env) -> BTreeMap<String, (String, String)> {
    let dir = env.c.info.kubelet_state_dir.join("pods");
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        // <namespace>_<pod>_<uid>
        let mut parts = name.splitn(3, '_');
        let (Some(ns), Some(pod)) = (parts.next(), parts.next()) else {
            continue;
        };
        if ns != env.ns.name {
            continue;
        }
        let Ok(log) = std::fs::read_to_string(e.path().join("server.log")) else {
            continue;
        };
        for line in log.lines() {
            let Ok(v) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            if v["target"] == "audit" && v["action"] == "tools/call" {
                if let (Some(h), Some(outcome)) =
                    (v["command_sha256"].as_str(), v["outcome"].as_str())
                {
                    out.insert(h.to_owned(), (pod.to_owned(), outcome.to_owned()));
                }
            }
        }
    }
    out
}

/// resourceVersions of the instance's children other than pods and the Deployment.
async fn stable_children(env: &Env, instance: &str) -> BTreeMap<String, String> {
    let sel = format!("{}={instance}", label::INSTANCE);
    let mut m = BTreeMap::new();
    let mut put = |kind: &str, name: String, rv: Option<String>| {
        m.insert(format!("{kind}/{name}"), rv.unwrap_or_default());
    };
    for o in env.list::<Service>(&sel).await {
        put("Service", o.name_any(), o.resource_version());
    }
    for o in env.list::<NetworkPolicy>(&sel).await {
        put("NetworkPolicy", o.name_any(), o.resource_version());
    }
    for o in env.list::<Secret>(&sel).await {
        put("Secret", o.name_any(), o.resource_version());
    }
    for o in env.list::<ConfigMap>(&sel).await {
        put("ConfigMap", o.name_any(), o.resource_version());
    }
    for o in env.list::<ServiceAccount>(&sel).await {
        put("ServiceAccount", o.name_any(), o.resource_version());
    }
    for o in env.list::<Role>(&sel).await {
        put("Role", o.name_any(), o.resource_version());
    }
    for o in env.list::<RoleBinding>(&sel).await {
        put("RoleBinding", o.name_any(), o.resource_version());
    }
    for o in env.cluster_bindings(instance).await {
        put("ClusterRoleBinding", o.name_any(), o.resource_version());
    }
    m
}

/// Journey 4: a session left idle past `idleTimeout` is collected and its next call starts
/// fresh, saying the state was reset; a session used every ~20 s over the same window is
/// kept alive by the server's `last-activity` stamps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_session_is_collected_and_an_active_one_is_not() {
    let env = Env::install("j-idle").await;
    env.dummy_kubeconfig("i").await;
    let mut cr = env.cr("i", 2);
    cr["spec"]["sandbox"]["idleTimeout"] = json!("1m");
    env.apply_cr(&cr).await;
    env.wait_ready("i").await;
    let mcp = env.client("i").await;
    const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

    // Taken before the call: its activity (stamped by the server while it runs) is later.
    let idle_last_call = Instant::now();
    let r = mcp.bash("idle", "cd /tmp && export IDLE_VAR=kept-4").await;
    assert_eq!(r["isError"], false, "{r}");
    let r = mcp.bash("busy", "cd /tmp && export BUSY_VAR=kept-4b").await;
    assert_eq!(r["isError"], false, "{r}");
    let busy_start = Instant::now();
    let idle_pod = session_pod(&env, "idle").await;
    let busy_pod = session_pod(&env, "busy").await;
    let busy_claimed_at = busy_pod
        .annotations()
        .get(cli_mcp_api::names::annotation::LAST_ACTIVITY)
        .cloned()
        .expect("last-activity stamped at claim");

    // The idle pod's deletion, watched (the operator requeues for the soonest expiry).
    let idle_uid = idle_pod.uid();
    let idle_name = idle_pod.name_any();
    let idle_gone = async {
        let r = wait_for(
            env.api::<Pod>(),
            &idle_name,
            "idle session pod collected",
            IDLE_TIMEOUT + TIMEOUT,
            move |p: Option<&Pod>| p.is_none_or(|p| p.uid() != idle_uid || is_deleting(p)),
        )
        .await;
        (r, idle_last_call.elapsed())
    };
    // Meanwhile the busy session is used every 20 s through the endpoint, and at least
    // until its own claim is 80 s old: were its activity not stamped, the operator would
    // have collected it at 60 s.
    let busy_calls = async {
        let mut tick = tokio::time::interval(Duration::from_secs(20));
        let mut calls = 0;
        loop {
            tick.tick().await;
            let r = mcp.bash("busy", "pwd; echo \"[$BUSY_VAR]\"").await;
            assert_eq!(r["isError"], false, "{r}");
            assert_eq!(stdout(&r), "/tmp\n[kept-4b]\n", "busy keeps its state: {r}");
            assert_ne!(r["structuredContent"]["state_reset"], true, "{r}");
            calls += 1;
            if busy_start.elapsed() >= IDLE_TIMEOUT + Duration::from_secs(20) {
                return calls;
            }
        }
    };
    let ((gone, idle_for), calls) = tokio::join!(idle_gone, busy_calls);
    gone.unwrap_or_else(|e| panic!("{e}\noperator:\n{}", env.logs("operator")));
    eprintln!("idle session collected {idle_for:?} after its last call");
    assert!(calls >= 5, "busy was called every 20 s: {calls}");
    assert!(
        idle_for >= IDLE_TIMEOUT,
        "collected no earlier than idleTimeout"
    );

    // The busy session's pod is the same one, alive, with a newer last-activity.
    let still = env
        .api::<Pod>()
        .get_opt(&busy_pod.name_any())
        .await
        .expect("get busy pod")
        .expect("the busy session's pod still exists");
    assert_eq!(still.uid(), busy_pod.uid());
    assert!(!is_deleting(&still), "the busy session is not collected");
    let stamped = still
        .annotations()
        .get(cli_mcp_api::names::annotation::LAST_ACTIVITY)
        .cloned()
        .unwrap_or_default();
    let parse = |s: &str| {
        s.parse::<k8s_openapi::jiff::Timestamp>()
            .unwrap_or_else(|e| panic!("last-activity {s:?}: {e}"))
    };
    let advanced = parse(&stamped).duration_since(parse(&busy_claimed_at));
    assert!(
        advanced.as_secs() >= 60,
        "last-activity advanced by the calls ({busy_claimed_at} -> {stamped})"
    );

    // The idle session's next call starts fresh and says so.
    let again = mcp.bash("idle", "pwd; echo \"[${IDLE_VAR:-}]\"").await;
    assert_eq!(again["isError"], false, "{again}");
    let sc = &again["structuredContent"];
    assert_eq!(sc["state_reset"], true, "the reset is reported: {again}");
    assert!(sc["new_sandbox"].is_string(), "a new sandbox: {again}");
    assert!(text(&again).contains("reset"), "the text says so: {again}");
    let out = stdout(&again);
    assert!(!out.starts_with("/tmp\n"), "cwd gone: {again}");
    assert!(out.ends_with("[]\n"), "variable gone: {again}");
    assert_ne!(session_pod(&env, "idle").await.uid(), idle_pod.uid());
    drop(mcp);
    env.finish(Some("i")).await;
}

/// One caller of the scale and rolling-restart journey: calls its session in a loop until
/// `stop`, recording every call's unique command and every failure.
struct Caller {
    sid: String,
    /// Its own client: a connection pool of its own, so the forward (an endpoint per
    /// connection) may send it to another replica than the others.
    mcp: Mcp,
}

#[derive(Default, Debug)]
struct Tally {
    /// (tag, command) of the answered calls.
    ok: Vec<(String, String)>,
    /// (tag, command, error, how long the call took)
    failed: Vec<(String, String, CallError, Duration)>,
}

/// Where each journey-5 command appends its tag in the sandbox: the session's own record
/// of what ran, independent of the servers.
const RAN_FILE: &str = "/tmp/j5-ran";

/// `phase` makes the tags of one phase distinct from another's.
async fn call_until(c: &Caller, phase: &str, stop: &AtomicBool, min: usize) -> Tally {
    let mut t = Tally::default();
    let mut n = 0;
    while n < min || !stop.load(Ordering::Relaxed) {
        let tag = format!("{}-{phase}{n}", c.sid);
        let cmd = format!("echo {tag} >> {RAN_FILE}; echo {tag}; echo \"[$J5_VAR]\"; pwd");
        n += 1;
        let started = Instant::now();
        match c.mcp.bash_ok(&c.sid, &cmd).await {
            Ok(r) => {
                let want = format!("{tag}\n[{}]\n/tmp\n", c.sid);
                assert_eq!(stdout(&r), want, "state survives: {r}");
                assert_ne!(r["structuredContent"]["state_reset"], true, "{r}");
                t.ok.push((tag, cmd));
            }
            Err(e) => t.failed.push((tag, cmd, e, started.elapsed())),
        }
    }
    t
}

/// Journey 5: `kubectl scale cmi/<n> --replicas=3` (scale subresource) → 3 ready replicas;
/// sessions with state keep working through `kubectl rollout restart` of the server while
/// several clients call concurrently; calls are spread over the replicas; no call fails;
/// the operator keeps the restart annotation through its later applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_survive_scale_and_a_rolling_restart() {
    let env = Env::install("j-rollout").await;
    env.dummy_kubeconfig("r").await;
    env.apply_cr(&env.cr("r", 4)).await;
    env.wait_ready("r").await;

    kubectl(&env, &["scale", "cmi/r", "--replicas=3"]).await;
    let scaled = wait_for(
        env.api::<CliMcpInstance>(),
        "r",
        "3 ready server replicas",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            o.is_some_and(|o| {
                o.spec.replicas == 3
                    && o.status.as_ref().is_some_and(|s| {
                        s.observed_generation == o.metadata.generation
                            && s.replicas == 3
                            && s.ready_replicas == 3
                    })
            })
        },
    )
    .await;
    scaled.unwrap_or_else(|e| panic!("{e}\n{}", env.logs("operator")));
    let printed = kubectl(&env, &["get", "cmi/r", "--no-headers"]).await;
    let cols: Vec<&str> = printed.split_whitespace().collect();
    assert_eq!(cols.get(2), Some(&"3"), "REPLICAS column: {printed}");

    let mcp = env.client("r").await;
    // Two keep-alive clients (pinned to one replica until it goes away) and two that open
    // a connection per call (spread round-robin by the forward).
    let mut callers = Vec::new();
    for i in 0..4 {
        let sid = format!("roll-{i}");
        let r = mcp
            .bash(&sid, &format!("cd /tmp && export J5_VAR={sid}"))
            .await;
        assert_eq!(r["isError"], false, "{r}");
        callers.push(Caller {
            sid,
            mcp: mcp.via(mcp.forward_addr(), i < 2),
        });
    }
    let sessions: BTreeMap<String, Option<String>> = {
        let mut m = BTreeMap::new();
        for c in &callers {
            m.insert(c.sid.clone(), session_pod(&env, &c.sid).await.uid());
        }
        m
    };

    // Before the restart: calls from every caller reach every replica.
    let before_pods: BTreeSet<String> = env
        .list::<Pod>(&server_selector("r"))
        .await
        .iter()
        .map(|p| p.name_any())
        .collect();
    assert_eq!(before_pods.len(), 3, "{before_pods:?}");
    let stop = AtomicBool::new(true);
    let warmup =
        futures::future::join_all(callers.iter().map(|c| call_until(c, "w", &stop, 6))).await;
    for t in &warmup {
        assert!(t.failed.is_empty(), "{:?}", t.failed);
    }
    let audited = audited_calls(&env);
    let served: BTreeSet<&String> = warmup
        .iter()
        .flat_map(|t| &t.ok)
        .filter_map(|(_, c)| audited.get(&command_hash(c)).map(|(pod, _)| pod))
        .collect();
    assert_eq!(
        served.len(),
        3,
        "calls spread over the 3 replicas: {served:?} of {before_pods:?}"
    );

    // The rolling restart, while all four callers keep calling.
    let deploy = env.api::<Deployment>();
    let gen_before = deploy
        .get("cli-mcp-r")
        .await
        .expect("Deployment")
        .metadata
        .generation
        .unwrap_or_default();
    let stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let load = futures::future::join_all(callers.iter().map(|c| call_until(c, "r", &stop, 1)));
    let restart = async {
        kubectl(&env, &["rollout", "restart", "deployment/cli-mcp-r"]).await;
        let done = wait_for_set(
            env.api::<Pod>(),
            &server_selector("r"),
            "rollout done: 3 new Ready server pods, the old ones gone",
            TIMEOUT,
            |ps: &[Pod]| {
                ps.len() == 3
                    && ps
                        .iter()
                        .all(|p| is_ready(p) && !before_pods.contains(&p.name_any()))
            },
        )
        .await;
        let rollout = t0.elapsed();
        stop.store(true, Ordering::Relaxed);
        (done, rollout)
    };
    let (tallies, (done, rollout)) = tokio::join!(load, restart);
    done.unwrap_or_else(|e| panic!("{e}\noperator:\n{}", env.logs("operator")));
    let after_pods: BTreeSet<String> = env
        .list::<Pod>(&server_selector("r"))
        .await
        .iter()
        .map(|p| p.name_any())
        .collect();
    let failed: Vec<_> = tallies.iter().flat_map(|t| &t.failed).collect();
    let ok: Vec<&String> = tallies.iter().flat_map(|t| &t.ok).map(|(_, c)| c).collect();
    eprintln!(
        "rollout took {rollout:?}: {} calls ok, {} failed",
        ok.len(),
        failed.len()
    );
    let audited = audited_calls(&env);
    // A failed call is never one that ran: it got no HTTP response at all (the caller sees
    // a transport error, never a wrong answer) and no server ever sent it to a sandbox.
    for (_, cmd, e, took) in &failed {
        assert!(
            matches!(e, CallError::NoResponse(_)),
            "a call failed with an answer during the rollout ({took:?}): {e}"
        );
        assert!(
            !audited.contains_key(&command_hash(cmd)),
            "a failed call ran anyway: {cmd:?} {e} {:?}",
            audited.get(&command_hash(cmd))
        );
    }
    for (_, cmd, e, took) in &failed {
        eprintln!("failed without running ({took:?}): {cmd:?}: {e}");
    }
    // The server's lame-duck phase on SIGTERM (docs/server.md, Shutdown) makes this zero:
    // before it, about one call in two runs failed without an answer, on a keep-alive
    // connection closed under it or a new connection to a stopping replica.
    assert!(failed.is_empty(), "calls lost in the rollout: {failed:#?}");

    // Every successful call was served by one replica; old and new replicas served calls.
    let mut per_pod: BTreeMap<&String, usize> = BTreeMap::new();
    for c in &ok {
        let (pod, outcome) = audited
            .get(&command_hash(c))
            .unwrap_or_else(|| panic!("call {c:?} not in any server's audit log"));
        assert_eq!(outcome, "ok", "{c:?}");
        *per_pod.entry(pod).or_default() += 1;
    }
    eprintln!("calls per server pod during the rollout: {per_pod:?}");
    assert!(
        per_pod.keys().any(|p| before_pods.contains(*p)),
        "old replicas served calls: {per_pod:?}"
    );
    assert!(
        per_pod.keys().filter(|p| after_pods.contains(**p)).count() >= 2,
        "new replicas served calls: {per_pod:?}"
    );

    // Session state survived: same sandbox pods, state intact (checked in every call).
    for c in &callers {
        assert_eq!(
            session_pod(&env, &c.sid).await.uid(),
            sessions[&c.sid],
            "{}",
            c.sid
        );
    }

    // The operator did not fight the restart: the annotation is on the template, and stays
    // through the operator's apply of a later spec change (scale to 2).
    let d = deploy.get("cli-mcp-r").await.expect("Deployment");
    let restarted_at = d
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.as_ref())
        .and_then(|a| a.get(RESTARTED_AT).cloned())
        .expect("restartedAt kept on the template");
    assert_eq!(
        d.metadata.generation,
        Some(gen_before + 1),
        "one rollout only"
    );
    kubectl(&env, &["scale", "cmi/r", "--replicas=2"]).await;
    let d = wait_for(
        deploy.clone(),
        "cli-mcp-r",
        "Deployment scaled to 2",
        TIMEOUT,
        |d: Option<&Deployment>| {
            d.is_some_and(|d| {
                d.spec.replicas == Some(2)
                    && d.status.as_ref().and_then(|s| s.observed_generation)
                        == d.metadata.generation
            })
        },
    )
    .await
    .expect("scaled")
    .expect("Deployment");
    let kept = d
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.as_ref())
        .and_then(|a| a.get(RESTARTED_AT).cloned());
    assert_eq!(kept.as_deref(), Some(restarted_at.as_str()));
    let replica_sets = env.list::<ReplicaSet>(&server_selector("r")).await;
    assert_eq!(
        replica_sets.len(),
        2,
        "no template change beyond the restart: {:?}",
        replica_sets
            .iter()
            .map(|r| r.name_any())
            .collect::<Vec<_>>()
    );

    // Each session's own record: every answered call ran exactly once, no failed call ran.
    for ((c, w), t) in callers.iter().zip(&warmup).zip(&tallies) {
        let r = mcp.bash(&c.sid, &format!("cat {RAN_FILE}")).await;
        assert_eq!(r["structuredContent"]["truncated"], false, "{r}");
        let mut ran: BTreeMap<&str, usize> = BTreeMap::new();
        for l in stdout(&r).lines() {
            *ran.entry(l).or_default() += 1;
        }
        let twice: Vec<_> = ran.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "{}: commands ran twice: {twice:?}", c.sid);
        for (tag, _) in w.ok.iter().chain(&t.ok) {
            assert!(ran.contains_key(tag.as_str()), "{tag} answered but not run");
        }
        for (tag, _, e, _) in &t.failed {
            assert!(
                !ran.contains_key(tag.as_str()),
                "{tag} failed ({e}) but ran"
            );
        }
    }

    // And the sessions still work after it all.
    for c in &callers {
        let r = mcp.bash(&c.sid, "echo \"[$J5_VAR]\"; pwd").await;
        assert_eq!(stdout(&r), format!("[{}]\n/tmp\n", c.sid), "{r}");
    }
    drop(mcp);
    env.finish(Some("r")).await;
}

/// The Deployment's pod template with the sandbox-config env value blanked, and that value.
/// The server's pod template without the two values a sandbox image change may change: the
/// sandbox config (returned) and the sandbox briefing, whose tools line names the image's
/// recorded tools (returned too).
fn template_without_sandbox_config(d: &Deployment) -> (Value, Value, String) {
    let mut t = serde_json::to_value(&d.spec.template).expect("json");
    let mut cfg = Value::Null;
    let mut briefing = String::new();
    if let Some(env) = t["spec"]["containers"][0]["env"].as_array_mut() {
        for e in env {
            if e["name"] == "CLI_MCP_SANDBOX_CONFIG" {
                cfg = serde_json::from_str(e["value"].as_str().unwrap_or("null")).expect("config");
                e["value"] = Value::Null;
            }
            if e["name"] == "CLI_MCP_BRIEFING" {
                briefing = e["value"].as_str().unwrap_or_default().to_owned();
                e["value"] = Value::Null;
            }
        }
    }
    (t, cfg, briefing)
}

/// Journey 7b (GitOps): applying the CR with another `spec.sandbox.image` replaces the warm
/// pool with pods of the new image and rolls the server (it builds cold sandboxes and checks
/// warm pods' `sandbox-hash` from the config in its pod template — the one template change),
/// while the Service, NetworkPolicy, Secrets, ConfigMap and RBAC keep their
/// resourceVersions and a live session keeps its pod and its state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_the_sandbox_image_rolls_only_what_must_roll() {
    const OLD: &str = cli_mcp_e2e::journey::SANDBOX_IMAGE;
    const NEW: &str = "cli-mcp-agent:v2";
    let env = Env::install("j-image").await;
    env.dummy_kubeconfig("g").await;
    let mut cr = env.cr("g", 2);
    env.apply_cr(&cr).await;
    env.wait_ready("g").await;
    let mcp = env.client("g").await;
    let r = mcp.bash("live", "cd /tmp && export J7_VAR=kept-7").await;
    assert_eq!(r["isError"], false, "{r}");
    let live = session_pod(&env, "live").await;
    assert_eq!(image_of(&live), Some(OLD));
    // The pool refilled after the claim: that is the state to change from.
    let pool_before: BTreeSet<String> = wait_for_set(
        env.api::<Pod>(),
        &sandbox_selector("g"),
        "pool refilled",
        TIMEOUT,
        |ps: &[Pod]| {
            ps.iter()
                .filter(|p| session_of(p).is_none() && !is_deleting(p) && is_ready(p))
                .count()
                == 2
        },
    )
    .await
    .expect("pool")
    .iter()
    .filter(|p| session_of(p).is_none())
    .filter_map(|p| p.uid())
    .collect();
    let children_before = stable_children(&env, "g").await;
    for kind in ["Service", "NetworkPolicy", "Secret", "ConfigMap", "Role"] {
        assert!(
            children_before
                .keys()
                .any(|k| k.starts_with(&format!("{kind}/"))),
            "{kind} missing: {children_before:?}"
        );
    }
    let deploy_before = env
        .api::<Deployment>()
        .get("cli-mcp-g")
        .await
        .expect("Deployment");
    let servers_before: BTreeSet<String> = env
        .list::<Pod>(&server_selector("g"))
        .await
        .iter()
        .map(|p| p.name_any())
        .collect();

    cr["spec"]["sandbox"]["image"] = json!(NEW);
    env.apply_cr(&cr).await;

    // The pool is replaced by pods of the new image.
    wait_for_set(
        env.api::<Pod>(),
        &sandbox_selector("g"),
        "pool replaced with the new image",
        TIMEOUT,
        |ps: &[Pod]| {
            let free: Vec<&Pod> = ps.iter().filter(|p| session_of(p).is_none()).collect();
            free.len() == 2
                && free.iter().all(|p| {
                    image_of(p) == Some(NEW)
                        && is_ready(p)
                        && !is_deleting(p)
                        && !pool_before.contains(&p.uid().unwrap_or_default())
                })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", env.logs("operator")));
    // The server rolls to the new config.
    wait_for_set(
        env.api::<Pod>(),
        &server_selector("g"),
        "server rolled",
        TIMEOUT,
        |ps: &[Pod]| {
            ps.len() == 1
                && ps
                    .iter()
                    .all(|p| is_ready(p) && !servers_before.contains(&p.name_any()))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", env.logs("operator")));
    let cr_now = env.wait_ready("g").await;
    assert_eq!(
        cr_now
            .status
            .as_ref()
            .and_then(|s| s.resolved_sandbox_image.as_deref()),
        Some(NEW)
    );

    // Only the sandbox config in the server's template changed.
    let deploy_after = env
        .api::<Deployment>()
        .get("cli-mcp-g")
        .await
        .expect("Deployment");
    let (t_before, cfg_before, briefing_before) = template_without_sandbox_config(&deploy_before);
    let (t_after, cfg_after, briefing_after) = template_without_sandbox_config(&deploy_after);
    assert_eq!(t_before, t_after, "nothing else in the template changed");
    // The briefing's tools line follows the image (the new one's tools were not recorded);
    // the rest of it stays.
    let rest = |b: &str| -> Vec<String> {
        b.lines()
            .filter(|l| !l.starts_with("- Tools:"))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(
        rest(&briefing_before),
        rest(&briefing_after),
        "{briefing_after}"
    );
    assert!(briefing_after.contains(NEW), "{briefing_after}");
    assert_eq!(cfg_before["image"], OLD, "{cfg_before}");
    assert_eq!(cfg_after["image"], NEW, "{cfg_after}");
    let mut cfg_only_image = cfg_before.clone();
    cfg_only_image["image"] = json!(NEW);
    assert_eq!(
        cfg_only_image, cfg_after,
        "only the image changed in the config"
    );
    assert_eq!(
        stable_children(&env, "g").await,
        children_before,
        "Service, NetworkPolicy, Secrets, ConfigMap, RBAC untouched"
    );

    // The live session kept its pod (old image) and its state, through the new server.
    let still = session_pod(&env, "live").await;
    assert_eq!(still.uid(), live.uid(), "the session pod is not replaced");
    assert_eq!(image_of(&still), Some(OLD));
    let r = mcp.bash("live", "pwd; echo \"[$J7_VAR]\"").await;
    assert_eq!(stdout(&r), "/tmp\n[kept-7]\n", "{r}");
    assert_ne!(r["structuredContent"]["state_reset"], true, "{r}");

    // A new session gets a warm pod of the new image (the new server accepts the new pool).
    let fresh = mcp.bash("fresh", "echo hi").await;
    assert_eq!(fresh["structuredContent"]["new_sandbox"], "warm", "{fresh}");
    assert_eq!(image_of(&session_pod(&env, "fresh").await), Some(NEW));
    drop(mcp);
    env.finish(Some("g")).await;
}

/// Journey 4 with two server replicas: a session whose sandbox was deleted under it (as the
/// idle GC, an eviction or an admin do) is reported reset by whichever replica serves its
/// next call, not only by the replica that served it before.
// Every replica's route watch records a session pod's deletion, also for sessions it never
// served (before, only the replica with a cached route knew, and another one answered "new
// session" with `state_reset: false`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_sandbox_is_reported_by_any_replica() {
    let env = Env::install("j-reset2").await;
    env.dummy_kubeconfig("x").await;
    let mut cr = env.cr("x", 2);
    cr["spec"]["replicas"] = json!(2);
    env.apply_cr(&cr).await;
    wait_for(
        env.api::<CliMcpInstance>(),
        "x",
        "2 ready server replicas and a full pool",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            o.and_then(|o| o.status.as_ref())
                .is_some_and(|s| s.ready_replicas == 2 && s.warm_pool.ready == 2)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", env.logs("operator")));
    let mcp = env.client("x").await;
    // Two keep-alive clients: the forward gives consecutive connections consecutive
    // endpoints, so they are pinned to different replicas (checked below).
    let a = mcp.via(mcp.forward_addr(), true);
    let b = mcp.via(mcp.forward_addr(), true);
    let pin_a = "echo pin-a";
    let pin_b = "echo pin-b";
    a.bash_ok("pin-a", pin_a).await.expect("pin a");
    b.bash_ok("pin-b", pin_b).await.expect("pin b");
    let audited = audited_calls(&env);
    let (ra, rb) = (
        &audited[&command_hash(pin_a)].0,
        &audited[&command_hash(pin_b)].0,
    );
    assert_ne!(ra, rb, "the two clients reach different replicas");

    let r = a
        .bash_ok("moved", "cd /tmp && export MOVED=1")
        .await
        .expect("state");
    assert_eq!(r["isError"], false, "{r}");
    let pod = session_pod(&env, "moved").await;
    env.api::<Pod>()
        .delete(&pod.name_any(), &kube::api::DeleteParams::default())
        .await
        .expect("delete the session pod");
    wait_for(
        env.api::<Pod>(),
        &pod.name_any(),
        "session pod gone",
        TIMEOUT,
        |p: Option<&Pod>| p.is_none(),
    )
    .await
    .expect("gone");

    // The other replica serves the next call.
    let cmd = "pwd; echo \"[${MOVED:-}]\"";
    let again = b.bash_ok("moved", cmd).await.expect("next call");
    assert_eq!(&audited_calls(&env)[&command_hash(cmd)].0, rb);
    assert!(stdout(&again).ends_with("[]\n"), "{again}");
    let sc = &again["structuredContent"];
    assert_eq!(sc["state_reset"], true, "the reset is reported: {again}");
    assert!(text(&again).contains("reset"), "{again}");

    // A session ended on purpose (DELETE through replica A) is not a reset when it is used
    // again through replica B: B saw the pod go, but it was retired, not lost.
    let r = a.bash_ok("ended", "export ENDED=1").await.expect("ended");
    assert_eq!(r["isError"], false, "{r}");
    let ended = session_pod(&env, "ended").await;
    assert_eq!(a.try_delete("ended").await.expect("DELETE"), 204);
    wait_for(
        env.api::<Pod>(),
        &ended.name_any(),
        "ended session pod gone",
        TIMEOUT,
        |p: Option<&Pod>| p.is_none(),
    )
    .await
    .expect("gone");
    let cmd = "echo \"[${ENDED:-}]\"";
    let fresh = b.bash_ok("ended", cmd).await.expect("a new session");
    assert_eq!(&audited_calls(&env)[&command_hash(cmd)].0, rb);
    assert_eq!(stdout(&fresh), "[]\n", "{fresh}");
    assert_ne!(
        fresh["structuredContent"]["state_reset"], true,
        "an ended session is not reported as reset: {fresh}"
    );
    assert!(text(&fresh).contains("new session"), "{fresh}");
    drop(mcp);
    env.finish(Some("x")).await;
}
