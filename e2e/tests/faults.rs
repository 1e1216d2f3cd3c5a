//! Faults end to end (docs/e2e.md): what a user sees through the real MCP endpoint
//! (operator installed from `config/default`, server and sandboxes as pods) when a part of
//! the system fails. "Nothing lost" is asserted each time: the caller gets a clear result or
//! error, no object is orphaned, and no session is silently swapped (a session whose sandbox
//! changed is told its state was reset).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::{label, InstanceName};
use cli_mcp_api::pod_state::{is_deleting, is_ready};
use cli_mcp_api::sandbox::made_for_key;
use cli_mcp_api::token::HmacKey;
use cli_mcp_api::SessionId;
use cli_mcp_e2e::journey::{
    container_pid, kill_when_running, process_running, sandbox_selector, server_selector,
    session_of, stdout, text, Env, Mcp,
};
use cli_mcp_e2e::load::CpuLoad;
use cli_mcp_e2e::testing::{pod_ip, wait_for, wait_for_set, wait_restarted, AfterRestart, TIMEOUT};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use kube::api::{DeleteParams, EvictParams, PostParams};
use kube::runtime::watcher;
use kube::ResourceExt;
use serde_json::{json, Value};

/// Installs the operator, applies instance `name` (the sample with `warm` pool pods, then
/// `edit`) and waits until it is Ready with a full pool.
async fn instance(prefix: &str, name: &str, warm: i64, edit: impl FnOnce(&mut Value)) -> Env {
    let env = Env::install(prefix).await;
    env.dummy_kubeconfig(name).await;
    let mut cr = env.cr(name, warm);
    edit(&mut cr);
    env.apply_cr(&cr).await;
    env.wait_ready(name).await;
    env
}

/// Waits until `instance` reports `n` ready server replicas and a full warm pool.
async fn wait_replicas(env: &Env, instance: &str, n: i32) {
    let r = wait_for(
        env.api::<CliMcpInstance>(),
        instance,
        "server replicas ready",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            o.and_then(|o| o.status.as_ref())
                .is_some_and(|s| s.ready_replicas == n && s.warm_pool.ready == s.warm_pool.desired)
        },
    )
    .await;
    assert!(r.is_ok(), "{r:?}\n{}", env.logs("operator"));
}

/// Largest number of live session pods seen at once, from a watch started now.
struct SessionPodPeak {
    peak: Arc<Mutex<usize>>,
    task: tokio::task::JoinHandle<()>,
}

impl SessionPodPeak {
    fn start(env: &Env, instance: &str) -> SessionPodPeak {
        let peak = Arc::new(Mutex::new(0));
        let sel = format!("{},{}", sandbox_selector(instance), label::SESSION_ID);
        let api = env.api::<Pod>();
        let p = peak.clone();
        let task = tokio::spawn(async move {
            let mut live_pods = BTreeSet::new();
            let stream = watcher(api, watcher::Config::default().labels(&sel));
            let mut stream = std::pin::pin!(stream);
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                        if !is_deleting(&pod) {
                            live_pods.insert(pod.name_any());
                        } else {
                            live_pods.remove(&pod.name_any());
                        }
                    }
                    Ok(watcher::Event::Delete(pod)) => {
                        live_pods.remove(&pod.name_any());
                    }
                    _ => {}
                }
                let mut peak = p.lock().expect("lock");
                *peak = (*peak).max(live_pods.len());
            }
        });
        SessionPodPeak { peak, task }
    }

    fn stop(self) -> usize {
        self.task.abort();
        *self.peak.lock().expect("lock")
    }
}

/// Fault: 300 sessions created as fast as possible against `maxSessions: 100`, spread over
/// three server replicas (a pool of 5): exactly 100 start, the other 200 get the limit error
/// as a clear tool result, and no more than 100 session pods ever exist. Each replica alone
/// would admit 100 (its own count cannot see what the others are starting at the same
/// moment); the session slots make the bound hold across them.
#[tokio::test]
async fn three_hundred_new_sessions_on_three_replicas_against_a_limit_of_one_hundred() {
    burst_against_the_limit("f-limit", None).await;
}

