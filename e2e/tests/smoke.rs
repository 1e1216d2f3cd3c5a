//! Smoke tests of the local cluster: real control plane + process kubelet.
//!
//! All tests share one cluster per run (see `cli_mcp_e2e::testing`), each works in its own
//! namespace, and every wait is a watch with a deadline.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use cli_mcp_api::pod_state::{is_ready, is_terminal, phase};
use cli_mcp_e2e::testing::{
    self, pod_ip, wait_for, wait_for_set, wait_restarted, AfterRestart, TestCluster, TIMEOUT,
};
use cli_mcp_e2e::ServiceForward;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Node, Pod, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, PostParams};
use kube::runtime::wait::conditions::is_deleted;
use kube::{Api, ResourceExt};
use serde_json::json;
use sha2::{Digest, Sha256};

const SHELL_IMAGE: &str = "cli-mcp-shell:1";
const AGENT_IMAGE: &str = "cli-mcp-agent:dev";
const AGENT_PORT: u16 = 8090;

async fn cluster() -> TestCluster {
    testing::cluster()
        .await
        .expect("the local cluster must come up (see docs/local-kubernetes.md)")
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .no_proxy()
        .build()
        .expect("building an HTTP client")
}

fn agent_deployment(name: &str) -> Deployment {
    let token_sha = hex::encode(Sha256::digest(b"e2e-smoke-token"));
    serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": { "name": name },
        "spec": {
            "replicas": 1,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name } },
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "agent",
                        "image": AGENT_IMAGE,
                        "env": [{ "name": "TOKEN_SHA256", "value": token_sha }],
                        "ports": [{ "name": "http", "containerPort": AGENT_PORT }],
                        "readinessProbe": {
                            "httpGet": { "path": "/healthz", "port": "http" },
                            "periodSeconds": 1
                        },
                        // Its state dir (/tmp/cli-mcp-agent) on a volume of its own, as a
                        // sandbox pod's: on the process kubelet the pod's /tmp is otherwise
                        // the host's.
                        "volumeMounts": [{ "name": "tmp", "mountPath": "/tmp" }]
                    }],
                    "volumes": [{ "name": "tmp", "emptyDir": {} }]
                }
            }
        }
    }))
    .expect("valid Deployment")
}

fn shell_pod(name: &str, script: &str, restart_policy: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name },
        "spec": {
            "restartPolicy": restart_policy,
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "main",
                "image": SHELL_IMAGE,
                "command": ["/bin/sh", "-c", script, name]
            }]
        }
    }))
    .expect("valid Pod")
}

fn container_waiting_reason(pod: &Pod) -> Option<(String, String)> {
    let status = pod.status.as_ref()?.container_statuses.as_ref()?.first()?;
    let waiting = status.state.as_ref()?.waiting.as_ref()?;
    Some((
        waiting.reason.clone().unwrap_or_default(),
        waiting.message.clone().unwrap_or_default(),
    ))
}

