//! The NetworkPolicy enforcer: kube-router's firewall controller alone, a host process
//! under a wrapper script that holds the host-wide lock and removes kube-router's rules on
//! exit (see the module docs of [`crate::addons`]).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::ipv4_net::Ipv4Net;
use super::{run_text, SERVICE_CIDR};
use crate::cluster_info::ClusterInfo;
use crate::error::{Error, Result};
use crate::process::{log_tail, Component};

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

/// Quote `s` for bash (single quotes).
fn sq(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

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
}