/// The same burst with every CPU of the machine busy: admission must not depend on how fast
/// the API answers.
#[tokio::test]
async fn three_hundred_new_sessions_on_three_replicas_against_a_limit_of_one_hundred_with_the_cpus_busy(
) {
    burst_against_the_limit("f-limit-load", Some(Duration::from_secs(300))).await;
}

/// One burst at a time: two at once would measure how 600 pod starts share two CPUs, not
/// admission.
static ONE_BURST: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Clients of instance `name` that each reach one ready server pod directly (its IP, port
/// 8443), one per replica.
async fn per_replica(env: &Env, mcp: &Mcp, name: &str) -> Vec<Mcp> {
    env.list::<Pod>(&server_selector(name))
        .await
        .iter()
        .filter(|p| is_ready(p) && !is_deleting(p))
        .map(|p| {
            let ip: std::net::IpAddr = pod_ip(p).expect("pod IP").parse().expect("IP");
            mcp.via(std::net::SocketAddr::new(ip, 8443), true)
        })
        .collect()
}

/// The instance's session slots (Leases).
async fn slots(env: &Env, name: &str) -> Vec<Lease> {
    let instance = InstanceName::parse(name).expect("instance name");
    env.list::<Lease>(&instance.slot_selector()).await
}

/// 300 new sessions at once against `maxSessions: 100`, a third to each of three server
/// replicas, with the CPUs busy for at most `load` while the burst runs.
async fn burst_against_the_limit(prefix: &str, load: Option<Duration>) {
    let _alone = ONE_BURST.lock().await;
    let env = instance(prefix, "m", 5, |cr| {
        cr["spec"]["sandbox"]["maxSessions"] = json!(100);
        // One client makes the whole burst: the instance's bound is under test, so the
        // per-client one (half of maxSessions by default) is set past anything the burst can
        // reach (equal to maxSessions, it would trip at the same moment for some calls).
        cr["spec"]["server"]["maxSessionsPerClient"] = json!(10_000);
        cr["spec"]["replicas"] = json!(3);
    })
    .await;
    wait_replicas(&env, "m", 3).await;
    let mcp = env.client("m").await;
    let replicas = per_replica(&env, &mcp, "m").await;
    assert_eq!(replicas.len(), 3, "three ready server pods");
    let peak = SessionPodPeak::start(&env, "m");
    let busy = load.map(CpuLoad::start);
    let t0 = std::time::Instant::now();
    let calls = (0..300).map(|i| {
        let mcp = &replicas[i % 3];
        async move { mcp.try_bash(&format!("crowd-{i}"), "echo ok").await }
    });
    let results = futures::future::join_all(calls).await;
    let took = t0.elapsed();
    drop(busy);
    let mut ok = 0;
    let mut limited = 0;
    let mut other = Vec::new();
    for r in &results {
        match r {
            Ok(v) if v["isError"] == false && stdout(v) == "ok\n" => ok += 1,
            Ok(v) if v["isError"] == true && text(v).contains("already has 100 sessions") => {
                limited += 1
            }
            other_result => other.push(format!("{other_result:?}")),
        }
    }
    assert!(
        other.is_empty(),
        "neither a session nor the limit error ({} of 300; {ok} started, {limited} refused, in {took:?}): {other:#?}",
        other.len()
    );
    assert_eq!((ok, limited), (100, 200), "started vs refused");
    let sessions: Vec<Pod> = env
        .list::<Pod>(&format!("{},{}", sandbox_selector("m"), label::SESSION_ID))
        .await
        .into_iter()
        .filter(|p| !is_deleting(p))
        .collect();
    assert_eq!(sessions.len(), 100, "session pods");
    let peak = peak.stop();
    assert!(
        peak <= 100,
        "at most 100 session pods at any time, saw {peak}"
    );
    // Every session holds one instance slot and one of its client's (the per-client limit
    // is on, if past reach), both owned by its pod, and no other slot is left.
    let uids: BTreeSet<String> = sessions.iter().filter_map(|p| p.uid()).collect();
    let held = slots(&env, "m").await;
    let owners: BTreeSet<String> = held
        .iter()
        .flat_map(|l| l.owner_references())
        .map(|o| o.uid.clone())
        .collect();
    assert_eq!(
        (held.len(), &owners),
        (200, &uids),
        "two slots per session (the instance's and its client's), owned by its pod"
    );
    let busy = if load.is_some() { ", CPUs busy" } else { "" };
    eprintln!("300 new sessions on 3 replicas against maxSessions 100{busy}: {took:?}, peak {peak} session pods");
    drop(mcp);
    env.finish(Some("m")).await;
}

/// Waits until instance `name` has `n` session slots.
async fn wait_slots(env: &Env, name: &str, n: usize, why: &str) {
    wait_slots_within(env, name, n, why, TIMEOUT).await;
}

async fn wait_slots_within(env: &Env, name: &str, n: usize, why: &str, within: Duration) {
    let instance = InstanceName::parse(name).expect("instance name");
    let r = wait_for_set(
        env.api::<Lease>(),
        &instance.slot_selector(),
        why,
        within,
        |l: &[Lease]| l.len() == n,
    )
    .await;
    assert!(r.is_ok(), "{why}: {r:?}\n{}", env.logs("server"));
}

/// The per-client quotas and the slots' lifetime, through the real endpoint with two client
/// identities (`maxSessions: 3`, `maxSessionsPerClient: 2`, `newSessionsPerMinutePerClient:
/// 3`): a client over its own limit gets an error that names it while another client still
/// starts sessions; a slot is free again after `DELETE /sessions/{id}` and after its pod is
/// deleted by someone else (as the idle collection does); the rate refusal says when to
/// retry; and slots a crashed replica left without a pod are taken back, so they never leak.
#[tokio::test]
async fn per_client_limits_and_freed_slots() {
    let env = instance("f-quota", "q", 1, |cr| {
        cr["spec"]["sandbox"]["maxSessions"] = json!(3);
        cr["spec"]["server"]["maxSessionsPerClient"] = json!(2);
        cr["spec"]["server"]["newSessionsPerMinutePerClient"] = json!(3);
        cr["spec"]["server"]["clients"] = json!([{"kind": "ServiceAccount", "name": "second"}]);
    })
    .await;
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "second"}})).expect("SA");
    env.api::<ServiceAccount>()
        .create(&PostParams::default(), &sa)
        .await
        .expect("create ServiceAccount second");
    let a = env.client("q").await;
    let mut b = a.via(a.forward_addr(), true);
    b.token = env.service_account_token("second").await;
    let ok = |r: Value, what: &str| {
        assert!(r["isError"] == false && stdout(&r) == "ok\n", "{what}: {r}");
    };
    let refused = |r: Value, what: &str, says: &[&str]| {
        let t = text(&r);
        assert!(
            r["isError"] == true && says.iter().all(|s| t.contains(s)),
            "{what}: want a tool error saying {says:?}, got {r}"
        );
    };
    const CLIENT_LIMIT: [&str; 3] = [
        "you already have 2 sessions",
        "maxSessionsPerClient",
        "retry when one of yours ends",
    ];
    const INSTANCE_LIMIT: [&str; 3] = ["already has 3 sessions", "maxSessions", "retry when"];

    ok(a.bash("a1", "echo ok").await, "a1");
    ok(a.bash("a2", "echo ok").await, "a2");
    refused(
        a.bash("a3", "echo ok").await,
        "a3 over a's own limit",
        &CLIENT_LIMIT,
    );
    ok(
        b.bash("b1", "echo ok").await,
        "b1: another client is not held to a's limit",
    );
    refused(
        b.bash("b2", "echo ok").await,
        "b2 over the instance's limit",
        &INSTANCE_LIMIT,
    );
    wait_slots(&env, "q", 6, "3 instance slots + 3 client slots").await;

    // DELETE frees both of a1's slots at once.
    assert_eq!(a.delete("a1").await, 204, "DELETE a1");
    ok(a.bash("a3", "echo ok").await, "a3 once a1 is deleted");

    // a has started 3 sessions within seconds (a3's refused attempt was given back): the
    // fourth is one too many, whatever a holds.
    assert_eq!(a.delete("a3").await, 204, "DELETE a3");
    let r = a.bash("a4", "echo ok").await;
    refused(
        r.clone(),
        "a4 over a's rate",
        &[
            "3 new sessions within the last minute",
            "newSessionsPerMinutePerClient",
            "retry after ~",
        ],
    );
    let wait: u64 = text(&r)
        .split("retry after ~")
        .nth(1)
        .and_then(|t| t.split('s').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a number of seconds in {}", text(&r)));
    assert!(
        (1..=20).contains(&wait),
        "one new session every 20 s: {wait}"
    );

    // A pod deleted by someone else (the idle collection deletes pods the same way) frees
    // its slots too.
    let a2 = env
        .list::<Pod>(&format!(
            "{},{}=a2",
            sandbox_selector("q"),
            label::SESSION_ID
        ))
        .await;
    assert_eq!(a2.len(), 1, "a2's pod");
    env.api::<Pod>()
        .delete(&a2[0].name_any(), &DeleteParams::default())
        .await
        .expect("delete a2's pod");
    wait_slots(&env, "q", 2, "a2's slots freed with its pod").await;
    ok(b.bash("b2", "echo ok").await, "b2 once a2's pod is gone");

    // A replica that crashed between its slots and the pod leaves slots nobody owns: they
    // are taken back, and the places are free again.
    assert_eq!(b.delete("b1").await, 204, "DELETE b1");
    assert_eq!(b.delete("b2").await, 204, "DELETE b2");
    wait_slots(&env, "q", 0, "every slot freed").await;
    let instance = InstanceName::parse("q").expect("name");
    for k in 0..3 {
        let lease: Lease = serde_json::from_value(json!({
            "metadata": {
                "name": format!("{}{k}", instance.slot_prefix()),
                "labels": {
                    label::INSTANCE: "q",
                    label::COMPONENT: label::COMPONENT_SLOT,
                    label::SESSION_ID: format!("crashed-{k}"),
                },
            },
            "spec": {"holderIdentity": format!("crashed-{k}")},
        }))
        .expect("Lease");
        env.api::<Lease>()
            .create(&PostParams::default(), &lease)
            .await
            .expect("create an abandoned slot");
    }
    refused(
        b.bash("b3", "echo ok").await,
        "b3 while abandoned slots fill the instance",
        &INSTANCE_LIMIT,
    );
    let t0 = std::time::Instant::now();
    // The server takes back a slot without a pod once it is 120 s old (a start still within
    // its own deadline keeps its place), then within its 5 s sweep.
    wait_slots_within(
        &env,
        "q",
        0,
        "abandoned slots taken back",
        Duration::from_secs(150),
    )
    .await;
    eprintln!("abandoned slots taken back after {:?}", t0.elapsed());
    ok(
        b.bash("b3", "echo ok").await,
        "b3 once the abandoned slots are gone",
    );
    env.finish(Some("q")).await;
}