#[tokio::test]
async fn agent_deployment_is_ready_and_reachable_by_pod_ip_and_service_forward() {
    let c = cluster().await;
    let ns = c.namespace("agent").await.expect("namespace");

    ns.api::<Deployment>()
        .create(&PostParams::default(), &agent_deployment("agent"))
        .await
        .expect("create Deployment");
    let pods = wait_for_set(
        ns.api::<Pod>(),
        "app=agent",
        "one Ready agent pod with an IP",
        TIMEOUT,
        |pods: &[Pod]| pods.len() == 1 && pods.iter().all(|p| is_ready(p) && pod_ip(p).is_some()),
    )
    .await
    .expect("agent pod becomes Ready");
    let ip = pod_ip(&pods[0]).expect("pod IP");
    let pod_cidr_prefix = c.info.pod_cidr.trim_end_matches("0/24");
    assert!(
        ip.starts_with(pod_cidr_prefix),
        "pod IP {ip} should be in the node's pod CIDR {}",
        c.info.pod_cidr
    );

    // Directly by pod IP.
    let resp = http()
        .get(format!("http://{ip}:{AGENT_PORT}/healthz"))
        .send()
        .await
        .expect("GET /healthz by pod IP");
    assert!(
        resp.status().is_success(),
        "healthz by pod IP: {}",
        resp.status()
    );

    // Through a Service, as `kubectl port-forward svc/agent` would give a user.
    let svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": { "name": "agent" },
        "spec": {
            "selector": { "app": "agent" },
            "ports": [{ "name": "web", "port": 80, "targetPort": "http" }]
        }
    }))
    .expect("valid Service");
    ns.api::<Service>()
        .create(&PostParams::default(), &svc)
        .await
        .expect("create Service");
    wait_for_set(
        ns.api::<EndpointSlice>(),
        "kubernetes.io/service-name=agent",
        "a ready endpoint for Service agent",
        TIMEOUT,
        |slices: &[EndpointSlice]| {
            slices.iter().any(|s| {
                s.endpoints.iter().flatten().any(|e| {
                    e.addresses.contains(&ip)
                        && e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true)
                })
            })
        },
    )
    .await
    .expect("EndpointSlice lists the agent pod");
    let fwd = ServiceForward::start(c.client.clone(), &ns.name, "agent", 80)
        .await
        .expect("start port-forward");
    let resp = http()
        .get(format!("{}/healthz", fwd.http_url()))
        .send()
        .await
        .expect("GET /healthz through the Service forward");
    assert!(
        resp.status().is_success(),
        "healthz via forward: {}",
        resp.status()
    );

    ns.delete().await.expect("delete namespace");
}

#[tokio::test]
async fn deleting_a_deployment_garbage_collects_its_replicaset_and_pods() {
    let c = cluster().await;
    let ns = c.namespace("gc").await.expect("namespace");
    let mut d = agent_deployment("gc");
    // A plain shell workload is enough here.
    if let Some(spec) = d.spec.template.spec.as_mut() {
        spec.containers[0].image = Some(SHELL_IMAGE.into());
        spec.containers[0].command = Some(vec![
            "/bin/sh".into(),
            "-c".into(),
            "exec sleep 100000".into(),
        ]);
        spec.containers[0].readiness_probe = None;
        spec.containers[0].env = None;
    }
    let d = ns
        .api::<Deployment>()
        .create(&PostParams::default(), &d)
        .await
        .expect("create Deployment");

    let rss = wait_for_set(
        ns.api::<ReplicaSet>(),
        "app=gc",
        "the Deployment's ReplicaSet",
        TIMEOUT,
        |rs: &[ReplicaSet]| rs.len() == 1,
    )
    .await
    .expect("ReplicaSet appears");
    let owner = rss[0].owner_references().first().map(|o| o.uid.clone());
    assert_eq!(owner, d.uid(), "the ReplicaSet is owned by the Deployment");
    let pods = wait_for_set(
        ns.api::<Pod>(),
        "app=gc",
        "a running pod of the Deployment",
        TIMEOUT,
        |p: &[Pod]| p.len() == 1 && p.iter().all(is_ready),
    )
    .await
    .expect("pod runs");
    let rs_uid = rss[0].uid().expect("rs uid");
    let pod_uid = pods[0].uid().expect("pod uid");

    ns.api::<Deployment>()
        .delete("gc", &DeleteParams::background())
        .await
        .expect("delete Deployment");
    wait_for(
        ns.api::<ReplicaSet>(),
        &rss[0].name_any(),
        "GC of the ReplicaSet",
        TIMEOUT,
        is_deleted(&rs_uid),
    )
    .await
    .expect("ReplicaSet is garbage-collected");
    wait_for(
        ns.api::<Pod>(),
        &pods[0].name_any(),
        "GC of the pod",
        TIMEOUT,
        is_deleted(&pod_uid),
    )
    .await
    .expect("pod is garbage-collected");

    ns.delete().await.expect("delete namespace");
}

