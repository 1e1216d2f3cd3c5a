//! Fault (docs/e2e.md): the kube-apiserver restarts while sessions are active.
//!
//! The test owns a private cluster (restarting the apiserver of the cluster that `make test`
//! shares would disturb every other test), installs the operator and an instance into it as a
//! user would, gives two sessions shell state, then stops the apiserver gracefully, holds it
//! down, and starts it again with the same flags, ports and certificates. It checks:
//!
//! - during the outage, a call on an existing session reaches the server's pod directly (as
//!   an in-cluster client through the Service's ClusterIP would: the test's loopback forward,
//!   like `kubectl port-forward`, itself needs the API) and still works while the server's
//!   cached TokenReview decision is fresh;
//! - a new session during the outage fails at once with a clear "Kubernetes API" error;
//! - once the cached decision has expired, calls fail with 503 "retry shortly", not a hang;
//! - after the restart, clients retrying like a user would (bounded) recover: old sessions
//!   keep their state on the same pods, new sessions work, the operator's watches reconnect
//!   (a warm pool change converges), and there is exactly one pod per session and no orphan.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::pod_state::{is_deleting, phase};
use cli_mcp_e2e::instance;
use cli_mcp_e2e::journey::{
    container_pid, sandbox_selector, server_selector, session_of, stdout, text, Env, Mcp,
};
use cli_mcp_e2e::testing::{pod_ip, private_cluster, wait_for, wait_for_set, TIMEOUT};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::{json, Value};

/// How long the server reuses a TokenReview + SubjectAccessReview decision
/// (`DECISION_TTL` in server/src/auth/tokenreview.rs).
const DECISION_TTL: Duration = Duration::from_secs(10);
/// Longest a user would keep retrying after the API is back.
const RECOVERY: Duration = Duration::from_secs(120);
const INSTANCE: &str = "r";

/// Like a user after an outage: retry until the call succeeds (tool result without
/// `isError`), at most `RECOVERY`, one second apart. Returns the result and the attempts.
async fn bash_retrying(mcp: &Mcp, sid: &str, command: &str) -> (Value, u32) {
    let deadline = Instant::now() + RECOVERY;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let last = match mcp.try_bash(sid, command).await {
            Ok(r) if r["isError"] != true => return (r, attempts),
            Ok(r) => format!("tool error: {r}"),
            Err(e) => e.to_string(),
        };
        assert!(
            Instant::now() < deadline,
            "{sid}: no success within {RECOVERY:?} ({attempts} attempts); last: {last}"
        );
        eprintln!("{sid}: attempt {attempts} failed, retrying: {last}");
        // A user's retry interval, not synchronisation: nothing signals "ready again".
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

const STATE: &str = "cd /tmp && export KEPT=\"$SID-state\" && kept() { echo \"fn-$1\"; }";
const PROBE: &str = "echo \"$(pwd) $KEPT $(kept x)\"";

fn expected(sid: &str) -> String {
    format!("/tmp {sid}-state fn-x\n")
}

/// session id -> uid of its pod, for the instance's sandbox pods that serve a session.
fn sessions(pods: &[Pod]) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for p in pods.iter().filter(|p| !is_deleting(p)) {
        if let Some(sid) = session_of(p) {
            out.entry(sid.to_owned())
                .or_default()
                .push(p.uid().unwrap_or_default());
        }
    }
    out
}

fn unassigned(pods: &[Pod]) -> usize {
    instance::unassigned(pods).len()
}

/// Waits until the apiserver refuses TCP connections (its listener closed); returns when.
async fn refused(api: SocketAddr) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match tokio::net::TcpStream::connect(api).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Instant::now(),
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "kube-apiserver at {api} still accepts connections 30 s after SIGTERM"
        );
        // Nothing notifies a closed listener: poll.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What a client sees while the API is down (see the module docs).