/// Fault: a sandbox pod of a live session is evicted (Eviction API, as `kubectl drain`
/// does): the next call starts fresh and says the state was reset; the pool stays full and
/// the session has exactly one pod.
#[tokio::test]
async fn an_evicted_sandbox_is_replaced_and_the_reset_is_reported() {
    let env = instance("f-evict", "e", 1, |_| {}).await;
    let mcp = env.client("e").await;
    let r = mcp.bash("evicted", "cd /tmp && export KEPT=1").await;
    assert_eq!(r["isError"], false, "{r}");
    let sel = format!("{}=evicted", label::SESSION_ID);
    let pod = env.list::<Pod>(&sel).await.pop().expect("session pod");
    env.api::<Pod>()
        .evict(&pod.name_any(), &EvictParams::default())
        .await
        .expect("evict");
    wait_for(
        env.api::<Pod>(),
        &pod.name_any(),
        "evicted pod gone",
        TIMEOUT,
        |p: Option<&Pod>| p.is_none_or(|p| p.uid() != pod.uid()),
    )
    .await
    .expect("the evicted pod is deleted");
    let next = mcp.bash("evicted", "pwd; echo \"[${KEPT:-}]\"").await;
    assert_eq!(next["isError"], false, "{next}");
    assert!(stdout(&next).ends_with("[]\n"), "{next}");
    assert_ne!(stdout(&next), "/tmp\n[]\n", "{next}");
    assert_eq!(next["structuredContent"]["state_reset"], true, "{next}");
    assert!(text(&next).contains("session state was reset"), "{next}");
    let mine = wait_for_set(
        env.api::<Pod>(),
        &sel,
        "one pod for the session",
        TIMEOUT,
        |ps: &[Pod]| ps.len() == 1 && ps.iter().all(|p| !is_deleting(p)),
    )
    .await
    .expect("one session pod");
    assert_ne!(mine[0].uid(), pod.uid());
    wait_replicas(&env, "e", 1).await;
    drop(mcp);
    env.finish(Some("e")).await;
}

