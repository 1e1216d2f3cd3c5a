//! `cli-mcp-bench proxy`: what the credential proxy adds to a Kubernetes GET (through it vs
//! straight to the API server, both with kept-alive connections as kubectl has), and its
//! memory idle and with many watch streams open. The API server is the local cluster's;
//! the proxy is the built binary, so its RSS is a real process's. It verifies its clients
//! as in a cluster: the bench connects as a sandbox pod (see [`crate::proxy_identity`], which
//! then measures what that verification costs).

use std::ffi::OsString;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use cli_mcp_api::kubeconfig;
use cli_mcp_api::proxy::{RouteTable, PLACEHOLDER_TOKEN};
use cli_mcp_e2e::testing;

use crate::figures::{ms, rss_kib, stats, Stats};
use crate::proxy_identity::{self, Sandbox, Sandboxes};
use crate::proxy_process::ProxyProcess;

#[derive(clap::Args)]
pub struct ProxyArgs {
    /// The proxy binary to measure (use a release build).
    #[arg(long)]
    pub proxy: PathBuf,
    /// GETs per path (after 50 of warm-up).
    #[arg(long, default_value_t = 1000)]
    pub requests: usize,
    /// Watch streams held open at once for the memory row.
    #[arg(long, default_value_t = 100)]
    pub watches: usize,
    /// kubectl (default: `$KUBECTL`, else from PATH).
    #[arg(long)]
    pub kubectl: Option<PathBuf>,
    #[command(flatten)]
    pub identity: proxy_identity::IdentityArgs,
}

fn kubectl(bin: &Path, kubeconfig: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(bin)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!(
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

pub fn proxy_bench(args: ProxyArgs) -> anyhow::Result<()> {
    tokio::runtime::Runtime::new()
        .context("tokio runtime")?
        .block_on(run(args))
}

async fn run(args: ProxyArgs) -> anyhow::Result<()> {
    let cluster = testing::cluster().await.context("the local cluster")?;
    let ns = cluster.namespace("proxy-bench").await?;
    let dir = tempfile::tempdir()?;
    let sandboxes = Sandboxes::new(&cluster, &ns, dir.path()).await?;
    // The bench's own sandbox pod: its connections come from 127.0.0.1.
    let me = sandboxes
        .sandbox("bench", IpAddr::V4(Ipv4Addr::LOCALHOST))
        .await?;
    if !args.identity.identity_only {
        kubernetes_figures(&args, &cluster, &sandboxes, &me, dir.path()).await?;
    }
    proxy_identity::identity_figures(&args.identity, &args.proxy, &sandboxes, &me).await?;
    ns.delete().await.ok();
    Ok(())
}

/// Through the proxy binary to the API server vs straight to it, and the proxy's RSS with
/// watches open; the bench's client is sandbox `me`.
async fn kubernetes_figures(
    args: &ProxyArgs,
    cluster: &testing::TestCluster,
    sandboxes: &Sandboxes,
    me: &Sandbox,
    dir: &Path,
) -> anyhow::Result<()> {
    let kubectl_bin = args
        .kubectl
        .clone()
        .or_else(|| std::env::var_os("KUBECTL").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("kubectl"));
    let admin = &cluster.info.kubeconfig;
    let n = sandboxes.namespace.as_str();
    let server = &cluster.info.apiserver;
    let (token, token_kubeconfig) = bench_credentials(&kubectl_bin, admin, n, server)?;
    let kc = kubeconfig::validate(&token_kubeconfig).context("the bench kubeconfig")?;
    let cluster_ca = kc
        .routes()
        .first()
        .and_then(|r| r.ca_cert.clone())
        .context("the cluster CA")?;

    let (proxy_ca, proxy_key) = cli_mcp_proxy::ca::generate_ca("bench proxy CA")?;
    std::fs::write(dir.join("ca.crt"), &proxy_ca)?;
    std::fs::write(dir.join("ca.key"), &proxy_key)?;
    std::fs::write(dir.join("kubeconfig"), &token_kubeconfig)?;
    std::fs::write(
        dir.join("routes.json"),
        RouteTable::new(kc.routes())?.to_json(),
    )?;
    let proxy = start_proxy(args, dir, sandboxes)?;
    let pid = proxy.pid();
    let http = reqwest::Client::builder().no_proxy().build()?;
    proxy.ready(&http).await?;
    let idle_kib = rss_kib(pid)?;

    let direct = reqwest::Client::builder()
        .no_proxy()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(cluster_ca.as_bytes())?)
        .build()?;
    let proof = reqwest::header::HeaderValue::from_str(&format!("Bearer {}", me.token))?;
    let proxied = reqwest::Client::builder()
        .proxy(reqwest::Proxy::https(format!("http://{}", proxy.listen))?.custom_http_auth(proof))
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(proxy_ca.as_bytes())?)
        .build()?;
    let url = format!("{server}/api/v1/namespaces/{n}/pods");
    let direct_s = timed_gets(&direct, &url, &token, args.requests).await?;
    let proxied_s = timed_gets(&proxied, &url, PLACEHOLDER_TOKEN, args.requests).await?;
    let after_gets_kib = rss_kib(pid)?;

    let streams = open_watches(&proxied, &format!("{url}?watch=true"), args.watches).await?;
    let tunnels = proxy.metric(&http, "cli_mcp_proxy_tunnels").await?;
    let watches_kib = rss_kib(pid)?;
    drop(streams);

    Figures {
        direct: stats(direct_s),
        proxied: stats(proxied_s),
        idle_kib,
        after_gets_kib,
        watches_kib,
        tunnels,
    }
    .print(args, &url);
    Ok(())
}

