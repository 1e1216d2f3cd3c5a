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
//!
//! - `enforcer`: the NetworkPolicy enforcer ([`Enforcer`]) and its rule inspection;
//! - `host_dns`: CoreDNS on the host for the process kubelet ([`ClusterDns`]);
//! - `dns_pod`: CoreDNS as a `kube-system` Deployment on the real node ([`deploy_dns_pod`]);
//! - `ipv4_net`: IPv4 networks ([`Ipv4Net`]);
//! - `netns`, `dns_wire`: for tests, traffic from a pod's network namespace and DNS
//!   queries.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;

use crate::error::{Error, Result};

mod dns_pod;
mod dns_wire;
mod enforcer;
mod host_dns;
mod ipv4_net;
mod netns;

pub use dns_pod::*;
pub use dns_wire::*;
pub use enforcer::*;
pub use host_dns::*;
pub use ipv4_net::Ipv4Net;
pub use netns::*;

/// Environment variable naming a directory with prebuilt `kube-router` and `coredns`.
pub const ADDONS_BIN_ENV: &str = "CLI_MCP_ADDONS_BIN";
/// The apiserver's `--service-cluster-ip-range`.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// ClusterIP of the `kube-dns` Service in `kube-system`.
pub const DNS_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The cluster domain CoreDNS answers for.
pub const CLUSTER_DOMAIN: &str = "cluster.local";

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