/// The command killed with the server replica; a marker so the test can see it run and end.
const LONG: &str = "sleep 31338; echo never";

/// Fault: the server replica serving a call is SIGKILLed mid-command (`replicas: 2`). The
/// in-flight call fails with a transport error; the command is interrupted in the sandbox;
/// the next call on the session through the Service runs in the same sandbox pod with the
/// session's state intact; nothing is orphaned.
#[tokio::test]
async fn killing_a_server_replica_mid_command_keeps_the_session() {
    let env = instance("f-srvkill", "r", 1, |cr| cr["spec"]["replicas"] = json!(2)).await;
    wait_replicas(&env, "r", 2).await;
    let mcp = env.client("r").await;
    let r = mcp.bash("kept", "cd /tmp && export KEPT=yes").await;
    assert_eq!(r["isError"], false, "{r}");
    let sel = format!("{}=kept", label::SESSION_ID);
    let sandbox = env.list::<Pod>(&sel).await.pop().expect("session pod");

    // Send the long command to one replica only: the Service's DNS name (for TLS) resolved
    // to that pod's IP.
    let servers: Vec<Pod> = env
        .list::<Pod>(&server_selector("r"))
        .await
        .into_iter()
        .filter(|p| !is_deleting(p) && is_ready(p))
        .collect();
    assert_eq!(servers.len(), 2, "two server replicas");
    let victim = &servers[0];
    let ip: std::net::IpAddr = pod_ip(victim).expect("pod IP").parse().expect("IP");
    let direct = mcp.via(std::net::SocketAddr::new(ip, 8443), true);
    let call = direct.post_bash("kept", LONG).send();
    let server_pid = container_pid(victim);
    let kill = kill_when_running(&["sleep", "31338"], server_pid, Duration::from_secs(60));
    let (resp, ()) = tokio::join!(call, kill);
    match resp {
        Err(e) => assert!(
            e.is_request() || e.is_connect() || e.is_body() || e.is_decode(),
            "a transport error: {e:?}"
        ),
        Ok(r) => {
            // The response head may have been sent already: then the body breaks.
            let body = r.text().await;
            assert!(body.is_err(), "the in-flight call cannot succeed: {body:?}");
        }
    }

    // The agent sees its caller gone and interrupts the command.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while process_running(&["sleep", "31338"]) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the killed call's command still runs in the sandbox"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Once the killed replica is back (or out of the Service), the session carries on.
    wait_restarted(
        env.api::<Pod>(),
        &victim.name_any(),
        1..,
        AfterRestart::Ready,
    )
    .await
    .expect("server back");
    for _ in 0..4 {
        // Through the Service: the calls land on both replicas.
        let next = mcp.bash("kept", "pwd; echo \"[${KEPT:-}]\"").await;
        assert_eq!(next["isError"], false, "{next}");
        assert_eq!(stdout(&next), "/tmp\n[yes]\n", "state intact: {next}");
        assert_ne!(next["structuredContent"]["state_reset"], true, "{next}");
    }
    let now: Vec<Pod> = env.list::<Pod>(&sel).await;
    assert_eq!(now.len(), 1, "one pod for the session");
    assert_eq!(now[0].uid(), sandbox.uid(), "the same sandbox pod");
    let all = env.list::<Pod>(&sandbox_selector("r")).await;
    assert_eq!(
        all.iter().filter(|p| session_of(p).is_some()).count(),
        1,
        "no other session pod"
    );
    drop(mcp);
    env.finish(Some("r")).await;
}

