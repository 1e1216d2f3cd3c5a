#!/usr/bin/env bash
# Build the local cluster's add-ons from the Go module proxy: the NetworkPolicy enforcer
# (kube-router, firewall controller only; e2e/tools/kube-router) and cluster DNS (CoreDNS
# with only the plugins the cluster needs; e2e/tools/coredns). Output goes to a cache
# directory OUTSIDE the repo, keyed by a hash of the tool modules (go.mod, go.sum, main.go),
# this script and the Go version. When that directory exists the script returns at once.
# Builds go to a temporary directory that is renamed into place only when both binaries are
# there, so an interrupted build never looks complete. See docs/network-policy.md.
#
# The last line on stdout is the bin directory (everything else goes to stderr):
#   bin="$(hack/build-addons.sh | tail -n1)"
#
# Env: CLI_MCP_CACHE (default /var/cache/cli-mcp), GOFLAGS/GOPROXY as usual.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
kr_dir="$root/e2e/tools/kube-router"
dns_dir="$root/e2e/tools/coredns"
cache="${CLI_MCP_CACHE:-/var/cache/cli-mcp}/addons"

if ! command -v go >/dev/null 2>&1; then
    echo "error: 'go' not found in PATH; install Go >= 1.26" >&2
    exit 1
fi
for f in "$kr_dir/go.mod" "$kr_dir/go.sum" "$dns_dir/go.mod" "$dns_dir/go.sum" "$dns_dir/main.go"; do
    if [[ ! -f "$f" ]]; then
        echo "error: $f is missing; restore it from git (git checkout -- ${f#"$root"/})" >&2
        exit 1
    fi
done

# The Go toolchain version is part of the key too: a new compiler means new binaries. Both
# modules pin `toolchain go1.26.10` (standard-library security fixes). GOTOOLCHAIN=auto makes
# go honour that line (this host's go env says `local`) and fetch the toolchain once from the
# module proxy (module golang.org/toolchain); ask for the version inside each module.
export GOTOOLCHAIN=auto
kr_go="$(cd "$kr_dir" && go env GOVERSION)"
dns_go="$(cd "$dns_dir" && go env GOVERSION)"
hash="$( (cat "$kr_dir/go.mod" "$kr_dir/go.sum" "$dns_dir/go.mod" "$dns_dir/go.sum" \
    "$dns_dir/main.go" "${BASH_SOURCE[0]}"; echo "$kr_go $dns_go") | sha256sum | cut -c1-16)"
final="$cache/$hash"
if [[ -x "$final/bin/kube-router" && -x "$final/bin/coredns" ]]; then
    echo "$final/bin"
    exit 0
fi

mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.build-$hash.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
mkdir -p "$tmp/bin"

# The version of module $1 required in go.mod $2 (`require M v` or a line of a require block).
required() {
    awk -v m="$1" '{ for (i = 1; i < NF; i++) if ($i == m && $(i + 1) ~ /^v/) { print $(i + 1); exit } }' "$2"
}
kr_version="$(required github.com/cloudnativelabs/kube-router/v2 "$kr_dir/go.mod")"
dns_version="$(required github.com/coredns/coredns "$dns_dir/go.mod")"
if [[ -z "$kr_version" || -z "$dns_version" ]]; then
    echo "error: cannot find the kube-router or CoreDNS version in $kr_dir/go.mod, $dns_dir/go.mod" >&2
    exit 1
fi

start=$(date +%s)
echo "building add-ons kube-router $kr_version ($kr_go) and CoreDNS $dns_version ($dns_go) into $final" >&2

# -mod=mod is not used: go.sum must already be complete (go mod tidy was run and committed).
(
    cd "$kr_dir"
    CGO_ENABLED=0 go build -trimpath \
        -ldflags "-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$kr_version" \
        -o "$tmp/bin/kube-router" github.com/cloudnativelabs/kube-router/v2/cmd/kube-router
)
echo "kube-router built after $(($(date +%s) - start)) s" >&2
(
    cd "$dns_dir"
    CGO_ENABLED=0 go build -trimpath \
        -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=$dns_version" \
        -o "$tmp/bin/coredns" .
)
echo "add-ons built in $(($(date +%s) - start)) s:" >&2
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
