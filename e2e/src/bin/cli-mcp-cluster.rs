//! `cli-mcp-cluster`: run the local Kubernetes cluster (etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler, and the process kubelet or, with `--node real`,
//! kubelet + kube-proxy on containerd) in the foreground.
//!
//! - `cli-mcp-cluster up`: bring it up, write `kubeconfig`, `cluster.env` and
//!   `cluster.json` into the run dir, print `CLI_MCP_READY <run-dir>/cluster.json` on stdout,
//!   and stay up until Ctrl-C / SIGTERM, then tear everything down. With `--node real` the
//!   project's images (operator, server, sandbox) are built from the binaries next to this
//!   one and imported into the node first.
//! - `cli-mcp-cluster exec -- CMD ARGS...`: bring it up, run CMD with `CLI_MCP_KUBECONFIG`,
//!   `KUBECONFIG` and friends set, tear down, exit with CMD's status (what `make test` uses).
//! - `cli-mcp-cluster down`: stop the cluster running with a run dir.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use cli_mcp_e2e::cluster::{
    default_images, locate_control_plane_async, ClusterInfo, CONTROL_PLANE_BIN_ENV, INFO_FILE,
};
use cli_mcp_e2e::node::NodeKind;
use cli_mcp_e2e::project_images;
use cli_mcp_e2e::testing::{workspace_root, READY_PREFIX};
use cli_mcp_e2e::{Cluster, ClusterConfig};
use tokio::signal::unix::{signal, SignalKind};

#[derive(Parser)]
#[command(about = "Run the project's local Kubernetes cluster (no Docker, no registry)")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
    /// Log JSON lines.
    #[arg(long, global = true, env = "CLI_MCP_CLUSTER_LOG_JSON")]
    log_json: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// Bring the cluster up and keep it up until Ctrl-C or SIGTERM.
    Up(UpArgs),
    /// Bring the cluster up, run a command against it, tear it down; exits with its status.
    Exec {
        #[command(flatten)]
        up: UpArgs,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Forward a loopback port to a Service's ready endpoints (what `kubectl port-forward
    /// svc/NAME` gives on a real cluster) until Ctrl-C.
    Forward {
        /// Kubeconfig of the cluster (default: $KUBECONFIG, then ~/.kube/config).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        #[arg(long, short = 'n')]
        namespace: String,
        /// Service name.
        service: String,
        /// The Service port to reach.
        #[arg(long)]
        port: u16,
        /// Local loopback port (0 = any free one).
        #[arg(long, default_value_t = 0)]
        local_port: u16,
        /// Terminate TLS for local clients: they speak plain HTTP to the loopback port and
        /// the forward speaks TLS to the endpoint, trusting only this CA (PEM file).
        #[arg(long, requires = "tls_server_name")]
        tls_ca: Option<PathBuf>,
        /// The name the endpoint's certificate must carry with --tls-ca (for an instance:
        /// `<service>.<namespace>.svc`).
        #[arg(long, requires = "tls_ca")]
        tls_server_name: Option<String>,
    },
    /// Stop the cluster that runs with this run dir (sends SIGTERM to its owner).
    Down {
        #[arg(long, env = "CLI_MCP_CLUSTER_RUN_DIR")]
        run_dir: Option<PathBuf>,
    },
}