/// The instance's current HMAC key, from its Secret.
async fn hmac_key(env: &Env, instance: &str) -> Option<HmacKey> {
    let s = env
        .api::<Secret>()
        .get_opt(&format!("cli-mcp-{instance}-hmac"))
        .await
        .expect("get Secret")?;
    let raw = s.data?.remove("key")?;
    HmacKey::from_hex(&String::from_utf8_lossy(&raw.0)).ok()
}

/// Whether a sandbox pod is signed with `key` (session pods: the session token commitment;
/// pool pods: the assign token commitment).
fn signed_with(p: &Pod, key: &HmacKey) -> bool {
    match session_of(p) {
        Some(sid) => {
            let sid = SessionId::parse(sid).expect("session id");
            cli_mcp_api::sandbox::session_token_of(p, &sid, key).is_some()
        }
        None => made_for_key(p, key),
    }
}

/// Whether a tool result is clear about the session: it ran with the session's state, or it
/// says the state is fresh, or it is an error that says what failed.
fn clear_about_state(r: &Value, with_state: &str) -> bool {
    let t = text(r);
    let fresh = t.contains("session state was reset") || t.contains("new session");
    if r["isError"] == false {
        stdout(r).contains(with_state) || fresh
    } else {
        r["isError"] == true && t.contains("sandbox")
    }
}

