//! What the identity check adds to a request: two proxies of the library in this process,
//! one unverified (`SandboxCheck::Unverified`) and one verifying against the local API
//! server, everything else the same (routes, CA, limits, audit file), measured side by side
//! with their samples interleaved so that the machine's load weighs on both alike.
//!
//! - a new tunnel each time (TCP, CONNECT, TLS to the leaf, one small GET): unverified, then
//!   verified with the same token again and again (its TokenReview cached, redone when the
//!   5 s cache entry lapses), then verified with a fresh token each time (a TokenReview on
//!   every CONNECT; the tokens are minted before, untimed); and the TokenReview alone;
//! - requests inside one open tunnel: what the per-request revocation check adds.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use cli_mcp_proxy::{Config, Proxy, SandboxCheck};

use super::client::Client;
use super::sandboxes::{Sandbox, Sandboxes};
use super::{IdentityArgs, Inputs};

const WARM_UP: usize = 50;

#[derive(Default)]
pub(crate) struct Latency {
    /// New tunnel + GET, unverified proxy.
    pub(crate) unverified: Vec<Duration>,
    /// The same, verified, one token (its review cached).
    pub(crate) warm: Vec<Duration>,
    /// The same, verified, a fresh token each time.
    pub(crate) cold: Vec<Duration>,
    /// A TokenReview alone, fresh tokens.
    pub(crate) review: Vec<Duration>,
    /// A GET inside one open tunnel, unverified and verified.
    pub(crate) in_unverified: Vec<Duration>,
    pub(crate) in_verified: Vec<Duration>,
}

/// A library proxy serving in this process until stopped.
struct InProcess {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
}

impl InProcess {
    async fn start(config: Config, client: Option<kube::Client>) -> anyhow::Result<Self> {
        let proxy = Proxy::bind_with(&config, client).await?;
        let addr = proxy.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let done = tokio::spawn(async move {
            let _ = proxy
                .serve(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Self {
            addr,
            stop: Some(stop),
            done,
        })
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.done).await;
    }
}

pub(crate) async fn measure(
    args: &IdentityArgs,
    inputs: &Inputs,
    sandboxes: &Sandboxes,
    me: &Sandbox,
) -> anyhow::Result<Latency> {
    let unverified =
        InProcess::start(inputs.config("unverified", SandboxCheck::Unverified), None).await?;
    let verified = InProcess::start(
        inputs.config("verified", sandboxes.check()?),
        Some(sandboxes.client()),
    )
    .await?;
    let plain = Client::new(unverified.addr, &inputs.target, &inputs.ca_pem)?;
    let checked = Client::new(verified.addr, &inputs.target, &inputs.ca_pem)?;
    drop(checked.tunnel_when_admitted(me).await?);
    let cold_tokens = sandboxes.tokens(&me.pod, args.cold).await?;
    let review_tokens = sandboxes.tokens(&me.pod, args.cold).await?;

    let mut l = Latency::default();
    let proxies = Pair {
        plain: &plain,
        checked: &checked,
    };
    let cold = Cold {
        sandboxes,
        connects: &cold_tokens,
        reviews: &review_tokens,
    };
    fresh_tunnels(args.connects, &proxies, me, &cold, &mut l).await?;
    in_tunnel(args.in_tunnel, &plain, &checked, me, &mut l).await?;
    unverified.stop().await;
    verified.stop().await;
    Ok(l)
}

/// The unverified proxy's client and the verifying one's.
struct Pair<'a> {
    plain: &'a Client,
    checked: &'a Client,
}

/// Fresh tokens (minted before, untimed): one per cold CONNECT, one per TokenReview alone.
struct Cold<'a> {
    sandboxes: &'a Sandboxes,
    connects: &'a [String],
    reviews: &'a [String],
}

/// A new tunnel and a GET per sample: unverified, verified (warm), verified (cold), and the
/// TokenReview alone, in turn, so that each sees the same machine (the API server as idle
/// between the reviews in the last two).
async fn fresh_tunnels(
    n: usize,
    p: &Pair<'_>,
    me: &Sandbox,
    cold: &Cold<'_>,
    l: &mut Latency,
) -> anyhow::Result<()> {
    let token = Some(me.token.as_str());
    for _ in 0..WARM_UP {
        p.plain.fresh_get(me.ip, None).await?;
        p.checked.fresh_get(me.ip, token).await?;
    }
    // The cold samples spread over the run (at most one per round).
    let every = (n / cold.connects.len().max(1)).max(1);
    for i in 0..n {
        l.unverified.push(p.plain.fresh_get(me.ip, None).await?);
        l.warm.push(p.checked.fresh_get(me.ip, token).await?);
        if i % every != 0 {
            continue;
        }
        // Which of the two goes first alternates: the second finds the API server just busy.
        let k = i / every;
        for second in [false, true] {
            if (k % 2 == 1) == second {
                if let Some(fresh) = cold.connects.get(k) {
                    l.cold.push(p.checked.fresh_get(me.ip, Some(fresh)).await?);
                }
            } else if let Some(fresh) = cold.reviews.get(k) {
                l.review.push(cold.sandboxes.review(fresh).await?);
            }
        }
    }
    Ok(())
}

/// GETs in one open tunnel through each proxy, in turn.
async fn in_tunnel(
    n: usize,
    plain: &Client,
    checked: &Client,
    me: &Sandbox,
    l: &mut Latency,
) -> anyhow::Result<()> {
    let mut a = plain.tunnel(me.ip, None).await?;
    let mut b = checked.tunnel(me.ip, Some(&me.token)).await?;
    for i in 0..n + WARM_UP {
        let start = Instant::now();
        plain.get(&mut a, "/").await?;
        let took_a = start.elapsed();
        let start = Instant::now();
        checked.get(&mut b, "/").await?;
        let took_b = start.elapsed();
        if i >= WARM_UP {
            l.in_unverified.push(took_a);
            l.in_verified.push(took_b);
        }
    }
    Ok(())
}