/// A ServiceAccount `bench` of namespace `n` bound to cluster-admin, and a kubeconfig with
/// its token for `server` (the cluster's CA from the admin kubeconfig): what a session's
/// kubeconfig is. Returns the token and the kubeconfig.
fn bench_credentials(
    kubectl_bin: &Path,
    admin: &Path,
    n: &str,
    server: &str,
) -> anyhow::Result<(String, String)> {
    kubectl(
        kubectl_bin,
        admin,
        &["-n", n, "create", "serviceaccount", "bench"],
    )?;
    kubectl(
        kubectl_bin,
        admin,
        &[
            "-n",
            n,
            "create",
            "rolebinding",
            "bench",
            "--clusterrole=cluster-admin",
            &format!("--serviceaccount={n}:bench"),
        ],
    )?;
    let token = kubectl(kubectl_bin, admin, &["-n", n, "create", "token", "bench"])?;
    let ca_data = kubectl(
        kubectl_bin,
        admin,
        &[
            "config",
            "view",
            "--raw",
            "--minify",
            "-o",
            "jsonpath={.clusters[0].cluster.certificate-authority-data}",
        ],
    )?;
    let token_kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca_data}\nusers:\n- name: u\n  user:\n    token: {token}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u, namespace: {n}}}\ncurrent-context: x\n"
    );
    Ok((token, token_kubeconfig))
}

/// The proxy binary on loopback with the files in `dir` (routes, its CA, the kubeconfig),
/// verifying `sandboxes`, room for the watches; once it serves.
fn start_proxy(
    args: &ProxyArgs,
    dir: &Path,
    sandboxes: &Sandboxes,
) -> anyhow::Result<ProxyProcess> {
    let mut flags: Vec<OsString> = Vec::new();
    for (flag, file) in [
        ("--routes", "routes.json"),
        ("--ca-cert", "ca.crt"),
        ("--ca-key", "ca.key"),
        ("--kubeconfig", "kubeconfig"),
    ] {
        flags.push(flag.into());
        flags.push(dir.join(file).into());
    }
    let room = (args.watches + 64).to_string();
    for flag in ["--max-connections", "--max-connections-per-client"] {
        flags.push(flag.into());
        flags.push(room.clone().into());
    }
    flags.extend(sandboxes.flags().into_iter().map(OsString::from));
    ProxyProcess::start(&args.proxy, &flags, &sandboxes.admin_kubeconfig)
}

/// `n` watches of `watch_url` through the proxy, held open with their headers received.
async fn open_watches(
    proxied: &reqwest::Client,
    watch_url: &str,
    n: usize,
) -> anyhow::Result<Vec<reqwest::Response>> {
    // Watches: each its own connection and tunnel, held open with its headers received.
    let mut open = Vec::with_capacity(n);
    for _ in 0..n {
        let c = proxied.clone();
        let u = watch_url.to_owned();
        open.push(tokio::spawn(async move {
            c.get(u).bearer_auth(PLACEHOLDER_TOKEN).send().await
        }));
    }
    let mut streams = Vec::with_capacity(n);
    for h in open {
        let resp = h.await??;
        if !resp.status().is_success() {
            bail!("a watch through the proxy got {}", resp.status());
        }
        streams.push(resp);
    }
    Ok(streams)
}

/// What the proxy tables print: both paths' latencies and the proxy's RSS readings.
struct Figures {
    direct: Stats,
    proxied: Stats,
    idle_kib: u64,
    after_gets_kib: u64,
    watches_kib: u64,
    tunnels: f64,
}

impl Figures {
    fn print(&self, args: &ProxyArgs, url: &str) {
        let (direct_st, proxied_st) = (&self.direct, &self.proxied);
        let added = |a: Duration, b: Duration| {
            format!("{:+.3} ms", (a.as_secs_f64() - b.as_secs_f64()) * 1000.0)
        };
        println!(
            "\n## proxy (GET {url}, {} requests, kept-alive connection)\n",
            args.requests
        );
        println!("| path | median | p99 |");
        println!("|---|---|---|");
        println!(
            "| direct to the API server | {} | {} |",
            ms(direct_st.median),
            ms(direct_st.p99)
        );
        println!(
            "| through cli-mcp-proxy | {} | {} |",
            ms(proxied_st.median),
            ms(proxied_st.p99)
        );
        println!(
            "| added by the proxy | {} | {} |",
            added(proxied_st.median, direct_st.median),
            added(proxied_st.p99, direct_st.p99)
        );
        println!("\n| proxy RSS | MiB |");
        println!("|---|---|");
        let mib = |k: u64| format!("{:.1}", k as f64 / 1024.0);
        println!("| idle (started, ready) | {} |", mib(self.idle_kib));
        println!("| after the GETs | {} |", mib(self.after_gets_kib));
        println!(
            "| {} watch streams open ({} tunnels) | {} |",
            args.watches,
            self.tunnels,
            mib(self.watches_kib)
        );
    }
}

async fn timed_gets(
    client: &reqwest::Client,
    url: &str,
    token: &str,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut samples = Vec::with_capacity(n);
    for i in 0..n + 50 {
        let start = Instant::now();
        let resp = client.get(url).bearer_auth(token).send().await?;
        let status = resp.status();
        resp.bytes().await?;
        if !status.is_success() {
            bail!("GET {url}: {status}");
        }
        if i >= 50 {
            samples.push(start.elapsed());
        }
    }
    Ok(samples)
}
