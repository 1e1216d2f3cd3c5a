//! ClusterIP Services, inside each pod's network namespace.
//!
//! There is no kube-proxy on this node: parallel process clusters on one host share the
//! Service range (10.96.0.0/12), so host-wide NAT rules of one cluster would capture another's
//! traffic. Instead every pod's own network namespace gets the rules of its cluster: the CNI
//! config routes the Service range to the gateway (see `kubelet.rs`), and an
//! `iptables-restore` of that namespace's `nat` and `filter` tables (which belong to the
//! kubelet: nothing else writes rules inside a pod's namespace) DNATs `ClusterIP:port` to a
//! ready endpoint's `IP:port`, spread over the endpoints with the `statistic` match, and
//! REJECTs whatever is still addressed to the Service range afterwards (a Service without
//! ready endpoints, an unknown ClusterIP or port), so such a connection is refused at once
//! instead of reaching the host.
//!
//! One task watches Services and EndpointSlices (reflectors over all namespaces), renders the
//! rules whenever they change and rewrites them in every attached namespace; a worker attaches
//! its pod's namespace right after the CNI `ADD` (the current rules are written before any
//! container starts) and detaches it before deleting it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt as _, StreamExt as _};
use ipnet::Ipv4Net;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt as _;
use kube::{Api, Client};
use tokio::io::AsyncWriteExt as _;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

const CHAIN: &str = "CLI-MCP-SERVICES";
/// Namespaces rewritten at once when the rules change.
const PARALLEL_WRITES: usize = 8;

/// One Service port and where its traffic goes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mapping {
    /// `namespace/name:port-name`, for the rule comment.
    pub what: String,
    pub protocol: &'static str,
    pub cluster_ip: Ipv4Addr,
    pub port: u16,
    /// Ready endpoints, sorted and unique.
    pub endpoints: Vec<(Ipv4Addr, u16)>,
}

fn protocol(p: Option<&str>) -> Option<&'static str> {
    match p.unwrap_or("TCP") {
        "TCP" => Some("tcp"),
        "UDP" => Some("udp"),
        // SCTP: not routed (the REJECT rule refuses it).
        _ => None,
    }
}

/// The mappings of all Services with an IPv4 ClusterIP, from the observed objects.
pub fn mappings(services: &[Arc<Service>], slices: &[Arc<EndpointSlice>]) -> Vec<Mapping> {
    // (namespace, service name) → its IPv4 slices.
    let mut by_service: BTreeMap<(&str, &str), Vec<&EndpointSlice>> = BTreeMap::new();
    for s in slices {
        if s.address_type != "IPv4" {
            continue;
        }
        let (Some(ns), Some(svc)) = (
            s.metadata.namespace.as_deref(),
            s.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("kubernetes.io/service-name"))
                .map(String::as_str),
        ) else {
            continue;
        };
        by_service.entry((ns, svc)).or_default().push(s);
    }
    let mut out = Vec::new();
    for svc in services {
        let (Some(ns), Some(name), Some(spec)) = (
            svc.metadata.namespace.as_deref(),
            svc.metadata.name.as_deref(),
            svc.spec.as_ref(),
        ) else {
            continue;
        };
        if spec.type_.as_deref() == Some("ExternalName") {
            continue;
        }
        let ips: BTreeSet<Ipv4Addr> = spec
            .cluster_ips
            .iter()
            .flatten()
            .chain(spec.cluster_ip.iter())
            .filter_map(|ip| ip.parse().ok())
            .collect();
        if ips.is_empty() {
            continue;
        }
        let own = by_service
            .get(&(ns, name))
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        for sp in spec.ports.iter().flatten() {
            let Some(proto) = protocol(sp.protocol.as_deref()) else {
                continue;
            };
            let Ok(port) = u16::try_from(sp.port) else {
                continue;
            };
            let port_name = sp.name.as_deref().unwrap_or("");
            let mut endpoints = BTreeSet::new();
            for slice in own {
                // The slice port with the Service port's name and protocol carries the
                // resolved target port (named target ports included).
                let Some(target) = slice.ports.iter().flatten().find_map(|p| {
                    let same = p.name.as_deref().unwrap_or("") == port_name
                        && protocol(p.protocol.as_deref()) == Some(proto);
                    same.then_some(p.port)
                        .flatten()
                        .and_then(|p| u16::try_from(p).ok())
                }) else {
                    continue;
                };
                for ep in slice.endpoints.iter().flatten() {
                    // As kube-proxy: an unknown readiness counts as ready.
                    if ep.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                        continue;
                    }
                    for a in &ep.addresses {
                        if let Ok(ip) = a.parse::<Ipv4Addr>() {
                            endpoints.insert((ip, target));
                        }
                    }
                }
            }
            for ip in &ips {
                out.push(Mapping {
                    what: format!("{ns}/{name}:{port_name}"),
                    protocol: proto,
                    cluster_ip: *ip,
                    port,
                    endpoints: endpoints.iter().copied().collect(),
                });
            }
        }
    }
    out.sort();
    out
}