async fn during_outage(env: &Env, direct: &Mcp, server_ip: &str, authorised_at: Instant) {
    // 0. The replica stays in the Service: it can serve existing sessions without the API,
    // so an API blip must not take every replica out at once.
    let ready = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client")
        .get(format!("http://{server_ip}:8081/readyz"))
        .send()
        .await
        .expect("/readyz answers during the outage");
    assert_eq!(
        ready.status(),
        200,
        "the server stays ready without the API"
    );

    // 1. An existing session with a cached decision and a cached route needs no API.
    let margin = Duration::from_secs(3);
    if authorised_at.elapsed() + margin < DECISION_TTL {
        let r = direct.try_bash("keep-1", PROBE).await;
        let r = r.unwrap_or_else(|e| {
            panic!(
                "an existing session during the outage: {e}\nserver:\n{}",
                env.logs("server")
            )
        });
        assert_eq!(r["isError"], false, "{r}");
        assert_eq!(stdout(&r), expected("keep-1"), "{r}");
        eprintln!("existing session during the outage: works, state intact");

        // 2. A new session needs the API (claim or create a pod): a clear error at once.
        let t0 = Instant::now();
        let r = direct.try_bash("born-in-outage", "echo hi").await;
        let took = t0.elapsed();
        let msg = match r {
            Ok(v) => {
                assert_eq!(
                    v["isError"], true,
                    "a new session cannot start without the API: {v}"
                );
                text(&v)
            }
            Err(e) => e.to_string(),
        };
        assert!(
            msg.contains("Kubernetes API") && msg.contains("retry shortly"),
            "the error names the cause and says to retry: {msg}"
        );
        assert!(
            took < Duration::from_secs(15),
            "failed in {took:?}, not at once"
        );
        eprintln!("new session during the outage ({took:?}): {msg}");
    } else {
        // Only on a machine so loaded that the SIGTERM took seconds to land.
        eprintln!(
            "the API went away {:?} after the last authorised call: too late to check a call \
             on the cached decision; checking the expired-decision path only",
            authorised_at.elapsed()
        );
    }

    // 3. Held down past the decision's lifetime: the token cannot be checked, and the
    // caller is told to retry (503), at once rather than after a hang.
    let expired = authorised_at + DECISION_TTL + Duration::from_secs(1);
    // The point of this wait is the passing of time (the decision's TTL), not an event.
    tokio::time::sleep_until(expired.into()).await;
    let t0 = Instant::now();
    let r = direct.try_bash("keep-1", PROBE).await;
    let took = t0.elapsed();
    let e = r
        .expect_err("a call whose token cannot be checked must fail")
        .to_string();
    assert!(
        e.starts_with("HTTP 503") && e.contains("retry shortly"),
        "503 with a retry hint: {e}"
    );
    assert!(
        took < Duration::from_secs(15),
        "failed in {took:?}, not at once"
    );
    eprintln!("expired decision during the outage ({took:?}): {e}");
}

