//! The operator's own NetworkPolicies and its sandboxes on real containers: a private
//! real-node cluster (kubelet + kube-proxy on containerd/runc) with the project's images
//! (built from this run's binaries by `hack/build-images.sh`, imported under the names the
//! operator uses), CoreDNS as a `kube-system` pod, kube-router's firewall enforcing
//! NetworkPolicy, and the operator installed from `config/default` into a namespace that
//! enforces the `restricted` Pod Security level. Two instances, `a` and `b`, each with a warm
//! pool; a busybox pod of the namespace and one of another namespace.
//!
//! Traffic is real TCP/UDP opened inside the pods' network namespaces (entered through their
//! containers' tasks; source = the pod's IP), polled with a deadline because policy changes
//! take effect asynchronously:
//! - ingress: only `a`'s server pods reach an `a` sandbox's agent port; the namespace's other
//!   pod, `b`'s server, `b`'s sandbox and a pod of another namespace cannot (the node itself
//!   can: that is the positive control that the agent listens);
//! - egress: an `a` sandbox reaches cluster DNS (through the `kube-dns` ClusterIP, answered by
//!   the CoreDNS pod) and its credential proxy (the implied one: `a` has no `spec.proxy`),
//!   nothing else: not the API server (neither its ClusterIP nor its endpoint), not the
//!   server's ports, not `b`'s sandbox, not the other pods, not CoreDNS's health port;
//! - deleting the sandbox NetworkPolicy: the operator restores it and isolation holds again;
//! - `b` denies DNS (`spec.networkPolicy.dns: Denied`): its sandbox reaches no DNS server and
//!   resolves nothing, and still reaches its proxy (by the Service's ClusterIP).
//!
//! Then the sandbox itself, through the MCP endpoint as a client uses it: admitted under
//! `restricted`, non-root on a read-only root filesystem, no Secret mounted and no real token
//! anywhere in the sandbox, `kubectl get ns` through the proxy with the dummy kubeconfig
//! while a direct connection to the API server fails, `jq`, `yq`, `kubectl version --client` (the image has no `oc`), short cluster
//! names resolving through libc, a session in a pod running as an arbitrary UID in group 0
//! (OpenShift's restricted SCC), and a memory limit: a command allocating past it is
//! OOM-killed with a clear result and the session goes on.
//!
//! All of it twice, at once in one cluster, in two namespaces: with the sandboxes under runc
//! (the node's default) and under gVisor (`spec.sandbox.runtimeClassName: gvisor`), each
//! first proven to run under the runtime it claims (`cli_mcp_e2e::runtime`). Under gVisor a
//! sandbox's own connections are made by its session's shell: runsc's network stack owns the
//! pod's interface, so the host cannot enter its network namespace to connect from it.
//!
//! Skipped, saying so, when not root or when the host cannot run the real node.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Instant;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::{annotation, label};
use cli_mcp_api::pod_state::is_ready;
use cli_mcp_api::wire::{ENV_ASSIGN_SHA256, ENV_TOKEN_SHA256};
use cli_mcp_api::SessionId;
use cli_mcp_e2e::addons::{self, tcp_reach, Reach, DNS_SERVICE_IP};
use cli_mcp_e2e::cluster_info::ClusterInfo;
use cli_mcp_e2e::instance::{delete_instance, hmac_key};
use cli_mcp_e2e::journey::{stdout, text, Env, Mcp};
use cli_mcp_e2e::node;
use cli_mcp_e2e::peer::{expect, expect_resolves, in_session, peer, Peer, CONNECT};
use cli_mcp_e2e::real_node_rig::RealNodeRig;
use cli_mcp_e2e::runtime::{assert_sandbox_runs_under, SandboxRuntime};
use cli_mcp_e2e::testing::PrivateCluster;
use cli_mcp_e2e::testing::{pod_ip, wait_for, wait_for_set, TIMEOUT};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{json, Value};