/// The `iptables-restore` input for a pod namespace: its whole `nat` and `filter` tables.
pub fn render(range: Ipv4Net, mappings: &[Mapping]) -> String {
    let mut s = String::new();
    s.push_str("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n");
    s.push_str(":POSTROUTING ACCEPT [0:0]\n");
    let _ = writeln!(s, ":{CHAIN} - [0:0]");
    let _ = writeln!(s, "-A OUTPUT -d {range} -j {CHAIN}");
    for m in mappings {
        let n = m.endpoints.len();
        for (i, (ip, port)) in m.endpoints.iter().enumerate() {
            let _ = write!(
                s,
                "-A {CHAIN} -d {}/32 -p {p} -m {p} --dport {} -m comment --comment \"{}\"",
                m.cluster_ip,
                m.port,
                m.what,
                p = m.protocol
            );
            if i + 1 < n {
                // Rule i takes 1/(n-i) of what the rules before it left: uniform overall.
                let _ = write!(
                    s,
                    " -m statistic --mode random --probability {:.10}",
                    1.0 / (n - i) as f64
                );
            }
            let _ = writeln!(s, " -j DNAT --to-destination {ip}:{port}");
        }
    }
    s.push_str(
        "COMMIT\n*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n",
    );
    let _ = writeln!(
        s,
        "-A OUTPUT -d {range} -m comment --comment \"no ready endpoint for this Service address\" -j REJECT"
    );
    s.push_str("COMMIT\n");
    s
}

struct State {
    rules: Arc<str>,
    attached: BTreeSet<String>,
}

/// The Service rules of this node's pods.
pub struct Services {
    range: Ipv4Net,
    /// `None` when `iptables-restore` is missing: pods then get no Services.
    restore: Option<std::path::PathBuf>,
    state: Mutex<State>,
}

fn find_restore() -> Option<std::path::PathBuf> {
    crate::env::DEFAULT_PATH
        .split(':')
        .map(|d| std::path::Path::new(d).join("iptables-restore"))
        .find(|p| p.is_file())
}

impl Services {
    pub fn new(range: Ipv4Net) -> Services {
        let restore = find_restore();
        if restore.is_none() {
            tracing::warn!(
                "iptables-restore not found: pods get no ClusterIP Services \
                 (run `apt-get install -y iptables`)"
            );
        }
        Services {
            range,
            restore,
            state: Mutex::new(State {
                rules: render(range, &[]).into(),
                attached: BTreeSet::new(),
            }),
        }
    }

    pub fn range(&self) -> Ipv4Net {
        self.range
    }

    /// Writes the current rules into a new pod namespace and keeps it up to date from now on.
    pub async fn attach(&self, netns: &str) -> Result<(), String> {
        let Some(restore) = &self.restore else {
            return Ok(());
        };
        let mut state = self.state.lock().await;
        write_rules(restore, netns, &state.rules).await?;
        state.attached.insert(netns.to_string());
        Ok(())
    }

    /// Stops updating a namespace (before it is deleted).
    pub async fn detach(&self, netns: &str) {
        self.state.lock().await.attached.remove(netns);
    }

    /// Rewrites every attached namespace when the rules changed.
    async fn update(&self, rules: String) {
        let Some(restore) = &self.restore else {
            return;
        };
        let mut state = self.state.lock().await;
        if *state.rules == *rules {
            return;
        }
        state.rules = rules.into();
        let rules = state.rules.clone();
        let results: Vec<(String, Result<(), String>)> =
            futures::stream::iter(state.attached.iter().cloned())
                .map(|ns| {
                    let rules = rules.clone();
                    async move {
                        let r = write_rules(restore, &ns, &rules).await;
                        (ns, r)
                    }
                })
                .buffer_unordered(PARALLEL_WRITES)
                .collect()
                .await;
        for (ns, r) in results {
            if let Err(e) = r {
                if crate::netns::exists(&ns) {
                    tracing::warn!(netns = %ns, "updating Service rules failed: {e}");
                } else {
                    state.attached.remove(&ns);
                }
            }
        }
    }
}