#[derive(Args, Clone)]
struct UpArgs {
    /// Run directory (certificates, kubeconfig, logs, kubelet state). Default: .run/cluster
    /// in the workspace.
    #[arg(long, env = "CLI_MCP_CLUSTER_RUN_DIR")]
    run_dir: Option<PathBuf>,
    /// Directory with etcd and the kube-* binaries. Default: built (or found in the cache)
    /// by hack/build-control-plane.sh.
    #[arg(long, env = CONTROL_PLANE_BIN_ENV)]
    control_plane_bin: Option<PathBuf>,
    /// The process kubelet binary. Default: cli-mcp-kubelet next to this binary.
    #[arg(long, env = "CLI_MCP_KUBELET_BIN")]
    kubelet: Option<PathBuf>,
    /// Extra image mapping PATTERN=PATH (repeatable), e.g. `my-tool:*=/usr/bin/my-tool`.
    /// Defaults: cli-mcp-{agent,server,operator}:* -> the binaries next to this one,
    /// cli-mcp-sandbox:* -> cli-mcp-agent (bash and CLIs from the host), cli-mcp-shell:* ->
    /// /bin/sh.
    #[arg(long = "image", value_name = "PATTERN=PATH")]
    images: Vec<String>,
    /// Node name the kubelet registers.
    #[arg(long, default_value = "cli-mcp-node")]
    node_name: String,
    /// Use pod subnet 10.244.N.0/24 (default: the first free one).
    #[arg(long)]
    pod_subnet: Option<u8>,
    /// Deadline in seconds for each startup phase.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// The node: `process` (cli-mcp-kubelet, pods as host processes) or `real` (kubelet +
    /// kube-proxy on containerd/runc, pods as containers from local images).
    #[arg(long, env = cli_mcp_e2e::node::NODE_ENV, default_value = "process")]
    node: String,
    /// With `--node real`: do not build and import the project's images (operator, server,
    /// sandbox from hack/build-images.sh, made of the binaries next to this one).
    #[arg(long)]
    no_project_images: bool,
}

fn exe_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this executable")?;
    Ok(exe
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".")))
}

async fn control_plane_bin(arg: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if arg.is_none() && std::env::var_os(CONTROL_PLANE_BIN_ENV).is_none() {
        eprintln!(
            "cli-mcp-cluster: locating the control-plane binaries with hack/build-control-plane.sh \
             (a cold build takes many minutes)"
        );
    }
    Ok(locate_control_plane_async(arg).await?)
}

async fn config(args: &UpArgs) -> anyhow::Result<ClusterConfig> {
    let dir = exe_dir()?;
    let run_dir = args
        .run_dir
        .clone()
        .unwrap_or_else(|| workspace_root().join(".run/cluster"));
    let kubelet = args
        .kubelet
        .clone()
        .unwrap_or_else(|| dir.join("cli-mcp-kubelet"));
    let mut cfg = ClusterConfig::new(
        control_plane_bin(args.control_plane_bin.clone()).await?,
        kubelet,
        run_dir,
    );
    let mut images: BTreeMap<String, PathBuf> = default_images(&dir);
    for spec in &args.images {
        let (pattern, path) = spec
            .split_once('=')
            .with_context(|| format!("--image {spec}: expected PATTERN=PATH"))?;
        let path = std::path::absolute(path).with_context(|| format!("--image {spec}"))?;
        images.insert(pattern.to_string(), path);
    }
    cfg.images = images;
    cfg.node_name = args.node_name.clone();
    cfg.pod_subnet = args.pod_subnet;
    cfg.timeout = Duration::from_secs(args.timeout);
    cfg.node = args.node.parse()?;
    Ok(cfg)
}

/// Resident memory of one process, in KiB (from /proc).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn report(cluster: &Cluster) {
    let info = cluster.info();
    let mut total = 0;
    let mut parts = Vec::new();
    for (name, pid) in cluster.pids() {
        let kib = rss_kib(pid);
        total += kib;
        parts.push(format!("{name}={}MiB", kib / 1024));
    }
    if let Some(t) = cluster.node_ready_after() {
        eprintln!(
            "cli-mcp-cluster: real node Ready {:.1}s after containerd started",
            t.as_secs_f64()
        );
    }
    eprintln!(
        "cli-mcp-cluster: ready in {:.1}s; apiserver {}; node {}; pod CIDR {}; RSS {} total={}MiB",
        cluster.ready_after().as_secs_f64(),
        info.apiserver,
        info.node_name,
        info.pod_cidr,
        parts.join(" "),
        total / 1024
    );
    println!("kubeconfig: {}", info.kubeconfig.display());
    println!(
        "env:        source {}",
        info.run_dir.join(cli_mcp_e2e::cluster::ENV_FILE).display()
    );
    println!("logs:       {}", info.log_dir.display());
    println!("{READY_PREFIX}{}", info.run_dir.join(INFO_FILE).display());
}

struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        Ok(Signals {
            int: signal(SignalKind::interrupt()).context("installing SIGINT handler")?,
            term: signal(SignalKind::terminate()).context("installing SIGTERM handler")?,
            hup: signal(SignalKind::hangup()).context("installing SIGHUP handler")?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
            _ = self.hup.recv() => "SIGHUP",
        }
    }
}

/// Everything before the cluster is ready (locating or building the control plane, waiting
/// for the run dir, starting each component, the readiness waits) gives way to SIGINT, SIGTERM
/// or SIGHUP: the startup is dropped, which stops whatever it had started (a control-plane
/// build included) and releases the run dir. `None` when a signal stopped it.
async fn bring_up(args: &UpArgs, signals: &mut Signals) -> anyhow::Result<Option<Cluster>> {
    let mut startup = Box::pin(async {
        let cfg = config(args).await?;
        if cfg.node != NodeKind::Real || args.no_project_images {
            return Cluster::up(cfg)
                .await
                .context("bringing the local cluster up");
        }
        // The images build (seconds when cached) while the cluster starts.
        let bin_dir = exe_dir()?;
        // The first error drops the other future: a cluster half up is torn down, a build
        // in progress is terminated.
        let (cluster, images) = tokio::try_join!(
            async {
                Cluster::up(cfg)
                    .await
                    .context("bringing the local cluster up")
            },
            async {
                project_images::build_async(&bin_dir).await.context(
                    "building the project's images (hack/build-images.sh; \
                     --no-project-images skips them)",
                )
            },
        )?;
        let names = cluster
            .import_project_images(&images)
            .context("pushing the project's images to the real node's registry")?;
        eprintln!(
            "cli-mcp-cluster: images from {} pushed to the node's registry as {}",
            images.dir.display(),
            names.join(", ")
        );
        Ok(cluster)
    });
    let sig = tokio::select! {
        r = &mut startup => {
            let cluster = r?;
            report(&cluster);
            return Ok(Some(cluster));
        }
        sig = signals.recv() => sig,
    };
    eprintln!("cli-mcp-cluster: {sig} during startup; stopping what was started");
    let started = Instant::now();
    // Dropping the startup future tears down the partial cluster (`Cluster`'s drop), bounded
    // by each component's grace period.
    drop(startup);
    eprintln!(
        "cli-mcp-cluster: stopped in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(None)
}

async fn up(args: UpArgs) -> anyhow::Result<ExitCode> {
    let mut signals = Signals::new()?;
    let Some(mut cluster) = bring_up(&args, &mut signals).await? else {
        return Ok(ExitCode::from(130));
    };
    eprintln!("cli-mcp-cluster: up; press Ctrl-C to stop");
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            sig = signals.recv() => {
                eprintln!("cli-mcp-cluster: {sig}; tearing down");
                break;
            }
            _ = tick.tick() => {
                if let Some(e) = cluster.first_exit() {
                    eprintln!("cli-mcp-cluster: {e}");
                    let started = Instant::now();
                    tokio::task::spawn_blocking(move || cluster.down()).await.ok();
                    eprintln!("cli-mcp-cluster: torn down in {:.1}s", started.elapsed().as_secs_f64());
                    return Ok(ExitCode::FAILURE);
                }
            }
        }
    }
    let started = Instant::now();
    tokio::task::spawn_blocking(move || cluster.down())
        .await
        .ok();
    eprintln!(
        "cli-mcp-cluster: torn down in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

async fn exec(args: UpArgs, command: Vec<String>) -> anyhow::Result<ExitCode> {
    let mut signals = Signals::new()?;
    let Some(cluster) = bring_up(&args, &mut signals).await? else {
        return Ok(ExitCode::from(130));
    };
    let info: ClusterInfo = cluster.info().clone();
    let (program, rest) = command
        .split_first()
        .context("exec needs a command after `--`")?;
    let mut child = tokio::process::Command::new(program)
        .args(rest)
        .envs(info.env_vars())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {program}"))?;
    let code = tokio::select! {
        status = child.wait() => {
            let status = status.with_context(|| format!("waiting for {program}"))?;
            eprintln!("cli-mcp-cluster: {program} exited with {status}");
            status.code().map(|c| u8::try_from(c).unwrap_or(1)).unwrap_or(1)
        }
        sig = signals.recv() => {
            eprintln!("cli-mcp-cluster: {sig}; stopping {program} and tearing down");
            if let Some(pid) = child.id() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
            130
        }
    };
    tokio::task::spawn_blocking(move || cluster.down())
        .await
        .ok();
    Ok(ExitCode::from(code))
}

fn down(run_dir: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let run_dir = run_dir.unwrap_or_else(|| workspace_root().join(".run/cluster"));
    let info = match ClusterInfo::load(&run_dir) {
        Ok(i) => i,
        Err(e) => {
            eprintln!(
                "cli-mcp-cluster: no running cluster in {} ({e})",
                run_dir.display()
            );
            return Ok(ExitCode::SUCCESS);
        }
    };
    let pid = nix::unistd::Pid::from_raw(info.pid as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)
        .with_context(|| format!("signalling cluster owner pid {}", info.pid))?;
    // The owner is not our child, so there is nothing to wait(2) on: watch /proc. An owner
    // whose parent died is reaped by init, which may take its time: a zombie has exited.
    let deadline = Instant::now() + Duration::from_secs(90);
    while cli_mcp_e2e::process::running(info.pid as i32) {
        if Instant::now() > deadline {
            bail!("cluster owner pid {} did not exit within 90 s", info.pid);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("cli-mcp-cluster: stopped");
    Ok(ExitCode::SUCCESS)
}

async fn forward(
    kubeconfig: Option<PathBuf>,
    namespace: &str,
    service: &str,
    port: u16,
    local_port: u16,
    tls: Option<(PathBuf, String)>,
) -> anyhow::Result<ExitCode> {
    let tls = match tls {
        Some((ca, name)) => {
            let pem =
                std::fs::read(&ca).with_context(|| format!("reading the CA {}", ca.display()))?;
            Some(
                cli_mcp_e2e::portforward::TlsUpstream::new(&pem, &name)
                    .with_context(|| format!("the CA {}", ca.display()))?,
            )
        }
        None => None,
    };
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(&path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer()
            .await
            .context("no kubeconfig: pass --kubeconfig")?,
    };
    let client = kube::Client::try_from(config)?;
    let fwd =
        cli_mcp_e2e::ServiceForward::start_with(client, namespace, service, port, local_port, tls)
            .await
            .with_context(|| format!("forwarding to svc/{service} port {port} in {namespace}"))?;
    // The one line scripts wait for.
    println!("CLI_MCP_FORWARD {}", fwd.local_addr());
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(ExitCode::SUCCESS)
}

fn init_tracing(json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,kube_client::client::builder=off"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(cli_mcp_api::terminal::log_colours());
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_json);
    let result = match cli.command {
        Cmd::Up(args) => up(args).await,
        Cmd::Exec { up, command } => exec(up, command).await,
        Cmd::Down { run_dir } => down(run_dir),
        Cmd::Forward {
            kubeconfig,
            namespace,
            service,
            port,
            local_port,
            tls_ca,
            tls_server_name,
        } => {
            let tls = tls_ca.zip(tls_server_name);
            forward(kubeconfig, &namespace, &service, port, local_port, tls).await
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("cli-mcp-cluster: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
