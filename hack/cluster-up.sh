#!/usr/bin/env bash
# `make cluster`: what the host lacks (hack/prereqs.sh), then build everything the local cluster
# runs and bring it up in the foreground: the control plane (cached, see hack/build-control-plane.sh)
# and, like `make run`, the real node with the project's images (CLI_MCP_NODE=process: the process
# kubelet and the workload binaries its image map points at). Ctrl-C tears it down.
#
#   hack/cluster-up.sh [cli-mcp-cluster up flags...]     e.g. --no-project-images
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
node="${CLI_MCP_NODE:-real}"
case "$node" in
real | process) ;;
*) printf 'make cluster: CLI_MCP_NODE=%s: expected real or process\n' "$node" >&2; exit 2 ;;
esac
exec "$target/debug/cli-mcp-cluster" up --node "$node" --control-plane-bin "$bin" "$@"
