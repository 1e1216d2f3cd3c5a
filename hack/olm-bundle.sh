#!/usr/bin/env bash
# Regenerate the OLM bundle (bundle/) from kustomize's rendering of config/default and
# config/samples plus config/manifests/ (the CSV's descriptions and icon). bundle/ is never
# edited by hand; operator/tests/olm_bundle.rs fails when it is stale.
#   hack/olm-bundle.sh          # write bundle/
#   hack/olm-bundle.sh --check  # exit 1 naming every stale file
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
# CLI_MCP_BUNDLE_ROOT: a copy of config/ (and bundle/) to make the bundle of, into its own
# bundle/ (make publish with PUBLISH_OUT); default: the repository.
root="${CLI_MCP_BUNDLE_ROOT:-$repo}"
tools="$(hack/build-helm-kustomize.sh | tail -n 1)"
cargo build -q -p cli-mcp-operator --bin cli-mcp-operator
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$tools/kustomize" build "$root/config/default" >"$tmp/default.yaml"
"$tools/kustomize" build "$root/config/samples" >"$tmp/samples.yaml"
args=(olm-bundle --rendered "$tmp/default.yaml" --samples "$tmp/samples.yaml" --root "$root")
if [[ "${1:-}" == "--check" ]]; then
    args+=(--check)
fi
"${CARGO_TARGET_DIR:-target}/debug/cli-mcp-operator" "${args[@]}"