const BUSYBOX: &str = "localhost/e2e-busybox:1";
const AGENT_PORT: u16 = cli_mcp_api::wire::AGENT_PORT;
/// The sandbox memory limit of instance `a`: room for the agent, bash and kubectl.
const SANDBOX_MEMORY: &str = "256Mi";
/// An arbitrary UID as OpenShift's restricted SCC assigns one (never the image's 1001).
const ARBITRARY_UID: i64 = 1_000_650_000;

/// A one-layer image with the host's static busybox and its applets as symlinks.
fn build_busybox_image(dir: &Path) -> PathBuf {
    let root = dir.join("rootfs");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("bin")).expect("busybox rootfs");
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).expect("copying /bin/busybox");
    for applet in ["sh", "httpd", "sleep"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).expect("applet");
    }
    let out = dir.join("busybox.tar");
    node::build_image_archive(&root, BUSYBOX, &["/bin/sh"], &dir.join("work"), &out)
        .expect("busybox image");
    let _ = std::fs::remove_dir_all(&root);
    out
}

/// A restricted busybox pod serving TCP 8080.
fn listener_pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "securityContext": {
                "runAsNonRoot": true, "runAsUser": 1002, "runAsGroup": 1002,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [{
                "name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                "command": ["/bin/httpd", "-f", "-p", "8080", "-h", "/"],
                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                "securityContext": {
                    "readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false,
                    "capabilities": {"drop": ["ALL"]},
                },
            }],
        }
    }))
    .expect("pod manifest")
}

