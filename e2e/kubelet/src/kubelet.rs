//! Startup, the main loop and shutdown.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use k8s_openapi::jiff::Timestamp;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::signal::unix::{signal, SignalKind};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::cli::Args;
use crate::cni::{self, Cni};
use crate::env::ServiceEnv;
use crate::imagemap::ImageMap;
use crate::node::{self, NodeInfo};
use crate::services::Services;
use crate::worker::{Ctx, Timing};
use crate::{logserver, podsync, probes, state};

fn preflight(args: &Args) -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("cli-mcp-kubelet must run as root (it creates network namespaces and mounts)");
    }
    let ptp = args.cni_bin_dir.join("ptp");
    if !ptp.exists() || !args.cni_bin_dir.join("host-local").exists() {
        bail!(
            "CNI plugins not found in {} (need ptp and host-local); run `apt-get install -y containernetworking-plugins` or pass --cni-bin-dir",
            args.cni_bin_dir.display()
        );
    }
    let text = std::fs::read_to_string(&args.image_map).with_context(|| {
        format!(
            "cannot read --image-map {}; write a JSON object like {{\"cli-mcp-agent:*\": \"/abs/path/cli-mcp-agent\"}}",
            args.image_map.display()
        )
    })?;
    ImageMap::parse(&text)
        .map_err(|e| anyhow::anyhow!("invalid --image-map {}: {e}", args.image_map.display()))?;
    Ok(())
}

/// Pods route through the host, so the host must forward between veths.
fn enable_ip_forward() {
    let path = Path::new("/proc/sys/net/ipv4/ip_forward");
    if std::fs::read_to_string(path).is_ok_and(|v| v.trim() == "1") {
        return;
    }
    match std::fs::write(path, "1") {
        Ok(()) => tracing::info!("enabled net.ipv4.ip_forward"),
        Err(e) => {
            tracing::warn!("cannot enable net.ipv4.ip_forward ({e}); pod-to-pod traffic may fail")
        }
    }
}

async fn client(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    let kc = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading kubeconfig {}", kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("loading kubeconfig {}", kubeconfig.display()))?;
    kube::Client::try_from(config).context("building the Kubernetes client")
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    preflight(&args)?;
    enable_ip_forward();
    let state_dir = state_dir(&args)?;
    let gateway = cni::gateway(&args.pod_cidr).with_context(|| {
        format!(
            "--pod-cidr {} is too small (need /30 or larger)",
            args.pod_cidr
        )
    })?;
    let cni = pod_network(&args, &state_dir);
    let services = Arc::new(Services::new(args.service_cidr));
    let mut node = NodeInfo::detect(
        &args.node_name,
        gateway,
        args.pod_cidr,
        cni::pod_capacity(&args.pod_cidr),
    );
    let client = client(&args.kubeconfig).await?;
    let endpoint_cancel = CancellationToken::new();
    let endpoint = serve_logs(
        &args,
        gateway,
        &mut node,
        &state_dir,
        endpoint_cancel.clone(),
    )
    .await;

    let cleaned = state::cleanup_previous_run(&state_dir, &cni).await;
    if cleaned > 0 {
        tracing::info!("cleaned up {cleaned} pod(s) left by a previous run");
    }

    let cancel = cancel_on_signal()?;
    let since = Timestamp::now();
    if !register(&client, &node, since, &cancel).await {
        return Ok(());
    }

    let heartbeat_cancel = CancellationToken::new();
    let heartbeat = tokio::spawn(node::heartbeat(
        client.clone(),
        node.clone(),
        since,
        Duration::from_secs(args.lease_interval_secs.max(1)),
        Duration::from_secs(args.node_status_interval_secs.max(1)),
        heartbeat_cancel.clone(),
    ));

    let ctx = worker_context(
        &args,
        client.clone(),
        node.clone(),
        state_dir,
        cni,
        services.clone(),
    )?;
    tracing::info!(node = %node.name, cidr = %node.cidr, gateway = %gateway, "process kubelet running");
    let services_cancel = CancellationToken::new();
    let services_task = tokio::spawn(crate::services::run(
        services,
        client.clone(),
        services_cancel.clone(),
    ));
    podsync::run(ctx, cancel).await;
    services_cancel.cancel();
    let _ = services_task.await;

    heartbeat_cancel.cancel();
    let _ = heartbeat.await;
    endpoint_cancel.cancel();
    if let Some(task) = endpoint {
        let _ = task.await;
    }
    if let Err(e) = node::post_status(&client, &node, false, Timestamp::now()).await {
        tracing::warn!("{e}");
    }
    tracing::info!("all pods stopped; exiting");
    Ok(())
}

