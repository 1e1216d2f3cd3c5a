//! The real node: kubelet and kube-proxy (built from the same Kubernetes module as the
//! control plane by `hack/build-control-plane.sh`) on containerd + runc from Debian, with the
//! CNI `ptp` plugin for pod networking. It is the alternative to the process kubelet
//! ([`NodeKind::Real`], `CLI_MCP_NODE=real`, `cli-mcp-cluster up --node real`): pods run as
//! real containers from local images.
//!
//! Everything lives under `<run dir>/node` (containerd's config, root, state, socket and
//! netns mounts; the CNI config and IPAM state; the kubelet's root dir; the node's
//! kubeconfigs and images). Pods get addresses in the cluster's `10.244.N.0/24` with the same
//! gateway on `lo` as the process kubelet (see [`crate::net`]), so pod traffic stays on this
//! host. The render functions below are pure; [`RealNode`] starts and tears down the three
//! processes.
//!
//! Host-wide state the node touches, and gives back on teardown:
//! - kube-proxy's iptables chains (`KUBE-*`, one set per host network namespace): only one
//!   real node runs at a time on a host (a lock in [`crate::net::STATE_DIR`]), and teardown
//!   runs `kube-proxy --cleanup`;
//! - the kubelet's `KUBE-KUBELET-CANARY` chains, deleted on teardown;
//! - the sysctls the kubelet insists on ([`KUBELET_SYSCTLS`]): saved before it starts and
//!   restored on teardown;
//! - the cgroup subtree `/cli-mcp-node-N` (the kubelet's `cgroupRoot`) in every hierarchy:
//!   its processes are killed and the directories removed on teardown (and on the next start
//!   if an earlier owner died).
//!
//! - `kind`: which node a cluster runs ([`NodeKind`]);
//! - `params`: where the node keeps everything ([`NodeParams`]);
//! - `config`: containerd's, the CNI's, the kubelet's and kube-proxy's configuration;
//! - `credentials`: the kubelet's and kube-proxy's client certificates and kubeconfigs;
//! - `image`: one-layer image archives and their import into containerd;
//! - `host`: the host's prerequisites, the host-wide lock, the kubelet's sysctls;
//! - `cgroup`, `mounts`: the cgroup subtree and the mounts the node leaves behind;
//! - `gvisor`: runsc as containerd's runtime `runsc`, and the RuntimeClass `gvisor`;
//! - `real_node`: [`RealNode`], starting and stopping the three processes.

// The node's commands (ctr, tar, mount) run as every command of the e2e crate does.
use crate::process::run_ok as run;

mod cgroup;
mod config;
mod credentials;
pub mod gvisor;
mod host;
mod image;
mod kind;
mod mounts;
mod params;
mod real_node;

pub use config::{
    cni_conflist, containerd_config, kube_proxy_config, kubelet_config, CLUSTER_CIDR, CLUSTER_DNS,
    CLUSTER_DOMAIN, POD_PIDS_LIMIT, VOLUME_STATS_AGG_PERIOD,
};
pub use credentials::{client_cert, write_private};
pub use host::{preflight, KUBELET_SYSCTLS};
pub use image::{
    build_image_archive, image_config_json, image_manifest_json, import_image, CATATONIT,
    CRI_NAMESPACE, PAUSE_IMAGE,
};
pub use kind::{NodeKind, NODE_ENV};
pub use mounts::{mounts_under, unmount_under};
pub use params::NodeParams;
pub use real_node::{NodeBins, NodeStart, RealNode};