async fn ready_pod(api: Api<Pod>, name: &str) -> Pod {
    wait_for(
        api,
        name,
        &format!("pod {name} ready"),
        TIMEOUT,
        |p: Option<&Pod>| p.is_some_and(|p| is_ready(p) && pod_ip(p).is_some()),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .unwrap_or_else(|| panic!("pod {name} gone"))
}

/// The one ready pod of `selector` in `api`, waiting for it.
async fn one_ready(api: Api<Pod>, selector: &str) -> Pod {
    let pods = wait_for_set(api, selector, selector, TIMEOUT, |ps: &[Pod]| {
        ps.iter()
            .any(|p| is_ready(p) && p.metadata.deletion_timestamp.is_none())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    pods.into_iter()
        .find(|p| is_ready(p) && p.metadata.deletion_timestamp.is_none())
        .expect("a ready pod")
}

fn structured_exit(result: &Value) -> i64 {
    result["structuredContent"]["exit_code"]
        .as_i64()
        .unwrap_or_else(|| panic!("no exit code in {result}"))
}

/// A session through MCP whose command must succeed; its stdout.
async fn ok(mcp: &Mcp, sid: &str, command: &str) -> String {
    let r = mcp.bash(sid, command).await;
    assert_eq!(r["isError"], false, "{command}: {}", text(&r));
    stdout(&r).to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn operator_policies_isolate_sandboxes_that_work_under_runc_and_gvisor() {
    let t0 = Instant::now();
    let Some(rig) = RealNodeRig::start("real_node_sandbox").await else {
        return;
    };
    let RealNodeRig {
        pc,
        info,
        socket,
        images: _,
        mut enforcer,
        gateway,
        run_dir,
    } = rig;
    let busybox = build_busybox_image(&run_dir.join("test-image"));
    node::import_image(&socket, &busybox).unwrap_or_else(|e| panic!("{e}"));
    let node = Node {
        pc: &pc,
        info: &info,
        socket: &socket,
        gateway,
    };
    tokio::join!(
        isolation_holds(&node, SandboxRuntime::Runc, t0),
        isolation_holds(&node, SandboxRuntime::Gvisor, t0),
    );
    if let Some(e) = enforcer.exited_error() {
        panic!("{e}");
    }
    eprintln!("all checks passed after {:.1?}", t0.elapsed());
    enforcer.stop().await.unwrap_or_else(|e| panic!("{e}"));
    drop(pc);
    let _ = std::fs::remove_dir_all(run_dir.join("test-image"));
}

/// The real node the two runtimes' checks share.
struct Node<'a> {
    pc: &'a PrivateCluster,
    info: &'a ClusterInfo,
    socket: &'a Path,
    gateway: Ipv4Addr,
}

/// A sandbox's own peer: its network namespace under runc, its session's shell under gVisor
/// (see the module documentation).
fn sandbox_peer(
    rt: SandboxRuntime,
    n: &Node<'_>,
    name: &str,
    pod: &Pod,
    mcp: &Mcp,
    sid: &str,
) -> Peer {
    match rt {
        SandboxRuntime::Runc => peer(n.socket, name, pod),
        SandboxRuntime::Gvisor => in_session(name, pod, mcp, sid),
    }
}

/// Every check of the module documentation, for sandboxes under `rt`.
async fn isolation_holds(n: &Node<'_>, rt: SandboxRuntime, t0: Instant) {
    let (pc, info, socket, gateway) = (n.pc, n.info, n.socket, n.gateway);
    // --- The namespace enforces `restricted` before any instance pod exists ------------------
    let mut env = Env::install_on(pc.test.clone(), &format!("rn-sandbox-{}", rt.name())).await;
    let ns = env.ns.name.clone();
    Api::<Namespace>::all(pc.test.client.clone())
        .patch(
            &ns,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {
                "pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "latest",
            }}})),
        )
        .await
        .expect("labelling the namespace restricted");
    let mut root_pod = listener_pod("root");
    if let Some(spec) = root_pod.spec.as_mut() {
        spec.security_context = None;
    }
    let refused = env
        .api::<Pod>()
        .create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            &root_pod,
        )
        .await;
    match refused {
        Err(kube::Error::Api(e)) => assert!(
            e.code == 403 && e.message.contains("violates PodSecurity"),
            "{e:?}"
        ),
        other => panic!("a pod breaking `restricted` was admitted: {other:?}"),
    }

    // --- Pods that are not the instance's -----------------------------------------------------
    let other_ns = pc
        .test
        .namespace(&format!("rn-other-{}", rt.name()))
        .await
        .expect("namespace");
    for (api, name) in [
        (env.api::<Pod>(), "stranger"),
        (other_ns.api::<Pod>(), "elsewhere"),
    ] {
        api.create(&PostParams::default(), &listener_pod(name))
            .await
            .unwrap_or_else(|e| panic!("creating {name}: {e}"));
    }

    // --- Two instances -----------------------------------------------------------------------
    env.investigation_kubeconfig("a").await;
    env.dummy_kubeconfig("b").await;
    let mut cr_a = env.cr("a", 1);
    rt.apply_to(&mut cr_a);
    cr_a["spec"]["sandbox"]["resources"] = json!({
        "requests": {"cpu": "5m", "memory": "64Mi"},
        "limits": {"cpu": "1", "memory": SANDBOX_MEMORY},
    });
    env.apply_cr(&cr_a).await;
    // b denies its sandboxes DNS: they reach their proxy by its ClusterIP.
    let mut cr_b = env.cr("b", 1);
    rt.apply_to(&mut cr_b);
    cr_b["spec"]["networkPolicy"] = json!({"dns": "Denied"});
    env.apply_cr(&cr_b).await;
    env.wait_ready("a").await;
    env.wait_ready("b").await;
    let mcp = env.client("a").await;
    let first = mcp.bash("s1", "export MARK=kept; cd /tmp; id -u").await;
    assert_eq!(first["isError"], false, "{}", text(&first));
    // b's session: its shell is where b's sandbox connects from under gVisor.
    let mcp_b = env.client("b").await;
    let first_b = mcp_b.bash("dnsless", "true").await;
    assert_eq!(first_b["isError"], false, "{}", text(&first_b));
    eprintln!(
        "{}: instances ready, sessions started after {:.1?}",
        rt.name(),
        t0.elapsed()
    );

    let pods = env.api::<Pod>();
    let sel = |instance: &str, component: &str| {
        format!(
            "{}={instance},{}={component}",
            label::INSTANCE,
            label::COMPONENT
        )
    };
    let s1_pod = one_ready(
        pods.clone(),
        &format!("{},{}=s1", sel("a", "sandbox"), label::SESSION_ID),
    )
    .await;
    let server_a_pod = one_ready(pods.clone(), &sel("a", "server")).await;
    let server_b_pod = one_ready(pods.clone(), &sel("b", "server")).await;
    let sandbox_b_pod = one_ready(
        pods.clone(),
        &format!("{},{}=dnsless", sel("b", "sandbox"), label::SESSION_ID),
    )
    .await;
    assert_sandbox_runs_under(rt, &mcp, "s1", socket, &s1_pod).await;
    assert_sandbox_runs_under(rt, &mcp_b, "dnsless", socket, &sandbox_b_pod).await;
    let stranger_pod = ready_pod(pods.clone(), "stranger").await;
    let elsewhere_pod = ready_pod(other_ns.api::<Pod>(), "elsewhere").await;
    let dns_pod = one_ready(
        Api::namespaced(pc.test.client.clone(), "kube-system"),
        "k8s-app=kube-dns",
    )
    .await;
    let sandbox_a = sandbox_peer(rt, n, "sandbox a", &s1_pod, &mcp, "s1");
    let server_a = peer(socket, "server a", &server_a_pod);
    let server_b = peer(socket, "server b", &server_b_pod);
    let sandbox_b = sandbox_peer(rt, n, "sandbox b", &sandbox_b_pod, &mcp_b, "dnsless");
    let stranger = peer(socket, "stranger", &stranger_pod);
    let elsewhere = peer(socket, "pod of another namespace", &elsewhere_pod);
    let coredns = peer(socket, "coredns", &dns_pod);
    for p in [&server_a_pod, &s1_pod] {
        let status = p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|cs| cs.first())
            .expect("container status");
        assert!(
            status.image.starts_with("docker.io/library/cli-mcp-"),
            "{} runs the project's image: {status:?}",
            p.name_any()
        );
    }

    // The operator's sandbox policy lets out DNS and the instance's proxy pods; it names no
    // address but NodeLocal DNSCache's (in the DNS rule): not the API server's endpoint (the
    // address kube-proxy DNATs 10.96.0.1 to, and the one the instance's kubeconfig names).
    let np = env
        .api::<NetworkPolicy>()
        .get("cli-mcp-a-sandbox")
        .await
        .expect("the sandbox NetworkPolicy");
    let egress = np.spec.and_then(|s| s.egress).unwrap_or_default();
    let cidrs: Vec<&str> = egress
        .iter()
        .flat_map(|r| r.to.iter().flatten())
        .filter_map(|p| p.ip_block.as_ref().map(|b| b.cidr.as_str()))
        .collect();
    assert_eq!(cidrs, ["169.254.20.10/32"], "{egress:?}");
    let proxy_pod = one_ready(pods.clone(), &sel("a", "proxy")).await;
    let proxy_a = peer(socket, "proxy a", &proxy_pod);

    // --- Ingress: only a's server reaches a's sandbox agent ---------------------------------
    eprintln!(
        "{}: ingress to sandbox a ({}:{AGENT_PORT})",
        rt.name(),
        sandbox_a.ip
    );
    // The positive controls: the agent listens (the node is always let in), and b's server
    // reaches b's own sandbox.
    let host = tcp_reach(SocketAddr::from((sandbox_a.ip, AGENT_PORT)), CONNECT);
    assert_eq!(host, Reach::Connected, "node -> sandbox a");
    expect(&server_b, sandbox_b.ip, AGENT_PORT, "sandbox b", true).await;
    expect(&server_a, sandbox_a.ip, AGENT_PORT, "sandbox a", true).await;
    for from in [&stranger, &server_b, &sandbox_b, &elsewhere] {
        expect(from, sandbox_a.ip, AGENT_PORT, "sandbox a", false).await;
    }

    // --- Egress: cluster DNS and the proxy, nothing else ----------------------------------------
    eprintln!("{}: egress of sandbox a", rt.name());
    expect_resolves(
        &sandbox_a,
        DNS_SERVICE_IP,
        "kubernetes.default.svc.cluster.local",
        Ipv4Addr::new(10, 96, 0, 1),
    )
    .await;
    expect(&sandbox_a, DNS_SERVICE_IP, 53, "kube-dns (TCP)", true).await;
    expect(
        &sandbox_a,
        proxy_a.ip,
        cli_mcp_api::proxy::PROXY_PORT,
        "proxy a",
        true,
    )
    .await;
    // The API server, directly: its endpoint and its ClusterIP. The proxy reaches it (the
    // positive control).
    expect(&proxy_a, gateway, info.apiserver_port, "apiserver", true).await;
    expect(&sandbox_a, gateway, info.apiserver_port, "apiserver", false).await;
    expect(
        &sandbox_a,
        Ipv4Addr::new(10, 96, 0, 1),
        443,
        "kubernetes",
        false,
    )
    .await;
    for (to, port) in [
        (&server_a, 8443),
        (&server_a, 8081),
        (&sandbox_b, AGENT_PORT),
        (&stranger, 8080),
        (&elsewhere, 8080),
        (&coredns, addons::DNS_POD_HEALTH_PORT),
    ] {
        expect(&sandbox_a, to.ip, port, &to.name, false).await;
    }
    // The same from inside the session: libc through the pod's resolv.conf; kubectl through
    // the proxy with the dummy kubeconfig, whose token is the placeholder; no Secret mounted;
    // the API server refuses a direct connection (the NetworkPolicy), and the proxy is where
    // the session's HTTPS goes.
    let names = ok(
        &mcp,
        "s1",
        "getent hosts kubernetes.default.svc | cut -d' ' -f1; \
         echo \"$KUBECONFIG $HTTPS_PROXY\"; \
         grep -c 'token: cli-mcp-proxy-managed' \"$KUBECONFIG\"; \
         test -e /etc/cli-mcp/kubeconfig && echo mounted || echo no-secret; \
         if curl --noproxy '*' -sk --max-time 5 -o /dev/null \"$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')/version\"; \
         then echo direct-reached; else echo direct-blocked; fi; \
         kubectl get ns -o name",
    )
    .await;
    let mut lines = names.lines();
    assert_eq!(lines.next(), Some("10.96.0.1"), "{names}");
    assert_eq!(
        lines.next(),
        Some("/etc/cli-mcp/proxy-client/kubeconfig http://127.0.0.1:3128"),
        "{names}"
    );
    assert_eq!(lines.next(), Some("1"), "the placeholder token: {names}");
    assert_eq!(lines.next(), Some("no-secret"), "{names}");
    assert_eq!(lines.next(), Some("direct-blocked"), "{names}");
    let listed: Vec<&str> = lines.collect();
    for want in ["namespace/kube-system", "namespace/default"] {
        assert!(listed.contains(&want), "kubectl get ns: {names}");
    }
    assert!(
        listed.contains(&format!("namespace/{ns}").as_str()),
        "kubectl get ns: {names}"
    );
    // exec into the sandbox's own pod through the proxy: the proxy refuses it itself.
    let r = mcp
        .bash(
            "s1",
            "kubectl -n \"$POD_NAMESPACE\" exec \"$POD_NAME\" -- true",
        )
        .await;
    assert_eq!(r["isError"], true, "{}", text(&r));
    assert!(
        text(&r).contains("the proxy never allows pods/exec"),
        "kubectl exec is refused by the proxy itself: {}",
        text(&r)
    );

    // --- Deleting the sandbox policy: the operator restores it ----------------------------------
    let policies = env.api::<NetworkPolicy>();
    let np_name = "cli-mcp-a-sandbox";
    let old_uid = policies
        .get(np_name)
        .await
        .expect("the sandbox NetworkPolicy")
        .uid();
    policies
        .delete(np_name, &DeleteParams::default())
        .await
        .expect("deleting the sandbox NetworkPolicy");
    let restored = wait_for(
        policies.clone(),
        np_name,
        "the sandbox NetworkPolicy restored by the operator",
        TIMEOUT,
        |p: Option<&NetworkPolicy>| p.is_some_and(|p| p.uid() != old_uid),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", env.logs("operator")))
    .expect("restored policy");
    eprintln!("sandbox policy restored (uid {:?})", restored.uid());
    expect(&stranger, sandbox_a.ip, AGENT_PORT, "sandbox a", false).await;
    expect(&server_b, sandbox_a.ip, AGENT_PORT, "sandbox a", false).await;
    expect(&sandbox_a, stranger.ip, 8080, "stranger", false).await;
    expect(&sandbox_a, server_a.ip, 8443, "server a", false).await;
    expect(&server_a, sandbox_a.ip, AGENT_PORT, "sandbox a", true).await;

    // --- Without DNS (instance b): nothing resolves, the proxy is still reached ---------------
    expect(&sandbox_b, DNS_SERVICE_IP, 53, "kube-dns (TCP)", false).await;
    let dnsless = ok(
        &mcp_b,
        "dnsless",
        "for h in anything.example kubernetes.default.svc; do \
         timeout 10 getent hosts $h >/dev/null 2>&1 && echo resolved || echo no-dns; done; \
         curl -s -o /tmp/out -w '%{http_code}\\n' --max-time 30 https://kubernetes.default.svc/version; \
         head -c 400 /tmp/out",
    )
    .await;
    let lines: Vec<&str> = dnsless.lines().collect();
    assert_eq!(lines.get(..2), Some(&["no-dns", "no-dns"][..]), "{dnsless}");
    // b's kubeconfig names kubernetes.default.svc without a CA: the proxy resolved it and
    // refused the upstream's certificate, so the request went relay, proxy, upstream.
    assert_eq!(lines.get(2), Some(&"502"), "{dnsless}");
    assert!(
        dnsless.contains("upstream"),
        "the proxy's answer: {dnsless}"
    );

    // --- The sandbox as its session sees it ---------------------------------------------------
    let spec = s1_pod.spec.clone().expect("sandbox spec");
    let sc = spec.containers[0]
        .security_context
        .clone()
        .expect("container securityContext");
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    let out = ok(
        &mcp,
        "s1",
        "echo \"$MARK $PWD\"; id -u; awk '$2 == \"/\" {split($4, o, \",\"); print \"root \" o[1]}' /proc/mounts; \
         echo '{\"a\": 1}' | jq .a; printf 'b: 2\\n' | yq .b; \
         if command -v oc >/dev/null; then oc version --client; \
         else echo no-oc; kubectl version --client; fi",
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"kept /tmp"), "state kept: {out}");
    assert_ne!(lines.get(1), Some(&"0"), "non-root: {out}");
    // The root's mount options, as the kernel (runc) or gVisor's Sentry has them: a write
    // as the sandbox's non-root user would fail for its permissions before the read-only
    // mount is even looked at under gVisor.
    assert_eq!(lines.get(2), Some(&"root ro"), "read-only root: {out}");
    assert_eq!(lines.get(3..5), Some(&["1", "2"][..]), "jq, yq: {out}");
    assert!(
        out.contains("Client Version: v1."),
        "oc or kubectl version --client: {out}"
    );

    // --- A session under an arbitrary UID in group 0 --------------------------------------------
    // OpenShift's restricted SCC picks the UID per namespace: the same pod as s1, as the
    // operator's builder made it, but under another UID with group 0, for session "uid".
    let sid = SessionId::parse("uid").expect("sid");
    let key = hmac_key(&env.ns, "a").await;
    let nonce = cli_mcp_api::sandbox::sandbox_nonce(&s1_pod).expect("s1's sandbox nonce");
    let commitment = key.session_token(&sid, &nonce).commitment().to_hex();
    let mut uid_pod = s1_pod.clone();
    uid_pod.status = None;
    uid_pod.metadata = kube::api::ObjectMeta {
        name: Some("cli-mcp-a-s-uid".into()),
        labels: s1_pod.metadata.labels.clone().map(|mut l| {
            l.insert(label::SESSION_ID.into(), sid.to_string());
            // Created for its session, as the server's own cold starts are (no /assign).
            l.insert(label::LAUNCH.into(), label::LAUNCH_COLD.into());
            l
        }),
        annotations: s1_pod.metadata.annotations.clone().map(|mut a| {
            a.insert(annotation::TOKEN_SHA256.into(), commitment.clone());
            a.insert(
                annotation::LAST_ACTIVITY.into(),
                cli_mcp_api::activity::stamp_now(),
            );
            a
        }),
        owner_references: s1_pod.metadata.owner_references.clone(),
        ..Default::default()
    };
    if let Some(spec) = uid_pod.spec.as_mut() {
        spec.node_name = None;
        if let Some(psc) = spec.security_context.as_mut() {
            psc.run_as_user = Some(ARBITRARY_UID);
            psc.run_as_group = Some(0);
            psc.fs_group = Some(ARBITRARY_UID);
        }
        // Started assigned to "uid" (a pool pod like s1's waits for /assign instead).
        let env = spec.containers[0].env.get_or_insert_with(Vec::new);
        env.retain(|e| e.name != ENV_TOKEN_SHA256 && e.name != ENV_ASSIGN_SHA256);
        env.push(k8s_openapi::api::core::v1::EnvVar {
            name: ENV_TOKEN_SHA256.into(),
            value: Some(commitment.clone()),
            ..Default::default()
        });
    }
    let created = pods
        .create(&PostParams::default(), &uid_pod)
        .await
        .expect("a sandbox under an arbitrary UID is admitted under restricted");
    // Sealed to its uid, as the server seals the pods it creates: an unsealed namesake is a
    // plant, which the server deletes instead of routing to it.
    let seal = cli_mcp_api::seal::seal_for(&created, &key).expect("a created pod has a uid");
    pods.patch(
        "cli-mcp-a-s-uid",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&serde_json::json!({"metadata": {
            "uid": created.metadata.uid,
            "annotations": {cli_mcp_api::names::annotation::SEAL: seal},
        }})),
    )
    .await
    .expect("sealing the pod");
    ready_pod(pods.clone(), "cli-mcp-a-s-uid").await;
    let out = ok(
        &mcp,
        "uid",
        "id -u; id -g; echo \"$HOME\"; \
         touch \"$HOME/h\" /workspace/w /tmp/cli-mcp-agent/probe && echo writable; \
         export KEPT=yes; cd /workspace",
    )
    .await;
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            ARBITRARY_UID.to_string().as_str(),
            "0",
            "/workspace",
            "writable"
        ],
        "{out}"
    );
    // The agent journals and spills in its state dir as that UID: output past the budget.
    let r = mcp
        .bash(
            "uid",
            "echo \"$KEPT $PWD\"; head -c 200000 /dev/zero | tr '\\0' x",
        )
        .await;
    assert_eq!(r["isError"], false, "{}", text(&r));
    assert!(stdout(&r).starts_with("yes /workspace\n"), "{}", text(&r));
    assert_eq!(r["structuredContent"]["truncated"], true, "{}", text(&r));
    let spills = ok(&mcp, "uid", "ls /tmp/cli-mcp-agent/spill | wc -l").await;
    assert_ne!(spills.trim(), "0", "a spill file was written: {spills}");

    // --- The memory limit ---------------------------------------------------------------------
    if rt == SandboxRuntime::Gvisor {
        memory_limit_stops_a_gvisor_sandbox(&mcp).await;
    } else {
        memory_limit_kills_the_command_under_runc(&mcp).await;
    }
    eprintln!(
        "{}: all checks passed after {:.1?}",
        rt.name(),
        t0.elapsed()
    );

    // --- Teardown ---------------------------------------------------------------------------
    delete_instance(env.api::<CliMcpInstance>(), "b", TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    drop(mcp);
    drop(mcp_b);
    env.finish(Some("a")).await;
    other_ns.delete().await.expect("deleting namespace");
}

