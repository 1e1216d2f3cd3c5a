#!/usr/bin/env bash
# Build helm and kustomize from the Go module proxy (Debian has neither at a usable version)
# into a cache directory OUTSIDE the repo, keyed by the pinned versions, this script and the
# Go version. A cached build returns at once; builds go to a temporary directory that is
# renamed into place only when both binaries exist.
#
# The last line on stdout is the bin directory:
#   bin="$(hack/build-helm-kustomize.sh | tail -n1)"; "$bin/helm" version
#
# Env: CLI_MCP_CACHE (default /var/cache/cli-mcp), GOFLAGS/GOPROXY as usual.
set -euo pipefail

HELM_VERSION=v3.22.0
KUSTOMIZE_VERSION=v5.8.0

cache="${CLI_MCP_CACHE:-/var/cache/cli-mcp}/packaging-tools"
if ! command -v go >/dev/null 2>&1; then
    echo "error: 'go' not found in PATH; install Go >= 1.26" >&2
    exit 1
fi
hash="$( (echo "$HELM_VERSION $KUSTOMIZE_VERSION"; cat "${BASH_SOURCE[0]}"; go env GOVERSION) \
    | sha256sum | cut -c1-16)"
final="$cache/$hash"
if [[ -x "$final/bin/helm" && -x "$final/bin/kustomize" ]]; then
    echo "$final/bin"
    exit 0
fi
mkdir -p "$cache"
# Concurrent callers (parallel tests) wait for one build instead of building twice.
exec 9>"$cache/.lock"
flock 9
if [[ -x "$final/bin/helm" && -x "$final/bin/kustomize" ]]; then
    echo "$final/bin"
    exit 0
fi
tmp="$(mktemp -d "$cache/.build-$hash.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
start=$(date +%s)
echo "building helm $HELM_VERSION and kustomize $KUSTOMIZE_VERSION into $final" >&2
# GOTOOLCHAIN=local: never fetch another Go toolchain; fail clearly if the pin needs one.
GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$tmp/bin" go install -trimpath -ldflags "-s -w \
    -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$tmp/bin" go install -trimpath -ldflags "-s -w" \
    "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION"
echo "built in $(($(date +%s) - start)) s" >&2
ls -l "$tmp/bin" >&2
if mv -T "$tmp" "$final" 2>/dev/null; then
    trap - EXIT
else
    echo "another build already published $final; using it" >&2
fi
find "$cache" -mindepth 1 -maxdepth 1 -name '.build-*' -mmin +720 -exec rm -rf {} + 2>/dev/null || true
ls -1dt "$cache"/*/ 2>/dev/null | tail -n +3 | while IFS= read -r old; do rm -rf "$old"; done
echo "$final/bin"
