//! Who may use the credential proxy, tried on real containers as a real attacker would: a
//! private real-node cluster (kubelet + kube-proxy on containerd/runc, CoreDNS, kube-router
//! enforcing NetworkPolicy) with the project's images, the operator from `config/default`,
//! and one instance `p` whose proxy holds the read-only investigation identity's kubeconfig
//! and serves a second MCP client identity (`spec.server.clients`). Every attack is made
//! from inside a pod, with curl or kubectl, and every proof is what the proxy itself wrote:
//! its answers, its audit lines and its refusal log lines (docs/proxy.md, "Who is calling").
//!
//! - **Label spoofing.** A tenant allowed to create pods in the namespace plants a pod with a
//!   sandbox's labels: the tenant admission policy refuses it (while the same pod without
//!   the labels passes). The cluster admin, whom that policy leaves alone, creates it
//!   anyway, as if the policy were missing: the proxy's NetworkPolicy lets the pod in, and
//!   its curl, straight at the proxy, gets `407` without a token and `403 not_a_sandbox`
//!   with a token of its own ServiceAccount for the proxy's audience; a second plant, run as
//!   the sandbox ServiceAccount itself, gets `403` (not sealed). No request of theirs is
//!   ever forwarded (no audit line names the canary path they asked for, which a real
//!   session's request for the same kind of path does get).
//! - **Copied token.** A session's own token (`cat /var/run/secrets/cli-mcp/proxy/token`),
//!   used from the planted pod: `403 wrong_source`.
//! - **Session end.** A session runs `kubectl get pods -w` in the background; `DELETE
//!   /sessions/{id}`: the proxy cuts the watch's tunnel itself (its `tunnel cut` line: the
//!   sandbox's processes dying with the pod would end the stream too, later and without
//!   it) and the watch's audit line (`watch: true`, that session) is stamped within 2 s of
//!   the DELETE returning.
//! - **Two callers.** Sessions of the instance's client ServiceAccount and of the second
//!   client each run `kubectl get ns`: the proxy's audit lines name each caller with its own
//!   session.
//! - **Fairness.** A session opens 2,500 connections straight to the proxy Service (more than
//!   both replicas' `--max-connections` together) and holds them until the proxy drops them
//!   as idle; meanwhile the proxies hold no more than the flooder's share (128 each),
//!   another session's `kubectl get ns` works, and the flooder's connections beyond its
//!   share get `429`. Without the per-client cap (tried once with it raised to 1024) the
//!   flood holds all 2,048 slots and the other session's kubectl gets `Service Unavailable`.
//! - **impersonateCaller.** The kubernetes target switched to `identity: impersonateCaller`,
//!   the kubeconfig's user granted `impersonate` (docs/contract.md), the first client allowed
//!   to list the namespace's Secrets and the second not: `kubectl get secrets` works in the
//!   first one's session and is Forbidden, naming the second client, in the other's, and
//!   `kubectl auth whoami` in the first one's sandbox names it and the session.
//!
//! Skipped, saying so, when not root or when the host cannot run the real node.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cli_mcp_api::names::label;
use cli_mcp_api::pod_state::is_ready;
use cli_mcp_e2e::http::{self, metric_sum};
use cli_mcp_e2e::journey::{stdout, text, Env, Mcp};
use cli_mcp_e2e::real_node_rig::RealNodeRig;
use cli_mcp_e2e::testing::{pod_ip, ready_pods, wait_for_set, TIMEOUT};
use k8s_openapi::api::core::v1::{Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, LogParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{json, Value};

const INSTANCE: &str = "p";
/// The second MCP client identity (`spec.server.clients`).
const SECOND_CLIENT: &str = "second-client";
/// The tenant: may create, get, list and delete pods in the namespace, nothing else.
const TENANT: &str = "tenant";
const PROXY_PORT: u16 = cli_mcp_api::proxy::PROXY_PORT;
const PROXY_HEALTH_PORT: u16 = cli_mcp_api::proxy::PROXY_HEALTH_PORT;
/// The proxy's defaults: `--max-connections` and `--max-connections-per-client`.
const MAX_CONNECTIONS: usize = 1024;
const MAX_PER_CLIENT: usize = 128;
/// Proxy replicas (the default of `spec.proxy.replicas`).
const REPLICAS: usize = 2;
/// The flood: more than every replica's `--max-connections` together, so that without the
/// per-client cap the flooder would hold every slot of both replicas.
const FLOOD: usize = REPLICAS * MAX_CONNECTIONS + 452;
/// The most client connections the proxies may hold during the flood: the flooder's share
/// of each replica, and a few of the other sessions (their relays' connections).
const SHARE_AND_OTHERS: f64 = (REPLICAS * MAX_PER_CLIENT + 16) as f64;
/// How soon after `DELETE /sessions/{id}` returns an open watch must be cut and audited.
const CUT_WITHIN: Duration = Duration::from_secs(2);
/// The path the planted pods ask for: no audit line may ever name it.
const CANARY: &str = "plant-canary";

fn sel(component: &str) -> String {
    format!(
        "{}={INSTANCE},{}={component}",
        label::INSTANCE,
        label::COMPONENT
    )
}

/// A command that must succeed; its stdout.
async fn ok(mcp: &Mcp, sid: &str, command: &str) -> String {
    let r = mcp.bash(sid, command).await;
    assert_eq!(r["isError"], false, "{sid}: {command}: {}", text(&r));
    stdout(&r).to_owned()
}

/// The pod of session `sid`, running.
async fn session_pod(env: &Env, sid: &str) -> Pod {
    ready_pods(
        env.api::<Pod>(),
        &format!("{},{}={sid}", sel("sandbox"), label::SESSION_ID),
        1,
    )
    .await
    .remove(0)
}

const ROUTES_VERSION: &str = "cli-mcp.redhat.com/proxy-routes-version";

fn routes_version(p: &Pod) -> Option<String> {
    p.annotations().get(ROUTES_VERSION).cloned()
}

/// Every line the proxy pods (those that exist now) wrote, with the pod's name. A pod
/// whose log cannot be read (just created, or gone meanwhile) is left out.
async fn proxy_log(env: &Env) -> Vec<(String, String)> {
    let pods = env.api::<Pod>();
    let mut lines = Vec::new();
    for p in env.list::<Pod>(&sel("proxy")).await {
        let name = p.name_any();
        let params = LogParams {
            container: Some("proxy".into()),
            ..Default::default()
        };
        match pods.logs(&name, &params).await {
            Ok(log) => lines.extend(log.lines().map(|l| (name.clone(), l.to_owned()))),
            Err(e) => eprintln!("  (the log of proxy pod {name} is not readable now: {e})"),
        }
    }
    lines
}

/// The audit lines among the proxy's log lines (one JSON object per request in a tunnel).
fn audit_lines(log: &[(String, String)]) -> Vec<Value> {
    log.iter()
        .filter_map(|(_, l)| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["outcome"].is_string() && v["method"].is_string() && v["path"].is_string())
        .collect()
}

/// The proxy's log lines that contain every one of `parts`.
fn lines_with<'a>(log: &'a [(String, String)], parts: &[&str]) -> Vec<&'a str> {
    log.iter()
        .map(|(_, l)| l.as_str())
        .filter(|l| parts.iter().all(|p| l.contains(p)))
        .collect()
}

