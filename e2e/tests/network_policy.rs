//! NetworkPolicy enforcement and cluster DNS on the local Kubernetes, proven with real traffic
//! (docs/network-policy.md).
//!
//! The test owns a private cluster (process kubelet: every pod in its own network namespace
//! with a ptp veth and an IP in the cluster's 10.244.N.0/24, routed through the host, and
//! CoreDNS on its pod gateway), starts the enforcer (kube-router's firewall) through
//! `cli_mcp_e2e::addons`, runs
//! three busybox pods listening on TCP 8080 and 9090, and opens TCP connections from inside
//! the pods' network namespaces (source address = the pod's IP) with short connect timeouts:
//!
//! - without a policy, every pair connects;
//! - a default-deny ingress policy blocks them all;
//! - an allow-from-podSelector policy on port 8080 lets exactly the selected client in, on
//!   that port only;
//! - deleting the policies restores traffic;
//! - an egress policy on one client allowing only DNS (UDP/TCP 53 to CoreDNS) and port 8080
//!   of one pod blocks everything else (the other port, the other pod, the apiserver) while
//!   DNS still answers;
//! - DNS answers `kubernetes.default.svc.cluster.local` and a Service of the test's
//!   namespace, and refuses `example.com` itself (CoreDNS has no forwarder); a pod resolves
//!   short names through libc with the resolv.conf the process kubelet writes (`--cluster-dns`:
//!   the gateway, the namespace's search path);
//! - the enforcer's rules only name this cluster's pod and Service ranges, and stopping it
//!   leaves none of its chains, jumps or ipsets on the host.
//!
//! Policy changes take effect asynchronously (kube-router syncs on watch events), so each
//! expectation is polled with a deadline; denied connections must end refused or timed out.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cli_mcp_api::pod_state::is_ready;
use cli_mcp_e2e::addons::{
    self, foreign_rules, in_netns, pod_netns, query_a, tcp_reach, DnsReply, Enforcer, Ipv4Net,
    Reach, DNS_SERVICE_IP, RCODE_NOERROR, RCODE_NXDOMAIN, RCODE_REFUSED, SERVICE_CIDR,
};
use cli_mcp_e2e::cluster::ClusterConfig;
use cli_mcp_e2e::testing::{
    binaries_dir, pod_ip, private_cluster_with, wait_for, workspace_root, TestNamespace, TIMEOUT,
};
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use cli_mcp_e2e::peer::{expect, From, Peer, CONNECT, SETTLE};

fn listener_pod(name: &str, role: &str) -> Pod {
    let httpd = |port: u16| {
        json!({
            "name": format!("tcp{port}"),
            "image": "busybox:stable",
            "command": ["busybox", "httpd", "-f", "-p", port.to_string(), "-h", "/www"],
            "volumeMounts": [{"name": "www", "mountPath": "/www"}],
            "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 1},
        })
    };
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"role": role}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "volumes": [{"name": "www", "emptyDir": {}}],
            "containers": [httpd(8080), httpd(9090)],
        }
    }))
    .expect("pod manifest")
}

