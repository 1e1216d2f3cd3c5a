//! Cluster add-ons of the local Kubernetes: a NetworkPolicy enforcer ([`Enforcer`]:
//! kube-router's firewall controller alone, a host process) and cluster DNS (CoreDNS serving
//! only `cluster.local` and reverse zones, with no forwarder): on the process kubelet a host
//! process ([`ClusterDns`]), on the real node a `kube-system` Deployment labelled
//! `k8s-app: kube-dns` as on real clusters ([`deploy_dns_pod`]); `Cluster::up` starts one or
//! the other on every cluster.
//! Both binaries come from `hack/build-addons.sh` ([`locate_addons`]). See
//! `docs/network-policy.md`.
//!
//! **The enforcer changes the host's iptables filter table**, which every local cluster on
//! the machine shares. kube-router only adds rules that match its own cluster's pod IPs (its
//! jumps are `-s POD_IP`/`-d POD_IP`), but its periodic sync deletes every `KUBE-POD-FW-*`
//! and `KUBE-NWPLCY-*` chain it did not create, so two instances on one host would delete
//! each other's rules. Hence one enforcer per host at a time: the wrapper script
//! ([`enforcer_script`]) holds [`ENFORCER_LOCK`] (flock) for as long as it runs, removes
//! what an earlier, killed enforcer may have left, and on exit (also on the harness's death:
//! it gets SIGTERM as parent-death signal) stops kube-router and removes exactly kube-router's
//! chains, the jumps to them and its ipsets ([`cleanup_commands`]).
//!
//! Pure parts (arguments, Corefile, wrapper script, rule inspection, DNS wire format) are
//! unit-tested below; `e2e/tests/network_policy.rs` proves enforcement with real traffic.

use std::fs;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, Pod, Service, ServiceAccount, ServicePort, ServiceSpec,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointPort, EndpointSlice};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};

use crate::cluster_info::ClusterInfo;
use crate::error::{Error, Result};
use crate::process::{log_tail, Component};

/// Environment variable naming a directory with prebuilt `kube-router` and `coredns`.
pub const ADDONS_BIN_ENV: &str = "CLI_MCP_ADDONS_BIN";
/// The apiserver's `--service-cluster-ip-range`.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// ClusterIP of the `kube-dns` Service in `kube-system`.
pub const DNS_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The cluster domain CoreDNS answers for.
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// Host-wide lock: only one NetworkPolicy enforcer runs on this machine at a time.
pub const ENFORCER_LOCK: &str = "/run/cli-mcp-e2e/network-policy-enforcer.lock";
/// How long a second enforcer waits for the lock before it gives up.
pub const ENFORCER_LOCK_WAIT: Duration = Duration::from_secs(600);
/// Prefixes of the filter-table chains kube-router's firewall creates (and deletes).
pub const OUR_CHAIN_PREFIXES: &[&str] = &["KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-"];
/// Prefixes of the ipsets kube-router's firewall creates (and deletes).
pub const OUR_IPSET_PREFIXES: &[&str] = &["KUBE-SRC-", "KUBE-DST-"];
/// A line the wrapper prints once leftovers are gone and kube-router is being started.
const STARTED_LINE: &str = "cli-mcp-enforcer: kube-router started";

/// The directory with `kube-router` and `coredns`: `dir` if given, else
/// `$CLI_MCP_ADDONS_BIN`, else the last line `hack/build-addons.sh` prints (it returns at
/// once when its cache has them; a cold build takes minutes).
pub fn locate_addons(dir: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(dir) = dir.or_else(|| std::env::var_os(ADDONS_BIN_ENV).map(PathBuf::from)) {
        return Ok(dir);
    }
    let script = crate::workspace::workspace_root().join("hack/build-addons.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| Error::Command {
            command: script.display().to_string(),
            detail: e.to_string(),
        })?;
    crate::build_scripts::bin_dir_from(&script, out, ADDONS_BIN_ENV)
}

/// [`locate_addons`] for a caller that may give up on it (`cli-mcp-cluster up` on SIGTERM,
/// while the real node's cluster DNS waits for a cold add-on build): the script runs in a
/// process group of its own, and dropping the future terminates that group.
pub async fn locate_addons_async(dir: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(dir) = dir.or_else(|| std::env::var_os(ADDONS_BIN_ENV).map(PathBuf::from)) {
        return Ok(dir);
    }
    let script = crate::workspace::workspace_root().join("hack/build-addons.sh");
    let mut cmd = tokio::process::Command::new("bash");
    cmd.arg(&script).stderr(std::process::Stdio::inherit());
    crate::build_scripts::bin_dir_from_cancellable(&script, cmd, ADDONS_BIN_ENV).await
}

/// An IPv4 network `a.b.c.d/len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Net {
    pub addr: Ipv4Addr,
    pub len: u8,
}

impl Ipv4Net {
    /// Parse `a.b.c.d/len` (a bare address is a /32).
    pub fn parse(s: &str) -> Option<Ipv4Net> {
        let (a, l) = s.split_once('/').unwrap_or((s, "32"));
        let len: u8 = l.parse().ok().filter(|l| *l <= 32)?;
        Some(Ipv4Net {
            addr: a.parse().ok()?,
            len,
        })
    }

    fn mask(self) -> u32 {
        if self.len == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(self.len))
        }
    }

    /// Whether `other` lies entirely inside this network.
    pub fn contains(self, other: Ipv4Net) -> bool {
        other.len >= self.len
            && (u32::from(other.addr) & self.mask()) == (u32::from(self.addr) & self.mask())
    }

    /// The first host address (`10.244.N.1` for `10.244.N.0/24`): the pod gateway.
    pub fn first_host(self) -> Ipv4Addr {
        Ipv4Addr::from((u32::from(self.addr) & self.mask()).wrapping_add(1))
    }
}

