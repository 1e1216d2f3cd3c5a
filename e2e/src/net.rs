//! Host networking for one local cluster.
//!
//! **Bind-address decision.** Pods live in their own network namespaces and get addresses
//! from the CNI `ptp` plugin with host-local IPAM in the node's pod subnet `10.244.N.0/24`.
//! `ptp` gives the host side of every pod veth the subnet's gateway address `10.244.N.1/32`
//! and points each pod's routes at it, so the gateway is the one host address every pod can
//! always reach. The harness therefore adds `10.244.N.1/32` to the host's `lo` interface
//! (the kernel has no `dummy` interfaces here, and the address must exist before the first
//! pod does, so the veths cannot carry it alone) and binds kube-apiserver to that address
//! only. It is not a public interface: nothing outside this host routes to it, and traffic
//! to it never leaves the machine. Host-side clients (tests, the kubeconfig) use the same
//! address, so the serving certificate, the kubeconfig and the pods all agree.
//! etcd, the controller-manager and the scheduler listen on 127.0.0.1 only.
//!
//! Several clusters can run side by side: each claims the first free `N`
//! (under a lock), recorded with its owner's pid in `/run/cli-mcp-e2e/`, and a claim
//! whose owner died is reclaimed.

use std::fs::{self, File, OpenOptions};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::fcntl::{Flock, FlockArg};

use crate::error::{Error, Result};

/// Directory with the harness' host-wide lock and network claims.
pub const STATE_DIR: &str = "/run/cli-mcp-e2e";
/// Directory the CNI plugins must be installed in (Debian `containernetworking-plugins`).
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";
/// The CNI plugins the process kubelet uses.
pub const CNI_PLUGINS: &[&str] = &["ptp", "host-local", "loopback"];

