//! The verifying binary's RSS with many sandboxes at once: each a sealed pod in its watch, a
//! token it reviewed (and cached), and a tunnel from the pod's own address holding a
//! streaming response open (the upstream's `/stream`, a watch with no events), with the
//! tunnel's revocation task waiting on the pod.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};

use crate::figures::rss_kib;
use crate::proxy_process::ProxyProcess;

use super::client::{Client, Tunnel};
use super::sandboxes::{Sandbox, Sandboxes};

pub(crate) struct Memory {
    pub(crate) sandboxes: usize,
    /// Started and ready (the instance's pods listed).
    pub(crate) ready_kib: u64,
    /// With the sandboxes' pods in its watch, nothing connected.
    pub(crate) pods_kib: u64,
    /// With every sandbox's tunnel and stream open.
    pub(crate) streams_kib: u64,
    /// Tunnels open then, from the proxy's `/metrics`.
    pub(crate) tunnels: f64,
}

/// Sandbox `i`'s address: `127.0.1.1`, `127.0.1.2`, … (250 to a /24).
fn address(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(
        127,
        0,
        1 + (i / 250) as u8,
        1 + (i % 250) as u8,
    ))
}

pub(crate) async fn measure(
    n: usize,
    proxy: &ProxyProcess,
    client: &Client,
    sandboxes: &Sandboxes,
    http: &reqwest::Client,
) -> anyhow::Result<Memory> {
    let pid = proxy.pid();
    let ready_kib = rss_kib(pid)?;
    let made: Vec<Sandbox> = futures::stream::iter(0..n)
        .map(|i| async move { sandboxes.sandbox(&format!("m-{i:03}"), address(i)).await })
        .buffer_unordered(8)
        .try_collect()
        .await?;
    // The watch events of the last pods arrive within milliseconds on loopback.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pods_kib = rss_kib(pid)?;
    let streams: Vec<Tunnel> = futures::stream::iter(&made)
        .map(|s| open_stream(client, s))
        .buffer_unordered(16)
        .try_collect()
        .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let tunnels = proxy.metric(http, "cli_mcp_proxy_tunnels").await?;
    let streams_kib = rss_kib(pid)?;
    drop(streams);
    Ok(Memory {
        sandboxes: n,
        ready_kib,
        pods_kib,
        streams_kib,
        tunnels,
    })
}

async fn open_stream(client: &Client, s: &Sandbox) -> anyhow::Result<Tunnel> {
    let mut t = client.tunnel_when_admitted(s).await?;
    client.open_stream(&mut t, "/stream").await?;
    Ok(t)
}
