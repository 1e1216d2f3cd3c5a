//! Local Kubernetes for the project's tests and `make run`: a real control plane (etcd,
//! kube-apiserver, kube-controller-manager, kube-scheduler built from the Go module proxy by
//! `hack/build-control-plane.sh`) plus the process kubelet, started as child processes with
//! generated PKI. See `docs/local-kubernetes.md`.
//!
//! - [`cluster`]: bring a cluster up and down ([`cluster::Cluster`]).
//! - [`node`]: the real node (kubelet + kube-proxy on containerd), the alternative to the
//!   process kubelet.
//! - [`registry`]: the real node's image registry (distribution, TLS on loopback), which its
//!   containerd pulls the project's images from.
//! - [`portforward`]: reach a Service's ready endpoints from a loopback port.
//! - [`cluster_info`]: where everything of a running cluster is (`cluster.json`).
//! - [`build_scripts`]: the bin dirs the `hack/build-*.sh` scripts print (the control plane).
//! - [`testing`]: one shared cluster per test run, namespaces per test.
//! - [`wait`]: watch-based waits with deadlines.
//! - [`journey`]: the operator installed as a user would, instances, an MCP client over TLS.
//! - [`instance`]: `CliMcpInstance`s for tests: the object, its conditions and waits, its
//!   Secrets, claiming its pool pods.
//! - [`jsonrpc`], [`http`]: MCP requests and tool results; HTTP clients, `/metrics` sums.
//! - [`child`]: the project's binaries on the host, started once they log they are ready.
//! - [`load`]: a bounded CPU load for tests that must hold on a busy machine.
//! - [`project_images`]: the operator, server and sandbox images built by
//!   `hack/build-images.sh`, imported into the real node under the names pods use.

pub mod addons;
pub mod build_scripts;
pub mod child;
pub mod cluster;
pub mod cluster_info;
pub mod error;
pub mod go_sdk;
pub mod http;
pub mod instance;
pub mod journey;
pub mod jsonrpc;
pub mod load;
pub mod net;
pub mod node;
pub mod peer;
pub mod pki;
pub mod portforward;
pub mod process;
pub mod project_images;
pub mod real_node_rig;
pub mod registry;
pub mod runtime;
pub mod testing;
pub mod wait;
pub mod workspace;

pub use cluster::{Cluster, ClusterConfig, ClusterInfo};
pub use error::{Error, Result};
pub use portforward::ServiceForward;
