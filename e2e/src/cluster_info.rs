//! What a running cluster tells its users: [`ClusterInfo`] (where everything is, written to
//! `cluster.json` in the run dir once the cluster is ready) and a client for it. A leaf
//! module: the cluster writes it, and the add-ons, the tests and `cli-mcp-cluster` read it.

use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::node::{NodeKind, NODE_ENV};

/// Name of the cluster description written into the run directory once the cluster is ready.
pub const INFO_FILE: &str = "cluster.json";
/// Shell-sourceable environment file written next to it.
pub const ENV_FILE: &str = "cluster.env";
/// Environment variable naming the real node's image registry (`127.0.0.1:<port>`), with
/// `CLI_MCP_REGISTRY_CA` (the CA it is trusted with) and `CLI_MCP_CRANE` beside it.
pub const REGISTRY_ENV: &str = "CLI_MCP_REGISTRY";
/// Environment variable naming the kubeconfig of an already running cluster to share.
pub const KUBECONFIG_ENV: &str = "CLI_MCP_KUBECONFIG";

/// Where everything of a running cluster is; written to `cluster.json` in the run dir.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterInfo {
    pub run_dir: PathBuf,
    pub kubeconfig: PathBuf,
    /// `https://<host>:<port>`
    pub apiserver: String,
    /// Pod-reachable host address the apiserver listens on (also used by host clients).
    pub apiserver_host: Ipv4Addr,
    pub apiserver_port: u16,
    pub node_name: String,
    pub pod_cidr: String,
    pub kubelet_state_dir: PathBuf,
    pub image_map: PathBuf,
    pub log_dir: PathBuf,
    /// Pid of the process that owns the cluster.
    pub pid: u32,
    /// Which node runs the pods.
    #[serde(default)]
    pub node: NodeKind,
    /// The real node's containerd socket (`ctr --address`; import images with
    /// [`crate::node::import_image`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub containerd_socket: Option<PathBuf>,
    /// The real node's image registry, which its containerd pulls from and trusts
    /// ([`crate::registry`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry: Option<crate::registry::RegistryInfo>,
}

impl ClusterInfo {
    /// Read `cluster.json` from a run dir.
    pub fn load(run_dir: &Path) -> Result<ClusterInfo> {
        let path = run_dir.join(INFO_FILE);
        let text = fs::read_to_string(&path).map_err(|e| Error::io("reading", &path, e))?;
        serde_json::from_str(&text).map_err(|e| Error::Parse {
            path,
            detail: e.to_string(),
        })
    }

    /// A client for the admin identity.
    pub async fn client(&self) -> Result<Client> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// Path of a container's log file as the kubelet writes it.
    pub fn container_log_path(
        &self,
        namespace: &str,
        pod: &str,
        uid: &str,
        container: &str,
    ) -> PathBuf {
        self.kubelet_state_dir
            .join("pods")
            .join(format!("{namespace}_{pod}_{uid}"))
            .join(format!("{container}.log"))
    }

    /// `KEY=value` lines describing the cluster (for `source`-ing and for child processes).
    pub fn env_vars(&self) -> Vec<(String, String)> {
        let p = |p: &Path| p.display().to_string();
        let registry = self.registry.iter().flat_map(|r| {
            [
                (REGISTRY_ENV.into(), r.host.clone()),
                ("CLI_MCP_REGISTRY_CA".into(), p(&r.ca)),
                ("CLI_MCP_CRANE".into(), p(&r.crane)),
            ]
        });
        let base: Vec<(String, String)> = vec![
            (KUBECONFIG_ENV.into(), p(&self.kubeconfig)),
            ("KUBECONFIG".into(), p(&self.kubeconfig)),
            ("CLI_MCP_APISERVER".into(), self.apiserver.clone()),
            ("CLI_MCP_NODE_NAME".into(), self.node_name.clone()),
            ("CLI_MCP_POD_CIDR".into(), self.pod_cidr.clone()),
            (
                "CLI_MCP_KUBELET_STATE_DIR".into(),
                p(&self.kubelet_state_dir),
            ),
            ("CLI_MCP_RUN_DIR".into(), p(&self.run_dir)),
            (
                NODE_ENV.into(),
                match self.node {
                    NodeKind::Process => "process".into(),
                    NodeKind::Real => "real".into(),
                },
            ),
        ];
        base.into_iter().chain(registry).collect()
    }
}

/// A kube client for the identity in a kubeconfig file.
pub async fn client_from_kubeconfig(path: &Path) -> Result<Client> {
    let kc = Kubeconfig::read_from(path)?;
    let mut config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    config.connect_timeout = Some(Duration::from_secs(5));
    Ok(Client::try_from(config)?)
}
