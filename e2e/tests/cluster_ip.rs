//! ClusterIP Services on the process kubelet (docs/process-kubelet.md, "Services"), proven
//! with real connections from inside pods' network namespaces.
//!
//! Two clusters run side by side on this host — a private one in this process and one
//! started by `cli-mcp-cluster up` in a process of its own, as parallel test binaries run
//! theirs — each with a Service at the same
//! ClusterIP ([`SERVICE_IP`]) in front of its own busybox HTTP servers, which answer with
//! their pod's name (a downwardAPI file served as `index.html`):
//!
//! - a client pod of the first cluster reaches its Service's ClusterIP (TCP, HTTP through the
//!   DNAT to the endpoint's target port);
//! - a second endpoint is followed: both backends answer, one after the other at random;
//! - a deleted endpoint (its pod deleted) no longer answers;
//! - the second cluster's client reaches its own backend at the same ClusterIP, while the
//!   first cluster's client still reaches the first one;
//! - the cluster DNS Service (`kube-dns`, 10.96.0.10, UDP) answers from a pod through the
//!   same rules;
//! - a deleted Service stops answering: the connection is refused at once (REJECT), the
//!   other cluster's Service keeps answering.
//!
//! Without the kubelet's Service rules a pod has no route to the Service range, so the
//! first request never succeeds and the test fails at its first deadline.

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cli_mcp_api::pod_state::is_ready;
use cli_mcp_e2e::addons::{self, in_netns, pod_netns, query_a, RCODE_NOERROR};
use cli_mcp_e2e::cluster::{client_from_kubeconfig, ClusterConfig, ClusterInfo};
use cli_mcp_e2e::testing::{
    binaries_dir, private_cluster_with, wait_for, workspace_root, PrivateCluster, TestCluster,
    TestNamespace, READY_PREFIX, TIMEOUT,
};
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{DeleteParams, PostParams};
use kube::ResourceExt;
use serde_json::json;
use tokio::io::AsyncBufReadExt as _;

/// The ClusterIP both clusters give their Service.
const SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 123, 45);
/// How long a Service or endpoint change may take to show in the traffic.
const SETTLE: Duration = Duration::from_secs(60);

async fn cluster(name: &str) -> PrivateCluster {
    let mut cfg = ClusterConfig::local(
        &binaries_dir().unwrap_or_else(|e| panic!("{e}")),
        workspace_root().join(format!(".run/e2e-private-{name}")),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    cfg.images
        .insert("busybox:*".into(), PathBuf::from("/usr/bin/busybox"));
    private_cluster_with(cfg)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A cluster in a process of its own; stopped (SIGINT, as Ctrl-C) by [`OtherCluster::stop`],
/// killed if the test panics first.
struct OtherCluster {
    child: tokio::process::Child,
    test: TestCluster,
}

impl OtherCluster {
    async fn start(name: &str) -> OtherCluster {
        let bin = binaries_dir()
            .unwrap_or_else(|e| panic!("{e}"))
            .join("cli-mcp-cluster");
        let run_dir = workspace_root().join(format!(".run/e2e-private-{name}"));
        let mut child = tokio::process::Command::new(&bin)
            .arg("up")
            .arg("--run-dir")
            .arg(&run_dir)
            .args(["--node", "process", "--image", "busybox:*=/usr/bin/busybox"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(240), async {
            while let Some(line) = lines.next_line().await.expect("reading cli-mcp-cluster") {
                if line.starts_with(READY_PREFIX) {
                    return;
                }
            }
            panic!(
                "cli-mcp-cluster up ended before it was ready (logs in {})",
                run_dir.display()
            );
        });
        ready
            .await
            .unwrap_or_else(|_| panic!("cli-mcp-cluster up not ready within 240 s"));
        // Keep reading, so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let info = ClusterInfo::load(&run_dir).unwrap_or_else(|e| panic!("{e}"));
        let client = client_from_kubeconfig(&info.kubeconfig)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        OtherCluster {
            child,
            test: TestCluster { info, client },
        }
    }

    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGINT,
            );
        }
        let status = tokio::time::timeout(Duration::from_secs(90), self.child.wait()).await;
        assert!(
            matches!(status, Ok(Ok(s)) if s.success()),
            "cli-mcp-cluster up did not stop cleanly: {status:?}"
        );
    }
}

