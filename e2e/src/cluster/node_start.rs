//! Starting the cluster's node once the control plane runs: the process kubelet
//! (`cli-mcp-kubelet`, with cluster DNS on the pod gateway) or the real node (kubelet +
//! kube-proxy on containerd, [`crate::node`]).

use std::fs;
use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use super::{Cluster, ClusterConfig};
use crate::error::{Error, Result};
use crate::net;
use crate::node::{NodeBins, NodeParams, NodeStart, RealNode};
use crate::pki::Pki;
use crate::process::Component;

impl Cluster {
    /// Start the node: the real node when its binaries were located (`node_bins`), else
    /// the process kubelet. Readiness is the caller's wait.
    pub(super) async fn start_node(
        &mut self,
        config: &ClusterConfig,
        node_bins: Option<NodeBins>,
        pki: &Pki,
    ) -> Result<()> {
        match node_bins {
            Some(bins) => self.start_real_node(config, bins, pki).await,
            None => self.start_process_kubelet(config),
        }
    }

    fn start_process_kubelet(&mut self, config: &ClusterConfig) -> Result<()> {
        let host = self.info.apiserver_host;
        let p = |p: &Path| p.display().to_string();
        let mut kubelet_args = vec![
            "--kubeconfig".to_string(),
            p(&self.info.kubeconfig),
            "--node-name".into(),
            config.node_name.clone(),
            "--state-dir".into(),
            p(&self.info.kubelet_state_dir),
            "--pod-cidr".into(),
            self.info.pod_cidr.clone(),
            "--image-map".into(),
            p(&self.info.image_map),
            "--apiserver-host".into(),
            host.to_string(),
            "--apiserver-port".into(),
            self.info.apiserver_port.to_string(),
        ];
        // Sandboxes reach their credential proxy by its Service name: every process
        // cluster has cluster DNS, CoreDNS on the pod gateway (started below).
        let dns = crate::addons::process_cluster_dns(host).ok_or_else(|| {
            Error::Prerequisite(format!(
                "port 53 of {host} is taken on this host (a local resolver listening on \
                 every address?); the process kubelet's pods need cluster DNS there to \
                 reach Services by name: bind the resolver to 127.0.0.53 only, or stop it"
            ))
        })?;
        kubelet_args.extend(["--cluster-dns".into(), dns.to_string()]);
        let rust_log = std::env::var("CLI_MCP_KUBELET_LOG").unwrap_or_else(|_| "info".into());
        self.kubelet = Some(Component::start(
            "cli-mcp-kubelet",
            &config.kubelet_bin,
            &kubelet_args,
            &[("RUST_LOG", rust_log)],
            &self.info.log_dir.join("cli-mcp-kubelet.log"),
            // Enough for the kubelet to stop pods with short grace periods and clean up.
            Duration::from_secs(45),
            false,
        )?);
        Ok(())
    }

    async fn start_real_node(
        &mut self,
        config: &ClusterConfig,
        bins: NodeBins,
        pki: &Pki,
    ) -> Result<()> {
        let host = self.info.apiserver_host;
        // 10.244.N.1: one cgroup root per pod subnet, so a dead owner's is found again.
        let n = host.octets()[2];
        let lo = Ipv4Addr::LOCALHOST;
        let params = NodeParams {
            dir: self.info.run_dir.join("node"),
            node_name: config.node_name.clone(),
            node_ip: host,
            pod_cidr: self.info.pod_cidr.clone(),
            kubelet_port: net::free_port(host)?,
            kubelet_healthz_port: net::free_port(lo)?,
            proxy_healthz_port: net::free_port(lo)?,
            proxy_metrics_port: net::free_port(lo)?,
            ca_cert: pki.ca_cert.clone(),
            cgroup_root: format!("/cli-mcp-node-{n}"),
            gvisor_bin: bins.gvisor_bin.clone(),
        };
        let ca_key_pem =
            fs::read_to_string(&pki.ca_key).map_err(|e| Error::io("reading", &pki.ca_key, e))?;
        let node_started = Instant::now();
        let node = RealNode::start(
            params,
            NodeStart {
                bins,
                apiserver: &self.info.apiserver,
                ca_cert_pem: &pki.ca_cert_pem,
                ca_key_pem: &ca_key_pem,
                log_dir: &self.info.log_dir,
                timeout: config.timeout,
                host_lock_wait: config.host_lock_wait,
            },
        )
        .await?;
        self.info.containerd_socket = Some(node.params().socket());
        self.info.registry = node.registry().cloned();
        self.real_node = Some(node);
        self.node_started = Some(node_started);
        Ok(())
    }
}
