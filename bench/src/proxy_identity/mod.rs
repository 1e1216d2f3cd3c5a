//! `cli-mcp-bench proxy`, second part: what the proxy's sandbox identity check costs.
//!
//! Every CONNECT to a verifying proxy carries the sandbox pod's token; the proxy asks the API
//! server for a TokenReview (reused for 5 s by the token's hash) and looks the pod up in its
//! pod watch, and checks on every request in a tunnel that the session has not ended. The
//! upstream is a loopback HTTPS server (so the API server's own time is not in the figures),
//! the sandboxes are real pod objects and real tokens on the local cluster's API server.
//!
//! - latency ([`latency`]): the library's proxy in this process, unverified
//!   (`SandboxCheck::Unverified`) and verifying side by side, samples interleaved;
//! - memory and fairness ([`memory`], [`flood`]): the release binary as its own process,
//!   verifying, with many sandboxes at once and one of them flooding.

mod client;
mod flood;
mod latency;
mod memory;
mod report;
mod sandboxes;
mod upstream;

use std::ffi::OsString;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

use cli_mcp_api::proxy::RouteTable;
use cli_mcp_proxy::upstream::Timeouts;
use cli_mcp_proxy::{Config, Limits, SandboxCheck};

use crate::proxy_process::ProxyProcess;
use client::Client;
use upstream::Upstream;

pub(crate) use sandboxes::{Sandbox, Sandboxes};

#[derive(clap::Args)]
pub struct IdentityArgs {
    /// New tunnels (CONNECT, TLS, one GET) per row of the identity latency table, after 50
    /// of warm-up.
    #[arg(long, default_value_t = 1000)]
    pub connects: usize,
    /// CONNECTs with a fresh token each (a TokenReview each), and TokenReviews timed alone
    /// (spread over the --connects rounds, at most one of each per round).
    #[arg(long, default_value_t = 200)]
    pub cold: usize,
    /// Requests per row inside one open tunnel, after 50 of warm-up.
    #[arg(long, default_value_t = 1000)]
    pub in_tunnel: usize,
    /// Sandboxes, each with a tunnel holding a streaming response open, for the memory rows.
    #[arg(long, default_value_t = 100)]
    pub sandboxes: usize,
    /// Connections the flooding sandbox holds: the proxy's --max-connections-per-client.
    #[arg(long, default_value_t = 500)]
    pub flood: usize,
    /// The second sandbox's requests, alone and while the first floods.
    #[arg(long, default_value_t = 1000)]
    pub flood_requests: usize,
    /// Only the sandbox identity tables, not the Kubernetes GET ones.
    #[arg(long)]
    pub identity_only: bool,
}

/// The proxy's inputs for the loopback upstream: its CA, the route table, where audit lines
/// go.
pub(crate) struct Inputs {
    dir: PathBuf,
    pub(crate) ca_pem: String,
    /// `127.0.0.1:<port>` of the upstream.
    pub(crate) target: String,
}

impl Inputs {
    fn new(dir: &Path, upstream: &Upstream) -> anyhow::Result<Self> {
        let (ca_pem, ca_key) = cli_mcp_proxy::ca::generate_ca("bench identity proxy CA")?;
        std::fs::write(dir.join("ca.crt"), &ca_pem)?;
        std::fs::write(dir.join("ca.key"), &ca_key)?;
        let routes = RouteTable::new(vec![upstream.route()?])?;
        std::fs::write(dir.join("routes.json"), routes.to_json())?;
        Ok(Self {
            dir: dir.to_owned(),
            ca_pem,
            target: upstream.target(),
        })
    }

    /// An in-process proxy's configuration: the binary's defaults, audit lines to a file of
    /// its own (`name`), no shutdown delay.
    fn config(&self, name: &str, sandboxes: SandboxCheck) -> Config {
        let any: SocketAddr = ([127, 0, 0, 1], 0).into();
        Config {
            routes: self.dir.join("routes.json"),
            ca_cert: self.dir.join("ca.crt"),
            ca_key: self.dir.join("ca.key"),
            kubeconfig: None,
            listen: any,
            health_listen: any,
            limits: Limits::default(),
            upstream: Timeouts {
                connect: Duration::from_secs(10),
                handshake: Duration::from_secs(10),
                response_headers: Duration::from_secs(120),
            },
            shutdown_delay: Duration::ZERO,
            grace: Duration::from_secs(2),
            leaf_cache: NonZeroUsize::new(256).unwrap_or(NonZeroUsize::MIN),
            sandboxes,
            audit_log: Some(self.dir.join(format!("audit-{name}.log"))),
        }
    }

    /// The binary's flags: these inputs, verifying `sandboxes`, `per_client` connections for
    /// each sandbox.
    fn flags(&self, sandboxes: &Sandboxes, per_client: usize) -> Vec<OsString> {
        let mut flags: Vec<OsString> = Vec::new();
        for (flag, file) in [
            ("--routes", "routes.json"),
            ("--ca-cert", "ca.crt"),
            ("--ca-key", "ca.key"),
            ("--audit-log", "audit-binary.log"),
        ] {
            flags.push(flag.into());
            flags.push(self.dir.join(file).into());
        }
        flags.push("--max-connections-per-client".into());
        flags.push(per_client.to_string().into());
        flags.extend(sandboxes.flags().into_iter().map(OsString::from));
        flags
    }
}

/// The identity tables; `me` is the bench's own sandbox (connecting from 127.0.0.1).
pub(crate) async fn identity_figures(
    args: &IdentityArgs,
    bin: &Path,
    sandboxes: &Sandboxes,
    me: &Sandbox,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let dir = tempfile::tempdir()?;
    let upstream = Upstream::start().await?;
    let inputs = Inputs::new(dir.path(), &upstream)?;
    let latency = latency::measure(args, &inputs, sandboxes, me)
        .await
        .context("the identity latency")?;

    let http = reqwest::Client::builder().no_proxy().build()?;
    let proxy = ProxyProcess::start(
        bin,
        &inputs.flags(sandboxes, args.flood),
        &sandboxes.admin_kubeconfig,
    )?;
    proxy.ready(&http).await?;
    let client = Client::new(proxy.listen.parse()?, &inputs.target, &inputs.ca_pem)?;
    let memory = memory::measure(args.sandboxes, &proxy, &client, sandboxes, &http)
        .await
        .context("the identity memory")?;
    let flood = flood::measure(args, &client, sandboxes, me, proxy.pid())
        .await
        .context("the flood")?;
    drop(proxy);
    report::print(args, &latency, &memory, &flood, started.elapsed());
    Ok(())
}
