#!/usr/bin/env bash
# Build gVisor's runsc from the Go module proxy (e2e/tools/gvisor) into a cache directory
# OUTSIDE the repo, keyed by a hash of the tool
# module's go.mod/go.sum, this script and the Go version. When that directory exists the
# script returns at once. Builds go to a temporary directory that is renamed into place only
# when complete, so an interrupted build never looks complete.
#
# Two binaries: runsc, and gVisor's containerd shim (containerd-shim-runsc-v1), through which
# the node's containerd runs pods under runsc. The shim is built from a vendored copy of the
# module graph with patches/shim-on-containerd-1.6.patch applied (a Go -overlay is refused for
# files in the module cache):
#   - the shim answers containerd's `start` with the bare socket address that every containerd
#     reads, not the JSON bootstrap form that only containerd >= 1.7 reads (Debian's is 1.6,
#     which takes the JSON for a socket path);
#   - lowering its own OOM score to -999 needs CAP_SYS_RESOURCE, which this project's machines
#     withhold even from root; a permission error there is not fatal, as in containerd's own
#     sys.SetOOMScore.
# (containerd's runc shim driving runsc, the way Docker runs gVisor, was tried first: a pod's
# second container start hangs in it.)
#
# The last line on stdout is the bin directory (everything else goes to stderr):
#   bin="$(hack/build-gvisor.sh | tail -n1)"
#
# Env: CLI_MCP_CACHE (default /var/cache/cli-mcp), GOFLAGS/GOPROXY as usual.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$root/e2e/tools/gvisor"
cache="${CLI_MCP_CACHE:-/var/cache/cli-mcp}/gvisor"

if ! command -v go >/dev/null 2>&1; then
    echo "error: 'go' not found in PATH; install Go >= 1.26" >&2
    exit 1
fi
for f in "$dir/go.mod" "$dir/go.sum"; do
    if [[ ! -f "$f" ]]; then
        echo "error: $f is missing; restore it from git (git checkout -- ${f#"$root"/})" >&2
        exit 1
    fi
done

# GOTOOLCHAIN=auto honours the module's `go` line (fetching that toolchain from the module
# proxy once if this host's is older); the resulting version is part of the key.
export GOTOOLCHAIN=auto
go_version="$(cd "$dir" && go env GOVERSION)"
hash="$( (cat "$dir/go.mod" "$dir/go.sum" "$dir"/patches/*.patch "${BASH_SOURCE[0]}"; echo "$go_version") \
    | sha256sum | cut -c1-16)"
final="$cache/$hash"
if [[ -x "$final/bin/runsc" && -x "$final/bin/containerd-shim-runsc-v1" ]]; then
    echo "$final/bin"
    exit 0
fi

version="$(awk '$1 == "gvisor.dev/gvisor" && $2 ~ /^v/ { print $2; exit }
                $1 == "require" && $2 == "gvisor.dev/gvisor" { print $3; exit }' "$dir/go.mod")"
if [[ -z "$version" ]]; then
    echo "error: cannot find the gvisor.dev/gvisor version in $dir/go.mod" >&2
    exit 1
fi

mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.build-$hash.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
mkdir -p "$tmp/bin"

start=$(date +%s)
echo "building gVisor $version ($go_version) into $final (about two minutes cold)" >&2
# A private copy of the tool module, vendored and patched; -mod=vendor builds from it alone
# (go.sum must already be complete: `go get -tool` of both packages did that).
src="$tmp/src"
mkdir -p "$src"
cp "$dir/go.mod" "$dir/go.sum" "$src/"
(cd "$src" && go mod vendor)
for p in "$dir"/patches/*.patch; do
    if ! patch --batch --forward --silent -p1 -d "$src/vendor" <"$p" >&2; then
        echo "error: $p no longer applies to the vendored sources; refresh it for this gVisor" >&2
        exit 1
    fi
done
(
    cd "$src"
    CGO_ENABLED=0 go build -mod=vendor -trimpath \
        -ldflags "-s -w -X gvisor.dev/gvisor/runsc/version.version=$version" \
        -o "$tmp/bin/runsc" gvisor.dev/gvisor/runsc
    CGO_ENABLED=0 go build -mod=vendor -trimpath -ldflags "-s -w" \
        -o "$tmp/bin/containerd-shim-runsc-v1" gvisor.dev/gvisor/shim
)
rm -rf "$src"
echo "gVisor built in $(($(date +%s) - start)) s:" >&2
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