/// Under runc a command allocating past the sandbox's limit is killed alone by the kernel
/// (SIGKILL, 137): the caller gets an error result, and the session's shell goes on with its
/// state. The shell itself past the limit is killed, and the reset is reported.
async fn memory_limit_kills_the_command_under_runc(mcp: &Mcp) {
    let r = mcp
        .bash("s1", "head -c 1G /dev/zero | tail -c 1G > /dev/null")
        .await;
    eprintln!("allocation past {SANDBOX_MEMORY}: {}", text(&r));
    assert_eq!(r["isError"], true, "{}", text(&r));
    assert_eq!(structured_exit(&r), 137, "{}", text(&r));
    let after = mcp.bash("s1", "echo \"$MARK $PWD\"").await;
    assert_eq!(after["isError"], false, "{}", text(&after));
    assert_eq!(stdout(&after), "kept /tmp\n", "{}", text(&after));
    assert_eq!(
        after["structuredContent"]["state_reset"],
        false,
        "{}",
        text(&after)
    );
    // The shell itself allocating past the limit: the shell is killed, and the caller is told
    // that the shell (and so the session's state) was reset; the session goes on.
    let r = mcp
        .bash(
            "s1",
            "x=$(head -c 1G /dev/zero | tr '\\0' x); echo survived",
        )
        .await;
    eprintln!("the shell allocating past {SANDBOX_MEMORY}: {}", text(&r));
    assert_eq!(r["isError"], true, "{}", text(&r));
    assert!(!stdout(&r).contains("survived"), "{}", text(&r));
    let next = mcp.bash("s1", "echo \"[$MARK]\"").await;
    eprintln!("next call: {}", text(&next));
    assert_eq!(next["isError"], false, "{}", text(&next));
    let reset_reported = r["structuredContent"]["shell_restarted"] == true
        || r["structuredContent"]["state_reset"] == true
        || next["structuredContent"]["shell_restarted"] == true
        || next["structuredContent"]["state_reset"] == true;
    assert!(
        reset_reported,
        "the lost state is reported:\n{}\n{}",
        text(&r),
        text(&next)
    );
    assert_eq!(stdout(&next), "[]\n", "{}", text(&next));
}