#[tokio::test]
async fn pod_with_secret_volume_and_projected_token_calls_the_api() {
    let c = cluster().await;
    assert!(
        Path::new("/usr/bin/curl").is_file(),
        "this test runs curl inside a pod; install it with `apt-get install -y curl`"
    );
    let ns = c.namespace("token").await.expect("namespace");
    let secret_value = format!("s3cr3t-{}", ns.name);
    let secret: Secret = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": { "name": "creds" },
        "stringData": { "password": secret_value }
    }))
    .expect("valid Secret");
    ns.api::<Secret>()
        .create(&PostParams::default(), &secret)
        .await
        .expect("create Secret");

    let sa = "/var/run/secrets/kubernetes.io/serviceaccount";
    let script = format!(
        r#"set -eu
echo "secret=$(cat /etc/creds/password)"
echo "namespace=$(cat {sa}/namespace)"
/usr/bin/curl -sS --fail --cacert {sa}/ca.crt \
  -H "Authorization: Bearer $(cat {sa}/token)" -H 'Content-Type: application/json' \
  -X POST -d '{{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}}' \
  "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/apis/authentication.k8s.io/v1/selfsubjectreviews"
echo
echo done"#
    );
    let mut pod = shell_pod("caller", &script, "Never");
    if let Some(spec) = pod.spec.as_mut() {
        spec.volumes = Some(vec![serde_json::from_value(
            json!({ "name": "creds", "secret": { "secretName": "creds" } }),
        )
        .expect("valid volume")]);
        spec.containers[0].volume_mounts = Some(vec![serde_json::from_value(
            json!({ "name": "creds", "mountPath": "/etc/creds", "readOnly": true }),
        )
        .expect("valid mount")]);
    }
    let created = ns
        .api::<Pod>()
        .create(&PostParams::default(), &pod)
        .await
        .expect("create Pod");
    // The ServiceAccount admission plugin adds the projected token volume.
    let projected_token = created
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .is_some_and(|vs| {
            vs.iter().any(|v| {
                v.projected.as_ref().is_some_and(|p| {
                    p.sources
                        .iter()
                        .flatten()
                        .any(|s| s.service_account_token.is_some())
                })
            })
        });
    assert!(
        projected_token,
        "pod should carry a projected service-account token volume"
    );

    let done = wait_for(
        ns.api::<Pod>(),
        "caller",
        "pod caller to finish",
        TIMEOUT,
        |p: Option<&Pod>| p.is_some_and(is_terminal),
    )
    .await
    .expect("pod finishes")
    .expect("pod exists");
    let log = c
        .container_log(&ns.name, "caller", "main")
        .await
        .expect("container log");
    assert_eq!(
        phase(&done),
        Some("Succeeded"),
        "pod failed; its log:\n{log}"
    );
    assert!(
        log.contains(&format!("secret={secret_value}")),
        "secret not mounted; log:\n{log}"
    );
    assert!(
        log.contains(&format!("namespace={}", ns.name)),
        "namespace file wrong; log:\n{log}"
    );
    let user = format!("system:serviceaccount:{}:default", ns.name);
    assert!(
        log.contains(&user),
        "API did not authenticate the token as {user}; log:\n{log}"
    );

    ns.delete().await.expect("delete namespace");
}

fn netns_inode(pid: i32) -> Option<u64> {
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .ok()
        .map(|m| m.ino())
}

fn pids_with_cmdline_containing(marker: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            if String::from_utf8_lossy(&cmd)
                .split('\0')
                .any(|a| a == marker)
            {
                out.push(pid);
            }
        }
    }
    out
}

fn pids_in_netns(inode: u64) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| netns_inode(*pid) == Some(inode))
        .collect()
}

