//! Real traffic between pods of the real node: a [`Peer`] is a running pod and the network
//! namespace its containers share, entered through a container's task, so a connection
//! from it has the pod's IP as its source — what a NetworkPolicy enforcer judges.
//!
//! Policy changes take effect asynchronously, so [`expect`] polls with a deadline.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;

use crate::addons::{container_netns, in_netns, tcp_reach, Reach};
use crate::testing::pod_ip;

/// One connection attempt; a policy's REJECT answers at once, a drop times out.
pub const CONNECT: Duration = Duration::from_millis(700);
/// How long a policy change may take to show in the traffic.
pub const SETTLE: Duration = Duration::from_secs(60);

/// A running pod and the network namespace its containers share.
#[derive(Clone, Debug)]
pub struct Peer {
    pub name: String,
    pub ip: Ipv4Addr,
    pub netns: PathBuf,
}

/// The peer of a running pod of the real node whose containerd listens on `socket`.
/// Panics (this is test support) when the pod has no IPv4 or no started container.
pub fn peer(socket: &Path, name: &str, pod: &Pod) -> Peer {
    let ip = pod_ip(pod)
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("{name}: no pod IPv4"));
    let id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find_map(|c| c.container_id.clone()))
        .unwrap_or_else(|| panic!("{name}: no containerID"));
    let netns = container_netns(socket, &id).unwrap_or_else(|e| panic!("{name}: {e}"));
    Peer {
        name: name.into(),
        ip,
        netns,
    }
}

/// One TCP connection from `from`'s network namespace to `to:port`.
pub async fn reach(from: &Peer, to: Ipv4Addr, port: u16) -> Reach {
    let netns = from.netns.clone();
    tokio::task::spawn_blocking(move || {
        in_netns(&netns, move || {
            tcp_reach(SocketAddr::from((to, port)), CONNECT)
        })
    })
    .await
    .expect("join")
    .unwrap_or_else(|e| panic!("{e}"))
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
