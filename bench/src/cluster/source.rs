//! Which cluster a section measures on: the one `$CLI_MCP_KUBECONFIG` names, or a private one
//! started for the run whose pods run the binaries (or the images built from them) of
//! `--bin-dir`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use cli_mcp_e2e::cluster::{ClusterConfig, KUBECONFIG_ENV};
use cli_mcp_e2e::node::NodeKind;
use cli_mcp_e2e::project_images;
use cli_mcp_e2e::testing::{
    cluster, private_cluster_with, workspace_root, PrivateCluster, TestCluster,
};

/// Which cluster a section measures on, and what its pods run.
#[derive(clap::Args, Debug, Clone)]
pub struct ClusterSource {
    /// Directory with the cli-mcp-{server,operator,agent} binaries the cluster's images map
    /// to (default: the directory of this binary, i.e. target/release).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// The process kubelet (default: cli-mcp-kubelet in --bin-dir, else target/debug).
    #[arg(long)]
    pub kubelet: Option<PathBuf>,
    /// Where the pods run: `process` (the process kubelet; images map to the binaries) or
    /// `real` (kubelet + containerd/runc; the project's images are built from the binaries in
    /// --bin-dir and imported). Default: `$CLI_MCP_NODE`, else `process`.
    #[arg(long)]
    pub node: Option<NodeKind>,
}

fn default_bin_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this executable")?;
    Ok(exe.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// The cluster to measure on: `$CLI_MCP_KUBECONFIG`'s, or a private one whose images map
/// to the binaries in `bin_dir`, with its run dir `.run/<run_dir>` and a pod subnet of
/// `/pod_prefix` (24 holds 253 pods). Returns it, what its pods run, and the private cluster
/// to keep alive.
pub(crate) async fn the_cluster(
    args: &ClusterSource,
    run_dir: &str,
    pod_prefix: u8,
) -> anyhow::Result<(TestCluster, String, Option<PrivateCluster>)> {
    if std::env::var_os(KUBECONFIG_ENV).is_some() {
        let c = cluster().await?;
        return Ok((
            c,
            format!("the cluster of ${KUBECONFIG_ENV} (its image map decides the build)"),
            None,
        ));
    }
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => default_bin_dir()?,
    };
    let bin_dir = std::path::absolute(&bin_dir).context("--bin-dir")?;
    for b in [
        "cli-mcp-server",
        "cli-mcp-operator",
        "cli-mcp-agent",
        "cli-mcp-proxy",
    ] {
        if !bin_dir.join(b).is_file() {
            bail!(
                "{} is missing: build it (cargo build --release -p {b}) or pass --bin-dir",
                bin_dir.join(b).display()
            );
        }
    }
    let mut cfg = ClusterConfig::local(&bin_dir, workspace_root().join(".run").join(run_dir))?;
    cfg.pod_prefix = pod_prefix;
    cfg.kubelet_bin = match &args.kubelet {
        Some(k) => k.clone(),
        None => {
            let here = bin_dir.join("cli-mcp-kubelet");
            let debug = bin_dir
                .parent()
                .map(|t| t.join("debug/cli-mcp-kubelet"))
                .unwrap_or_default();
            if here.is_file() {
                here
            } else {
                debug
            }
        }
    };
    let profile = bin_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if let Some(node) = args.node {
        cfg.node = node;
    }
    let node = cfg.node;
    // On the real node the pods are containers of the images built from these binaries
    // (seconds when cached); they build while the cluster starts.
    let images = (node == NodeKind::Real).then(|| {
        cfg.images.clear();
        let dir = bin_dir.clone();
        tokio::task::spawn_blocking(move || project_images::build(&dir))
    });
    let pc = private_cluster_with(cfg).await?;
    let mut kind = "process kubelet: pods are host processes";
    if let Some(build) = images {
        let images = build
            .await
            .context("the image build task")?
            .context("building the project's images (hack/build-images.sh)")?;
        pc.cluster
            .import_project_images(&images)
            .context("importing the project's images into the real node")?;
        kind = "real node: containerd containers of the built images, under runc or, for \
                the RuntimeClass gvisor, runsc";
    }
    let c = pc.test.clone();
    Ok((
        c,
        format!(
            "a private cluster ({kind}); server, operator and agents from {} ({profile} build)",
            bin_dir.display()
        ),
        Some(pc),
    ))
}
