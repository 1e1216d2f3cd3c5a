//! Real traffic between pods of the real node: a [`Peer`] is a running pod and where its
//! connections start, so that they have the pod's IP as their source — what a NetworkPolicy
//! enforcer judges:
//! - the network namespace its containers share, entered through a container's task (runc);
//! - or its MCP session's shell, for a sandbox under gVisor: runsc's own network stack owns
//!   the pod's interface (the host's view of the namespace keeps no address or route), so a
//!   connection is made the way the session's commands make one, with bash's `/dev/tcp`.
//!
//! Policy changes take effect asynchronously, so [`expect`] polls with a deadline.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;

use crate::addons::{container_netns, in_netns, query_a, tcp_reach, Reach, RCODE_NOERROR};
use crate::journey::{stdout, Mcp};
use crate::testing::pod_ip;

/// One connection attempt; a policy's REJECT answers at once, a drop times out.
pub const CONNECT: Duration = Duration::from_millis(700);
/// How long a policy change may take to show in the traffic.
pub const SETTLE: Duration = Duration::from_secs(60);

/// A running pod and where its connections start.
#[derive(Clone, Debug)]
pub struct Peer {
    pub name: String,
    pub ip: Ipv4Addr,
    pub from: From,
}

impl Peer {
    /// The pod's network namespace; panics for a session peer (test support), whose network
    /// the host cannot enter.
    pub fn netns(&self) -> &Path {
        match &self.from {
            From::Netns(p) => p,
            From::Session { .. } => panic!("{}: a session's peer has no host netns", self.name),
        }
    }
}

/// Where a [`Peer`]'s connections start.
#[derive(Clone)]
pub enum From {
    /// The pod's network namespace, entered from the host.
    Netns(PathBuf),
    /// A shell command of MCP session `sid` (the pod serves it).
    Session { mcp: Mcp, sid: String },
}

impl std::fmt::Debug for From {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            From::Netns(p) => write!(f, "netns {}", p.display()),
            From::Session { sid, .. } => write!(f, "session {sid}"),
        }
    }
}

/// The pod's IPv4; panics (test support) without one.
fn ipv4(name: &str, pod: &Pod) -> Ipv4Addr {
    pod_ip(pod)
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("{name}: no pod IPv4"))
}

/// The containerd id of the pod's first started container; panics (test support) without
/// one.
pub fn container_id(name: &str, pod: &Pod) -> String {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find_map(|c| c.container_id.clone()))
        .unwrap_or_else(|| panic!("{name}: no containerID"))
}

/// The peer of a running pod of the real node whose containerd listens on `socket`.
/// Panics (this is test support) when the pod has no IPv4 or no started container.
pub fn peer(socket: &Path, name: &str, pod: &Pod) -> Peer {
    let ip = ipv4(name, pod);
    let id = container_id(name, pod);
    let netns = container_netns(socket, &id).unwrap_or_else(|e| panic!("{name}: {e}"));
    Peer {
        name: name.into(),
        ip,
        from: From::Netns(netns),
    }
}

/// The peer of a sandbox pod serving session `sid` of `mcp`, whose connections its shell
/// makes (a gVisor sandbox: see the module documentation).
pub fn in_session(name: &str, pod: &Pod, mcp: &Mcp, sid: &str) -> Peer {
    Peer {
        name: name.into(),
        ip: ipv4(name, pod),
        from: From::Session {
            mcp: mcp.clone(),
            sid: sid.into(),
        },
    }
}

/// One TCP connection from `from` to `to:port`.
pub async fn reach(from: &Peer, to: Ipv4Addr, port: u16) -> Reach {
    match &from.from {
        From::Netns(netns) => {
            let netns = netns.clone();
            tokio::task::spawn_blocking(move || {
                in_netns(&netns, move || {
                    tcp_reach(SocketAddr::from((to, port)), CONNECT)
                })
            })
            .await
            .expect("join")
            .unwrap_or_else(|e| panic!("{e}"))
        }
        From::Session { mcp, sid } => session_reach(mcp, sid, to, port).await,
    }
}