async fn write_rules(restore: &std::path::Path, netns: &str, rules: &str) -> Result<(), String> {
    let mut child = tokio::process::Command::new("ip")
        .args(["netns", "exec", netns])
        .arg(restore)
        .args(["-w", "5"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run `ip netns exec` (install iproute2): {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(rules.as_bytes())
            .await
            .map_err(|e| format!("writing rules to iptables-restore in {netns}: {e}"))?;
    }
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .map_err(|_| format!("iptables-restore in {netns} timed out after 30s"))?
        .map_err(|e| format!("iptables-restore in {netns}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "iptables-restore in {netns} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

enum Kind {
    /// Part of a (re)listing, which ends with `Synced`.
    Listing,
    Synced,
    Changed,
}

fn kind<K>(ev: Result<Event<K>, watcher::Error>) -> Result<Kind, String> {
    match ev {
        Ok(Event::Init | Event::InitApply(_)) => Ok(Kind::Listing),
        Ok(Event::InitDone) => Ok(Kind::Synced),
        Ok(Event::Apply(_) | Event::Delete(_)) => Ok(Kind::Changed),
        Err(e) => Err(e.to_string()),
    }
}

/// Watches Services and EndpointSlices until `cancel`, keeping every attached namespace's
/// rules current.
pub async fn run(services: Arc<Services>, client: Client, cancel: CancellationToken) {
    let (svc_store, svc_writer) = reflector::store::<Service>();
    let (eps_store, eps_writer) = reflector::store::<EndpointSlice>();
    let svc_stream = reflector::reflector(
        svc_writer,
        watcher::watcher(Api::<Service>::all(client.clone()), Default::default()),
    )
    .default_backoff()
    .map(|e| (true, kind(e)));
    let eps_stream = reflector::reflector(
        eps_writer,
        watcher::watcher(Api::<EndpointSlice>::all(client), Default::default()),
    )
    .default_backoff()
    .map(|e| (false, kind(e)));
    let mut events = futures::stream::select(svc_stream, eps_stream).boxed();
    let (mut svc_synced, mut eps_synced) = (false, false);
    loop {
        let first = tokio::select! {
            _ = cancel.cancelled() => return,
            ev = events.next() => ev,
        };
        let mut batch = vec![first];
        // A burst (an initial listing, a Deployment scaling) is rendered once.
        while let Some(ev) = events.next().now_or_never() {
            batch.push(ev);
        }
        let mut changed = false;
        for ev in batch {
            let Some((is_svc, ev)) = ev else {
                tracing::error!("Service/EndpointSlice watch ended unexpectedly");
                return;
            };
            match ev {
                Ok(Kind::Synced) => {
                    if is_svc {
                        svc_synced = true;
                    } else {
                        eps_synced = true;
                    }
                    changed = true;
                }
                // A relisting ends with InitDone; render the whole new listing then.
                Ok(Kind::Listing) => {}
                Ok(Kind::Changed) => changed = true,
                Err(e) => tracing::warn!("Service/EndpointSlice watch error (retrying): {e}"),
            }
        }
        if changed && svc_synced && eps_synced {
            let rules = render(
                services.range(),
                &mappings(&svc_store.state(), &eps_store.state()),
            );
            services.update(rules).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(v: serde_json::Value) -> Arc<Service> {
        Arc::new(serde_json::from_value(v).expect("service"))
    }
    fn slice(v: serde_json::Value) -> Arc<EndpointSlice> {
        Arc::new(serde_json::from_value(v).expect("slice"))
    }

    fn web() -> Arc<Service> {
        svc(json!({
            "metadata": {"namespace": "a", "name": "web"},
            "spec": {"clusterIP": "10.96.7.7", "clusterIPs": ["10.96.7.7"],
                     "ports": [{"name": "http", "port": 80, "targetPort": "http"},
                               {"name": "dns", "port": 53, "protocol": "UDP"}]},
        }))
    }

    fn web_slice(name: &str, eps: serde_json::Value) -> Arc<EndpointSlice> {
        slice(json!({
            "metadata": {"namespace": "a", "name": name,
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": eps,
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                      {"name": "dns", "port": 5353, "protocol": "UDP"}],
        }))
    }

    #[test]
    fn ready_endpoints_of_every_slice_are_mapped_per_port_and_protocol() {
        let slices = [
            web_slice(
                "web-1",
                json!([{"addresses": ["10.244.1.3"], "conditions": {"ready": true}},
                       {"addresses": ["10.244.1.4"], "conditions": {"ready": false}}]),
            ),
            web_slice("web-2", json!([{"addresses": ["10.244.1.2"]}])),
            // Another Service's slice and an IPv6 slice are ignored.
            slice(json!({"metadata": {"namespace": "b", "name": "x",
                         "labels": {"kubernetes.io/service-name": "web"}},
                         "addressType": "IPv4",
                         "endpoints": [{"addresses": ["10.244.1.9"]}],
                         "ports": [{"name": "http", "port": 1}]})),
            slice(json!({"metadata": {"namespace": "a", "name": "v6",
                         "labels": {"kubernetes.io/service-name": "web"}},
                         "addressType": "IPv6",
                         "endpoints": [{"addresses": ["fd00::1"]}],
                         "ports": [{"name": "http", "port": 1}]})),
        ];
        let m = mappings(&[web()], &slices);
        assert_eq!(m.len(), 2, "{m:?}");
        let tcp = m.iter().find(|m| m.protocol == "tcp").expect("tcp");
        assert_eq!(tcp.cluster_ip, Ipv4Addr::new(10, 96, 7, 7));
        assert_eq!(tcp.port, 80);
        assert_eq!(
            tcp.endpoints,
            vec![
                (Ipv4Addr::new(10, 244, 1, 2), 8080),
                (Ipv4Addr::new(10, 244, 1, 3), 8080)
            ]
        );
        let udp = m.iter().find(|m| m.protocol == "udp").expect("udp");
        assert_eq!(udp.port, 53);
        assert_eq!(udp.endpoints.len(), 2);
        assert!(udp.endpoints.iter().all(|(_, p)| *p == 5353));
    }

    #[test]
    fn headless_external_and_sctp_services_get_no_mapping() {
        let services = [
            svc(json!({"metadata": {"namespace": "a", "name": "h"},
                       "spec": {"clusterIP": "None", "ports": [{"port": 80}]}})),
            svc(json!({"metadata": {"namespace": "a", "name": "e"},
                       "spec": {"type": "ExternalName", "externalName": "example.com"}})),
            svc(json!({"metadata": {"namespace": "a", "name": "s"},
                       "spec": {"clusterIP": "10.96.0.9",
                                "ports": [{"port": 80, "protocol": "SCTP"}]}})),
        ];
        assert!(mappings(&services, &[]).is_empty());
    }

    #[test]
    fn rules_spread_over_endpoints_and_reject_the_rest_of_the_range() {
        let range: Ipv4Net = "10.96.0.0/12".parse().expect("net");
        let m = Mapping {
            what: "a/web:http".into(),
            protocol: "tcp",
            cluster_ip: Ipv4Addr::new(10, 96, 7, 7),
            port: 80,
            endpoints: vec![
                (Ipv4Addr::new(10, 244, 1, 2), 8080),
                (Ipv4Addr::new(10, 244, 1, 3), 8080),
                (Ipv4Addr::new(10, 244, 1, 4), 8080),
            ],
        };
        let text = render(range, &[m]);
        let dnat: Vec<&str> = text.lines().filter(|l| l.contains("DNAT")).collect();
        assert_eq!(dnat.len(), 3);
        assert!(
            dnat[0].contains("--probability 0.3333333333"),
            "{}",
            dnat[0]
        );
        assert!(
            dnat[1].contains("--probability 0.5000000000"),
            "{}",
            dnat[1]
        );
        assert!(!dnat[2].contains("statistic"), "{}", dnat[2]);
        assert!(dnat[2].ends_with("-j DNAT --to-destination 10.244.1.4:8080"));
        assert!(dnat[0].starts_with("-A CLI-MCP-SERVICES -d 10.96.7.7/32 -p tcp -m tcp --dport 80"));
        assert!(text.contains("-A OUTPUT -d 10.96.0.0/12 -j CLI-MCP-SERVICES\n"));
        assert!(text.contains("\n-A OUTPUT -d 10.96.0.0/12 -m comment"));
        assert!(text.trim_end().ends_with("-j REJECT\nCOMMIT"));
        // No endpoints: no DNAT, so the REJECT answers.
        let empty = Mapping {
            endpoints: Vec::new(),
            ..mappings(&[web()], &[])[0].clone()
        };
        assert!(!render(range, &[empty]).contains("DNAT"));
    }
}