fn backend(name: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "web"}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "volumes": [{"name": "www", "downwardAPI": {"items": [
                {"path": "index.html", "fieldRef": {"fieldPath": "metadata.name"}}]}}],
            "containers": [{
                "name": "httpd", "image": "busybox:stable",
                "command": ["busybox", "httpd", "-f", "-p", "8080", "-h", "/www"],
                "ports": [{"name": "http", "containerPort": 8080}],
                "volumeMounts": [{"name": "www", "mountPath": "/www"}],
                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
            }],
        }
    }))
    .expect("pod manifest")
}

fn client() -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "client"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "c", "image": "busybox:stable",
                            "command": ["busybox", "sleep", "3600"]}],
        }
    }))
    .expect("pod manifest")
}

fn web_service() -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"clusterIP": SERVICE_IP.to_string(), "selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }))
    .expect("service manifest")
}

/// Creates a pod and waits until it is ready; returns its network namespace.
async fn start(ns: &TestNamespace, pod: Pod) -> PathBuf {
    let name = pod.name_any();
    ns.api::<Pod>()
        .create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("creating pod {name}: {e}"));
    let pod = wait_for(
        ns.api::<Pod>(),
        &name,
        &format!("pod {name} ready"),
        TIMEOUT,
        |p: Option<&Pod>| p.is_some_and(is_ready),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .expect("ready pod");
    let netns = pod_netns(&pod.uid().expect("uid"));
    assert!(netns.exists(), "{} missing for pod {name}", netns.display());
    netns
}

/// What one HTTP GET of `http://SERVICE_IP/` from inside `netns` got.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Got {
    Body(String),
    Refused,
    Other(String),
}

fn http_get(addr: SocketAddr) -> Got {
    let mut s = match TcpStream::connect_timeout(&addr, Duration::from_millis(700)) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Got::Refused,
        Err(e) => return Got::Other(format!("connect: {e}")),
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
    if let Err(e) = s.write_all(b"GET / HTTP/1.0\r\nHost: web\r\n\r\n") {
        return Got::Other(format!("write: {e}"));
    }
    let mut buf = Vec::new();
    if let Err(e) = s.take(64 * 1024).read_to_end(&mut buf) {
        return Got::Other(format!("read: {e}"));
    }
    let text = String::from_utf8_lossy(&buf);
    match text.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => {
            Got::Body(body.trim().to_string())
        }
        _ => Got::Other(format!("unexpected answer: {text:?}")),
    }
}