/// Check what the process kubelet and the harness need from the host; the error says how
/// to fix what is missing.
pub fn preflight() -> Result<()> {
    let mut problems = Vec::new();
    if !nix::unistd::geteuid().is_root() {
        problems.push(
            "the local cluster needs root (network namespaces, veths, addresses on lo); run as root"
                .to_string(),
        );
    }
    let missing: Vec<&str> = CNI_PLUGINS
        .iter()
        .copied()
        .filter(|p| !Path::new(CNI_BIN_DIR).join(p).is_file())
        .collect();
    if !missing.is_empty() {
        problems.push(format!(
            "CNI plugins {missing:?} are missing from {CNI_BIN_DIR}; install them with \
             `apt-get install -y containernetworking-plugins`"
        ));
    }
    match fs::read_to_string("/proc/sys/net/ipv4/ip_forward") {
        Ok(v) if v.trim() == "1" => {}
        Ok(_) => problems.push(
            "IPv4 forwarding is off; enable it with `sysctl -w net.ipv4.ip_forward=1`".to_string(),
        ),
        Err(e) => problems.push(format!("cannot read net.ipv4.ip_forward: {e}")),
    }
    if which("ip").is_none() {
        problems.push("`ip` is missing; install it with `apt-get install -y iproute2`".into());
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::Prerequisite(format!(
            "the host is not ready for the local cluster:\n  - {}\n`make prereqs` \
             (hack/prereqs.sh, as root) installs and sets all of these; `make run`, `make test` \
             and `make cluster` run it first",
            problems.join("\n  - ")
        )))
    }
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn run_ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| Error::Command {
            command: format!("ip {}", args.join(" ")),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(Error::Command {
            command: format!("ip {}", args.join(" ")),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A pick of a free TCP port on `ip`, for a cluster component that binds it a moment later.
///
/// Not the kernel's pick (`bind` to port 0): that comes from the ephemeral range, which every
/// outgoing connection on the machine also draws its local port from, and under the test
/// lanes' load one of those took a picked port before the component bound it (the
/// scheduler: "bind: address already in use", the cluster gone before it was ready). So the
/// pick is a random port of the 12,000 below the ephemeral range, which no connection
/// takes by itself, found free by a bind and never handed out twice by this process. It
/// also stays below Kubernetes' NodePort range (30000–32767): kube-router lets any traffic
/// to a node port through whatever the NetworkPolicies say, so an API server on such a
/// port was reachable from sandboxes (`network_policy` and `real_node_proxy` caught it).
pub fn free_port(ip: Ipv4Addr) -> Result<u16> {
    use rand::Rng as _;
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let range = pick_range(ephemeral_start());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    let mut rng = rand::rng();
    for _ in 0..1000 {
        let port = rng.random_range(range.clone());
        if !given.contains(&port) && TcpListener::bind(SocketAddr::from((ip, port))).is_ok() {
            given.insert(port);
            return Ok(port);
        }
    }
    Err(Error::Other(format!(
        "no free TCP port on {ip} in {}..{} after 1000 tries",
        range.start, range.end
    )))
}

/// First port of the kernel's ephemeral range (32768 when it cannot be read).
fn ephemeral_start() -> u16 {
    fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// First port of Kubernetes' default NodePort range (`--service-node-port-range`).
const NODE_PORTS_START: u16 = 30000;

/// The ports [`free_port`] draws from: up to 12,000 below `ephemeral_start` and the NodePort
/// range, never below 1024 (privileged) and never empty.
fn pick_range(ephemeral_start: u16) -> std::ops::Range<u16> {
    let end = ephemeral_start.clamp(2048, NODE_PORTS_START);
    end.saturating_sub(12_000).max(1024)..end
}

/// The pod subnet of the one node plus its gateway address on `lo`, held for the cluster's
/// lifetime. Dropping it removes the address and the claim.
#[derive(Debug)]
pub struct PodNetwork {
    index: u8,
    /// Prefix length: 24, or shorter for a node that holds more pods (see [`Self::claim_sized`]).
    prefix: u8,
    /// One claim file per `/24` the network spans.
    claims: Vec<PathBuf>,
}

fn lock_state_dir() -> Result<Flock<File>> {
    fs::create_dir_all(STATE_DIR).map_err(|e| Error::io("creating", STATE_DIR, e))?;
    let path = Path::new(STATE_DIR).join("lock");
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io("opening", &path, e))?;
    Flock::lock(f, FlockArg::LockExclusive)
        .map_err(|(_, e)| Error::io("locking", &path, std::io::Error::from(e)))
}

fn pid_alive(pid: i32) -> bool {
    pid > 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// The `/24`s held by live [`PodNetwork`]s of this process. A claim file with our own pid is
/// ambiguous: another cluster of this process (tests bring up several side by side) or a
/// leftover of a dead process whose pid we were given. Only this set tells them apart.
static HELD_HERE: std::sync::Mutex<std::collections::BTreeSet<u8>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn held_here() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<u8>> {
    // A panic while holding the set cannot leave it half-updated (single insert/remove).
    HELD_HERE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The `/24` indexes `first..first + blocks`.
fn span(first: u8, blocks: u16) -> impl Iterator<Item = u8> {
    (u16::from(first)..u16::from(first) + blocks).filter_map(|n| u8::try_from(n).ok())
}

/// Whether the claim file's owner still holds the subnet.
fn claim_held(owner: i32, n: u8) -> bool {
    if owner == std::process::id() as i32 {
        held_here().contains(&n)
    } else {
        pid_alive(owner)
    }
}

/// Ranges that exist only inside this machine: the pod subnets and the Service range.
pub const GUARDED_RANGES: &[&str] = &["10.244.0.0/16", "10.96.0.0/12"];

/// Makes traffic to the pod and Service ranges fail on this host instead of following the
/// default route off the machine. A live pod has a more specific /32 route (added by the CNI
/// plugin), so only addresses with no pod behind them — a deleted pod, a Service ClusterIP
/// (there is no kube-proxy) — hit these `unreachable` routes. They are left in place: they
/// are harmless, and removing them while another local cluster runs would open the hole again.
pub fn guard_routes() -> Result<()> {
    for range in GUARDED_RANGES {
        run_ip(&["route", "replace", "unreachable", range])?;
    }
    Ok(())
}

/// The first `/24` index `N` of each `10.244.N.0/prefix` to try, in order, and how many
/// `/24`s each spans. `10.244.255.0/24` is never used.
fn subnet_candidates(want: Option<u8>, prefix: u8) -> Result<(Vec<u8>, u16)> {
    if !(20..=24).contains(&prefix) {
        return Err(Error::Prerequisite(format!(
            "pod network prefix /{prefix}: use 20..=24 (a /20 holds 4093 pods)"
        )));
    }
    let blocks = 1u16 << (24 - prefix);
    let fits = |n: u16| n.is_multiple_of(blocks) && n + blocks - 1 <= 254;
    let candidates = match want {
        Some(n) if !fits(u16::from(n)) => {
            return Err(Error::Prerequisite(format!(
                "pod subnet {n} does not start a /{prefix} inside 10.244.0.0/16: use a multiple of {blocks} below {}",
                255 - blocks + 1
            )))
        }
        Some(n) => vec![n],
        None => (0..=254u16)
            .filter(|n| fits(*n))
            .filter_map(|n| u8::try_from(n).ok())
            .collect(),
    };
    Ok((candidates, blocks))
}

impl PodNetwork {
    /// Claim `10.244.N.0/24` for the lowest free `N` (or exactly `want` if given) and add its
    /// gateway `10.244.N.1/32` to `lo`.
    pub fn claim(want: Option<u8>) -> Result<PodNetwork> {
        Self::claim_sized(want, 24)
    }

    /// Like [`Self::claim`], but `10.244.N.0/prefix` (`prefix` 20..=24): `2^(24 - prefix)`
    /// consecutive free `/24`s from an aligned `N`, each claimed as if it were one cluster's,
    /// so other clusters step around it. For a node that must hold more than 253 pods.
    pub fn claim_sized(want: Option<u8>, prefix: u8) -> Result<PodNetwork> {
        let (candidates, blocks) = subnet_candidates(want, prefix)?;
        let _lock = lock_state_dir()?;
        guard_routes()?;
        // Addresses and routes of the host, as one text to search (our guard routes aside).
        let scan = || -> Result<String> {
            let routes = run_ip(&["-4", "route", "show", "table", "all"])?;
            let routes: String = routes
                .lines()
                .filter(|l| !l.starts_with("unreachable"))
                .map(|l| format!("{l}\n"))
                .collect();
            Ok(run_ip(&["-4", "-o", "addr", "show"])? + &routes)
        };
        let mut host = scan()?;
        let in_use = |host: &str, n: u8| host.contains(&format!("10.244.{n}."));
        'candidate: for first in candidates {
            let mut claims = Vec::new();
            for n in span(first, blocks) {
                let claim = Path::new(STATE_DIR).join(format!("pod-net-{n}.pid"));
                if let Ok(text) = fs::read_to_string(&claim) {
                    let owner = text.trim().parse::<i32>().unwrap_or(0);
                    if claim_held(owner, n) {
                        continue 'candidate;
                    }
                    // The owner died without cleaning up: take the subnet over.
                    tracing::warn!(
                        subnet = n,
                        owner,
                        "reclaiming the pod network of a dead cluster"
                    );
                    let _ = run_ip(&["addr", "del", &format!("10.244.{n}.1/32"), "dev", "lo"]);
                    let _ = fs::remove_file(&claim);
                    host = scan()?;
                    if in_use(&host, n) && want.is_none() {
                        // Something (stale pod routes) still uses it; leave it alone.
                        continue 'candidate;
                    }
                } else if in_use(&host, n) {
                    if want.is_some() {
                        return Err(Error::Prerequisite(format!(
                        "10.244.{n}.0/24 is already in use on this host (see `ip addr` / `ip route`); \
                         choose another pod subnet"
                    )));
                    }
                    continue 'candidate;
                }
                claims.push(claim);
            }
            for claim in &claims {
                fs::write(claim, format!("{}\n", std::process::id()))
                    .map_err(|e| Error::io("writing", claim, e))?;
            }
            held_here().extend(span(first, blocks));
            let net = PodNetwork {
                index: first,
                prefix,
                claims,
            };
            run_ip(&["addr", "add", &format!("{}/32", net.gateway()), "dev", "lo"])?;
            return Ok(net);
        }
        Err(Error::Prerequisite(
            "no free pod subnet in 10.244.0.0/16; stop other local clusters".into(),
        ))
    }

    /// The pod subnet, e.g. `10.244.0.0/24`.
    pub fn cidr(&self) -> String {
        format!("10.244.{}.0/{}", self.index, self.prefix)
    }

    /// The gateway address, on `lo` and on the host side of every pod veth.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 244, self.index, 1)
    }
}

impl Drop for PodNetwork {
    fn drop(&mut self) {
        let _lock = lock_state_dir();
        let _ = run_ip(&[
            "addr",
            "del",
            &format!("{}/32", self.gateway()),
            "dev",
            "lo",
        ]);
        for claim in &self.claims {
            let _ = fs::remove_file(claim);
        }
        let mut held = held_here();
        for n in span(self.index, 1u16 << (24 - self.prefix)) {
            held.remove(&n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picked_ports_are_below_the_ephemeral_and_node_port_ranges_distinct_and_free() {
        let start = ephemeral_start();
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let p = free_port(Ipv4Addr::LOCALHOST).expect("a port");
            assert!(
                p < start.clamp(2048, NODE_PORTS_START) && p >= 1024,
                "{p} (ephemeral from {start}, node ports from {NODE_PORTS_START})"
            );
            assert!(seen.insert(p), "{p} handed out twice");
        }
        let p = free_port(Ipv4Addr::LOCALHOST).expect("a port");
        TcpListener::bind((Ipv4Addr::LOCALHOST, p)).expect("the picked port binds");
    }

    #[test]
    fn the_pick_range_stays_within_unprivileged_ports() {
        assert_eq!(pick_range(32768), 18000..30000, "below the node ports");
        assert_eq!(pick_range(25000), 13000..25000);
        assert_eq!(pick_range(10000), 1024..10000);
        assert_eq!(pick_range(0), 1024..2048);
    }

    /// Two clusters of one process (tests bring up several side by side) must not share a
    /// subnet, and the second claim must not take the first one's gateway off `lo`.
    #[test]
    fn two_networks_of_one_process_get_their_own_subnets() {
        let first = PodNetwork::claim(None).expect("first claim (needs root and `ip`)");
        let second = PodNetwork::claim(None).expect("second claim");
        assert_ne!(first.index, second.index, "one subnet claimed twice");
        let lo = run_ip(&["-4", "-o", "addr", "show", "dev", "lo"]).expect("ip addr");
        assert!(
            lo.contains(&format!("{}/32", first.gateway())),
            "the first network's gateway was removed from lo:\n{lo}"
        );
        let index = first.index;
        drop(first);
        assert!(
            !held_here().contains(&index),
            "a dropped network is still held"
        );
        // A claim file with this process' pid but no live network is a leftover: reclaimed.
        let stale = Path::new(STATE_DIR).join(format!("pod-net-{index}.pid"));
        fs::write(&stale, format!("{}\n", std::process::id())).expect("plant a stale claim");
        let again = PodNetwork::claim(Some(index)).expect("the leftover claim is taken over");
        assert_eq!(again.index, index);
        drop((second, again));
    }

    #[test]
    fn a_larger_pod_network_starts_aligned_and_spans_its_24s() {
        let (all, blocks) = subnet_candidates(None, 24).expect("/24");
        assert_eq!((all.len(), blocks), (255, 1));
        let (c, blocks) = subnet_candidates(None, 21).expect("/21");
        assert_eq!(blocks, 8);
        assert_eq!(c.first(), Some(&0));
        assert_eq!(c.get(1), Some(&8));
        // 248..=255 would include 10.244.255.0/24, which no cluster uses.
        assert_eq!(c.last(), Some(&240));
        assert_eq!(
            subnet_candidates(Some(16), 21).expect("aligned").0,
            vec![16]
        );
        let e = subnet_candidates(Some(3), 21)
            .expect_err("unaligned")
            .to_string();
        assert!(e.contains("multiple of 8"), "{e}");
        let e = subnet_candidates(None, 16)
            .expect_err("too large")
            .to_string();
        assert!(e.contains("20..=24"), "{e}");
    }
}