/// Quote `s` for bash (single quotes).
fn sq(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

// ---------------------------------------------------------------------------------------
// The enforcer

/// What the enforcer of one cluster needs.
#[derive(Debug, Clone)]
pub struct EnforcerConfig {
    pub kube_router: PathBuf,
    pub kubeconfig: PathBuf,
    pub node_name: String,
    pub service_cidr: String,
    pub lock_file: PathBuf,
    pub lock_wait: Duration,
}

impl EnforcerConfig {
    /// The enforcer of `info`'s cluster with binaries from `bin_dir`.
    pub fn for_cluster(info: &ClusterInfo, bin_dir: &Path) -> EnforcerConfig {
        EnforcerConfig {
            kube_router: bin_dir.join("kube-router"),
            kubeconfig: info.kubeconfig.clone(),
            node_name: info.node_name.clone(),
            service_cidr: SERVICE_CIDR.into(),
            lock_file: PathBuf::from(ENFORCER_LOCK),
            lock_wait: ENFORCER_LOCK_WAIT,
        }
    }
}

/// kube-router's arguments: the firewall (NetworkPolicy) controller only. No BGP, no
/// service proxy, no load-balancer allocator, no CNI config, no IPv6, and no health or
/// metrics listener (its health server would listen on every interface).
pub fn kube_router_args(cfg: &EnforcerConfig) -> Vec<String> {
    vec![
        format!("--kubeconfig={}", cfg.kubeconfig.display()),
        format!("--hostname-override={}", cfg.node_name),
        "--run-firewall=true".into(),
        "--run-router=false".into(),
        "--run-service-proxy=false".into(),
        "--run-loadbalancer=false".into(),
        "--enable-cni=false".into(),
        "--enable-ipv4=true".into(),
        "--enable-ipv6=false".into(),
        format!("--service-cluster-ip-range={}", cfg.service_cidr),
        "--health-port=0".into(),
        "--metrics-port=0".into(),
        "--iptables-sync-period=1m".into(),
        "--v=1".into(),
    ]
}

/// Shell commands that remove everything kube-router's firewall adds to the host: the jumps
/// from INPUT/FORWARD/OUTPUT to its chains, its chains (flushed first, then deleted) and its
/// ipsets. Rule by rule with `iptables -w` (no whole-table restore), so concurrent changes
/// of other writers are kept. Only valid while [`ENFORCER_LOCK`] is held: the prefixes are
/// kube-router's, not this cluster's.
pub fn cleanup_commands() -> String {
    let chains = OUR_CHAIN_PREFIXES.join("|");
    let sets = OUR_IPSET_PREFIXES.join("|");
    format!(
        r#"cleanup() {{
    local chain rule set chains
    for chain in INPUT FORWARD OUTPUT; do
        iptables -w -t filter -S "$chain" 2>/dev/null | grep -E -- '-j KUBE-ROUTER-(INPUT|FORWARD|OUTPUT)( |$)' |
            while IFS= read -r rule; do
                eval "iptables -w -t filter -D ${{rule#-A }}"
            done
    done
    chains="$(iptables -w -t filter -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^({chains})/ {{ print $2 }}')"
    for chain in $chains; do iptables -w -t filter -F "$chain"; done
    for chain in $chains; do iptables -w -t filter -X "$chain"; done
    ipset list -n 2>/dev/null | grep -E '^({sets})' | while IFS= read -r set; do
        ipset destroy "$set"
    done
}}
"#
    )
}

/// The wrapper the enforcer runs as: take the host-wide lock (waiting up to `lock_wait`),
/// remove leftovers, run kube-router, and on SIGTERM/SIGINT/SIGHUP (or kube-router's exit)
/// stop it and remove its rules before releasing the lock.
pub fn enforcer_script(cfg: &EnforcerConfig) -> String {
    let lock = sq(&cfg.lock_file.display().to_string());
    let wait = cfg.lock_wait.as_secs();
    let cmd: Vec<String> = std::iter::once(cfg.kube_router.display().to_string())
        .chain(kube_router_args(cfg))
        .map(|a| sq(&a))
        .collect();
    format!(
        r#"#!/usr/bin/env bash
# Generated by cli-mcp-e2e (e2e/src/addons.rs): kube-router's firewall for one local cluster.
set -u
mkdir -p "$(dirname {lock})"
exec 9>>{lock}
if ! flock -n 9; then
    echo "cli-mcp-enforcer: waiting up to {wait} s for {lock}: another local cluster runs the enforcer (one per host)"
    if ! flock -w {wait} 9; then
        echo "cli-mcp-enforcer: error: {lock} is still held after {wait} s; stop the other cluster's enforcer (see docs/network-policy.md)"
        exit 75
    fi
fi
echo "cli-mcp-enforcer: holding {lock}"
{cleanup}
cleanup
trap 'kill -TERM "$child" 2>/dev/null' TERM INT HUP
{cmd} 9>&- &
child=$!
echo "{started} (pid $child)"
wait "$child"
status=$?
while kill -0 "$child" 2>/dev/null; do
    wait "$child"
    status=$?
done
cleanup
echo "cli-mcp-enforcer: kube-router exited ($status); its rules and ipsets are removed"
exit "$status"
"#,
        cleanup = cleanup_commands(),
        cmd = cmd.join(" "),
        started = STARTED_LINE,
    )
}

/// The lines of `iptables-save` output and the ipset names that belong to kube-router's
/// firewall (its chains, rules in them, jumps to them, its sets).
pub fn our_lines(iptables_save: &str, ipsets: &str) -> Vec<String> {
    let ours = |s: &str| OUR_CHAIN_PREFIXES.iter().any(|p| s.contains(p));
    iptables_save
        .lines()
        .filter(|l| ours(l))
        .chain(
            ipsets
                .lines()
                .filter(|l| OUR_IPSET_PREFIXES.iter().any(|p| l.trim().starts_with(p))),
        )
        .map(str::to_owned)
        .collect()
}

/// kube-router's rules that name an address outside `pod_cidr` and `service_cidr` with
/// `-s`/`-d`: rules that could touch another cluster's traffic. Empty when the enforcer only
/// touches its own cluster's pods.
pub fn foreign_rules(iptables_save: &str, pod_cidr: Ipv4Net, service_cidr: Ipv4Net) -> Vec<String> {
    iptables_save
        .lines()
        .filter(|l| l.starts_with("-A ") && OUR_CHAIN_PREFIXES.iter().any(|p| l.contains(p)))
        .filter(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            words.windows(2).any(|w| {
                (w[0] == "-s" || w[0] == "-d")
                    && Ipv4Net::parse(w[1])
                        .is_none_or(|n| !pod_cidr.contains(n) && !service_cidr.contains(n))
            })
        })
        .map(str::to_owned)
        .collect()
}

