//! What the operator's real-container tests start from: a private real-node cluster (kubelet
//! and kube-proxy on containerd/runc, CoreDNS) with the project's images built from this
//! run's binaries and imported under the names the manifests use, and kube-router's firewall
//! enforcing NetworkPolicy. The images are built while the cluster starts.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Instant;

use crate::addons::{self, Enforcer, Ipv4Net};
use crate::cluster::{ClusterConfig, ClusterInfo};
use crate::node::{self, NodeKind};
use crate::project_images::{self, ProjectImages};
use crate::testing::{self, workspace_root, PrivateCluster};

pub struct RealNodeRig {
    pub pc: PrivateCluster,
    pub info: ClusterInfo,
    /// The node's containerd socket (`ctr --address`, [`crate::peer::peer`]).
    pub socket: PathBuf,
    pub images: ProjectImages,
    pub enforcer: Enforcer,
    /// The pod network's gateway: the host, where the API server listens.
    pub gateway: Ipv4Addr,
    /// `.run/e2e-<name>` under the workspace.
    pub run_dir: PathBuf,
}

impl RealNodeRig {
    /// The rig for test `name`, or `None` (after saying why on stderr) when this host cannot
    /// run it: not root, or no real node here. Panics, as test support does, on a failure
    /// once the host qualifies.
    pub async fn start(name: &str) -> Option<RealNodeRig> {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP {name}: needs root (containerd, cgroups, network namespaces)");
            return None;
        }
        let t0 = Instant::now();
        let bin_dir = testing::binaries_dir().expect("binaries dir");
        let run_dir = workspace_root().join(format!(".run/e2e-{}", name.replace('_', "-")));
        let mut cfg = ClusterConfig::local(&bin_dir, run_dir.clone()).expect("cluster config");
        if let Err(e) = node::preflight(&cfg.control_plane_bin) {
            eprintln!("SKIP {name}: {e}");
            return None;
        }
        addons::enforcer_preflight().unwrap_or_else(|e| panic!("{e}"));
        cfg.node = NodeKind::Real;
        cfg.images.clear();
        let build = tokio::task::spawn_blocking(move || project_images::build(&bin_dir));
        let mut pc = testing::private_cluster_with(cfg)
            .await
            .unwrap_or_else(|e| panic!("a private real-node cluster: {e}"));
        let images = build
            .await
            .expect("join")
            .unwrap_or_else(|e| panic!("hack/build-images.sh: {e}"));
        pc.cluster
            .import_project_images(&images)
            .unwrap_or_else(|e| panic!("{e}"));
        let info = pc.test.info.clone();
        let socket = info.containerd_socket.clone().expect("containerd socket");
        // The real node's cluster runs the enforcer from its start; the tests own it from here
        // to check that it stops cleanly.
        let enforcer = pc
            .cluster
            .take_enforcer()
            .expect("a real-node cluster runs the NetworkPolicy enforcer");
        let gateway = Ipv4Net::parse(&info.pod_cidr)
            .expect("pod CIDR")
            .first_host();
        eprintln!(
            "{name}: cluster, images and enforcer ready after {:.1?}",
            t0.elapsed()
        );
        Some(RealNodeRig {
            pc,
            info,
            socket,
            images,
            enforcer,
            gateway,
            run_dir,
        })
    }
}
