//! One sandbox flooding the verifying binary, another using it: the second's requests (a new
//! tunnel and a GET each, as a kubectl run makes) alone, then while the first holds its whole
//! share of connections (`--max-connections-per-client`, verified tunnels left idle) and keeps
//! opening more, each answered 429. The two sandboxes are two pods at two addresses
//! (127.0.0.1 and 127.0.0.2). The flood's connections are opened from a thread of their own,
//! so that they compete with the rest for the CPUs, not for this runtime's scheduler.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use tokio::io::AsyncReadExt;
use tokio::net::TcpSocket;

use super::client::{Client, Tunnel};
use super::sandboxes::{Sandbox, Sandboxes};
use super::IdentityArgs;

/// Connection loops of the flood, all at once.
const OPENERS: usize = 4;

pub(crate) struct Flood {
    /// The second sandbox's requests, alone, and the ones that failed.
    pub(crate) alone: Vec<Duration>,
    pub(crate) alone_failed: usize,
    /// The same while the first floods.
    pub(crate) flooded: Vec<Duration>,
    pub(crate) flooded_failed: usize,
    /// Tunnels the flooding sandbox held.
    pub(crate) held: usize,
    /// Its further connections answered 429 while the second's requests ran, and the rest.
    pub(crate) refused: usize,
    pub(crate) other: usize,
    /// How long the second's requests under the flood took.
    pub(crate) span: Duration,
    /// The proxy's CPU time meanwhile, in CPUs (1.0: one CPU all the time).
    pub(crate) proxy_cpus: f64,
}

#[derive(Default)]
struct Counts {
    stop: AtomicBool,
    refused: AtomicUsize,
    other: AtomicUsize,
}

pub(crate) async fn measure(
    args: &IdentityArgs,
    client: &Client,
    sandboxes: &Sandboxes,
    flooder: &Sandbox,
    pid: u32,
) -> anyhow::Result<Flood> {
    let calm = sandboxes
        .sandbox("calm", IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)))
        .await?;
    drop(client.tunnel_when_admitted(&calm).await?);
    // Its review cached before the tunnels open at once, so that they do not all ask.
    drop(client.tunnel_when_admitted(flooder).await?);
    for _ in 0..20 {
        client.fresh_get(calm.ip, Some(&calm.token)).await?;
    }
    let (alone, alone_failed) = requests(client, &calm, args.flood_requests).await;

    let held: Vec<Tunnel> = futures::stream::iter(0..args.flood)
        .map(|_| client.tunnel(flooder.ip, Some(&flooder.token)))
        .buffer_unordered(8)
        .try_collect()
        .await?;
    let counts = Arc::new(Counts::default());
    let flood = {
        let (counts, proxy, from) = (counts.clone(), client.proxy, flooder.ip);
        std::thread::spawn(move || flood(proxy, from, &counts))
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused_before = counts.refused.load(Ordering::Relaxed);
    let other_before = counts.other.load(Ordering::Relaxed);
    let start = Instant::now();
    let cpu_before = crate::figures::cpu_seconds(pid)?;
    let (flooded, flooded_failed) = requests(client, &calm, args.flood_requests).await;
    let span = start.elapsed();
    let proxy_cpus =
        (crate::figures::cpu_seconds(pid)? - cpu_before) / span.as_secs_f64().max(1e-9);
    let refused = counts.refused.load(Ordering::Relaxed) - refused_before;
    let other = counts.other.load(Ordering::Relaxed) - other_before;
    counts.stop.store(true, Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || flood.join()).await;
    Ok(Flood {
        alone,
        alone_failed,
        flooded,
        flooded_failed,
        held: held.len(),
        refused,
        other,
        span,
        proxy_cpus,
    })
}

/// `n` requests of sandbox `s`, each on a new tunnel: the times of those that succeeded, and
/// how many failed.
async fn requests(client: &Client, s: &Sandbox, n: usize) -> (Vec<Duration>, usize) {
    let mut took = Vec::with_capacity(n);
    let mut failed = 0;
    for _ in 0..n {
        match client.fresh_get(s.ip, Some(&s.token)).await {
            Ok(d) => took.push(d),
            Err(_) => failed += 1,
        }
    }
    (took, failed)
}

/// Opens connections from `from` to `proxy` until told to stop, [`OPENERS`] at a time,
/// counting the 429s.
fn flood(proxy: SocketAddr, from: IpAddr, counts: &Counts) {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    rt.block_on(futures::future::join_all((0..OPENERS).map(|_| async {
        while !counts.stop.load(Ordering::Relaxed) {
            let counter = match one_more(proxy, from).await {
                Ok(answer) if answer.starts_with(b"HTTP/1.1 429") => &counts.refused,
                _ => &counts.other,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    })));
}

/// One more connection: what the proxy answers before it closes it.
async fn one_more(proxy: SocketAddr, from: IpAddr) -> anyhow::Result<Vec<u8>> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from, 0))?;
    let mut tcp = socket.connect(proxy).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut answer)).await??;
    Ok(answer)
}