/// Fault: the HMAC Secret is deleted with a live session. The operator makes a new key and
/// the server rolls; a call during the change is clear about the session's state; after
/// convergence the session's next call starts fresh and says so, new sessions work, and no
/// sandbox signed with the old key remains.
#[tokio::test]
async fn deleting_the_hmac_secret_is_survived_and_reported() {
    let env = instance("f-hmac", "h", 1, |_| {}).await;
    let mcp = env.client("h").await;
    let r = mcp.bash("keyed", "export KEPT=old-key").await;
    assert_eq!(r["isError"], false, "{r}");
    let old = hmac_key(&env, "h").await.expect("HMAC key");
    let old_servers: BTreeSet<String> = env
        .list::<Pod>(&server_selector("h"))
        .await
        .iter()
        .filter_map(|p| p.uid())
        .collect();
    env.api::<Secret>()
        .delete("cli-mcp-h-hmac", &DeleteParams::default())
        .await
        .expect("delete the HMAC Secret");

    // A call while the key changes: either the old state or a clear statement.
    match mcp.try_bash("keyed", "echo \"[${KEPT:-}]\"").await {
        Ok(v) => {
            assert!(clear_about_state(&v, "[old-key]"), "{v}");
            eprintln!("call during the key change: {}", text(&v));
        }
        // The forward may pick a server pod that is going away: a transport error is clear.
        Err(e) => eprintln!("call during the key change failed in transport: {e}"),
    }

    let new = wait_for(
        env.api::<Secret>(),
        "cli-mcp-h-hmac",
        "a new HMAC key",
        TIMEOUT,
        |s: Option<&Secret>| s.is_some(),
    )
    .await
    .expect("Secret recreated")
    .expect("Secret");
    let new = HmacKey::from_hex(&String::from_utf8_lossy(
        &new.data.expect("data").remove("key").expect("key").0,
    ))
    .expect("key");
    assert_ne!(new.to_hex(), old.to_hex(), "a new key");
    // Converged: the server rolled to the new key, and every sandbox is signed with it.
    let dep = wait_for(
        env.api::<Deployment>(),
        "cli-mcp-h",
        "server rolled",
        TIMEOUT,
        |d: Option<&Deployment>| {
            d.is_some_and(|d| {
                let s = d.status.clone().unwrap_or_default();
                s.observed_generation == d.metadata.generation
                    && s.updated_replicas == Some(1)
                    && s.ready_replicas == Some(1)
                    && s.replicas == Some(1)
            })
        },
    )
    .await;
    assert!(dep.is_ok(), "{dep:?}\n{}", env.logs("operator"));
    let old2 = old.clone();
    let converged = wait_for_set(
        env.api::<Pod>(),
        &sandbox_selector("h"),
        "no sandbox signed with the old key",
        TIMEOUT,
        move |ps: &[Pod]| {
            ps.iter()
                .filter(|p| !is_deleting(p))
                .all(|p| !signed_with(p, &old2))
        },
    )
    .await;
    assert!(converged.is_ok(), "{converged:?}\n{}", env.logs("operator"));
    wait_replicas(&env, "h", 1).await;
    // The replicas with the old key are gone (a keep-alive connection could still reach one
    // while it shuts down).
    wait_for_set(
        env.api::<Pod>(),
        &server_selector("h"),
        "old server replicas gone",
        TIMEOUT,
        |ps: &[Pod]| {
            ps.iter()
                .all(|p| !p.uid().is_some_and(|u| old_servers.contains(&u)))
                && ps.iter().any(is_ready)
        },
    )
    .await
    .expect("server rolled");
    drop(mcp);
    let mcp = env.client("h").await;

    let next = mcp.bash("keyed", "echo \"[${KEPT:-}]\"").await;
    assert_eq!(next["isError"], false, "{next}");
    assert_eq!(stdout(&next), "[]\n", "{next}");
    let t = text(&next);
    assert!(
        t.contains("session state was reset") || t.contains("new session"),
        "the fresh start is said: {t}"
    );
    let fresh = mcp.bash("keyed-new", "echo fresh").await;
    assert_eq!(stdout(&fresh), "fresh\n", "{fresh}");
    for p in env
        .list::<Pod>(&sandbox_selector("h"))
        .await
        .iter()
        .filter(|p| !is_deleting(p))
    {
        assert!(
            signed_with(p, &new),
            "{} not signed with the new key",
            p.name_any()
        );
    }
    drop(mcp);
    env.finish(Some("h")).await;
}