async fn start_pod(ns: &TestNamespace, name: &str, role: &str) -> Peer {
    let api: Api<Pod> = ns.api();
    api.create(&PostParams::default(), &listener_pod(name, role))
        .await
        .unwrap_or_else(|e| panic!("creating pod {name}: {e}"));
    let pod = wait_for(
        api,
        name,
        &format!("pod {name} ready"),
        TIMEOUT,
        |p: Option<&Pod>| p.is_some_and(|p| is_ready(p) && pod_ip(p).is_some()),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .expect("ready pod");
    let ip = pod_ip(&pod)
        .and_then(|ip| ip.parse().ok())
        .expect("pod IPv4");
    let netns = pod_netns(&pod.uid().expect("uid"));
    assert!(netns.exists(), "{} missing for pod {name}", netns.display());
    Peer {
        name: name.into(),
        ip,
        from: From::Netns(netns),
    }
}

async fn dns(from: &Peer, server: SocketAddr, name: &str) -> std::io::Result<DnsReply> {
    let netns = from.netns().to_path_buf();
    let name = name.to_string();
    tokio::task::spawn_blocking(move || {
        in_netns(&netns, move || {
            query_a(server, &name, Duration::from_secs(2))
        })
    })
    .await
    .expect("join")
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Poll until `name` resolves from `from` to exactly `want`.
async fn expect_resolves(from: &Peer, server: SocketAddr, name: &str, want: Ipv4Addr) {
    let deadline = Instant::now() + SETTLE;
    loop {
        let got = dns(from, server, name).await;
        if let Ok(r) = &got {
            if r.rcode == RCODE_NOERROR && r.addrs == vec![want] {
                eprintln!("  {} resolves {name} -> {want}", from.name);
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{}: {name} did not resolve to {want} within {SETTLE:?}: {got:?}",
            from.name
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn apply(ns: &TestNamespace, policy: serde_json::Value) -> String {
    let np: NetworkPolicy = serde_json::from_value(policy).expect("policy manifest");
    let name = np.name_any();
    ns.api::<NetworkPolicy>()
        .create(&PostParams::default(), &np)
        .await
        .unwrap_or_else(|e| panic!("creating NetworkPolicy {name}: {e}"));
    name
}

async fn delete(ns: &TestNamespace, name: &str) {
    ns.api::<NetworkPolicy>()
        .delete(name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("deleting NetworkPolicy {name}: {e}"));
}

fn lines(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        // Chain headers carry packet counters.
        .map(|l| match l.strip_prefix(':') {
            Some(h) => format!(":{}", h.split(" [").next().unwrap_or(h)),
            None => l.to_string(),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn network_policies_are_enforced_and_cluster_dns_answers_only_cluster_names() {
    let addons_bin = tokio::task::spawn_blocking(|| addons::locate_addons(None))
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("{e}"));
    let mut cfg = ClusterConfig::local(
        &binaries_dir().unwrap_or_else(|e| panic!("{e}")),
        workspace_root().join(".run/e2e-private-netpol"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    cfg.images
        .insert("busybox:*".into(), PathBuf::from("/usr/bin/busybox"));
    let private = private_cluster_with(cfg)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let test = &private.test;
    let info = &test.info;
    let pod_cidr = Ipv4Net::parse(&info.pod_cidr).expect("pod CIDR");
    let gateway = pod_cidr.first_host();

    let before = addons::iptables_filter().expect("iptables-save");
    // Every process cluster has CoreDNS on its pod gateway (`Cluster::up`).
    let dns_server = private.cluster.dns().expect("the process cluster's DNS");
    let mut enforcer = Enforcer::start(info, &addons_bin)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let t0 = Instant::now();

    let ns = test.namespace("netpol").await.expect("namespace");
    let (server, allowed, other) = tokio::join!(
        start_pod(&ns, "server", "server"),
        start_pod(&ns, "allowed", "client"),
        start_pod(&ns, "other", "client"),
    );
    let dns_addr = SocketAddr::from(dns_server.addr());

    // --- Cluster DNS -------------------------------------------------------------------
    eprintln!("cluster DNS at {dns_addr}");
    let web: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"role": "server"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }))
    .expect("service manifest");
    let web = ns
        .api::<Service>()
        .create(&PostParams::default(), &web)
        .await
        .expect("creating Service web");
    let web_ip: Ipv4Addr = web
        .spec
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse().ok())
        .expect("web ClusterIP");
    expect_resolves(
        &allowed,
        dns_addr,
        "kubernetes.default.svc.cluster.local",
        Ipv4Addr::new(10, 96, 0, 1),
    )
    .await;
    expect_resolves(
        &allowed,
        dns_addr,
        &format!("web.{}.svc.cluster.local", ns.name),
        web_ip,
    )
    .await;
    expect_resolves(
        &allowed,
        dns_addr,
        "kube-dns.kube-system.svc.cluster.local",
        DNS_SERVICE_IP,
    )
    .await;
    // Through libc, as a program in a pod resolves: the kubelet's resolv.conf names the
    // gateway (CoreDNS) and the search path, so short names resolve.
    let script = "cat /etc/resolv.conf; echo ---; getent hosts kubernetes.default; echo ---; \
                  getent hosts web; echo ---; getent hosts example.com || echo unresolved";
    let resolver: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "resolver"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "c", "image": "busybox:stable",
                            "command": ["/bin/sh", "-c", script]}],
        },
    }))
    .expect("pod manifest");
    ns.api::<Pod>()
        .create(&PostParams::default(), &resolver)
        .await
        .expect("creating pod resolver");
    let done = wait_for(
        ns.api::<Pod>(),
        "resolver",
        "pod resolver to finish",
        TIMEOUT,
        |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref())
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|ph| ph == "Succeeded" || ph == "Failed")
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let log = test
        .container_log(&ns.name, "resolver", "c")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        done.and_then(|p| p.status).and_then(|s| s.phase).as_deref(),
        Some("Succeeded"),
        "{log}"
    );
    let parts: Vec<&str> = log.split("---").collect();
    assert_eq!(parts.len(), 4, "{log}");
    let resolv: Vec<&str> = parts[0].lines().filter(|l| !l.starts_with('#')).collect();
    assert!(
        resolv.contains(&format!("nameserver {gateway}").as_str())
            && resolv.contains(
                &format!(
                    "search {}.svc.cluster.local svc.cluster.local cluster.local",
                    ns.name
                )
                .as_str()
            )
            && resolv.contains(&"options ndots:5"),
        "the process kubelet's resolv.conf names cluster DNS: {log}"
    );
    let first_word = |part: &str| part.split_whitespace().next().map(str::to_owned);
    assert_eq!(
        first_word(parts[1]).as_deref(),
        Some("10.96.0.1"),
        "kubernetes.default: {log}"
    );
    assert_eq!(
        first_word(parts[2]),
        Some(web_ip.to_string()),
        "web (the test's namespace, through the search path): {log}"
    );
    assert_eq!(parts[3].trim(), "unresolved", "example.com: {log}");

    // Outside the cluster's zones: CoreDNS itself answers REFUSED at once. The binary has
    // no forwarding plugin at all, so nothing could have asked another resolver.
    let outside = dns(&allowed, dns_addr, "example.com")
        .await
        .expect("CoreDNS answers a name outside the cluster");
    assert!(
        outside.rcode == RCODE_REFUSED || outside.rcode == RCODE_NXDOMAIN,
        "example.com: {outside:?}"
    );
    assert!(outside.addrs.is_empty(), "example.com: {outside:?}");
    let plugins = std::process::Command::new(addons_bin.join("coredns"))
        .arg("-plugins")
        .output()
        .expect("coredns -plugins");
    let plugins = String::from_utf8_lossy(&plugins.stdout);
    assert!(plugins.contains("kubernetes"), "{plugins}");
    for forwarder in ["forward", "grpc", "etcd", "route53", "clouddns", "azure"] {
        assert!(
            !plugins.lines().any(|l| l.trim() == forwarder),
            "CoreDNS links {forwarder}: {plugins}"
        );
    }

    // --- The enforcer only names this cluster's addresses --------------------------------
    let svc_cidr = Ipv4Net::parse(SERVICE_CIDR).expect("service CIDR");
    let running = addons::iptables_filter().expect("iptables-save");
    let foreign = foreign_rules(&running, pod_cidr, svc_cidr);
    assert!(
        foreign.is_empty(),
        "rules outside {pod_cidr:?}: {foreign:#?}"
    );

    // --- No policy: everything connects ----------------------------------------------------
    eprintln!(
        "no policy ({:.1?} after the enforcer started)",
        t0.elapsed()
    );
    for (from, to) in [
        (&allowed, &server),
        (&other, &server),
        (&server, &allowed),
        (&allowed, &other),
    ] {
        for port in [8080, 9090] {
            expect(from, to.ip, port, &to.name, true).await;
        }
    }

    // --- Default-deny ingress ----------------------------------------------------------------
    eprintln!("default-deny ingress");
    let deny = apply(
        &ns,
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "default-deny-ingress"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        }),
    )
    .await;
    for (from, to) in [(&allowed, &server), (&other, &server), (&server, &allowed)] {
        for port in [8080, 9090] {
            expect(from, to.ip, port, &to.name, false).await;
        }
    }
    // The node itself (kubelet probes) is still let in, as on a real node.
    let host = tcp_reach(SocketAddr::from((server.ip, 8080)), CONNECT);
    assert_eq!(
        host,
        Reach::Connected,
        "host -> server:8080 under default deny"
    );

    // --- Allow one client on one port --------------------------------------------------------
    eprintln!("allow access=yes (pod allowed) -> server:8080");
    ns.api::<Pod>()
        .patch(
            "allowed",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"labels": {"access": "yes"}}})),
        )
        .await
        .expect("labelling pod allowed");
    let allow = apply(
        &ns,
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "allow-client-8080"},
            "spec": {
                "podSelector": {"matchLabels": {"role": "server"}},
                "policyTypes": ["Ingress"],
                "ingress": [{
                    "from": [{"podSelector": {"matchLabels": {"access": "yes"}}}],
                    "ports": [{"protocol": "TCP", "port": 8080}],
                }],
            },
        }),
    )
    .await;
    expect(&allowed, server.ip, 8080, &server.name, true).await;
    expect(&allowed, server.ip, 9090, &server.name, false).await;
    expect(&other, server.ip, 8080, &server.name, false).await;
    expect(&server, allowed.ip, 8080, &allowed.name, false).await;

    // --- Deleting the policies restores traffic ----------------------------------------------
    eprintln!("policies deleted");
    delete(&ns, &allow).await;
    delete(&ns, &deny).await;
    for (from, to) in [(&other, &server), (&allowed, &server), (&server, &allowed)] {
        for port in [8080, 9090] {
            expect(from, to.ip, port, &to.name, true).await;
        }
    }

    // --- Egress: only DNS and server:8080 ----------------------------------------------------
    eprintln!("egress of 'allowed': DNS + server:8080 only");
    let egress = apply(
        &ns,
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "allowed-egress"},
            "spec": {
                "podSelector": {"matchLabels": {"access": "yes"}},
                "policyTypes": ["Egress"],
                "egress": [
                    {
                        "to": [{"ipBlock": {"cidr": format!("{}/32", dns_server.addr().ip())}}],
                        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                    },
                    {
                        "to": [{"podSelector": {"matchLabels": {"role": "server"}}}],
                        "ports": [{"protocol": "TCP", "port": 8080}],
                    },
                ],
            },
        }),
    )
    .await;
    expect(&allowed, server.ip, 9090, &server.name, false).await;
    expect(&allowed, server.ip, 8080, &server.name, true).await;
    expect(&allowed, other.ip, 8080, &other.name, false).await;
    expect(&allowed, other.ip, 9090, &other.name, false).await;
    expect(&allowed, gateway, info.apiserver_port, "apiserver", false).await;
    expect(
        &allowed,
        dns_server.addr().ip().to_owned(),
        53,
        "CoreDNS (TCP)",
        true,
    )
    .await;
    expect_resolves(
        &allowed,
        dns_addr,
        &format!("web.{}.svc.cluster.local", ns.name),
        web_ip,
    )
    .await;
    // Other pods are not selected by the egress policy.
    expect(&other, server.ip, 9090, &server.name, true).await;
    expect(&other, gateway, info.apiserver_port, "apiserver", true).await;

    eprintln!("egress policy deleted");
    delete(&ns, &egress).await;
    expect(&allowed, server.ip, 9090, &server.name, true).await;
    expect(&allowed, other.ip, 8080, &other.name, true).await;

    if let Some(e) = enforcer.exited_error() {
        panic!("{e}");
    }

    // --- Stopping removes exactly what kube-router added --------------------------------------
    enforcer.stop().await.unwrap_or_else(|e| panic!("{e}"));
    let after = addons::iptables_filter().expect("iptables-save");
    let (before, after) = (lines(&before), lines(&after));
    let ours_left: Vec<&String> = after
        .iter()
        .filter(|l| addons::OUR_CHAIN_PREFIXES.iter().any(|p| l.contains(p)))
        .collect();
    assert!(ours_left.is_empty(), "left behind: {ours_left:#?}");
    // Other writers (other local clusters) may change the table meanwhile: report, not fail.
    let gone: Vec<&String> = before.difference(&after).collect();
    let added: Vec<&String> = after.difference(&before).collect();
    if !gone.is_empty() || !added.is_empty() {
        eprintln!("filter table changed by others during the test: -{gone:#?} +{added:#?}");
    }
    ns.delete().await.expect("deleting namespace");
}