/// Under gVisor the host's OOM killer stops the whole sandbox (its kernel holds the memory):
/// the call is answered at once with why (not after its timeout), and the next call goes on
/// in the restarted sandbox with a fresh shell, the lost state reported.
async fn memory_limit_stops_a_gvisor_sandbox(mcp: &Mcp) {
    let t = Instant::now();
    let r = mcp
        .bash("s1", "head -c 1G /dev/zero | tail -c 1G > /dev/null")
        .await;
    eprintln!(
        "gvisor: allocation past {SANDBOX_MEMORY} after {:.1?}: {}",
        t.elapsed(),
        text(&r)
    );
    assert_eq!(r["isError"], true, "{}", text(&r));
    assert!(
        text(&r).contains("the sandbox stopped while the command ran"),
        "{}",
        text(&r)
    );
    assert!(
        t.elapsed() < std::time::Duration::from_secs(40),
        "answered after {:?}, not at once",
        t.elapsed()
    );
    let next = mcp.bash("s1", "echo \"[$MARK]\"").await;
    eprintln!("gvisor: next call: {}", text(&next));
    assert_eq!(next["isError"], false, "{}", text(&next));
    assert_eq!(stdout(&next), "[]\n", "{}", text(&next));
    let sc = &next["structuredContent"];
    assert!(
        sc["shell_restarted"] == true || sc["state_reset"] == true,
        "the lost state is reported: {}",
        text(&next)
    );
}