async fn get(netns: &std::path::Path) -> Got {
    let netns = netns.to_path_buf();
    tokio::task::spawn_blocking(move || {
        in_netns(&netns, || http_get(SocketAddr::from((SERVICE_IP, 80))))
    })
    .await
    .expect("join")
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Polls until `ok` holds for what a GET returns; panics with the last answer at the deadline.
async fn until(what: &str, netns: &std::path::Path, mut ok: impl FnMut(&Got) -> bool) {
    let deadline = Instant::now() + SETTLE;
    loop {
        let got = get(netns).await;
        if ok(&got) {
            eprintln!("  {what}: {got:?}");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still {got:?} after {SETTLE:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `n` GETs in a row, all answered by `backend`.
async fn all_from(netns: &std::path::Path, backend: &str, n: usize) {
    for i in 0..n {
        let got = get(netns).await;
        assert_eq!(
            got,
            Got::Body(backend.into()),
            "request {i} of {n} did not reach {backend}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_ips_reach_ready_endpoints_inside_each_clusters_pods() {
    let (a, b) = tokio::join!(cluster("clusterip-a"), OtherCluster::start("clusterip-b"));
    let t0 = Instant::now();
    let (ns_a, ns_b) = tokio::join!(a.test.namespace("svc"), b.test.namespace("svc"));
    let (ns_a, ns_b) = (ns_a.expect("namespace a"), ns_b.expect("namespace b"));
    for ns in [&ns_a, &ns_b] {
        ns.api::<Service>()
            .create(&PostParams::default(), &web_service())
            .await
            .unwrap_or_else(|e| panic!("creating Service web in {}: {e}", ns.name));
    }
    let (client_a, _, client_b, _) = tokio::join!(
        start(&ns_a, client()),
        start(&ns_a, backend("web-1")),
        start(&ns_b, client()),
        start(&ns_b, backend("other-1")),
    );

    eprintln!("one endpoint");
    until("a -> web", &client_a, |g| *g == Got::Body("web-1".into())).await;
    all_from(&client_a, "web-1", 10).await;

    eprintln!("a second endpoint is followed");
    start(&ns_a, backend("web-2")).await;
    let mut seen = BTreeSet::new();
    until("a -> web, both backends", &client_a, |g| {
        if let Got::Body(b) = g {
            seen.insert(b.clone());
        }
        seen.len() == 2
    })
    .await;
    assert_eq!(
        seen,
        BTreeSet::from(["web-1".to_string(), "web-2".to_string()])
    );

    eprintln!("a removed endpoint is no longer used");
    ns_a.api::<Pod>()
        .delete("web-1", &DeleteParams::default())
        .await
        .expect("deleting pod web-1");
    wait_for(
        ns_a.api::<Pod>(),
        "web-1",
        "pod web-1 gone",
        TIMEOUT,
        |p: Option<&Pod>| p.is_none(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    until("a -> web after web-1 left", &client_a, |g| {
        *g == Got::Body("web-2".into())
    })
    .await;
    all_from(&client_a, "web-2", 20).await;

    eprintln!("two clusters, one ClusterIP, each its own backend");
    until("b -> web", &client_b, |g| *g == Got::Body("other-1".into())).await;
    all_from(&client_b, "other-1", 10).await;
    all_from(&client_a, "web-2", 10).await;

    eprintln!("the cluster DNS Service answers over UDP");
    // Every process cluster has CoreDNS on its pod gateway (`Cluster::up`).
    let dns = a.cluster.dns().expect("the process cluster's DNS");
    let deadline = Instant::now() + SETTLE;
    loop {
        let netns = client_a.clone();
        let reply = tokio::task::spawn_blocking(move || {
            in_netns(&netns, || {
                query_a(
                    SocketAddr::from((addons::DNS_SERVICE_IP, 53)),
                    "kubernetes.default.svc.cluster.local",
                    Duration::from_secs(1),
                )
            })
        })
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("{e}"));
        match &reply {
            Ok(r) if r.rcode == RCODE_NOERROR && r.addrs == vec![Ipv4Addr::new(10, 96, 0, 1)] => {
                eprintln!("  kube-dns via {}: {r:?}", addons::DNS_SERVICE_IP);
                break;
            }
            _ => assert!(
                Instant::now() < deadline,
                "no DNS answer through {} after {SETTLE:?}: {reply:?} (CoreDNS log {})",
                addons::DNS_SERVICE_IP,
                dns.log().display()
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    eprintln!("a deleted Service stops answering");
    ns_a.api::<Service>()
        .delete("web", &DeleteParams::default())
        .await
        .expect("deleting Service web");
    until("a -> deleted web", &client_a, |g| *g == Got::Refused).await;
    all_from(&client_b, "other-1", 5).await;
    eprintln!("done in {:?} after both clusters were up", t0.elapsed());
    b.stop().await;
}