/// Polls the proxy's log until `found` picks something out of it, at most `within`.
async fn wait_in_proxy_log<T>(
    env: &Env,
    what: &str,
    within: Duration,
    found: impl Fn(&[(String, String)]) -> Option<T>,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        let log = proxy_log(env).await;
        if let Some(t) = found(&log) {
            return t;
        }
        if Instant::now() >= deadline {
            let tail: Vec<&str> = log.iter().rev().take(40).map(|(_, l)| l.as_str()).collect();
            panic!(
                "the proxy's log never showed {what} within {within:?}; its last lines (newest \
                 first):\n{}",
                tail.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `/metrics` of every ready proxy pod (their health port, which the node reaches).
async fn proxy_metrics(env: &Env) -> Vec<String> {
    let client = http::client(None)
        .timeout(Duration::from_secs(5))
        .build()
        .expect("HTTP client");
    let mut bodies = Vec::new();
    for p in env.list::<Pod>(&sel("proxy")).await {
        if !is_ready(&p) || p.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let ip = pod_ip(&p).unwrap_or_else(|| panic!("proxy pod {} has no IP", p.name_any()));
        let url = format!("http://{ip}:{PROXY_HEALTH_PORT}/metrics");
        match http::get(&client, &url).await {
            Some((200, body)) => bodies.push(body),
            other => panic!("GET {url} of proxy pod {}: {other:?}", p.name_any()),
        }
    }
    bodies
}

fn metric(bodies: &[String], series: &str) -> f64 {
    bodies.iter().filter_map(|b| metric_sum(b, series)).sum()
}

/// A ServiceAccount of the test's namespace.
async fn service_account(env: &Env, name: &str) {
    let sa: ServiceAccount = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name},
    }))
    .expect("ServiceAccount");
    env.api::<ServiceAccount>()
        .create(&PostParams::default(), &sa)
        .await
        .unwrap_or_else(|e| panic!("creating ServiceAccount {name}: {e}"));
}

/// A Role of `rules` in the test's namespace, bound to ServiceAccount `sa` of it.
async fn role_for(env: &Env, name: &str, sa: &str, rules: Value) {
    let role: Role = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": name}, "rules": rules,
    }))
    .expect("Role");
    env.api::<Role>()
        .create(&PostParams::default(), &role)
        .await
        .unwrap_or_else(|e| panic!("creating Role {name}: {e}"));
    let binding: RoleBinding = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": env.ns.name}],
    }))
    .expect("RoleBinding");
    env.api::<RoleBinding>()
        .create(&PostParams::default(), &binding)
        .await
        .unwrap_or_else(|e| panic!("creating RoleBinding {name}: {e}"));
}

