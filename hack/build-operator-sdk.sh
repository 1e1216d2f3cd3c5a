#!/usr/bin/env bash
# Build operator-sdk (for `operator-sdk bundle validate` of bundle/) from the Go module proxy
# into a cache directory OUTSIDE the repo, keyed by the pinned version, this script and the
# Go version. A cached build returns at once.
#
# Why not `go install ...@version`: the proxy serves this version's source archive but
# refuses its go.mod (403), which `go install` needs first. The archive carries the same
# go.mod and go.sum, so the build runs inside the unpacked module: its dependencies are
# resolved and checked against its go.sum like any build. containers_image_openpgp: the
# pure-Go signature backend instead of gpgme, which needs cgo and a C library.
#
# The last line on stdout is the bin directory:
#   bin="$(hack/build-operator-sdk.sh | tail -n1)"; "$bin/operator-sdk" version
#
# Env: CLI_MCP_CACHE (default /var/cache/cli-mcp), GOPROXY as usual.
set -euo pipefail

OPERATOR_SDK_VERSION=v1.42.0
MODULE=github.com/operator-framework/operator-sdk

cache="${CLI_MCP_CACHE:-/var/cache/cli-mcp}/operator-sdk"
if ! command -v go >/dev/null 2>&1; then
    echo "error: 'go' not found in PATH; install Go >= 1.26" >&2
    exit 1
fi
hash="$( (echo "$OPERATOR_SDK_VERSION"; cat "${BASH_SOURCE[0]}"; go env GOVERSION) \
    | sha256sum | cut -c1-16)"
final="$cache/$hash"
if [[ -x "$final/bin/operator-sdk" ]]; then
    echo "$final/bin"
    exit 0
fi
mkdir -p "$cache"
# Concurrent callers (parallel tests) wait for one build instead of building twice.
exec 9>"$cache/.lock"
flock 9
if [[ -x "$final/bin/operator-sdk" ]]; then
    echo "$final/bin"
    exit 0
fi
tmp="$(mktemp -d "$cache/.build-$hash.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
start=$(date +%s)
echo "building operator-sdk $OPERATOR_SDK_VERSION into $final" >&2
proxy="$(go env GOPROXY | tr ',|' '\n\n' | grep -v -x -e direct -e off | head -n 1)"
if [[ -z "$proxy" ]]; then
    echo "error: GOPROXY names no module proxy; operator-sdk's archive comes from one" >&2
    exit 1
fi
curl -fsSL --retry 3 -o "$tmp/src.zip" "$proxy/$MODULE/@v/$OPERATOR_SDK_VERSION.zip"
# python3 (a prerequisite already, for the SDK tests) unpacks it: no unzip package needed.
(cd "$tmp" && python3 -m zipfile -e src.zip .)
src="$tmp/$MODULE@$OPERATOR_SDK_VERSION"
# GOTOOLCHAIN=local: never fetch another Go toolchain; fail clearly if the pin needs one.
(cd "$src" && GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath \
    -tags containers_image_openpgp,exclude_graphdriver_btrfs,exclude_graphdriver_devicemapper \
    -ldflags "-s -w -X $MODULE/internal/version.Version=$OPERATOR_SDK_VERSION" \
    -o "$tmp/bin/operator-sdk" ./cmd/operator-sdk)
rm -rf "$src" "$tmp/src.zip"
echo "built in $(($(date +%s) - start)) s" >&2
if mv -T "$tmp" "$final" 2>/dev/null; then
    trap - EXIT
else
    echo "another build already published $final; using it" >&2
fi
find "$cache" -mindepth 1 -maxdepth 1 -name '.build-*' -mmin +720 -exec rm -rf {} + 2>/dev/null || true
ls -1dt "$cache"/*/ 2>/dev/null | tail -n +3 | while IFS= read -r old; do rm -rf "$old"; done
echo "$final/bin"