fn run_text(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| Error::Command {
            command: format!("{program} {}", args.join(" ")),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(Error::Command {
            command: format!("{program} {}", args.join(" ")),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The host's filter table (`iptables-save -t filter`, counters and comments as printed).
pub fn iptables_filter() -> Result<String> {
    run_text("iptables-save", &["-t", "filter"])
}

/// kube-router's lines on the host right now ([`our_lines`] of the live filter table and
/// ipsets).
pub fn host_leftovers() -> Result<Vec<String>> {
    let ipsets = run_text("ipset", &["list", "-n"])?;
    Ok(our_lines(&iptables_filter()?, &ipsets))
}

/// Check what the enforcer needs on this host; the error names the fix.
pub fn enforcer_preflight() -> Result<()> {
    let missing: Vec<&str> = ["iptables", "iptables-save", "ipset", "flock"]
        .into_iter()
        .filter(|p| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {p} >/dev/null")])
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::Prerequisite(format!(
            "the NetworkPolicy enforcer needs {missing:?} on PATH; install them with \
             `apt-get install -y iptables ipset util-linux`"
        )))
    }
}

/// kube-router's firewall controller for one cluster, running under [`enforcer_script`].
/// Dropping it stops kube-router and removes its rules.
#[derive(Debug)]
pub struct Enforcer {
    component: Component,
}

impl Enforcer {
    /// Start the enforcer for `info`'s cluster and wait until its first sync is in the
    /// host's filter table (after waiting for the host-wide lock, if another cluster holds
    /// it).
    pub async fn start(info: &ClusterInfo, bin_dir: &Path) -> Result<Enforcer> {
        enforcer_preflight()?;
        let cfg = EnforcerConfig::for_cluster(info, bin_dir);
        if !cfg.kube_router.is_file() {
            return Err(Error::Prerequisite(format!(
                "{} does not exist; build it with hack/build-addons.sh",
                cfg.kube_router.display()
            )));
        }
        let dir = info.run_dir.join("addons");
        fs::create_dir_all(&dir).map_err(|e| Error::io("creating", &dir, e))?;
        let script = dir.join("enforcer.sh");
        fs::write(&script, enforcer_script(&cfg)).map_err(|e| Error::io("writing", &script, e))?;
        let log = info.log_dir.join("kube-router.log");
        // SIGTERM to the wrapper only (it stops kube-router and cleans up); SIGTERM is also
        // its parent-death signal, so a killed harness still leaves no rules behind.
        let mut component = Component::start(
            "kube-router",
            Path::new("/bin/bash"),
            &[script.display().to_string()],
            &[],
            &log,
            Duration::from_secs(30),
            false,
        )?;
        let deadline = Instant::now() + cfg.lock_wait + Duration::from_secs(120);
        loop {
            if let Some(e) = component.exited_error() {
                return Err(e);
            }
            let started = fs::read_to_string(&log).is_ok_and(|t| t.contains(STARTED_LINE));
            // The explicit-ACCEPT rule is appended by kube-router's first full sync.
            if started
                && run_text(
                    "iptables",
                    &["-w", "-t", "filter", "-S", "KUBE-ROUTER-FORWARD"],
                )
                .is_ok_and(|t| t.contains("0x20000/0x20000"))
            {
                return Ok(Enforcer { component });
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    what: format!(
                        "kube-router's first sync (log {}):\n{}",
                        log.display(),
                        log_tail(&log, 20)
                    ),
                    elapsed: cfg.lock_wait + Duration::from_secs(120),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Path of the wrapper's and kube-router's log.
    pub fn log(&self) -> &Path {
        self.component.log()
    }

    /// An error if kube-router (or its wrapper) exited.
    pub fn exited_error(&mut self) -> Option<Error> {
        self.component.exited_error()
    }

    /// Stop kube-router, let the wrapper remove its rules, and check that none are left.
    pub async fn stop(mut self) -> Result<()> {
        self.component.stop_async().await;
        let left = host_leftovers()?;
        if left.is_empty() {
            Ok(())
        } else {
            Err(Error::Other(format!(
                "kube-router's rules are still on the host after it stopped (see {}):\n{}",
                self.component.log().display(),
                left.join("\n")
            )))
        }
    }
}

// ---------------------------------------------------------------------------------------
// Cluster DNS

/// What CoreDNS of one cluster needs.
#[derive(Debug, Clone)]
pub struct DnsConfig {
    pub coredns: PathBuf,
    pub kubeconfig: PathBuf,
    /// Address CoreDNS binds (the pod gateway: pods reach it, other clusters use others).
    pub listen: Ipv4Addr,
    pub port: u16,
    /// `health` and `ready` listen on 127.0.0.1 at these ports.
    pub health_port: u16,
    pub ready_port: u16,
    pub domain: String,
}

/// The Corefile: one server for the cluster domain and the reverse zones, answered from
/// the Kubernetes API only. No `forward` plugin (it is not even linked into the binary):
/// a name outside these zones matches no server block and gets REFUSED, without a packet
/// leaving the machine.
pub fn corefile(cfg: &DnsConfig) -> String {
    let p = cfg.port;
    let d = &cfg.domain;
    format!(
        r#"{d}:{p} in-addr.arpa:{p} ip6.arpa:{p} {{
    bind {listen}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes {d} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods disabled
        ttl 5
    }}
    cache 5
}}
"#,
        listen = cfg.listen,
        health = cfg.health_port,
        ready = cfg.ready_port,
        kubeconfig = cfg.kubeconfig.display(),
    )
}

/// The `kube-dns` Service (ClusterIP [`DNS_SERVICE_IP`], no selector) and its
/// EndpointSlice pointing at CoreDNS on the host, so that a kube-proxy routes the ClusterIP
/// to it and CoreDNS itself answers `kube-dns.kube-system.svc`.
pub fn kube_dns_objects(endpoint: Ipv4Addr, port: u16) -> (Service, EndpointSlice) {
    let labels = std::collections::BTreeMap::from([
        ("k8s-app".to_string(), "kube-dns".to_string()),
        ("kubernetes.io/name".to_string(), "CoreDNS".to_string()),
    ]);
    let svc_port = |name: &str, proto: &str| ServicePort {
        name: Some(name.into()),
        protocol: Some(proto.into()),
        port: 53,
        target_port: Some(
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i32::from(port)),
        ),
        ..Default::default()
    };
    let service = Service {
        metadata: ObjectMeta {
            name: Some("kube-dns".into()),
            namespace: Some("kube-system".into()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some(DNS_SERVICE_IP.to_string()),
            ports: Some(vec![svc_port("dns", "UDP"), svc_port("dns-tcp", "TCP")]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let ep_port = |name: &str, proto: &str| EndpointPort {
        name: Some(name.into()),
        protocol: Some(proto.into()),
        port: Some(i32::from(port)),
        ..Default::default()
    };
    let slice = EndpointSlice {
        metadata: ObjectMeta {
            name: Some("kube-dns-host".into()),
            namespace: Some("kube-system".into()),
            labels: Some(std::collections::BTreeMap::from([
                (
                    "kubernetes.io/service-name".to_string(),
                    "kube-dns".to_string(),
                ),
                (
                    "endpointslice.kubernetes.io/managed-by".to_string(),
                    "cli-mcp-e2e".to_string(),
                ),
            ])),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: Some(vec![Endpoint {
            addresses: vec![endpoint.to_string()],
            ..Default::default()
        }]),
        ports: Some(vec![ep_port("dns", "UDP"), ep_port("dns-tcp", "TCP")]),
    };
    (service, slice)
}

async fn create_or_keep<K>(api: Api<K>, obj: &K) -> Result<()>
where
    K: Clone + std::fmt::Debug + serde::Serialize + serde::de::DeserializeOwned,
{
    match api.create(&PostParams::default(), obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// CoreDNS of one cluster on the host. Dropping it stops CoreDNS.
#[derive(Debug)]
pub struct ClusterDns {
    component: Component,
    addr: SocketAddrV4,
}

impl ClusterDns {
    /// Start CoreDNS for `info`'s cluster on its pod gateway, port 53, wait until it is
    /// ready (its Kubernetes caches synced), and create the `kube-dns` Service.
    pub async fn start(info: &ClusterInfo, bin_dir: &Path) -> Result<ClusterDns> {
        let pod_cidr = Ipv4Net::parse(&info.pod_cidr).ok_or_else(|| {
            Error::Other(format!(
                "pod CIDR {:?} is not an IPv4 network",
                info.pod_cidr
            ))
        })?;
        let cfg = DnsConfig {
            coredns: bin_dir.join("coredns"),
            kubeconfig: info.kubeconfig.clone(),
            listen: pod_cidr.first_host(),
            port: 53,
            health_port: crate::net::free_port(Ipv4Addr::LOCALHOST)?,
            ready_port: crate::net::free_port(Ipv4Addr::LOCALHOST)?,
            domain: CLUSTER_DOMAIN.into(),
        };
        let dir = info.run_dir.join("addons");
        fs::create_dir_all(&dir).map_err(|e| Error::io("creating", &dir, e))?;
        let conf = dir.join("Corefile");
        fs::write(&conf, corefile(&cfg)).map_err(|e| Error::io("writing", &conf, e))?;
        let log = info.log_dir.join("coredns.log");
        let mut component = Component::start(
            "coredns",
            &cfg.coredns,
            &["-conf".to_string(), conf.display().to_string()],
            &[],
            &log,
            Duration::from_secs(10),
            true,
        )?;
        let ready = format!("http://127.0.0.1:{}/ready", cfg.ready_port);
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| Error::Other(format!("building an HTTP client: {e}")))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(e) = component.exited_error() {
                return Err(e);
            }
            if http
                .get(&ready)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    what: format!("CoreDNS ready at {ready} (log {})", log.display()),
                    elapsed: Duration::from_secs(60),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let client = info.client().await?;
        let (svc, slice) = kube_dns_objects(cfg.listen, cfg.port);
        create_or_keep(
            Api::<Service>::namespaced(client.clone(), "kube-system"),
            &svc,
        )
        .await?;
        create_or_keep(
            Api::<EndpointSlice>::namespaced(client, "kube-system"),
            &slice,
        )
        .await?;
        Ok(ClusterDns {
            component,
            addr: SocketAddrV4::new(cfg.listen, cfg.port),
        })
    }

    /// Why CoreDNS is not running any more, if it exited.
    pub fn exited_error(&mut self) -> Option<Error> {
        self.component.exited_error()
    }

    /// Where pods reach CoreDNS directly (the pod gateway, port 53).
    pub fn addr(&self) -> SocketAddrV4 {
        self.addr
    }

    /// Path of CoreDNS's log.
    pub fn log(&self) -> &Path {
        self.component.log()
    }

    /// Stop CoreDNS.
    pub async fn stop(mut self) {
        self.component.stop_async().await;
    }
}

/// The cluster DNS address the process kubelet writes into pods' resolv.conf: the pod
/// gateway, where [`ClusterDns`] binds port 53. `None` when something on the host already
/// holds port 53 on that address (a local resolver on all addresses): pods would reach the
/// host's resolver there, so `Cluster::up` refuses to start.
pub fn process_cluster_dns(gateway: Ipv4Addr) -> Option<Ipv4Addr> {
    let free = UdpSocket::bind((gateway, 53)).is_ok()
        && std::net::TcpListener::bind((gateway, 53)).is_ok();
    free.then_some(gateway)
}

/// The `kube-dns` Service of a cluster, if it exists.
pub async fn kube_dns_service(client: Client) -> Result<Option<Service>> {
    Ok(Api::<Service>::namespaced(client, "kube-system")
        .get_opt("kube-dns")
        .await?)
}

// ---------------------------------------------------------------------------------------
// Cluster DNS as a kube-system pod (the real node)

/// The CoreDNS image the real node runs: the built `coredns` binary alone, one layer.
pub const DNS_POD_IMAGE: &str = "localhost/cli-mcp-coredns:1";
/// Name of the Deployment, its ServiceAccount and ConfigMap in `kube-system`.
pub const DNS_POD_NAME: &str = "coredns";
/// The label real clusters put on their DNS pods, which NetworkPolicies (the operator's
/// sandbox egress rule among them) select.
pub const DNS_POD_LABEL: (&str, &str) = ("k8s-app", "kube-dns");
/// Inside the pod: `health` and `ready` ports (probed by the kubelet from the node).
pub const DNS_POD_HEALTH_PORT: u16 = 8080;
pub const DNS_POD_READY_PORT: u16 = 8181;
/// The unprivileged user CoreDNS runs as (the number upstream's image uses).
pub const DNS_POD_UID: i64 = 65532;

/// The Corefile of the DNS pod: the same single server block as the host's (cluster names
/// and reverse zones from the API, nothing forwarded), listening on every address of the
/// pod's own network namespace, with the in-cluster API credentials of its ServiceAccount.
pub fn pod_corefile(domain: &str) -> String {
    format!(
        r#"{domain}:53 in-addr.arpa:53 ip6.arpa:53 {{
    errors
    health :{DNS_POD_HEALTH_PORT}
    ready :{DNS_POD_READY_PORT}
    kubernetes {domain} in-addr.arpa ip6.arpa {{
        pods disabled
        ttl 5
    }}
    cache 5
}}
"#
    )
}

/// Everything the DNS pod needs in `kube-system`, in the order it is applied.
#[derive(Debug, Clone)]
pub struct DnsPodObjects {
    pub service_account: ServiceAccount,
    pub cluster_role: ClusterRole,
    pub cluster_role_binding: ClusterRoleBinding,
    pub config_map: ConfigMap,
    pub deployment: Deployment,
    pub service: Service,
}

/// The DNS pod's objects. The pod meets the `restricted` Pod Security Standard (non-root,
/// no privilege escalation, no capability, RuntimeDefault seccomp) with a read-only root
/// filesystem; binding port 53 without `NET_BIND_SERVICE` is allowed by the namespaced
/// sysctl `net.ipv4.ip_unprivileged_port_start`, which both the kubelet and Pod Security
/// count as safe. `dnsPolicy: None` with the pod's own loopback as resolver: CoreDNS never
/// sees the node's resolv.conf, so nothing of the host's resolver configuration is used.
pub fn dns_pod_objects(domain: &str) -> Result<DnsPodObjects> {
    let (lk, lv) = DNS_POD_LABEL;
    let ns = "kube-system";
    let name = DNS_POD_NAME;
    fn parse<T: serde::de::DeserializeOwned>(what: &str, v: serde_json::Value) -> Result<T> {
        serde_json::from_value(v)
            .map_err(|e| Error::Other(format!("the DNS pod's {what} does not parse: {e}")))
    }
    let labels = serde_json::json!({lk: lv, "kubernetes.io/name": "CoreDNS"});
    Ok(DnsPodObjects {
        service_account: parse(
            "ServiceAccount",
            serde_json::json!({
                "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": name, "namespace": ns, "labels": labels},
            }),
        )?,
        cluster_role: parse(
            "ClusterRole",
            serde_json::json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": "system:coredns", "labels": labels},
                "rules": [
                    {"apiGroups": [""], "resources": ["services", "namespaces"],
                     "verbs": ["list", "watch"]},
                    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                     "verbs": ["list", "watch"]},
                ],
            }),
        )?,
        cluster_role_binding: parse(
            "ClusterRoleBinding",
            serde_json::json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": "system:coredns", "labels": labels},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": "system:coredns"},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
            }),
        )?,
        config_map: parse(
            "ConfigMap",
            serde_json::json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": ns, "labels": labels},
                "data": {"Corefile": pod_corefile(domain)},
            }),
        )?,
        deployment: parse(
            "Deployment",
            serde_json::json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": name, "namespace": ns, "labels": labels},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": {lk: lv}},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "serviceAccountName": name,
                            "priorityClassName": "system-cluster-critical",
                            "dnsPolicy": "None",
                            "dnsConfig": {"nameservers": ["127.0.0.1"]},
                            "enableServiceLinks": false,
                            "terminationGracePeriodSeconds": 5,
                            "securityContext": {
                                "runAsNonRoot": true,
                                "runAsUser": DNS_POD_UID,
                                "runAsGroup": DNS_POD_UID,
                                "seccompProfile": {"type": "RuntimeDefault"},
                                "sysctls": [{"name": "net.ipv4.ip_unprivileged_port_start",
                                             "value": "53"}],
                            },
                            "containers": [{
                                "name": "coredns",
                                "image": DNS_POD_IMAGE,
                                "imagePullPolicy": "Never",
                                "args": ["-conf", "/etc/coredns/Corefile"],
                                "ports": [
                                    {"name": "dns", "containerPort": 53, "protocol": "UDP"},
                                    {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
                                ],
                                "resources": {
                                    "requests": {"cpu": "10m", "memory": "32Mi"},
                                    "limits": {"memory": "128Mi"},
                                },
                                "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns",
                                                  "readOnly": true}],
                                "livenessProbe": {
                                    "httpGet": {"path": "/health", "port": DNS_POD_HEALTH_PORT},
                                    "periodSeconds": 10, "failureThreshold": 5,
                                },
                                "readinessProbe": {
                                    "httpGet": {"path": "/ready", "port": DNS_POD_READY_PORT},
                                    "periodSeconds": 1,
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": false,
                                    "readOnlyRootFilesystem": true,
                                    "runAsNonRoot": true,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                            }],
                            "volumes": [{"name": "config", "configMap": {"name": name}}],
                        },
                    },
                },
            }),
        )?,
        service: parse(
            "Service",
            serde_json::json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "kube-dns", "namespace": ns, "labels": labels},
                "spec": {
                    "clusterIP": DNS_SERVICE_IP.to_string(),
                    "selector": {lk: lv},
                    "ports": [
                        {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": "dns"},
                        {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": "dns-tcp"},
                    ],
                },
            }),
        )?,
    })
}