/// One TCP connection by the session's shell: bash's `/dev/tcp` under coreutils' `timeout`
/// (exit 124 when the connect hangs, as a dropped packet makes it).
async fn session_reach(mcp: &Mcp, sid: &str, to: Ipv4Addr, port: u16) -> Reach {
    let secs = CONNECT.as_secs_f64().max(1.0);
    let cmd = format!("timeout {secs} bash -c 'exec 3<>/dev/tcp/{to}/{port}' 2>&1; echo \"rc=$?\"");
    let r = mcp.bash(sid, &cmd).await;
    classify(stdout(&r))
}

/// What [`session_reach`]'s output says.
fn classify(out: &str) -> Reach {
    let rc = out.lines().last().and_then(|l| l.strip_prefix("rc="));
    match rc {
        Some("0") => Reach::Connected,
        Some("124") => Reach::TimedOut,
        _ if out.contains("Connection refused") || out.contains("No route to host") => {
            Reach::Refused
        }
        _ => Reach::Failed(out.trim().to_string()),
    }
}

/// Polls until `name` resolves from `from` through `server` (UDP) to exactly `want`, at
/// most [`SETTLE`]. A session resolves through libc and the pod's `resolv.conf`, whose
/// server the caller names as `server`.
pub async fn expect_resolves(from: &Peer, server: Ipv4Addr, name: &str, want: Ipv4Addr) {
    let deadline = Instant::now() + SETTLE;
    loop {
        let got: Result<Vec<Ipv4Addr>, String> = match &from.from {
            From::Netns(netns) => {
                let (netns, n) = (netns.clone(), name.to_string());
                tokio::task::spawn_blocking(move || {
                    in_netns(&netns, move || {
                        query_a(SocketAddr::from((server, 53)), &n, Duration::from_secs(2))
                    })
                })
                .await
                .expect("join")
                .unwrap_or_else(|e| panic!("{e}"))
                .map_err(|e| e.to_string())
                .and_then(|r| match r.rcode {
                    RCODE_NOERROR => Ok(r.addrs),
                    rcode => Err(format!("rcode {rcode}")),
                })
            }
            From::Session { mcp, sid } => {
                let r = mcp
                    .bash(
                        sid,
                        &format!("grep -c '^nameserver {server}$' /etc/resolv.conf; getent ahostsv4 {name} | cut -d' ' -f1 | sort -u"),
                    )
                    .await;
                let out = stdout(&r);
                let mut lines = out.lines();
                if lines.next() != Some("1") {
                    panic!("{}: {server} is not the pod's nameserver: {out}", from.name);
                }
                Ok(lines.filter_map(|l| l.parse().ok()).collect())
            }
        };
        if got.as_ref().is_ok_and(|addrs| addrs == &vec![want]) {
            eprintln!("  {} resolves {name} -> {want} via {server}", from.name);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{}: {name} did not resolve to {want} via {server} within {SETTLE:?}: {got:?}",
            from.name
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls until a connection from `from` to `to:port` is allowed (`true`) or denied
/// (`false`), at most [`SETTLE`]. A denied connection must be refused or time out, nothing
/// else.
pub async fn expect(from: &Peer, to: Ipv4Addr, port: u16, to_name: &str, allowed: bool) {
    let deadline = Instant::now() + SETTLE;
    loop {
        let got = reach(from, to, port).await;
        if let Reach::Failed(e) = &got {
            panic!("{} -> {to_name}:{port}: unexpected error {e}", from.name);
        }
        if (got == Reach::Connected) == allowed {
            eprintln!("  {} -> {to_name} ({to}:{port}): {got:?}", from.name);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} -> {to_name} ({to}:{port}) still {got:?} after {SETTLE:?}; want {}",
            from.name,
            if allowed { "connected" } else { "denied" }
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shell_probe_reads_as_the_socket_would() {
        assert_eq!(classify("rc=0\n"), Reach::Connected);
        assert_eq!(classify("rc=124\n"), Reach::TimedOut);
        assert_eq!(
            classify("bash: connect: Connection refused\nbash: /dev/tcp/10.0.0.1/80: Connection refused\nrc=1\n"),
            Reach::Refused
        );
        assert_eq!(
            classify("bash: connect: No route to host\nrc=1\n"),
            Reach::Refused
        );
        assert!(matches!(
            classify("bash: connect: Network is unreachable\nrc=1\n"),
            Reach::Failed(_)
        ));
    }
}
