#!/usr/bin/env bash
# `make cluster`: what the host lacks (hack/prereqs.sh), then build everything the local cluster
# runs and bring it up in the foreground: the control plane (cached, see hack/build-control-plane.sh), the process kubelet and the
# workload binaries the image map points at. Ctrl-C tears it down.
#
#   hack/cluster-up.sh [cli-mcp-cluster up flags...]     e.g. --image 'my-tool:*=/usr/bin/my-tool'
#
# The kubeconfig is written to .run/cluster/kubeconfig (override with --run-dir);
# `source .run/cluster/cluster.env` in another shell sets KUBECONFIG and friends.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

hack/prereqs.sh
bin="$(hack/build-control-plane.sh | tail -n1)"
cargo build --workspace --bins
target="${CARGO_TARGET_DIR:-$root/target}"
exec "$target/debug/cli-mcp-cluster" up --control-plane-bin "$bin" "$@"