/// Labels `kube-system` with the `restricted` Pod Security level, enforced: a DNS pod that
/// breaks it is refused at admission rather than run.
pub const KUBE_SYSTEM_POD_SECURITY: &[(&str, &str)] = &[
    ("pod-security.kubernetes.io/enforce", "restricted"),
    ("pod-security.kubernetes.io/enforce-version", "latest"),
];

/// Build [`DNS_POD_IMAGE`] from the `coredns` binary: a one-layer image holding `/coredns`
/// and nothing else (the binary is static).
pub fn build_dns_image(coredns: &Path, dir: &Path) -> Result<PathBuf> {
    let root = dir.join("rootfs");
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(root.join("etc/coredns")).map_err(|e| Error::io("creating", &root, e))?;
    let target = root.join("coredns");
    fs::copy(coredns, &target).map_err(|e| Error::io("copying", coredns, e))?;
    let archive = dir.join("coredns.tar");
    crate::node::build_image_archive(
        &root,
        DNS_POD_IMAGE,
        &["/coredns"],
        &dir.join("work"),
        &archive,
    )?;
    let _ = fs::remove_dir_all(&root);
    Ok(archive)
}

const FIELD_MANAGER: &str = "cli-mcp-e2e";

async fn apply<K>(api: Api<K>, obj: &K) -> Result<()>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::Serialize + serde::de::DeserializeOwned,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(obj),
    )
    .await?;
    Ok(())
}