/// A client of the API server acting with `token` (the admin kubeconfig's server and CA).
async fn client_with_token(env: &Env, token: String) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(&env.c.info.kubeconfig).expect("admin kubeconfig");
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .expect("client config");
    cfg.auth_info = kube::config::AuthInfo {
        token: Some(token.into()),
        ..Default::default()
    };
    kube::Client::try_from(cfg).expect("client")
}

/// What a planted pod runs: for each of `$TRIES`, one curl straight at the proxy
/// (`$PROXY`, never through a relay) for `$URL`, with no `Proxy-Authorization` (`none`),
/// with a token of its own ServiceAccount for the proxy's audience (`own`), or with the
/// token copied out of a real session (`copied`, `$COPIED`). Until the NetworkPolicy
/// enforcer knows the new pod, its connections go nowhere (`connect=000`): retried with a
/// deadline. Then `DONE`, and the pod idles.
const PLANT_SCRIPT: &str = r#"
for t in $TRIES; do
  case "$t" in
    none) auth=() ;;
    own) auth=(--proxy-header "Proxy-Authorization: Bearer $(cat /var/run/secrets/plant/token)") ;;
    copied) auth=(--proxy-header "Proxy-Authorization: Bearer $COPIED") ;;
  esac
  end=$((SECONDS + 90))
  while :; do
    out=$(curl -sS -k -m 10 -o /dev/null -w ' connect=%{http_connect} code=%{http_code}' \
      -p -x "$PROXY" "${auth[@]}" "$URL" 2>&1)
    rc=$?
    case "$out" in
      *connect=000*) if [ "$SECONDS" -lt "$end" ]; then sleep 0.5; continue; fi ;;
    esac
    break
  done
  echo "RESULT $t rc=$rc $(echo $out)"
done
echo DONE
exec sleep infinity
"#;

/// A pod posing as one of the instance's sandboxes: `labels` copied from a real one, the
/// sandbox image, run as `sa` with a projected token of `sa` for the proxy's audience.
fn planted_pod(
    name: &str,
    sa: &str,
    labels: &BTreeMap<String, String>,
    image: &str,
    audience: &str,
    env: &[(&str, &str)],
) -> Pod {
    let env: Vec<Value> = env
        .iter()
        .map(|(k, v)| json!({"name": k, "value": v}))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "serviceAccountName": sa,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "securityContext": {
                "runAsNonRoot": true, "runAsUser": 1001, "runAsGroup": 0,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [{
                // IfNotPresent: the node pulls the project's images from its registry.
                "name": "c", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["bash", "-c", PLANT_SCRIPT],
                "env": env,
                "volumeMounts": [{"name": "proxy-token", "mountPath": "/var/run/secrets/plant",
                                  "readOnly": true}],
                "securityContext": {
                    "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
                },
            }],
            "volumes": [{"name": "proxy-token", "projected": {"sources": [{
                "serviceAccountToken": {"audience": audience, "expirationSeconds": 600,
                                        "path": "token"},
            }]}}],
        }
    }))
    .expect("planted pod manifest")
}

