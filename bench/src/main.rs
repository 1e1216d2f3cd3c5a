//! `cli-mcp-bench`: measures, never asserts. Each section prints a table; docs/benchmarks.md
//! says how to read it. Numbers come from real processes on loopback.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

mod agent_attacks;
mod agent_exec;
mod agent_mcp;
mod agent_peer;
mod agent_proc;
mod apiserver;
mod cluster;
mod figures;
mod images;
mod prom;
mod proxy;
mod proxy_identity;
mod proxy_process;
mod scale;
mod steps;

#[derive(Parser)]
#[command(about = "cli-mcp benchmarks (printed as tables)")]
struct Cli {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand)]
enum What {
    /// Agent: exec overhead vs a fresh `bash -c true` and a bare HTTP round trip; RSS; MCP
    /// `tools/call` on the local backend vs the agent's exec.
    Agent {
        /// The agent binary to measure (use a release build).
        #[arg(long)]
        agent: PathBuf,
        #[arg(long, default_value_t = 1000)]
        iterations: usize,
        /// Health probes per row of the hostile-load table.
        #[arg(long, default_value_t = 200)]
        probes: usize,
        /// Leave out `yes` for 10 s (an agent without spill caps writes gigabytes).
        #[arg(long)]
        skip_yes: bool,
        /// Where the measured agent's state dir is made: a disk-backed file system, as a
        /// pod's `/tmp` emptyDir is (on tmpfs, the file-system work per command is hidden).
        #[arg(long, default_value = "/var/tmp")]
        state_parent: PathBuf,
        /// Only the latency and memory tables, not the hostile-load ones.
        #[arg(long)]
        no_attacks: bool,
        /// The server binary for the MCP `tools/call` row (default: beside the agent).
        #[arg(long)]
        server: Option<PathBuf>,
        /// Another agent to time `POST /exec true` of in the same rounds: any binary speaking
        /// the Go original's agent wire (`SANDBOX_AUTH_TOKEN`, `GET /health`, `POST /exec`).
        #[arg(long)]
        peer: Option<PathBuf>,
        /// Where the peer listens (the Go original: `:8090`, whatever it is told).
        #[arg(long, default_value = "127.0.0.1:8090")]
        peer_addr: String,
    },
    /// Local Kubernetes with the operator and server as pods: warm vs cold session start,
    /// `tools/call` through the Service and on the pod IP, N sessions × M commands at once.
    Cluster(cluster::ClusterArgs),
    /// What grows with sessions: 1,000 idle and 100 active sessions on the local Kubernetes
    /// (RSS, API writes, apiserver requests, warm claims), then up to 10,000 simulated
    /// session pods on a KWOK node (memory, watch traffic, reconcile and claim latency).
    Scale(scale::ScaleArgs),
    /// Sizes of the OCI image archives hack/build-images.sh builds (compressed, uncompressed).
    Images(images::ImagesArgs),
    /// Credential proxy: added latency of a Kubernetes GET (through vs direct), RSS idle and
    /// with many watch streams open; what its sandbox identity check costs (per CONNECT,
    /// per request, RSS per sandbox, one sandbox flooding another).
    Proxy(proxy::ProxyArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().what {
        What::Agent {
            agent,
            iterations,
            probes,
            skip_yes,
            state_parent,
            no_attacks,
            server,
            peer,
            peer_addr,
        } => {
            let peer = peer.as_deref().map(|p| (p, peer_addr.as_str()));
            agent_exec::agent_bench(&agent, iterations, &state_parent, peer)?;
            let server = server.unwrap_or_else(|| agent.with_file_name("cli-mcp-server"));
            agent_mcp::mcp_vs_exec(&agent, &server, iterations, &state_parent)?;
            if no_attacks {
                return Ok(());
            }
            agent_attacks::attacks(&agent, &agent_proc::bench_token()?, probes, skip_yes)
        }
        What::Cluster(args) => cluster::cluster_bench(args),
        What::Scale(args) => scale::scale_bench(args),
        What::Images(args) => images::images_bench(args),
        What::Proxy(args) => proxy::proxy_bench(args),
    }
}