/// Run cluster DNS as the `coredns` Deployment in `kube-system` of a real-node cluster: build
/// and import its image into the node's containerd, enforce `restricted` Pod Security on
/// `kube-system`, apply the ServiceAccount, RBAC, Corefile, Deployment and the `kube-dns`
/// Service (ClusterIP [`DNS_SERVICE_IP`], the kubelet's `clusterDNS`), then wait until the
/// Service's EndpointSlice lists a ready CoreDNS pod (its Kubernetes caches synced) or
/// `timeout` passes. The `coredns` binary comes from [`locate_addons_async`].
pub async fn deploy_dns_pod(info: &ClusterInfo, timeout: Duration) -> Result<()> {
    let socket = info.containerd_socket.clone().ok_or_else(|| {
        Error::Prerequisite(
            "cluster DNS as a pod needs the real node (its containerd); the process kubelet \
             runs CoreDNS on the host (addons::ClusterDns)"
                .into(),
        )
    })?;
    let bin_dir = locate_addons_async(None).await?;
    let coredns = bin_dir.join("coredns");
    if !coredns.is_file() {
        return Err(Error::Prerequisite(format!(
            "{} does not exist; build it with hack/build-addons.sh",
            coredns.display()
        )));
    }
    let dir = info.run_dir.join("node/images/coredns");
    tokio::task::spawn_blocking(move || {
        let archive = build_dns_image(&coredns, &dir)?;
        crate::node::import_image(&socket, &archive)?;
        let _ = fs::remove_file(&archive);
        Ok::<_, Error>(())
    })
    .await
    .map_err(|e| Error::Other(format!("building the DNS image panicked: {e}")))??;

    let client = info.client().await?;
    let labels: std::collections::BTreeMap<String, String> = KUBE_SYSTEM_POD_SECURITY
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Api::<Namespace>::all(client.clone())
        .patch(
            "kube-system",
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(serde_json::json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": "kube-system", "labels": labels},
            })),
        )
        .await?;
    let o = dns_pod_objects(CLUSTER_DOMAIN)?;
    apply(
        Api::<ServiceAccount>::namespaced(client.clone(), "kube-system"),
        &o.service_account,
    )
    .await?;
    apply(Api::<ClusterRole>::all(client.clone()), &o.cluster_role).await?;
    apply(
        Api::<ClusterRoleBinding>::all(client.clone()),
        &o.cluster_role_binding,
    )
    .await?;
    apply(
        Api::<ConfigMap>::namespaced(client.clone(), "kube-system"),
        &o.config_map,
    )
    .await?;
    apply(
        Api::<Deployment>::namespaced(client.clone(), "kube-system"),
        &o.deployment,
    )
    .await?;
    apply(
        Api::<Service>::namespaced(client.clone(), "kube-system"),
        &o.service,
    )
    .await?;

    let slices = Api::<EndpointSlice>::namespaced(client.clone(), "kube-system");
    let ready = crate::wait::wait_for_set(
        slices,
        "kubernetes.io/service-name=kube-dns",
        "a ready CoreDNS pod behind the kube-dns Service",
        timeout,
        |s: &[EndpointSlice]| {
            s.iter().any(|s| {
                s.endpoints
                    .iter()
                    .flatten()
                    .any(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false))
            })
        },
    )
    .await;
    if let Err(e) = ready {
        return Err(Error::Other(format!(
            "{e}; CoreDNS pod: {}",
            dns_pod_state(&client).await
        )));
    }
    Ok(())
}

/// What the DNS pods and their ReplicaSet say, for an error message (why it is not ready:
/// refused at admission, image missing, crashing).
async fn dns_pod_state(client: &Client) -> String {
    let (lk, lv) = DNS_POD_LABEL;
    let lp = kube::api::ListParams::default().labels(&format!("{lk}={lv}"));
    let mut out = Vec::new();
    if let Ok(pods) = Api::<Pod>::namespaced(client.clone(), "kube-system")
        .list(&lp)
        .await
    {
        for p in pods.items {
            out.push(format!(
                "pod {}: {}",
                p.metadata.name.unwrap_or_default(),
                serde_json::to_string(&p.status).unwrap_or_default()
            ));
        }
    }
    if let Ok(rs) = Api::<ReplicaSet>::namespaced(client.clone(), "kube-system")
        .list(&lp)
        .await
    {
        for r in rs.items {
            let conds = r.status.and_then(|s| s.conditions).unwrap_or_default();
            for c in conds {
                out.push(format!(
                    "replicaset {}: {} {}",
                    r.metadata.name.clone().unwrap_or_default(),
                    c.reason.unwrap_or_default(),
                    c.message.unwrap_or_default()
                ));
            }
        }
    }
    if out.is_empty() {
        "no pod and no ReplicaSet condition".into()
    } else {
        out.join("; ")
    }
}

