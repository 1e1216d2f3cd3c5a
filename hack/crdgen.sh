#!/usr/bin/env bash
# Regenerate the CliMcpInstance CRD from the Rust types (api/src/crd.rs and api/src/crd/) into every
# checked-in copy. `operator/tests/crd_sync.rs` fails when a copy is stale; this fixes it.
#   hack/crdgen.sh          # write the files
#   hack/crdgen.sh --check  # exit 1 if a copy differs (what CI can run instead of the test)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build -q -p cli-mcp-operator --bin cli-mcp-operator
yaml="$(mktemp)"
trap 'rm -f "$yaml"' EXIT
"${CARGO_TARGET_DIR:-target}/debug/cli-mcp-operator" crdgen >"$yaml"
status=0
for f in config/crd/bases/cli-mcp.redhat.com_climcpinstances.yaml \
         charts/cli-mcp-operator/crds/cli-mcp.redhat.com_climcpinstances.yaml; do
    if [[ "${1:-}" == "--check" ]]; then
        if ! cmp -s "$yaml" "$f"; then
            echo "stale: $f (run hack/crdgen.sh)" >&2
            status=1
        fi
    else
        mkdir -p "$(dirname "$f")"
        cp "$yaml" "$f"
        echo "wrote $f" >&2
    fi
done
if [[ "${1:-}" != "--check" ]]; then
    # The OLM bundle carries a copy of the CRD.
    "$root/hack/olm-bundle.sh"
fi
exit "$status"
