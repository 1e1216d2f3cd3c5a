#!/usr/bin/env bash
# Build CNCF distribution's `registry` (an OCI registry server) and go-containerregistry's
# `crane` (a registry client: push of OCI archives, digests, copies) from the Go module proxy
# (e2e/tools/registry) into a cache directory OUTSIDE the repo, keyed by a hash of the tool
# module's go.mod/go.sum, this script and the Go version. When that directory exists the
# script returns at once. Builds go to a temporary directory that is renamed into place only
# when complete, so an interrupted build never looks complete; concurrent callers (parallel
# test lanes) wait for one build instead of building twice.
#
# The local Kubernetes runs `registry` for its real node (e2e/src/registry.rs) and pushes the
# project's images there with `crane`; `make publish` pushes with `crane` too.
#
# The last line on stdout is the bin directory (everything else goes to stderr):
#   bin="$(hack/build-registry.sh | tail -n1)"; "$bin/crane" version
#
# Env: CLI_MCP_CACHE (default /var/cache/cli-mcp), GOFLAGS/GOPROXY as usual.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$root/e2e/tools/registry"
cache="${CLI_MCP_CACHE:-/var/cache/cli-mcp}/registry"

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

# GOTOOLCHAIN=local: never fetch another Go toolchain; fail clearly if the pin needs one.
export GOTOOLCHAIN=local
go_version="$(go env GOVERSION)"
hash="$( (cat "$dir/go.mod" "$dir/go.sum" "${BASH_SOURCE[0]}"; echo "$go_version") \
    | sha256sum | cut -c1-16)"
final="$cache/$hash"
done_already() { [[ -x "$final/bin/registry" && -x "$final/bin/crane" ]]; }
if done_already; then
    echo "$final/bin"
    exit 0
fi
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if done_already; then
    echo "$final/bin"
    exit 0
fi

version_of() {
    awk -v m="$1" '$1 == m && $2 ~ /^v/ { print $2; exit }' "$dir/go.mod"
}
distribution_version="$(version_of github.com/distribution/distribution/v3)"
crane_version="$(version_of github.com/google/go-containerregistry)"
if [[ -z "$distribution_version" || -z "$crane_version" ]]; then
    echo "error: cannot find the distribution or go-containerregistry version in $dir/go.mod" >&2
    exit 1
fi

tmp="$(mktemp -d "$cache/.build-$hash.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
start=$(date +%s)
echo "building registry $distribution_version and crane $crane_version ($go_version) into $final" >&2
(
    cd "$dir"
    CGO_ENABLED=0 go build -trimpath \
        -ldflags "-s -w -X github.com/distribution/distribution/v3/version.version=$distribution_version" \
        -o "$tmp/bin/registry" github.com/distribution/distribution/v3/cmd/registry
    CGO_ENABLED=0 go build -trimpath \
        -ldflags "-s -w -X github.com/google/go-containerregistry/cmd/crane/cmd.Version=$crane_version" \
        -o "$tmp/bin/crane" github.com/google/go-containerregistry/cmd/crane
)
echo "built in $(($(date +%s) - start)) s:" >&2
ls -l "$tmp/bin" >&2

if mv -T "$tmp" "$final" 2>/dev/null; then
    trap - EXIT
else
    echo "another build already published $final; using it" >&2
fi
# Keep the three newest builds (other checkouts may use older ones) and drop build
# directories abandoned by killed builds.
find "$cache" -mindepth 1 -maxdepth 1 -name '.build-*' -mmin +720 -exec rm -rf {} + 2>/dev/null || true
ls -1dt "$cache"/*/ 2>/dev/null | tail -n +4 | while IFS= read -r old; do rm -rf "$old"; done
echo "$final/bin"