fn named_netns_with_inode(inode: u64) -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| std::fs::metadata(e.path()).is_ok_and(|m| m.ino() == inode))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[tokio::test]
async fn deleted_pod_has_no_process_and_no_network_namespace_left() {
    let c = cluster().await;
    let ns = c.namespace("delete").await.expect("namespace");
    // $0 of the shell is the marker; a background child shares the pod's netns.
    let marker = format!("e2e-marker-{}", ns.name);
    let mut pod = shell_pod("victim", "", "Always");
    if let Some(spec) = pod.spec.as_mut() {
        spec.containers[0].command = Some(vec![
            "/bin/sh".into(),
            "-c".into(),
            "trap 'exit 0' TERM; sleep 100000 & wait".into(),
            marker.clone(),
        ]);
    }
    ns.api::<Pod>()
        .create(&PostParams::default(), &pod)
        .await
        .expect("create Pod");
    let running = wait_for(
        ns.api::<Pod>(),
        "victim",
        "pod victim Ready",
        TIMEOUT,
        |p: Option<&Pod>| p.is_some_and(is_ready),
    )
    .await
    .expect("pod runs")
    .expect("pod exists");
    let uid = running.uid().expect("uid");

    let pids = pids_with_cmdline_containing(&marker);
    assert_eq!(
        pids.len(),
        1,
        "exactly one process carries the marker: {pids:?}"
    );
    let inode = netns_inode(pids[0]).expect("netns of the pod process");
    // Held open until the end: a namespace's inode number is recycled as soon as it is
    // freed, and with other tests creating pods the next one may get it. Holding it keeps
    // this number this namespace's, so "a process or a name with this inode" means ours.
    let _held = std::fs::File::open(format!("/proc/{}/ns/net", pids[0])).expect("hold the netns");
    let host_inode = netns_inode(std::process::id() as i32).expect("host netns");
    assert_ne!(
        inode, host_inode,
        "the pod runs in its own network namespace"
    );
    // Ready means the shell started (no probes), not that it has forked its `sleep` yet:
    // poll /proc (no event says so), bounded.
    let deadline = Instant::now() + Duration::from_secs(10);
    let in_ns = loop {
        let in_ns = pids_in_netns(inode);
        if in_ns.len() >= 2 || Instant::now() > deadline {
            break in_ns;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        in_ns.len() >= 2,
        "the shell and its sleep child run in the pod netns: {in_ns:?}"
    );
    assert!(
        !named_netns_with_inode(inode).is_empty(),
        "the pod's netns is a named netns under /run/netns"
    );

    ns.api::<Pod>()
        .delete("victim", &DeleteParams::default())
        .await
        .expect("delete Pod");
    wait_for(
        ns.api::<Pod>(),
        "victim",
        "pod victim to be removed",
        TIMEOUT,
        is_deleted(&uid),
    )
    .await
    .expect("kubelet finishes the deletion");

    assert!(
        pids_with_cmdline_containing(&marker).is_empty(),
        "the pod's main process is gone"
    );
    assert!(
        pids_in_netns(inode).is_empty(),
        "no process is left in the pod's netns: {:?}",
        pids_in_netns(inode)
    );
    assert!(
        named_netns_with_inode(inode).is_empty(),
        "the pod's netns is removed from /run/netns: {:?}",
        named_netns_with_inode(inode)
    );
    let name = cli_mcp_e2e::addons::pod_netns(&uid);
    assert!(!name.exists(), "{} is removed", name.display());

    ns.delete().await.expect("delete namespace");
}

#[tokio::test]
async fn unmapped_image_reports_err_image_pull_and_kubelet_stays_up() {
    let c = cluster().await;
    let ns = c.namespace("badimage").await.expect("namespace");
    let mut pod = shell_pod("nomap", "true", "Always");
    if let Some(spec) = pod.spec.as_mut() {
        spec.containers[0].image = Some("registry.example.invalid/e2e/no-such-image:1.0".into());
        spec.containers[0].command = None;
    }
    ns.api::<Pod>()
        .create(&PostParams::default(), &pod)
        .await
        .expect("create Pod");
    let p = wait_for(
        ns.api::<Pod>(),
        "nomap",
        "ErrImagePull on pod nomap",
        TIMEOUT,
        |p: Option<&Pod>| {
            p.and_then(container_waiting_reason)
                .is_some_and(|(r, _)| r == "ErrImagePull" || r == "ImagePullBackOff")
        },
    )
    .await
    .expect("image pull error is reported")
    .expect("pod exists");
    let (reason, message) = container_waiting_reason(&p).expect("waiting state");
    assert!(
        message.contains("no-such-image"),
        "{reason} message should name the image, got {message:?}"
    );
    assert_eq!(
        phase(&p),
        Some("Pending"),
        "a pod that cannot pull stays Pending"
    );

    // The kubelet is still alive and serving: its node stays Ready.
    let node = Api::<Node>::all(c.client.clone())
        .get(&c.info.node_name)
        .await
        .expect("get node");
    let ready = node
        .status
        .and_then(|s| s.conditions)
        .into_iter()
        .flatten()
        .any(|cond| cond.type_ == "Ready" && cond.status == "True");
    assert!(ready, "node stays Ready after a bad image");

    ns.delete().await.expect("delete namespace");
}

#[tokio::test]
async fn exiting_container_goes_to_crash_loop_backoff() {
    let c = cluster().await;
    let ns = c.namespace("crash").await.expect("namespace");
    ns.api::<Pod>()
        .create(
            &PostParams::default(),
            &shell_pod("crasher", "echo crashing; exit 3", "Always"),
        )
        .await
        .expect("create Pod");
    let p = wait_restarted(ns.api::<Pod>(), "crasher", 1.., AfterRestart::BackingOff)
        .await
        .expect("container backs off");
    let cs = p
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .expect("container status");
    let exit_code = cs
        .last_state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .map(|t| t.exit_code);
    assert_eq!(exit_code, Some(3), "lastState records the exit code");
    assert!(!cs.ready, "a crash-looping container is not ready");
    let log = c
        .container_log(&ns.name, "crasher", "main")
        .await
        .expect("container log");
    assert!(
        log.contains("crashing"),
        "log has the container's output: {log:?}"
    );

    ns.delete().await.expect("delete namespace");
}

/// Measures pod create → Ready on the process kubelet (`cargo test -p cli-mcp-e2e --test
/// smoke -- --ignored --nocapture measure_`). Pods have no probes, so Ready means started.
#[tokio::test]
#[ignore = "measurement, run explicitly"]
async fn measure_pod_create_to_ready() {
    let c = cluster().await;
    let ns = c.namespace("latency").await.expect("namespace");
    let mut samples = Vec::new();
    for i in 0..15 {
        let name = format!("p{i}");
        let start = Instant::now();
        ns.api::<Pod>()
            .create(
                &PostParams::default(),
                &shell_pod(&name, "exec sleep 100000", "Always"),
            )
            .await
            .expect("create Pod");
        wait_for(
            ns.api::<Pod>(),
            &name,
            "pod Ready",
            TIMEOUT,
            |p: Option<&Pod>| p.is_some_and(is_ready),
        )
        .await
        .expect("pod Ready");
        samples.push(start.elapsed());
    }
    samples.sort();
    let median = samples[samples.len() / 2];
    eprintln!(
        "pod create->Ready over {} pods: min {:?}, median {:?}, max {:?}",
        samples.len(),
        samples[0],
        median,
        samples[samples.len() - 1]
    );
    ns.delete().await.expect("delete namespace");
}

/// Addresses of the pod and Service ranges with nothing behind them (a deleted pod, a Service
/// ClusterIP: there is no kube-proxy) must be unreachable on this host, never routed off the
/// machine by the default route. `ip route get` asks the kernel without sending a packet.
#[tokio::test]
async fn pod_and_service_ranges_never_leave_the_host() {
    let _c = cluster().await;
    for ip in ["10.244.250.250", "10.96.0.1", "10.100.1.1"] {
        let out = std::process::Command::new("ip")
            .args(["route", "get", ip])
            .output()
            .expect("run ip route get");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("unreachable") || text.contains("No route to host"),
            "{ip} would be routed off the machine: {text}"
        );
    }
}