/// The `RESULT <try> ...` lines of a planted pod once it printed `DONE`, by try.
async fn plant_results(env: &Env, name: &str) -> BTreeMap<String, String> {
    let pods = env.api::<Pod>();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let log = pods.logs(name, &LogParams::default()).await;
        if let Ok(log) = &log {
            if log.lines().any(|l| l == "DONE") {
                return log
                    .lines()
                    .filter_map(|l| l.strip_prefix("RESULT "))
                    .filter_map(|l| l.split_once(' '))
                    .map(|(t, rest)| (t.to_owned(), rest.to_owned()))
                    .collect();
            }
        }
        assert!(
            Instant::now() < deadline,
            "planted pod {name} did not finish its tries within {TIMEOUT:?}: {log:?}\n{:?}",
            pods.get(name).await.map(|p| p.status)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn assert_connect(results: &BTreeMap<String, String>, pod: &str, try_: &str, status: u16) {
    let got = results
        .get(try_)
        .unwrap_or_else(|| panic!("planted pod {pod} did not report try {try_}: {results:?}"));
    assert!(
        got.contains(&format!("connect={status}")),
        "planted pod {pod}, {try_}: the proxy must answer the CONNECT {status} (and let \
         nothing through): {got}"
    );
}

/// Attacks 1 and 2: pods posing as sandboxes, and a session's token used from another pod.
async fn label_spoofing_and_copied_token(env: &Env, mcp: &Mcp, image: &str) {
    let ns = &env.ns.name;
    let audience = cli_mcp_api::proxy::sandbox_token_audience(ns, INSTANCE);
    // A real session: its token, and where its kubeconfig sends kubectl (the route).
    let token = ok(mcp, "s1", "cat /var/run/secrets/cli-mcp/proxy/token").await;
    let token = token.trim().to_owned();
    assert_eq!(
        token.split('.').count(),
        3,
        "the session's proxy token is a JWT: {token}"
    );
    let api = ok(
        mcp,
        "s1",
        "kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}'",
    )
    .await;
    let api = api.trim().to_owned();
    assert!(
        api.starts_with("https://"),
        "the sandbox's API server: {api}"
    );
    let s1_pod = session_pod(env, "s1").await;
    let s1_name = s1_pod.name_any();

    // Positive control: the session's own request for a path like the plants' is forwarded
    // and audited with its session.
    let control = format!("/api/v1/namespaces/{ns}/configmaps/{CANARY}-control");
    let code = ok(
        mcp,
        "s1",
        &format!("curl -sS -k -m 20 -o /dev/null -w '%{{http_code}}' {api}{control}"),
    )
    .await;
    assert_eq!(
        code.trim(),
        "404",
        "the session's request reaches the API server through its relay and the proxy"
    );
    wait_in_proxy_log(
        env,
        "the audit line of the session's control request",
        TIMEOUT,
        |log| {
            audit_lines(log)
                .into_iter()
                .find(|v| v["path"] == control.as_str() && v["session"] == "s1")
        },
    )
    .await;

    // --- The tenant: may create pods, not ones labelled as a sandbox ---------------------
    service_account(env, TENANT).await;
    role_for(
        env,
        TENANT,
        TENANT,
        json!([{"apiGroups": [""], "resources": ["pods"],
                "verbs": ["create", "get", "list", "watch", "delete"]}]),
    )
    .await;
    let tenant = client_with_token(env, env.service_account_token(TENANT).await).await;
    let tenant_pods: Api<Pod> = Api::namespaced(tenant, ns);
    let mut labels: BTreeMap<String, String> = s1_pod.labels().clone();
    let url = format!("{api}/api/v1/namespaces/{ns}/configmaps/{CANARY}");
    let proxy = format!("http://cli-mcp-{INSTANCE}-proxy:{PROXY_PORT}");
    labels.insert(label::SESSION_ID.into(), "plant-own".into());
    let own = planted_pod(
        "plant-own",
        TENANT,
        &labels,
        image,
        &audience,
        &[
            ("TRIES", "none own copied"),
            ("URL", &url),
            ("PROXY", &proxy),
            ("COPIED", &token),
        ],
    );
    labels.insert(label::SESSION_ID.into(), "plant-sa".into());
    let as_sandbox = planted_pod(
        "plant-sa",
        &format!("cli-mcp-{INSTANCE}-sandbox"),
        &labels,
        image,
        &audience,
        &[("TRIES", "own"), ("URL", &url), ("PROXY", &proxy)],
    );
    // Positive control: the tenant may create this very pod without the product's labels.
    let mut unlabelled = own.clone();
    unlabelled.metadata.labels = None;
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    tenant_pods
        .create(&dry, &unlabelled)
        .await
        .unwrap_or_else(|e| panic!("the tenant may create a plain pod (dry run): {e}"));
    for pod in [&own, &as_sandbox] {
        let name = pod.name_any();
        match tenant_pods.create(&PostParams::default(), pod).await {
            Err(kube::Error::Api(s)) => {
                assert!(
                    s.code == 403 && s.message.contains("cli-mcp.redhat.com/"),
                    "the tenant's {name} is refused by the tenant admission policy for its \
                     labels: {s:?}"
                );
                eprintln!("tenant's {name} refused: {}", s.message);
            }
            other => panic!("the tenant planted {name} with a sandbox's labels: {other:?}"),
        }
    }

    // --- Where the policy is missing: the admin plants them ------------------------------
    let pods = env.api::<Pod>();
    for pod in [&own, &as_sandbox] {
        pods.create(&PostParams::default(), pod)
            .await
            .unwrap_or_else(|e| panic!("the admin creates {}: {e}", pod.name_any()));
    }
    let own_results = plant_results(env, "plant-own").await;
    let sa_results = plant_results(env, "plant-sa").await;
    eprintln!("plant-own: {own_results:?}\nplant-sa: {sa_results:?}");
    assert_connect(&own_results, "plant-own", "none", 407);
    assert_connect(&own_results, "plant-own", "own", 403);
    assert_connect(&own_results, "plant-own", "copied", 403);
    assert_connect(&sa_results, "plant-sa", "own", 403);

    // The proxy's own account of each refusal, and of nothing forwarded.
    let tenant_user = format!("system:serviceaccount:{ns}:{TENANT}");
    let refusals = wait_in_proxy_log(env, "the four refusals of the plants", TIMEOUT, |log| {
        let no_token = lines_with(
            log,
            &[
                "CONNECT refused",
                "proxy_auth_invalid",
                "no Proxy-Authorization header",
            ],
        );
        let own_sa = lines_with(log, &["CONNECT refused", "not_a_sandbox", &tenant_user]);
        let copied = lines_with(
            log,
            &[
                "CONNECT refused",
                "wrong_source",
                &format!("sandbox pod {s1_name}"),
            ],
        );
        let unsealed = lines_with(
            log,
            &["CONNECT refused", "not_sealed", "plant-sa", "not sealed"],
        );
        (!no_token.is_empty() && !own_sa.is_empty() && !copied.is_empty() && !unsealed.is_empty())
            .then(|| {
                [no_token[0], own_sa[0], copied[0], unsealed[0]]
                    .map(str::to_owned)
                    .join("\n")
            })
    })
    .await;
    eprintln!("the proxy's refusals:\n{refusals}");
    let log = proxy_log(env).await;
    let leaked: Vec<Value> = audit_lines(&log)
        .into_iter()
        .filter(|v| {
            let path = v["path"].as_str().unwrap_or_default();
            path.ends_with(&format!("/{CANARY}"))
                || v["pod"].as_str().is_some_and(|p| p.starts_with("plant-"))
        })
        .collect();
    assert!(
        leaked.is_empty(),
        "a planted pod's request went through the proxy: {leaked:?}"
    );
    for name in ["plant-own", "plant-sa"] {
        pods.delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap_or_else(|e| panic!("deleting {name}: {e}"));
    }
    eprintln!(
        "label spoofing: refused by admission; planted anyway: 407 without a token, 403 with \
         its own, 403 as the unsealed sandbox ServiceAccount; a copied token: 403 wrong_source; \
         nothing forwarded"
    );
}

/// Attack 3: a session's open watch outlives its session.
async fn session_end_cuts_the_watch(env: &Env, mcp: &Mcp) {
    let sid = "watcher";
    let ns = &env.ns.name;
    ok(
        mcp,
        sid,
        &format!(
            "nohup kubectl -n {ns} get pods -w -v=6 </dev/null >/tmp/watch.out 2>/tmp/watch.err & \
             echo started"
        ),
    )
    .await;
    // The watch is open once kubectl logged its answer's head (-v=6).
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let seen = ok(
            mcp,
            sid,
            "grep 'watch=true' /tmp/watch.err | grep -c '200 OK' || true",
        )
        .await;
        if seen.trim() != "0" {
            break;
        }
        let err = ok(mcp, sid, "tail -5 /tmp/watch.err; tail -3 /tmp/watch.out").await;
        assert!(
            Instant::now() < deadline,
            "kubectl get pods -w never opened its watch: {err}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let pod = session_pod(env, sid).await.name_any();
    let cuts_before = lines_with(&proxy_log(env).await, &["tunnel refused", "tunnel cut"]).len();
    let sent = Timestamp::now();
    let status = mcp
        .try_delete(sid)
        .await
        .unwrap_or_else(|e| panic!("DELETE /sessions/{sid}: {e}"));
    let returned = Timestamp::now();
    let returned_at = Instant::now();
    assert_eq!(status, 204, "DELETE /sessions/{sid}");
    let watch_line = wait_in_proxy_log(
        env,
        &format!("the audit line of session {sid}'s watch"),
        CUT_WITHIN + Duration::from_secs(8),
        |log| {
            audit_lines(log).into_iter().find(|v| {
                v["session"] == sid
                    && v["watch"] == true
                    && v["path"].as_str().is_some_and(|p| p.ends_with("/pods"))
            })
        },
    )
    .await;
    let seen_after = returned_at.elapsed();
    let stamped: Timestamp = watch_line["time"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("an audit line without a time: {watch_line}"));
    let after_ms = stamped.as_millisecond() - returned.as_millisecond();
    eprintln!(
        "the watch's audit line, stamped {after_ms} ms after the DELETE returned (seen after \
         {seen_after:.1?}): {watch_line}"
    );
    assert!(
        stamped.as_millisecond() >= sent.as_millisecond(),
        "the watch ended before its session did: {watch_line}"
    );
    assert!(
        after_ms <= CUT_WITHIN.as_millis() as i64,
        "the watch of session {sid} was audited {after_ms} ms after DELETE returned, more than \
         {CUT_WITHIN:?}: {watch_line}"
    );
    assert_eq!(
        watch_line["pod"], pod,
        "the line names the session's pod: {watch_line}"
    );
    assert_eq!(
        watch_line["complete"], false,
        "the line says the watch did not end on its own: {watch_line}"
    );
    // The proxy cut the tunnel itself, not merely saw the dying sandbox close it.
    let log = proxy_log(env).await;
    let cuts = lines_with(&log, &["tunnel refused", "tunnel cut"]);
    assert!(
        cuts.len() > cuts_before,
        "the proxy never cut the watch's tunnel (its `tunnel cut` lines: {cuts:?})"
    );
    eprintln!("session end: the proxy cut the open watch and audited it {after_ms} ms after");
}

/// Attack 4 (an accountability check): two callers, each named with its own session.
async fn two_callers_are_audited_apart(env: &Env, mcp_a: &Mcp, mcp_b: &Mcp) {
    let ns = &env.ns.name;
    let (a, b) = tokio::join!(
        ok(mcp_a, "caller-a", "kubectl get ns -o name"),
        ok(mcp_b, "caller-b", "kubectl get ns -o name"),
    );
    for out in [&a, &b] {
        assert!(
            out.lines().any(|l| l == "namespace/kube-system"),
            "kubectl get ns through the proxy: {out}"
        );
    }
    let user_a = format!("system:serviceaccount:{ns}:cli-mcp-{INSTANCE}-client");
    let user_b = format!("system:serviceaccount:{ns}:{SECOND_CLIENT}");
    let (line_a, line_b) = wait_in_proxy_log(env, "both callers' audit lines", TIMEOUT, |log| {
        let lines = audit_lines(log);
        let of = |sid: &str| {
            lines
                .iter()
                .find(|v| v["session"] == sid && v["path"] == "/api/v1/namespaces")
                .cloned()
        };
        Some((of("caller-a")?, of("caller-b")?))
    })
    .await;
    for (line, user, sid) in [
        (&line_a, &user_a, "caller-a"),
        (&line_b, &user_b, "caller-b"),
    ] {
        assert_eq!(
            line["caller"]["user"],
            user.as_str(),
            "session {sid}'s request names its caller: {line}"
        );
        let groups: Vec<&str> = line["caller"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            groups.contains(&format!("system:serviceaccounts:{ns}").as_str()),
            "session {sid}'s caller with the groups the server's TokenReview saw: {line}"
        );
    }
    let mixed: Vec<Value> = audit_lines(&proxy_log(env).await)
        .into_iter()
        .filter(|v| {
            (v["session"] == "caller-a" && v["caller"]["user"] != user_a.as_str())
                || (v["session"] == "caller-b" && v["caller"]["user"] != user_b.as_str())
        })
        .collect();
    assert!(
        mixed.is_empty(),
        "an audit line names the other session's caller: {mixed:?}"
    );
    eprintln!("two callers: {line_a}\n{line_b}");
}

/// Attack 5: one sandbox floods the proxy while another works.
async fn a_flood_leaves_the_others_their_share(env: &Env, mcp: &Mcp, victim: &Mcp) {
    let proxy_ip = env
        .api::<Service>()
        .get(&format!("cli-mcp-{INSTANCE}-proxy"))
        .await
        .expect("the proxy Service")
        .spec
        .and_then(|s| s.cluster_ip)
        .expect("the proxy Service's IP");
    let limits = ok(mcp, "flood", "ulimit -Hn").await;
    let hard: u64 = match limits.trim() {
        "unlimited" => u64::MAX,
        n => n
            .parse()
            .unwrap_or_else(|_| panic!("ulimit -Hn in the sandbox: {n}")),
    };
    assert!(
        hard >= FLOOD as u64 + 64,
        "the sandbox may open only {hard} files, too few to flood with {FLOOD} connections"
    );
    let before = proxy_metrics(env).await;
    let refused_before = metric(
        &before,
        "cli_mcp_proxy_refusals_total{reason=\"client_connection_limit\"}",
    );
    // Open them all, then read each one's first line: the proxy's `429` at once, or nothing
    // until the proxy drops an idle connection (its --header-read-timeout, 10 s), which is
    // how long the flood holds its share. (No `read -t`: bash's select() cannot take the
    // descriptors past 1023 this needs.)
    let flood = format!(
        "ulimit -n {limit}; fds=(); \
         for i in $(seq {FLOOD}); do exec {{fd}}<>/dev/tcp/{proxy_ip}/{PROXY_PORT} || break; fds+=($fd); done; \
         echo \"opened ${{#fds[@]}}\"; r429=0; r503=0; held=0; other=0; \
         for fd in \"${{fds[@]}}\"; do line=''; IFS= read -r -u $fd line; \
           case \"$line\" in 'HTTP/1.1 429'*) r429=$((r429+1));; 'HTTP/1.1 503'*) r503=$((r503+1));; \
             '') held=$((held+1));; *) other=$((other+1));; esac; \
           exec {{fd}}>&-; done; \
         echo \"429=$r429 503=$r503 held=$held other=$other\"",
        limit = FLOOD + 64,
    );
    let flooder = {
        let mcp = mcp.clone();
        tokio::spawn(async move { mcp.bash("flood", &flood).await })
    };
    // The flood is in force once the proxies turn it away and hold a full share of it.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (connections, refused) = loop {
        let m = proxy_metrics(env).await;
        let connections = metric(&m, "cli_mcp_proxy_connections");
        let refused = metric(
            &m,
            "cli_mcp_proxy_refusals_total{reason=\"client_connection_limit\"}",
        ) - refused_before;
        assert!(
            connections <= SHARE_AND_OTHERS,
            "the proxies hold {connections} connections at once: more than the flooder's share \
             of {MAX_PER_CLIENT} per replica"
        );
        if connections >= (REPLICAS * MAX_PER_CLIENT) as f64 && refused > 0.0 {
            break (connections, refused);
        }
        assert!(
            Instant::now() < deadline && !flooder.is_finished(),
            "the flood never held its share of the proxies: {connections} connections open, \
             {refused} turned away"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("flood in force: {connections} connections open, {refused} turned away so far");
    let t = Instant::now();
    let listed = ok(victim, "caller-b", "kubectl get ns kube-system -o name").await;
    let took = t.elapsed();
    assert_eq!(
        listed.trim(),
        "namespace/kube-system",
        "another session's kubectl during the flood"
    );
    let still = metric(&proxy_metrics(env).await, "cli_mcp_proxy_connections");
    assert!(
        still >= (REPLICAS * MAX_PER_CLIENT) as f64 && still <= SHARE_AND_OTHERS,
        "after the other session's call the proxies hold {still} connections: fewer than the \
         flooder's full share (it let go before the call was done, which then proves \
         nothing), or more than that share"
    );
    let r = flooder.await.expect("the flood's call");
    assert_eq!(r["isError"], false, "the flood: {}", text(&r));
    let out = stdout(&r);
    eprintln!(
        "the other session's kubectl answered in {took:.1?} during the flood; flood: {}",
        out.replace('\n', "; ")
    );
    let count = |key: &str| -> usize {
        out.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{key}=")))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {key}= in the flood's output: {out}"))
    };
    assert!(
        out.starts_with(&format!("opened {FLOOD}\n")),
        "the sandbox opened all its connections: {out}"
    );
    let (r429, r503, held, other) = (count("429"), count("503"), count("held"), count("other"));
    assert_eq!(r503, 0, "the proxy's global limit was never reached: {out}");
    assert_eq!(other, 0, "every connection was held or turned away: {out}");
    // Held is at least one replica's share; more than both shares only if the opening took
    // longer than the proxy keeps an idle connection (slots freed and taken again): the
    // gauge above is what says the flooder never held more than its share at once.
    assert!(
        held >= MAX_PER_CLIENT && r429 > 0,
        "the flooder held its share and was turned away beyond it: {out}"
    );
    assert_eq!(r429 + held, FLOOD, "{out}");
}

/// Attack 6: on an impersonateCaller target, each caller's own RBAC decides.
async fn impersonation_acts_as_each_caller(env: &Env, cr: &Value, mcp_a: &Mcp, mcp_b: &Mcp) {
    let ns = &env.ns.name;
    let user_a = format!("system:serviceaccount:{ns}:cli-mcp-{INSTANCE}-client");
    // The kubeconfig's user (the investigator) may impersonate; the first client may list
    // the namespace's Secrets, the second may not.
    let name = format!("{ns}-impersonate-callers");
    let role: ClusterRole = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [
            {"apiGroups": [""], "resources": ["users", "groups", "serviceaccounts"],
             "verbs": ["impersonate"]},
            {"apiGroups": ["authentication.k8s.io"],
             "resources": ["userextras/cli-mcp.redhat.com/session"], "verbs": ["impersonate"]},
        ],
    }))
    .expect("ClusterRole");
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": "cli-mcp-investigator", "namespace": ns}],
    }))
    .expect("ClusterRoleBinding");
    let roles: Api<ClusterRole> = Api::all(env.c.client.clone());
    let bindings: Api<ClusterRoleBinding> = Api::all(env.c.client.clone());
    roles
        .create(&PostParams::default(), &role)
        .await
        .expect("creating the impersonation ClusterRole");
    bindings
        .create(&PostParams::default(), &binding)
        .await
        .expect("creating the impersonation ClusterRoleBinding");
    role_for(
        env,
        "secret-reader",
        &format!("cli-mcp-{INSTANCE}-client"),
        json!([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]}]),
    )
    .await;

    let pods = env.api::<Pod>();
    let shared = routes_version(&ready_pods(pods.clone(), &sel("proxy"), REPLICAS).await[0]);
    let mut impersonating = cr.clone();
    impersonating["spec"]["proxy"]["targets"][0]["identity"] = json!("impersonateCaller");
    env.apply_cr(&impersonating).await;
    env.wait_ready(INSTANCE).await;
    // The new route table rolls the proxy: wait until no pod of the shared one is left, not
    // even a terminating one (it serves new connections for its shutdown delay).
    wait_for_set(
        pods.clone(),
        &sel("proxy"),
        "the proxy rolled to impersonateCaller",
        TIMEOUT,
        |ps: &[Pod]| {
            ps.iter().all(|p| routes_version(p) != shared)
                && ps
                    .iter()
                    .filter(|p| is_ready(p) && p.metadata.deletion_timestamp.is_none())
                    .count()
                    >= REPLICAS
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", env.logs("operator")));

    // The rolled pods are new addresses: the first call may come before every node's
    // kube-proxy and NetworkPolicy enforcer have them.
    let list = format!("kubectl -n {ns} get secrets -o name");
    let deadline = Instant::now() + TIMEOUT;
    let secrets = loop {
        let r = mcp_a.bash("caller-a", &list).await;
        if r["isError"] == false {
            break stdout(&r).to_owned();
        }
        assert!(
            Instant::now() < deadline && !text(&r).contains("Forbidden"),
            "the first caller never listed the Secrets its own RBAC allows: {}",
            text(&r)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(
        secrets
            .lines()
            .any(|l| l == "secret/cli-mcp-investigator-token"),
        "the first caller lists the Secrets its own RBAC allows: {secrets}"
    );
    let r = mcp_b.bash("caller-b", &list).await;
    let t = text(&r);
    assert_eq!(r["isError"], true, "the second caller listed Secrets: {t}");
    assert!(
        t.contains("Forbidden")
            && t.contains(&format!("system:serviceaccount:{ns}:{SECOND_CLIENT}")),
        "the API server refuses the second caller by name: {t}"
    );
    let whoami = ok(mcp_a, "caller-a", "kubectl auth whoami -o json").await;
    let review: Value = serde_json::from_str(&whoami)
        .unwrap_or_else(|e| panic!("kubectl auth whoami -o json: {e}: {whoami}"));
    let info = &review["status"]["userInfo"];
    assert_eq!(
        info["username"],
        user_a.as_str(),
        "whoami in the first caller's sandbox: {whoami}"
    );
    assert_eq!(
        info["extra"]["cli-mcp.redhat.com/session"],
        json!(["caller-a"]),
        "the session is in the impersonated identity's extra: {whoami}"
    );
    eprintln!(
        "impersonateCaller: secrets listed as {user_a}, Forbidden as {SECOND_CLIENT}; whoami: {info}"
    );
    bindings
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("deleting the impersonation ClusterRoleBinding: {e}"));
    roles
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("deleting the impersonation ClusterRole: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_proxy_serves_only_proven_sandboxes_and_names_their_callers() {
    let t0 = Instant::now();
    let Some(rig) = RealNodeRig::start("real_node_identity").await else {
        return;
    };
    let RealNodeRig {
        pc,
        info: _,
        socket: _,
        images,
        mut enforcer,
        gateway: _,
        run_dir: _,
    } = rig;
    let sandbox_image = images
        .names()
        .into_iter()
        .find(|n| n.contains("/cli-mcp-sandbox:"))
        .expect("the sandbox image");

    // --- An instance with two MCP client identities --------------------------------------
    let mut env = Env::install_on(pc.test.clone(), "rn-identity").await;
    env.investigation_kubeconfig(INSTANCE).await;
    service_account(&env, SECOND_CLIENT).await;
    let mut cr = env.cr(INSTANCE, 2);
    cr["spec"]["proxy"] = json!({"targets": [{"type": "kubernetes"}]});
    cr["spec"]["server"]["clients"] = json!([{"kind": "ServiceAccount", "name": SECOND_CLIENT}]);
    cr["spec"]["sandbox"]["resources"] = json!({
        "requests": {"cpu": "5m", "memory": "64Mi"},
        "limits": {"cpu": "1", "memory": "256Mi"},
    });
    env.apply_cr(&cr).await;
    env.wait_ready(INSTANCE).await;
    ready_pods(env.api::<Pod>(), &sel("proxy"), REPLICAS).await;
    let mcp = env.client(INSTANCE).await;
    let mut mcp_b = mcp.clone();
    mcp_b.token = env.service_account_token(SECOND_CLIENT).await;
    eprintln!("instance Ready after {:.1?}", t0.elapsed());

    let t = Instant::now();
    label_spoofing_and_copied_token(&env, &mcp, &sandbox_image).await;
    eprintln!("[1, 2] done in {:.1?}", t.elapsed());
    let t = Instant::now();
    session_end_cuts_the_watch(&env, &mcp).await;
    eprintln!("[3] done in {:.1?}", t.elapsed());
    let t = Instant::now();
    two_callers_are_audited_apart(&env, &mcp, &mcp_b).await;
    eprintln!("[4] done in {:.1?}", t.elapsed());
    let t = Instant::now();
    a_flood_leaves_the_others_their_share(&env, &mcp, &mcp_b).await;
    eprintln!("[5] done in {:.1?}", t.elapsed());
    let t = Instant::now();
    impersonation_acts_as_each_caller(&env, &cr, &mcp, &mcp_b).await;
    eprintln!("[6] done in {:.1?}", t.elapsed());

    if let Some(e) = enforcer.exited_error() {
        panic!("{e}");
    }
    eprintln!("all checks passed after {:.1?}", t0.elapsed());

    // --- Teardown -------------------------------------------------------------------------
    drop((mcp, mcp_b));
    env.finish(Some(INSTANCE)).await;
    enforcer.stop().await.unwrap_or_else(|e| panic!("{e}"));
    drop(pc);
}