/// `--state-dir`, made if missing, as an absolute path without links.
fn state_dir(args: &Args) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(&args.state_dir)
        .with_context(|| format!("creating --state-dir {}", args.state_dir.display()))?;
    args.state_dir
        .canonicalize()
        .with_context(|| format!("resolving --state-dir {}", args.state_dir.display()))
}

/// The CNI set-up every pod's network namespace gets: addresses from `--pod-cidr`, and
/// routes to the Service CIDR and to the API server (unless it is on loopback).
fn pod_network(args: &Args, state_dir: &Path) -> Cni {
    Cni {
        bin_dir: args.cni_bin_dir.clone(),
        cidr: args.pod_cidr,
        ipam_dir: state_dir.join("cni").join("ipam"),
        extra_routes: match args.apiserver_host {
            std::net::IpAddr::V4(ip) if !ip.is_loopback() => {
                vec![ipnet::Ipv4Net::from(ip), args.service_cidr]
            }
            _ => vec![args.service_cidr],
        },
    }
}

/// Starts the `kubectl logs` endpoint on `gateway` (unless `--kubelet-port` is 0) and
/// records its port in `node`; a kubelet that cannot serve it runs on without.
async fn serve_logs(
    args: &Args,
    gateway: Ipv4Addr,
    node: &mut NodeInfo,
    state_dir: &Path,
    cancel: CancellationToken,
) -> Option<JoinHandle<()>> {
    if args.kubelet_port == 0 {
        return None;
    }
    let addr = std::net::SocketAddr::new(gateway.into(), args.kubelet_port);
    match logserver::serve(addr, &node.name, state_dir.to_path_buf(), cancel).await {
        Ok(task) => {
            node.kubelet_port = args.kubelet_port;
            tracing::info!("serving container logs on https://{addr}");
            Some(task)
        }
        Err(e) => {
            tracing::warn!("{e}; `kubectl logs` will not work (is {gateway} on a host interface?)");
            None
        }
    }
}

/// A token cancelled on the first SIGTERM or SIGINT: the signal to stop all pods.
fn cancel_on_signal() -> anyhow::Result<CancellationToken> {
    let mut sigterm = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    let cancel = CancellationToken::new();
    {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = sigterm.recv() => tracing::info!("SIGTERM: stopping all pods"),
                _ = sigint.recv() => tracing::info!("SIGINT: stopping all pods"),
            }
            cancel.cancel();
        });
    }
    Ok(cancel)
}

/// Registers the Node (retrying with back-off until it succeeds) and takes its Lease;
/// false if `cancel` came first.
async fn register(
    client: &kube::Client,
    node: &NodeInfo,
    since: Timestamp,
    cancel: &CancellationToken,
) -> bool {
    let mut delay = Duration::from_millis(500);
    loop {
        match node::register(client, node, since).await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!("{e}; retrying in {delay:?}");
                tokio::select! {
                    _ = cancel.cancelled() => return false,
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(10));
            }
        }
    }
    if let Err(e) = node::renew_lease(client, node).await {
        tracing::warn!("{e}");
    }
    true
}

/// What every pod worker shares: the clients, the node, the network and the timings from
/// the flags.
fn worker_context(
    args: &Args,
    client: kube::Client,
    node: NodeInfo,
    state_dir: PathBuf,
    cni: Cni,
    services: Arc<Services>,
) -> anyhow::Result<Arc<Ctx>> {
    Ok(Arc::new(Ctx {
        client,
        node,
        state_dir,
        image_map: args.image_map.clone(),
        cni,
        service_env: ServiceEnv {
            apiserver_host: args.apiserver_host.to_string(),
            apiserver_port: args.apiserver_port,
        },
        dns: crate::launch::PodDns {
            server: args.cluster_dns,
            domain: args.cluster_domain.clone(),
        },
        services,
        http: probes::http_client().map_err(anyhow::Error::msg)?,
        timing: Timing {
            crash_initial: Duration::from_secs(args.crash_backoff_initial_secs),
            crash_max: Duration::from_secs(args.crash_backoff_max_secs),
            retry_initial: Duration::from_secs(2),
            retry_max: Duration::from_secs(60),
            volume_resync: Duration::from_secs(args.volume_resync_secs.max(1)),
        },
    }))
}