/// Fault: a command fills `/workspace` past its size limit (the sandbox's emptyDir
/// `sizeLimit`, 1Gi; a tmpfs of that size under the process kubelet). The command fails
/// clearly (ENOSPC in stderr, non-zero exit, `isError`), the session keeps its state, and
/// freeing the space works.
#[tokio::test]
async fn filling_the_workspace_fails_clearly_and_the_session_recovers() {
    let env = instance("f-full", "w", 1, |_| {}).await;
    let mcp = env.client("w").await;
    let r = mcp
        .bash("filler", "cd /workspace && export KEPT=full")
        .await;
    assert_eq!(r["isError"], false, "{r}");
    let size = mcp
        .bash("filler", "df -B1 --output=size /workspace | tail -1")
        .await;
    let bytes: u64 = stdout(&size).trim().parse().expect("df size");
    assert!(bytes <= 1 << 30, "/workspace is bounded: {bytes} bytes");

    let fill = mcp
        .bash("filler", "head -c 2147483648 /dev/zero > /workspace/fill")
        .await;
    let sc = &fill["structuredContent"];
    assert_eq!(fill["isError"], true, "{sc}");
    assert_ne!(sc["exit_code"], 0, "{sc}");
    assert!(
        sc["stderr"]
            .as_str()
            .is_some_and(|e| e.contains("No space left on device")),
        "ENOSPC in stderr: {sc}"
    );
    let after = mcp
        .bash(
            "filler",
            "pwd; echo \"[$KEPT]\"; stat -c %s /workspace/fill",
        )
        .await;
    assert_eq!(after["isError"], false, "{after}");
    let out = stdout(&after).to_owned();
    assert!(
        out.starts_with("/workspace\n[full]\n"),
        "state kept: {after}"
    );
    let filled: u64 = out
        .lines()
        .nth(2)
        .and_then(|l| l.parse().ok())
        .expect("size");
    assert!(
        filled >= bytes / 2,
        "the disk was filled: {filled} of {bytes}"
    );
    assert_ne!(after["structuredContent"]["state_reset"], true, "{after}");

    let freed = mcp
        .bash(
            "filler",
            "rm /workspace/fill && echo again > /workspace/after && cat /workspace/after",
        )
        .await;
    assert_eq!(freed["isError"], false, "{freed}");
    assert_eq!(stdout(&freed), "again\n", "{freed}");
    drop(mcp);
    env.finish(Some("w")).await;
}

/// The operator's pod (one replica).
async fn operator_pod(env: &Env) -> Pod {
    let pods = wait_for_set(
        env.api::<Pod>(),
        "app.kubernetes.io/name=cli-mcp-operator",
        "operator pod running",
        TIMEOUT,
        |ps: &[Pod]| ps.iter().filter(|p| !is_deleting(p) && is_ready(p)).count() == 1,
    )
    .await
    .expect("operator pod");
    pods.into_iter()
        .find(|p| !is_deleting(p) && is_ready(p))
        .expect("operator pod")
}

