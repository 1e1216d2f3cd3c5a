#!/usr/bin/env bash
# Build KWOK (sigs.k8s.io/kwok: simulated nodes whose pods are marked Running/Ready without
# any process) from the Go module proxy, for the scale simulation of `cli-mcp-bench scale`
# (docs/benchmarks.md, Scale). Output goes to a cache directory OUTSIDE the repo, keyed by a
# hash of this script (which pins the version) and the Go version. When that directory
# exists the script returns at once. The build goes to a temporary directory that is renamed
# into place only when the binary is there, so an interrupted build never looks complete.
#
# KWOK run alone needs its Stages (what it writes into a simulated node's and pod's status):
# the module's own "fast" node and pod Stages and the node heartbeat with a Lease (without it
# the node controller marks the node unreachable after 40 s and evicts its pods) are copied
# next to the binary as stages.yaml, for `kwok --config`.
#
# The last line on stdout is the bin directory (everything else goes to stderr); the stages
# are in its parent:
#   bin="$(hack/build-kwok.sh | tail -n1)"; kwok --config "$bin/../stages.yaml" ...
#
# Env: CLI_MCP_CACHE (default /var/cache/cli-mcp), GOFLAGS/GOPROXY as usual.
set -euo pipefail

# The module's own go.mod and go.sum decide its dependencies (`go install module@version`),
# checked against the checksum database like any module download.
KWOK_VERSION=v0.8.0

cache="${CLI_MCP_CACHE:-/var/cache/cli-mcp}/kwok"

if ! command -v go >/dev/null 2>&1; then
    echo "error: 'go' not found in PATH; install Go >= 1.24" >&2
    exit 1
fi

go_version="$(go env GOVERSION)"
hash="$( (cat "${BASH_SOURCE[0]}"; echo "$go_version") | sha256sum | cut -c1-16)"
final="$cache/$hash"
if [[ -x "$final/bin/kwok" && -s "$final/stages.yaml" ]]; then
    echo "$final/bin"
    exit 0
fi

mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.build-$hash.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
mkdir -p "$tmp/bin"

start=$(date +%s)
echo "building kwok $KWOK_VERSION ($go_version) into $final" >&2
GOBIN="$tmp/bin" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" \
    "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
src="$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
if [[ -z "$src" || ! -d "$src/kustomize/stage" ]]; then
    echo "error: cannot find the kwok $KWOK_VERSION module source (go mod download -json)" >&2
    exit 1
fi
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
    pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    echo "---"
    cat "$src/kustomize/stage/$f"
done >"$tmp/stages.yaml"
echo "kwok built in $(($(date +%s) - start)) s" >&2
ls -l "$tmp/bin" >&2

# Atomic publish: a concurrent builder may have won the race; keep its result.
if mv -T "$tmp" "$final" 2>/dev/null; then
    trap - EXIT
else
    echo "another build already published $final; using it" >&2
fi

# Keep the three newest builds and drop build directories abandoned by killed builds.
find "$cache" -mindepth 1 -maxdepth 1 -name '.build-*' -mmin +720 -exec rm -rf {} + 2>/dev/null || true
ls -1dt "$cache"/*/ 2>/dev/null | tail -n +4 | while IFS= read -r old; do
    rm -rf "$old"
done
echo "$final/bin"
