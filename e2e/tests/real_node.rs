//! The real node (kubelet + kube-proxy on containerd/runc, `CLI_MCP_NODE=real`): a private
//! cluster with it, a busybox image built here and imported into its containerd, and
//! - a Pod under a restricted securityContext becomes Ready; its logs and an exec work
//!   through the apiserver (which calls the kubelet);
//! - another pod reaches it through a Service ClusterIP (only kube-proxy's DNAT can make
//!   that address answer: the host routes 10.96.0.0/12 to `unreachable`);
//! - cluster DNS is a restricted `kube-system` pod behind the kubelet's `clusterDNS`
//!   (10.96.0.10): a pod resolves short names through its resolv.conf's search path, and
//!   names outside the cluster are not resolved (CoreDNS has no forwarder);
//! - a container allocating past its memory limit is OOMKilled;
//! - teardown leaves no process, mount, cgroup or kube-proxy chain behind.
//!
//! Traffic goes only to pod and Service addresses of the namespace the test creates.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cli_mcp_e2e::cluster::ClusterConfig;
use cli_mcp_e2e::node::{self, NodeKind};
use cli_mcp_e2e::testing::{self, wait_for, TestNamespace};
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::api::{ListParams, LogParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(120);
const IMAGE: &str = "localhost/e2e-busybox:1";

fn pod_ready(p: Option<&Pod>) -> bool {
    p.and_then(|p| p.status.as_ref())
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn phase(p: Option<&Pod>) -> Option<String> {
    p.and_then(|p| p.status.as_ref())
        .and_then(|s| s.phase.clone())
}

fn terminated_reason(p: Option<&Pod>) -> Option<String> {
    p.and_then(|p| p.status.as_ref())
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref())
        .and_then(|t| t.reason.clone())
}

/// A one-layer image with the host's static busybox and its applets as symlinks.
fn build_busybox_image(dir: &Path) -> anyhow::Result<PathBuf> {
    let busybox = Path::new("/bin/busybox");
    let root = dir.join("rootfs");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("bin")).context("creating the image rootfs")?;
    std::fs::copy(busybox, root.join("bin/busybox")).context("copying /bin/busybox")?;
    for applet in [
        "sh", "httpd", "nc", "id", "cat", "echo", "sleep", "dd", "printf", "test", "grep",
        "nslookup",
    ] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet))
            .with_context(|| format!("linking {applet}"))?;
    }
    let out = dir.join("busybox.tar");
    node::build_image_archive(&root, IMAGE, &["/bin/sh"], &dir.join("work"), &out)?;
    Ok(out)
}

fn restricted_pod(
    name: &str,
    labels: serde_json::Value,
    script: &str,
    extra: serde_json::Value,
) -> anyhow::Result<Pod> {
    let mut container = json!({
        "name": "c",
        "image": IMAGE,
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", script],
        "securityContext": {
            "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false,
            "capabilities": {"drop": ["ALL"]}
        }
    });
    if let (Some(c), Some(e)) = (container.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            c.insert(k.clone(), v.clone());
        }
    }
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 1001,
                "runAsGroup": 1001,
                "seccompProfile": {"type": "RuntimeDefault"}
            },
            "containers": [container]
        }
    }))?)
}

async fn create_and_wait_ready(ns: &TestNamespace, pod: &Pod) -> anyhow::Result<Duration> {
    let api: Api<Pod> = ns.api();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let t = Instant::now();
    api.create(&PostParams::default(), pod).await?;
    wait_for(api, &name, &format!("pod {name} Ready"), TIMEOUT, pod_ready).await?;
    Ok(t.elapsed())
}