/// Fault: the operator is restarted (its pod deleted) while it fills a pool of 10 and again
/// while it tears an instance down. The new operator converges to exactly 10 pool pods
/// (none extra at any time), and finishes the teardown (nothing labelled with the instance
/// is left, the ClusterRoleBinding included).
#[tokio::test]
async fn restarting_the_operator_during_pool_fill_and_teardown() {
    let env = Env::install("f-oprestart").await;
    env.dummy_kubeconfig("o").await;
    let op = operator_pod(&env).await;
    let pool_sel = sandbox_selector("o");
    let peak = Arc::new(Mutex::new(0usize));
    let seen_at_kill = Arc::new(Mutex::new(0usize));
    let watch = {
        let api = env.api::<Pod>();
        let (peak, seen_at_kill) = (peak.clone(), seen_at_kill.clone());
        let ops = env.api::<Pod>();
        let op_name = op.name_any();
        let sel = pool_sel.clone();
        tokio::spawn(async move {
            let mut pods = BTreeSet::new();
            let mut killed = false;
            let stream = watcher(api, watcher::Config::default().labels(&sel));
            let mut stream = std::pin::pin!(stream);
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                        if !is_deleting(&p) {
                            pods.insert(p.name_any());
                        } else {
                            pods.remove(&p.name_any());
                        }
                    }
                    Ok(watcher::Event::Delete(p)) => {
                        pods.remove(&p.name_any());
                    }
                    _ => {}
                }
                {
                    let mut peak = peak.lock().expect("lock");
                    *peak = (*peak).max(pods.len());
                }
                if !killed && !pods.is_empty() {
                    killed = true;
                    *seen_at_kill.lock().expect("lock") = pods.len();
                    ops.delete(&op_name, &DeleteParams::default().grace_period(0))
                        .await
                        .expect("delete the operator pod");
                }
            }
        })
    };
    env.apply_cr(&env.cr("o", 10)).await;
    let ready = wait_for(
        env.api::<CliMcpInstance>(),
        "o",
        "pool of 10 ready",
        Duration::from_secs(180),
        |o: Option<&CliMcpInstance>| {
            o.and_then(|o| o.status.as_ref())
                .is_some_and(|s| s.warm_pool.ready == 10 && s.warm_pool.desired == 10)
        },
    )
    .await;
    assert!(ready.is_ok(), "{ready:?}\n{}", env.logs("operator"));
    let new_op = operator_pod(&env).await;
    assert_ne!(new_op.uid(), op.uid(), "the operator was restarted");
    let pool: Vec<Pod> = env
        .list::<Pod>(&pool_sel)
        .await
        .into_iter()
        .filter(|p| !is_deleting(p))
        .collect();
    assert_eq!(pool.len(), 10, "exactly 10 pool pods");
    watch.abort();
    let peak = *peak.lock().expect("lock");
    let at_kill = *seen_at_kill.lock().expect("lock");
    eprintln!("operator killed with {at_kill} pool pod(s) created; peak {peak}");
    assert!(peak <= 10, "never more than 10 pool pods, saw {peak}");
    // The server's and the proxy's TokenReview bindings.
    assert_eq!(env.cluster_bindings("o").await.len(), 2);

    // Teardown, with the operator killed once it has started.
    let op = new_op;
    let api = env.api::<CliMcpInstance>();
    api.delete("o", &DeleteParams::default())
        .await
        .expect("delete CR");
    let tearing = wait_for(
        api.clone(),
        "o",
        "teardown started",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| o.is_none_or(|o| o.metadata.deletion_timestamp.is_some()),
    )
    .await
    .expect("deletion");
    env.api::<Pod>()
        .delete(&op.name_any(), &DeleteParams::default().grace_period(0))
        .await
        .expect("delete the operator pod");
    // The operator is killed while the instance, held by its finalizer, still has children.
    assert!(
        tearing.is_some(),
        "the teardown had finished before the operator was killed"
    );
    let left = env
        .list::<Pod>(&format!("{}=o", label::INSTANCE))
        .await
        .len();
    eprintln!("operator killed during teardown with {left} pod(s) of the instance left");
    let gone = wait_for(
        api,
        "o",
        "instance deleted",
        Duration::from_secs(180),
        |o: Option<&CliMcpInstance>| o.is_none(),
    )
    .await;
    assert!(gone.is_ok(), "{gone:?}\n{}", env.logs("operator"));
    env.assert_nothing_left("o").await;
    env.finish(None).await;
}