/// The instance's status and every pod of the namespace (node, phase, session), for
/// failure messages.
async fn state(env: &Env) -> String {
    let status = env
        .api::<CliMcpInstance>()
        .get_opt(INSTANCE)
        .await
        .map(|o| format!("{:?}", o.and_then(|o| o.status)))
        .unwrap_or_else(|e| e.to_string());
    let pods = env
        .api::<Pod>()
        .list(&Default::default())
        .await
        .map(|l| {
            l.items
                .iter()
                .map(|p| {
                    format!(
                        "  {} node={:?} phase={:?} session={:?} deleting={}",
                        p.name_any(),
                        p.spec.as_ref().and_then(|s| s.node_name.clone()),
                        phase(p),
                        session_of(p),
                        is_deleting(p)
                    )
                })
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_else(|e| e.to_string());
    // The operator's TCP connections (from its network namespace) and its metrics: whether
    // its watches are connected to the new apiserver, and whether it still reconciles.
    let mut operator = String::new();
    for p in env
        .list::<Pod>("app.kubernetes.io/name=cli-mcp-operator")
        .await
    {
        let pid = container_pid(&p);
        let ss = std::process::Command::new("nsenter")
            .args(["-t", &pid.to_string(), "-n", "ss", "-tnoi"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| e.to_string());
        let metrics = match pod_ip(&p) {
            Some(ip) => reqwest::get(format!("http://{ip}:8081/metrics"))
                .await
                .map(|r| r.text())
                .map_err(|e| e.to_string()),
            None => Err("no pod IP".into()),
        };
        let metrics = match metrics {
            Ok(t) => t.await.unwrap_or_default(),
            Err(e) => e,
        };
        let metrics: Vec<&str> = metrics.lines().filter(|l| !l.starts_with('#')).collect();
        operator.push_str(&format!(
            "operator pod {} (pid {pid}):\n{ss}\n{}\n",
            p.name_any(),
            metrics.join("\n")
        ));
    }
    format!("instance status: {status}\npods:\n{pods}\n{operator}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_survive_an_apiserver_restart() {
    let mut pc = private_cluster("apiserver-restart")
        .await
        .expect("private cluster");
    let env = Env::install_on(pc.test.clone(), "apiserver").await;
    env.dummy_kubeconfig(INSTANCE).await;
    let mut cr = env.cr(INSTANCE, 2);
    env.apply_cr(&cr).await;
    env.wait_ready(INSTANCE).await;
    let mcp = env.client(INSTANCE).await;

    let kept = ["keep-1", "keep-2"];
    for sid in kept {
        let r = mcp
            .bash(sid, &format!("SID={sid}; {STATE}; unset SID"))
            .await;
        assert_eq!(r["isError"], false, "{r}");
        assert_eq!(stdout(&mcp.bash(sid, PROBE).await), expected(sid));
    }
    let before = sessions(&env.list::<Pod>(&sandbox_selector(INSTANCE)).await);
    assert_eq!(before.len(), 2, "{before:?}");
    assert!(before.values().all(|uids| uids.len() == 1), "{before:?}");

    let servers = env.list::<Pod>(&server_selector(INSTANCE)).await;
    assert_eq!(servers.len(), 1, "one server replica");
    let server_ip = pod_ip(&servers[0]).expect("server pod IP");
    let direct = mcp.via(
        SocketAddr::new(server_ip.parse().expect("server pod IP"), 8443),
        true,
    );

    // Right before the outage, so that the server's decision for this token is fresh.
    let r = direct.try_bash("keep-1", PROBE).await.expect("direct call");
    assert_eq!(stdout(&r), expected("keep-1"), "{r}");
    let authorised_at = Instant::now();

    // The apiserver stops listening at SIGTERM but lingers (open watches) until it exits or
    // is killed: the outage starts when connections are refused, so probe during the stop.
    let api = SocketAddr::new(
        pc.test.info.apiserver_host.into(),
        pc.test.info.apiserver_port,
    );
    let outage = async {
        let down_at = refused(api).await;
        during_outage(&env, &direct, &server_ip, authorised_at).await;
        down_at
    };
    let (stopped, down_at) = tokio::join!(pc.cluster.stop_apiserver(), outage);
    let stopped_in = stopped.expect("stop kube-apiserver");
    eprintln!("kube-apiserver exited {stopped_in:?} after SIGTERM");

    let up_in = pc
        .cluster
        .start_apiserver()
        .await
        .expect("start kube-apiserver");
    eprintln!(
        "kube-apiserver refused connections for {:?} (ready {up_in:?} after its start)",
        down_at.elapsed()
    );
    assert!(pc.cluster.first_exit().is_none(), "a component died");

    // After: through the Service, retrying like a user, old sessions kept their state.
    let recovered = Instant::now();
    for sid in kept {
        let (r, attempts) = bash_retrying(&mcp, sid, PROBE).await;
        assert_eq!(stdout(&r), expected(sid), "{sid} kept its state: {r}");
        assert!(
            r["structuredContent"]["new_sandbox"].is_null()
                && r["structuredContent"]["state_reset"] != true,
            "{sid} was not swapped: {r}"
        );
        eprintln!("{sid}: recovered after {attempts} attempt(s)");
    }
    let (r, attempts) = bash_retrying(&mcp, "after-restart", "echo fresh").await;
    assert_eq!(stdout(&r), "fresh\n", "{r}");
    eprintln!(
        "new session after the restart: {attempts} attempt(s); all recovered in {:?}",
        recovered.elapsed()
    );

    // The operator's watches reconnected: a warm pool change converges.
    cr["spec"]["sandbox"]["warmPoolSize"] = json!(4);
    env.apply_cr(&cr).await;
    let converged = wait_for(
        env.api::<CliMcpInstance>(),
        INSTANCE,
        "warm pool of 4 after the restart",
        TIMEOUT,
        |o: Option<&CliMcpInstance>| {
            o.is_some_and(|o| {
                o.status.as_ref().is_some_and(|s| {
                    s.observed_generation == o.metadata.generation
                        && s.warm_pool.desired == 4
                        && s.warm_pool.ready == 4
                })
            })
        },
    )
    .await;
    if let Err(e) = converged {
        panic!(
            "operator did not resume: {e}\n{}\noperator:\n{}",
            state(&env).await,
            env.logs("operator")
        );
    }

    // Exactly one pod per session, the kept sessions on their old pods, the pool full, and
    // nothing else (no pod left behind by the failed start during the outage).
    let want: Vec<&str> = vec!["after-restart", "keep-1", "keep-2"];
    let settled = wait_for_set(
        env.api::<Pod>(),
        &sandbox_selector(INSTANCE),
        "one pod per session and a pool of 4",
        TIMEOUT,
        |pods: &[Pod]| {
            let s = sessions(pods);
            s.keys().map(String::as_str).eq(want.iter().copied())
                && s.values().all(|uids| uids.len() == 1)
                && unassigned(pods) == 4
                && !pods.iter().any(is_deleting)
        },
    )
    .await;
    let pods = match settled {
        Ok(p) => p,
        Err(e) => {
            let now = env.list::<Pod>(&sandbox_selector(INSTANCE)).await;
            panic!(
                "{e}: sessions {:?}, unassigned {}\n{}\noperator:\n{}",
                sessions(&now),
                unassigned(&now),
                state(&env).await,
                env.logs("operator")
            );
        }
    };
    let after = sessions(&pods);
    for sid in kept {
        assert_eq!(after[sid], before[sid], "{sid} is on the pod it had");
    }
    let owner_uid = env
        .api::<CliMcpInstance>()
        .get(INSTANCE)
        .await
        .expect("instance")
        .uid()
        .expect("uid");
    for p in &pods {
        let owned = p
            .owner_references()
            .iter()
            .any(|o| o.uid == owner_uid && o.controller == Some(true));
        assert!(owned, "{} is owned by the instance", p.name_any());
    }
    let servers_now = env.list::<Pod>(&server_selector(INSTANCE)).await;
    assert_eq!(servers_now.len(), 1, "still one server replica");

    drop(mcp);
    env.finish(Some(INSTANCE)).await;
    assert!(pc.cluster.first_exit().is_none(), "a component died");
}