fn kubectl(bin: &Path, kubeconfig: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(bin.join("kubectl"))
        .env("KUBECONFIG", kubeconfig)
        .args(args)
        .output()
        .context("running kubectl")?;
    if !out.status.success() {
        bail!(
            "kubectl {args:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_node_runs_restricted_pods_with_logs_exec_services_and_memory_limits(
) -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIP real_node: needs root (containerd, cgroups, network namespaces)");
        return Ok(());
    }
    let bin_dir = testing::binaries_dir()?;
    let run_dir = testing::workspace_root().join(".run/e2e-real-node");
    let mut cfg = ClusterConfig::local(&bin_dir, run_dir.clone())?;
    if let Err(e) = node::preflight(&cfg.control_plane_bin) {
        eprintln!("SKIP real_node: {e}");
        return Ok(());
    }
    cfg.node = NodeKind::Real;
    cfg.images = BTreeMap::new();
    let control_plane_bin = cfg.control_plane_bin.clone();
    let up = Instant::now();
    let pc = testing::private_cluster_with(cfg).await?;
    let up_took = up.elapsed();
    let info = pc.cluster.info().clone();
    let socket = info
        .containerd_socket
        .clone()
        .context("a real-node cluster names its containerd socket")?;
    assert_eq!(info.node, NodeKind::Real);

    let image_dir = run_dir.join("test-image");
    let archive = build_busybox_image(&image_dir)?;
    let t = Instant::now();
    node::import_image(&socket, &archive)?;
    let import_took = t.elapsed();

    let ns = pc.test.namespace("real-node").await?;
    let pods: Api<Pod> = ns.api();

    // 1. A restricted web pod: Ready, logs and exec through the apiserver.
    let web = restricted_pod(
        "web",
        json!({"app": "web"}),
        "echo hello-from-the-real-node; exec httpd -f -p 8080 -h /",
        json!({"readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}),
    )?;
    let cold = create_and_wait_ready(&ns, &web).await?;
    let logs = pods.logs("web", &LogParams::default()).await?;
    assert!(
        logs.contains("hello-from-the-real-node"),
        "pod log through the apiserver: {logs:?}"
    );
    let id = kubectl(
        &control_plane_bin,
        &info.kubeconfig,
        &["-n", &ns.name, "exec", "web", "--", "id"],
    )?;
    assert!(
        id.contains("uid=1001") && id.contains("gid=1001"),
        "exec through the apiserver ran as the pod's user: {id:?}"
    );
    // The root filesystem is read-only and no capability is left.
    let probe = kubectl(
        &control_plane_bin,
        &info.kubeconfig,
        &[
            "-n",
            &ns.name,
            "exec",
            "web",
            "--",
            "sh",
            "-c",
            "echo x > /x 2>/dev/null && echo writable || echo read-only; grep CapEff /proc/self/status",
        ],
    )?;
    assert!(probe.contains("read-only"), "{probe}");
    assert!(probe.contains("CapEff:\t0000000000000000"), "{probe}");

    // 2. A Service ClusterIP reaches the pod from another pod (kube-proxy's rules).
    let svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}
    }))?;
    let svc = ns
        .api::<Service>()
        .create(&PostParams::default(), &svc)
        .await?;
    let cluster_ip = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .context("Service has a ClusterIP")?;
    assert!(cluster_ip.starts_with("10.96."), "{cluster_ip}");
    // Until kube-proxy has written the rules the address is unreachable; the client polls
    // with a deadline (60 tries, 0.5 s apart) and prints the answer.
    let script = format!(
        "i=0; while [ $i -lt 60 ]; do \
           out=$(printf 'GET /etc/hostname HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {cluster_ip} 80) && \
           case \"$out\" in *'200 OK'*) echo \"$out\"; exit 0;; esac; \
           i=$((i+1)); sleep 0.5; done; echo no answer from {cluster_ip}; exit 1"
    );
    let client = restricted_pod("client", json!({"app": "client"}), &script, json!({}))?;
    pods.create(&PostParams::default(), &client).await?;
    let done = wait_for(
        pods.clone(),
        "client",
        "pod client to finish",
        TIMEOUT,
        |p: Option<&Pod>| matches!(phase(p).as_deref(), Some("Succeeded") | Some("Failed")),
    )
    .await?;
    let client_log = pods.logs("client", &LogParams::default()).await?;
    assert_eq!(
        phase(done.as_ref()).as_deref(),
        Some("Succeeded"),
        "client log: {client_log}"
    );
    assert!(
        client_log.lines().any(|l| l.trim() == "web"),
        "the answer through the ClusterIP is the web pod's hostname: {client_log}"
    );

    // 3. Cluster DNS: a kube-system pod, restricted, behind the kubelet's clusterDNS.
    let kube_system = Api::<Namespace>::all(pc.test.client.clone())
        .get("kube-system")
        .await?;
    assert_eq!(
        kube_system
            .labels()
            .get("pod-security.kubernetes.io/enforce")
            .map(String::as_str),
        Some("restricted"),
        "kube-system enforces the restricted Pod Security level"
    );
    let dns_pods = Api::<Pod>::namespaced(pc.test.client.clone(), "kube-system")
        .list(&ListParams::default().labels("k8s-app=kube-dns"))
        .await?
        .items;
    assert_eq!(dns_pods.len(), 1, "one CoreDNS pod: {dns_pods:?}");
    let dns_pod = &dns_pods[0];
    assert!(
        pod_ready(Some(dns_pod)),
        "CoreDNS is ready when the cluster is"
    );
    let dns_spec = dns_pod.spec.clone().context("CoreDNS pod spec")?;
    let dns_sc = dns_spec.containers[0]
        .security_context
        .clone()
        .context("CoreDNS securityContext")?;
    assert_eq!(dns_sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        dns_spec.security_context.and_then(|s| s.run_as_user),
        Some(65532)
    );
    let script = format!(
        "cat /etc/resolv.conf; echo ---; i=0; while [ $i -lt 60 ]; do \
           out=$(nslookup web 2>&1); case \"$out\" in *{web_ip}*) echo \"$out\"; break;; esac; \
           i=$((i+1)); sleep 0.5; done; [ $i -lt 60 ] || {{ echo \"no answer for web: $out\"; exit 1; }}; \
         echo ---; nslookup kubernetes.default.svc.cluster.local 2>&1; echo ---; \
         out=$(nslookup example.com 2>&1); echo \"$out\"; \
         case \"$out\" in *Name:*) echo example.com resolved; exit 1;; esac; \
         echo example.com: not resolved",
        web_ip = cluster_ip
    );
    let resolver = restricted_pod("resolver", json!({"app": "resolver"}), &script, json!({}))?;
    pods.create(&PostParams::default(), &resolver).await?;
    let done = wait_for(
        pods.clone(),
        "resolver",
        "pod resolver to finish",
        TIMEOUT,
        |p: Option<&Pod>| matches!(phase(p).as_deref(), Some("Succeeded") | Some("Failed")),
    )
    .await?;
    let resolver_log = pods.logs("resolver", &LogParams::default()).await?;
    assert_eq!(
        phase(done.as_ref()).as_deref(),
        Some("Succeeded"),
        "resolver log: {resolver_log}"
    );
    let search = format!(
        "search {}.svc.cluster.local svc.cluster.local cluster.local",
        ns.name
    );
    assert!(
        resolver_log.contains("nameserver 10.96.0.10") && resolver_log.contains(&search),
        "the kubelet's clusterDNS and search path: {resolver_log}"
    );
    let sections: Vec<&str> = resolver_log.split("---").collect();
    let answers = |section: &str, ip: &str| {
        section
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["Address:", ip])
    };
    assert!(
        sections.len() == 4
            && answers(sections[1], &cluster_ip)
            && answers(sections[2], "10.96.0.1")
            && sections[3].contains("example.com: not resolved"),
        "web -> {cluster_ip}, kubernetes.default.svc.cluster.local -> 10.96.0.1, example.com unresolved: \
         {resolver_log}"
    );

    // 4. A memory limit kills an allocation past it. The shell keeps 256 MiB it reads in its
    // own memory, written from user space: the memory cgroup's OOM killer is certain to act.
    // (dd's one 256 MiB read was filled by the kernel, whose faults past the limit may only
    // cut the read short: the pod then completed without an OOM kill, now and then.)
    let hog = restricted_pod(
        "hog",
        json!({"app": "hog"}),
        "echo allocating; x=$(head -c 268435456 /dev/zero | tr '\\0' a); echo survived ${#x}",
        json!({"resources": {
            "limits": {"memory": "32Mi", "cpu": "500m"},
            "requests": {"memory": "32Mi", "cpu": "10m"}
        }}),
    )?;
    pods.create(&PostParams::default(), &hog).await?;
    let hog_done = wait_for(
        pods.clone(),
        "hog",
        "pod hog to be terminated",
        TIMEOUT,
        |p: Option<&Pod>| terminated_reason(p).is_some(),
    )
    .await?;
    assert_eq!(
        terminated_reason(hog_done.as_ref()).as_deref(),
        Some("OOMKilled"),
        "status: {:?}",
        hog_done.and_then(|p| p.status)
    );

    // 5. Warm pod starts, for the record.
    let mut warm = Vec::new();
    for i in 0..3 {
        let p = restricted_pod(
            &format!("warm-{i}"),
            json!({"app": "warm"}),
            "exec sleep 3600",
            json!({}),
        )?;
        warm.push(create_and_wait_ready(&ns, &p).await?);
    }
    eprintln!(
        "real node: cluster up {:.1}s (node Ready {:.1}s after containerd started); image import {} ms; \
         first pod create->Ready {} ms (cold container start); next pods median {} ms",
        up_took.as_secs_f64(),
        pc.cluster
            .node_ready_after()
            .map(|d| d.as_secs_f64())
            .unwrap_or_default(),
        import_took.as_millis(),
        cold.as_millis(),
        median(warm).as_millis()
    );

    // 6. Teardown leaves nothing of the node behind.
    let node_dir = run_dir.join("node");
    let cgroup = "cli-mcp-node-".to_string() + &info.apiserver_host.octets()[2].to_string();
    let t = Instant::now();
    drop(pc);
    eprintln!("real node: teardown {:.1}s", t.elapsed().as_secs_f64());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    assert!(
        node::mounts_under(&mountinfo, &node_dir).is_empty(),
        "mounts left under {}",
        node_dir.display()
    );
    let left = cli_mcp_e2e::process::processes_with_arg(&node_dir.display().to_string());
    assert!(left.is_empty(), "processes left: {left:?}");
    for h in std::fs::read_dir("/sys/fs/cgroup")?.flatten() {
        let d = h.path().join(&cgroup);
        assert!(!d.exists(), "cgroup {} left", d.display());
    }
    let rules = std::process::Command::new("iptables-save")
        .args(["-t", "nat"])
        .output()?;
    let rules = String::from_utf8_lossy(&rules.stdout);
    assert!(
        !rules.contains("KUBE-SERVICES") && !rules.contains(&cluster_ip),
        "kube-proxy's rules are left: {rules}"
    );
    Ok(())
}