// ---------------------------------------------------------------------------------------
// Traffic from inside a pod's network namespace (for tests)

/// The network namespace the process kubelet creates for the pod with this uid.
pub fn pod_netns(uid: &str) -> PathBuf {
    let short: String = uid
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(8)
        .collect();
    PathBuf::from("/run/netns").join(format!("cm-{short}"))
}

/// The network namespace of a container on the real node, `/proc/<pid>/ns/net` of its task
/// (found through the node's containerd at `socket`). `container_id` is the pod status's
/// `containerID` (`containerd://<id>`, or the bare id). Valid while the container runs.
pub fn container_netns(socket: &Path, container_id: &str) -> Result<PathBuf> {
    let pid = container_task_pid(socket, container_id)?;
    Ok(PathBuf::from(format!("/proc/{pid}/ns/net")))
}

/// The host pid of a container's task on the real node (its init process), from the node's
/// containerd at `socket`; `container_id` as for [`container_netns`].
pub fn container_task_pid(socket: &Path, container_id: &str) -> Result<u32> {
    let id = container_id
        .strip_prefix("containerd://")
        .unwrap_or(container_id);
    let sock = socket.display().to_string();
    let tasks = run_text(
        "ctr",
        &["--address", &sock, "--namespace", "k8s.io", "tasks", "ls"],
    )?;
    let pid = tasks
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?, w.next()?.parse::<u32>().ok()?))
        })
        .find(|(task, _)| *task == id)
        .map(|(_, pid)| pid)
        .ok_or_else(|| {
            Error::Other(format!(
                "container {id} has no running task in the node's containerd ({sock})"
            ))
        })?;
    Ok(pid)
}

/// Run `f` on a new thread that has joined the network namespace at `netns`: sockets it
/// opens live in that namespace (source address = the pod's IP), exactly like the pod's own.
pub fn in_netns<T, F>(netns: &Path, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let ns = fs::File::open(netns).map_err(|e| Error::io("opening", netns, e))?;
    let path = netns.to_path_buf();
    std::thread::spawn(move || -> Result<T> {
        nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| Error::Other(format!("setns into {}: {e}", path.display())))?;
        Ok(f())
    })
    .join()
    .map_err(|_| Error::Other(format!("thread in {} panicked", netns.display())))?
}

/// The result of one TCP connection attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    Connected,
    /// RST or ICMP unreachable (kube-router REJECTs what policy denies).
    Refused,
    TimedOut,
    Failed(String),
}

/// Connect to `addr` once, at most `timeout`.
pub fn tcp_reach(addr: SocketAddr, timeout: Duration) -> Reach {
    match TcpStream::connect_timeout(&addr, timeout) {
        Ok(_) => Reach::Connected,
        Err(e) => match e.kind() {
            std::io::ErrorKind::ConnectionRefused => Reach::Refused,
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Reach::TimedOut,
            _ => match e.raw_os_error() {
                // EHOSTUNREACH / ENETUNREACH / EACCES / EPERM: an ICMP error or a local drop.
                Some(113) | Some(101) | Some(13) | Some(1) => Reach::Refused,
                _ => Reach::Failed(e.to_string()),
            },
        },
    }
}

/// DNS response codes used by the tests.
pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_REFUSED: u8 = 5;

/// A parsed DNS response to an A query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsReply {
    pub rcode: u8,
    pub addrs: Vec<Ipv4Addr>,
}

/// A DNS query (recursion desired) for the A records of `name`.
pub fn encode_query(id: u16, name: &str) -> Vec<u8> {
    let mut q = Vec::with_capacity(name.len() + 18);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name
        .trim_end_matches('.')
        .split('.')
        .filter(|l| !l.is_empty())
    {
        let bytes = &label.as_bytes()[..label.len().min(63)];
        q.push(bytes.len() as u8);
        q.extend_from_slice(bytes);
    }
    q.push(0);
    q.extend_from_slice(&[0, 1, 0, 1]);
    q
}

/// Skip a (possibly compressed) name starting at `at`; the offset after it.
fn skip_name(buf: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let len = *buf.get(at)?;
        if len & 0xC0 == 0xC0 {
            return Some(at + 2);
        }
        if len == 0 {
            return Some(at + 1);
        }
        at += 1 + usize::from(len);
    }
}

/// Parse the response to [`encode_query`] with the same `id`.
pub fn parse_reply(id: u16, buf: &[u8]) -> std::result::Result<DnsReply, String> {
    let be16 =
        |at: usize| -> Option<u16> { Some(u16::from_be_bytes([*buf.get(at)?, *buf.get(at + 1)?])) };
    let short = || format!("short DNS reply ({} bytes)", buf.len());
    if be16(0).ok_or_else(short)? != id {
        return Err("DNS reply with another id".into());
    }
    let flags = be16(2).ok_or_else(short)?;
    if flags & 0x8000 == 0 {
        return Err("not a DNS response".into());
    }
    let qd = be16(4).ok_or_else(short)?;
    let an = be16(6).ok_or_else(short)?;
    let mut at = 12;
    for _ in 0..qd {
        at = skip_name(buf, at).ok_or_else(short)? + 4;
    }
    let mut addrs = Vec::new();
    for _ in 0..an {
        at = skip_name(buf, at).ok_or_else(short)?;
        let rtype = be16(at).ok_or_else(short)?;
        let rdlen = usize::from(be16(at + 8).ok_or_else(short)?);
        let data = buf.get(at + 10..at + 10 + rdlen).ok_or_else(short)?;
        if rtype == 1 && rdlen == 4 {
            addrs.push(Ipv4Addr::new(data[0], data[1], data[2], data[3]));
        }
        at += 10 + rdlen;
    }
    Ok(DnsReply {
        rcode: (flags & 0x000F) as u8,
        addrs,
    })
}

