#!/usr/bin/env bash
# Build etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl, plus the node
# binaries kubelet and kube-proxy (the real-node lane), from the Go module proxy
# (e2e/tools/{etcd,kube}) into a cache directory OUTSIDE the repo, keyed by a hash of the tool
# modules' go.mod/go.sum, this script and the Go version. When that directory exists the script
# returns at once. Builds go to a temporary directory that is renamed into place only when all
# seven binaries are there, so an interrupted build never looks complete.
#
# The last line on stdout is the bin directory (everything else goes to stderr):
#   bin="$(hack/build-control-plane.sh | tail -n1)"
#
# Env: CLI_MCP_CACHE (default /var/cache/cli-mcp), GOFLAGS/GOPROXY as usual.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
kube_dir="$root/e2e/tools/kube"
etcd_dir="$root/e2e/tools/etcd"
cache="${CLI_MCP_CACHE:-/var/cache/cli-mcp}/control-plane"

if ! command -v go >/dev/null 2>&1; then
    echo "error: 'go' not found in PATH; install Go >= 1.26 (k8s.io/kubernetes v1.37 needs it)" >&2
    exit 1
fi

# The Go toolchain version is part of the key too: a new compiler means new binaries.
hash="$( (cat "$kube_dir/go.mod" "$kube_dir/go.sum" "$etcd_dir/go.mod" "$etcd_dir/go.sum" \
    "${BASH_SOURCE[0]}"; go env GOVERSION) | sha256sum | cut -c1-16)"
final="$cache/$hash"
if [[ -x "$final/bin/kube-apiserver" && -x "$final/bin/kube-controller-manager" \
    && -x "$final/bin/kube-scheduler" && -x "$final/bin/kubectl" && -x "$final/bin/etcd" \
    && -x "$final/bin/kubelet" && -x "$final/bin/kube-proxy" ]]; then
    echo "$final/bin"
    exit 0
fi

mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.build-$hash.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
mkdir -p "$tmp/bin"

kube_version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ { print $2; exit }
                     $1 == "require" && $2 == "k8s.io/kubernetes" { print $3; exit }' "$kube_dir/go.mod")"
if [[ ! "$kube_version" =~ ^v([0-9]+)\.([0-9]+)\.[0-9]+$ ]]; then
    echo "error: cannot find the k8s.io/kubernetes version in $kube_dir/go.mod" >&2
    exit 1
fi
major="${BASH_REMATCH[1]}"
minor="${BASH_REMATCH[2]}"

ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

start=$(date +%s)
echo "building control plane $kube_version into $final (cold builds take many minutes)" >&2

# -mod=mod is not used: go.sum must already be complete (go mod tidy was run and committed).
(
    cd "$etcd_dir"
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$tmp/bin/etcd" go.etcd.io/etcd/server/v3
)
echo "etcd built after $(($(date +%s) - start)) s" >&2
(
    cd "$kube_dir"
    CGO_ENABLED=0 go build -trimpath -tags selinux,notest,grpcnotrace -ldflags "$ldflags" \
        -o "$tmp/bin/" \
        k8s.io/kubernetes/cmd/kube-apiserver \
        k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler \
        k8s.io/kubernetes/cmd/kubectl \
        k8s.io/kubernetes/cmd/kubelet \
        k8s.io/kubernetes/cmd/kube-proxy
)
echo "control plane and node binaries built in $(($(date +%s) - start)) s:" >&2
ls -l "$tmp/bin" >&2

# Atomic publish: a concurrent builder may have won the race; keep its result.
if mv -T "$tmp" "$final" 2>/dev/null; then
    trap - EXIT
else
    echo "another build already published $final; using it" >&2
fi

# Keep the three newest builds (other checkouts may use older ones) and drop build
# directories abandoned by killed builds.
find "$cache" -mindepth 1 -maxdepth 1 -name '.build-*' -mmin +720 -exec rm -rf {} + 2>/dev/null || true
ls -1dt "$cache"/*/ 2>/dev/null | tail -n +4 | while IFS= read -r old; do
    rm -rf "$old"
done
echo "$final/bin"