/// Ask `server` (UDP) for the A records of `name`, waiting at most `timeout` for a reply.
pub fn query_a(server: SocketAddr, name: &str, timeout: Duration) -> std::io::Result<DnsReply> {
    let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    sock.set_read_timeout(Some(timeout))?;
    sock.connect(server)?;
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);
    let id = (std::process::id() as u16) ^ NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    sock.send(&encode_query(id, name))?;
    let mut buf = [0u8; 1500];
    let n = sock.recv(&mut buf)?;
    parse_reply(id, &buf[..n]).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> EnforcerConfig {
        EnforcerConfig {
            kube_router: PathBuf::from("/cache/bin/kube-router"),
            kubeconfig: PathBuf::from("/run dir/kubeconfig"),
            node_name: "cli-mcp-node".into(),
            service_cidr: SERVICE_CIDR.into(),
            lock_file: PathBuf::from("/run/cli-mcp-e2e/x.lock"),
            lock_wait: Duration::from_secs(7),
        }
    }

    #[test]
    fn kube_router_runs_the_firewall_only_without_listeners() {
        let args = kube_router_args(&cfg());
        for want in [
            "--run-firewall=true",
            "--run-router=false",
            "--run-service-proxy=false",
            "--run-loadbalancer=false",
            "--enable-ipv6=false",
            "--health-port=0",
            "--metrics-port=0",
            "--hostname-override=cli-mcp-node",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--kubeconfig=/run dir/kubeconfig",
        ] {
            assert!(
                args.iter().any(|a| a == want),
                "{want} missing from {args:?}"
            );
        }
    }

    #[test]
    fn the_wrapper_locks_cleans_runs_and_cleans_again() {
        let s = enforcer_script(&cfg());
        let lock = s.find("flock -n 9").expect("takes the lock");
        let first_cleanup = s.find("\ncleanup\n").expect("cleans up leftovers");
        let run = s
            .find("'/cache/bin/kube-router'")
            .expect("runs kube-router");
        let last_cleanup = s.rfind("\ncleanup\n").expect("cleans up at exit");
        assert!(lock < first_cleanup && first_cleanup < run && run < last_cleanup);
        assert!(s.contains("flock -w 7 9"), "waits lock_wait for the lock");
        assert!(
            s.contains("'--kubeconfig=/run dir/kubeconfig'"),
            "arguments are quoted"
        );
        assert!(
            s.contains("9>&- &"),
            "kube-router does not inherit the lock"
        );
        assert!(
            s.contains("trap 'kill -TERM \"$child\""),
            "SIGTERM reaches kube-router"
        );
    }

    #[test]
    fn cleanup_touches_only_kube_routers_chains_and_sets() {
        let c = cleanup_commands();
        assert!(c.contains("KUBE-ROUTER-|KUBE-POD-FW-|KUBE-NWPLCY-"));
        assert!(c.contains("^(KUBE-SRC-|KUBE-DST-)"));
        assert!(!c.contains("iptables-restore"), "no whole-table restore");
        // Built-in chains are only edited rule by rule (-D), never flushed.
        for builtin in ["INPUT", "FORWARD", "OUTPUT"] {
            assert!(!c.contains(&format!("-F {builtin}")));
        }
    }

    #[test]
    fn the_cleanup_script_is_valid_bash() {
        let out = Command::new("bash")
            .args(["-n", "-c", &enforcer_script(&cfg())])
            .output()
            .expect("bash runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    const SAVE: &str = "*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:KUBE-POD-FW-ABC - [0:0]
:KUBE-ROUTER-FORWARD - [0:0]
:OTHER-CHAIN - [0:0]
-A FORWARD -m comment --comment \"kube-router netpol - X\" -j KUBE-ROUTER-FORWARD
-A FORWARD -d 10.244.9.0/24 -j OTHER-CHAIN
-A KUBE-ROUTER-FORWARD -d 10.244.3.7/32 -m comment --comment \"jump\" -j KUBE-POD-FW-ABC
-A KUBE-ROUTER-FORWARD -s 10.244.3.7/32 -j KUBE-POD-FW-ABC
-A KUBE-POD-FW-ABC -d 10.96.0.0/16 -j RETURN
COMMIT
";

    #[test]
    fn our_lines_are_kube_routers_chains_rules_and_sets() {
        let lines = our_lines(SAVE, "KUBE-SRC-AAA\nKUBE-CLUSTER-IP\nKUBE-DST-BBB\n");
        assert_eq!(lines.len(), 8, "{lines:#?}");
        assert!(lines.iter().all(|l| !l.contains("OTHER-CHAIN")));
        assert!(lines.contains(&"KUBE-SRC-AAA".to_string()));
        assert!(!lines.contains(&"KUBE-CLUSTER-IP".to_string()));
        assert!(our_lines("*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n", "").is_empty());
    }

    #[test]
    fn foreign_rules_name_addresses_outside_the_cluster() {
        let pods = Ipv4Net::parse("10.244.3.0/24").expect("cidr");
        let svc = Ipv4Net::parse(SERVICE_CIDR).expect("cidr");
        assert!(foreign_rules(SAVE, pods, svc).is_empty());
        let other = Ipv4Net::parse("10.244.4.0/24").expect("cidr");
        assert_eq!(foreign_rules(SAVE, other, svc).len(), 2);
    }

    #[test]
    fn ipv4_nets() {
        let n = Ipv4Net::parse("10.244.7.0/24").expect("cidr");
        assert_eq!(n.first_host(), Ipv4Addr::new(10, 244, 7, 1));
        assert!(n.contains(Ipv4Net::parse("10.244.7.9").expect("ip")));
        assert!(!n.contains(Ipv4Net::parse("10.244.8.9").expect("ip")));
        assert!(!n.contains(Ipv4Net::parse("10.244.0.0/16").expect("cidr")));
        assert!(Ipv4Net::parse("0.0.0.0/0").expect("all").contains(n));
        assert_eq!(Ipv4Net::parse("10.0.0.0/33"), None);
        assert_eq!(Ipv4Net::parse("nope"), None);
    }

    fn dns() -> DnsConfig {
        DnsConfig {
            coredns: PathBuf::from("/bin/coredns"),
            kubeconfig: PathBuf::from("/run/kc"),
            listen: Ipv4Addr::new(10, 244, 3, 1),
            port: 53,
            health_port: 4001,
            ready_port: 4002,
            domain: CLUSTER_DOMAIN.into(),
        }
    }

    #[test]
    fn the_corefile_answers_cluster_names_only_and_forwards_nothing() {
        let c = corefile(&dns());
        assert!(
            c.starts_with("cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {"),
            "{c}"
        );
        assert!(c.contains("bind 10.244.3.1\n"));
        assert!(c.contains("kubernetes cluster.local in-addr.arpa ip6.arpa {"));
        assert!(c.contains("kubeconfig /run/kc\n"));
        assert!(c.contains("pods disabled\n"));
        assert!(c.contains("health 127.0.0.1:4001\n") && c.contains("ready 127.0.0.1:4002\n"));
        assert!(c.contains("errors\n"));
        for absent in ["forward", "proxy", "fallthrough", ".:53", "\n. "] {
            assert!(!c.contains(absent), "{absent:?} in {c}");
        }
    }

    #[test]
    fn the_dns_pod_corefile_answers_cluster_names_only() {
        let c = pod_corefile(CLUSTER_DOMAIN);
        assert!(
            c.starts_with("cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {"),
            "{c}"
        );
        assert!(c.contains("health :8080\n") && c.contains("ready :8181\n"));
        assert!(c.contains("pods disabled\n"));
        // In-cluster credentials (the pod's ServiceAccount), no kubeconfig, no bind.
        for absent in [
            "kubeconfig",
            "bind",
            "forward",
            "proxy",
            "fallthrough",
            ".:53",
        ] {
            assert!(!c.contains(absent), "{absent:?} in {c}");
        }
    }

    #[test]
    fn the_dns_pod_is_restricted_labelled_kube_dns_and_behind_the_cluster_dns_ip() {
        let o = dns_pod_objects(CLUSTER_DOMAIN).expect("objects");
        let d = o.deployment.spec.clone();
        let tpl = d.template;
        let labels = tpl.metadata.and_then(|m| m.labels).expect("pod labels");
        assert_eq!(labels["k8s-app"], "kube-dns");
        let spec = tpl.spec.expect("pod spec");
        assert_eq!(spec.service_account_name.as_deref(), Some("coredns"));
        assert_eq!(spec.dns_policy.as_deref(), Some("None"));
        assert_eq!(
            spec.dns_config.and_then(|c| c.nameservers),
            Some(vec!["127.0.0.1".to_string()])
        );
        let psc = spec.security_context.expect("pod securityContext");
        assert_eq!(psc.run_as_non_root, Some(true));
        assert_eq!(psc.run_as_user, Some(DNS_POD_UID));
        assert_eq!(
            psc.seccomp_profile.map(|p| p.type_).as_deref(),
            Some("RuntimeDefault")
        );
        let sysctls = psc.sysctls.expect("sysctls");
        assert_eq!(sysctls[0].name, "net.ipv4.ip_unprivileged_port_start");
        assert_eq!(sysctls[0].value, "53");
        let c = &spec.containers[0];
        assert_eq!(c.image.as_deref(), Some(DNS_POD_IMAGE));
        assert_eq!(c.image_pull_policy.as_deref(), Some("Never"));
        let sc = c
            .security_context
            .clone()
            .expect("container securityContext");
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        let caps = sc.capabilities.expect("capabilities");
        assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
        assert_eq!(caps.add, None, "no capability is added back");
        let cm = o.config_map.data.expect("Corefile");
        assert_eq!(cm["Corefile"], pod_corefile(CLUSTER_DOMAIN));

        let svc = o.service.spec.expect("service spec");
        assert_eq!(svc.cluster_ip.as_deref(), Some("10.96.0.10"));
        assert_eq!(
            svc.cluster_ip.as_deref(),
            Some(crate::node::CLUSTER_DNS.to_string().as_str()),
            "the address the real kubelet writes into pods' resolv.conf"
        );
        assert_eq!(
            svc.selector.expect("selector")["k8s-app"],
            "kube-dns",
            "the Service selects the pod"
        );
        let rules = o.cluster_role.rules.expect("rules");
        let granted: Vec<(String, String)> = rules
            .iter()
            .flat_map(|r| {
                r.resources
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .flat_map(move |res| r.verbs.clone().into_iter().map(move |v| (res.clone(), v)))
            })
            .collect();
        for want in ["services", "endpointslices", "namespaces"] {
            for verb in ["list", "watch"] {
                assert!(
                    granted.contains(&(want.to_string(), verb.to_string())),
                    "{want} {verb}: {granted:?}"
                );
            }
        }
        assert!(
            granted.iter().all(|(_, v)| v == "list" || v == "watch"),
            "read-only: {granted:?}"
        );
        let subject = &o.cluster_role_binding.subjects.expect("subjects")[0];
        assert_eq!(
            (subject.name.as_str(), subject.namespace.as_deref()),
            ("coredns", Some("kube-system"))
        );
    }

    #[test]
    fn the_dns_image_holds_only_the_binary() {
        let dir = std::env::temp_dir().join(format!("cli-mcp-dns-image-{}", std::process::id()));
        let bin = dir.join("coredns-bin");
        fs::create_dir_all(&dir).expect("dir");
        fs::write(&bin, b"#!/bin/true\n").expect("binary");
        let archive = build_dns_image(&bin, &dir.join("build")).expect("image");
        let out = Command::new("tar")
            .arg("-xOf")
            .arg(&archive)
            .arg("manifest.json")
            .output()
            .expect("tar");
        let m: serde_json::Value = serde_json::from_slice(&out.stdout).expect("manifest");
        assert_eq!(m[0]["RepoTags"][0], DNS_POD_IMAGE);
        let layer = m[0]["Layers"][0].as_str().expect("layer").to_string();
        let listing = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "tar -xOf '{}' '{layer}' | tar -t",
                archive.display()
            ))
            .output()
            .expect("tar");
        let files: Vec<String> = String::from_utf8_lossy(&listing.stdout)
            .lines()
            .map(|l| l.trim_start_matches("./").trim_end_matches('/').to_string())
            .filter(|l| !l.is_empty())
            .collect();
        assert_eq!(files, ["coredns", "etc", "etc/coredns"], "{files:?}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn process_pods_get_no_cluster_dns_where_port_53_is_taken() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP: binding port 53 needs root");
            return;
        }
        // Loopback addresses no cluster uses (every pod gateway is in 10.244.0.0/16).
        let free = Ipv4Addr::new(127, 77, 0, 1);
        assert_eq!(process_cluster_dns(free), Some(free));
        let taken = Ipv4Addr::new(127, 77, 0, 2);
        let _resolver = UdpSocket::bind((taken, 53)).expect("holding UDP 53");
        assert_eq!(process_cluster_dns(taken), None, "a resolver holds UDP 53");
        let tcp_only = Ipv4Addr::new(127, 77, 0, 3);
        let _listener = std::net::TcpListener::bind((tcp_only, 53)).expect("holding TCP 53");
        assert_eq!(
            process_cluster_dns(tcp_only),
            None,
            "a resolver holds TCP 53"
        );
    }

    #[test]
    fn kube_dns_service_points_at_coredns() {
        let (svc, slice) = kube_dns_objects(Ipv4Addr::new(10, 244, 3, 1), 53);
        let spec = svc.spec.expect("spec");
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.10"));
        assert_eq!(spec.selector, None);
        assert_eq!(spec.ports.expect("ports").len(), 2);
        assert_eq!(
            slice.endpoints.expect("endpoints")[0].addresses,
            vec!["10.244.3.1".to_string()]
        );
        assert_eq!(
            slice.metadata.labels.expect("labels")["kubernetes.io/service-name"],
            "kube-dns"
        );
    }

    #[test]
    fn pod_netns_names_match_the_process_kubelet() {
        assert_eq!(
            pod_netns("1f2e3d4c-5b6a-7980-abcd-ef0123456789"),
            PathBuf::from("/run/netns/cm-1f2e3d4c")
        );
    }

    #[test]
    fn dns_query_and_reply_round_trip() {
        let q = encode_query(0x1234, "kubernetes.default.svc.cluster.local.");
        assert_eq!(&q[..2], &[0x12, 0x34]);
        assert_eq!(q[12], 10);
        assert_eq!(&q[13..23], b"kubernetes");
        // A reply: the question echoed, one A answer with a compressed name.
        let mut r = q.clone();
        r[2] = 0x85; // response, authoritative, RD
        r[3] = 0x80; // RA, rcode 0
        r[7] = 1; // ancount
        r.extend_from_slice(&[0xC0, 12, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4, 10, 96, 0, 1]);
        assert_eq!(
            parse_reply(0x1234, &r),
            Ok(DnsReply {
                rcode: RCODE_NOERROR,
                addrs: vec![Ipv4Addr::new(10, 96, 0, 1)]
            })
        );
        let mut refused = q.clone();
        refused[2] = 0x81;
        refused[3] = 0x05;
        assert_eq!(
            parse_reply(0x1234, &refused).map(|r| r.rcode),
            Ok(RCODE_REFUSED)
        );
        assert!(parse_reply(0x9999, &r).is_err(), "other id");
        assert!(parse_reply(0x1234, &q).is_err(), "a query is not a reply");
        assert!(parse_reply(0x1234, &r[..r.len() - 3]).is_err(), "truncated");
    }
}
