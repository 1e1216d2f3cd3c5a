#!/usr/bin/env bash
# `make publish REGISTRY=host[:port]/path [VERSION=x.y.z]`: push a release to an OCI registry
# and pin the manifests that install it to what was pushed.
#
#   1. the four images (cli-mcp-operator, -server, -proxy, -sandbox) as REGISTRY/cli-mcp-<name>:VERSION,
#      pushed with go-containerregistry's crane from the OCI archives hack/build-images.sh writes;
#      the registry keeps each archive's manifest, so its digest is the one images.tsv records;
#   2. the digests written into the manifests: config/manager/kustomization.yaml (`images:` with
#      newName, newTag and digest; its `configurations:` make the RELATED_IMAGE_* values follow),
#      the chart's values.yaml (image.repository/tag/digest; serverImage, sandboxImage and
#      proxyImage as name:tag@digest; the chart README's table follows) and the OLM bundle,
#      regenerated from them by hack/olm-bundle.sh (relatedImages and RELATED_IMAGE_*);
#   3. the Helm chart, packaged at VERSION with those values, pushed as an OCI artifact:
#      oci://REGISTRY/charts/cli-mcp-operator, version VERSION (helm push);
#   4. the OLM bundle image REGISTRY/cli-mcp-operator-bundle:VERSION: operator-sdk builds bundle
#      images only through a container engine (`docker build -f bundle.Dockerfile`), and none
#      runs here, so crane makes the same image: one layer with manifests/ and metadata/ on an
#      empty base, and the labels bundle.Dockerfile sets.
#
# The last line on stdout is a JSON object: {"registry", "version", "images": {name: ref@digest},
# "chart": "oci://…", "bundle": ref@digest, "manifests": dir}. Everything else goes to stderr.
#
# Env:
#   REGISTRY        required: where to push, host[:port][/path] (host with a dot or a port, or
#                   localhost, as container runtimes tell a registry from a Docker Hub user)
#   VERSION         image tag and chart version (default: the workspace version in Cargo.toml)
#   REGISTRY_CA     a CA file to trust for REGISTRY instead of the system's (a private registry)
#   PUBLISH_OUT     write the pinned manifests into a copy of config/, charts/ and bundle/ in this
#                   directory instead of the repository (make run and the install test do)
#   CLI_MCP_IMAGES_DIR  the archives to push (default: cargo build --release, then
#                   TAG=VERSION hack/build-images.sh)
# Credentials: crane and helm read ~/.docker/config.json (docker login, crane auth login,
# helm registry login); nothing here asks for or stores one.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
say() { printf 'publish: %s\n' "$*" >&2; }
die() {
    printf 'publish: error: %s\n' "$*" >&2
    exit 1
}

REGISTRY="${REGISTRY:-}"
REGISTRY="${REGISTRY%/}"
[[ -n $REGISTRY ]] || die "REGISTRY is not set: make publish REGISTRY=host[:port]/path (e.g. quay.io/you)"
host="${REGISTRY%%/*}"
if ! [[ $REGISTRY =~ ^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$ ]]; then
    die "REGISTRY=$REGISTRY is not host[:port]/path in lower case (e.g. registry.example.com:5000/team)"
fi
if [[ $host != *.* && $host != *:* && $host != localhost ]]; then
    die "REGISTRY=$REGISTRY does not start with a registry host: '$host' would be read as a Docker Hub user (docker.io/$host); name the registry, e.g. docker.io/$REGISTRY"
fi
workspace_version="$(awk -F'"' '/^\[workspace.package\]/ { p = 1 } p && /^version *=/ { print $2; exit }' Cargo.toml)"
VERSION="${VERSION:-$workspace_version}"
if ! [[ $VERSION =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]]; then
    die "VERSION=$VERSION is not a semantic version x.y.z[-pre] (Helm needs one; an image tag cannot hold '+')"
fi
if [[ -n ${REGISTRY_CA:-} && ! -r $REGISTRY_CA ]]; then
    die "REGISTRY_CA=$REGISTRY_CA is not a readable file"
fi
out="${PUBLISH_OUT:-$root}"
names=(operator server proxy sandbox)

tools="$(hack/build-registry.sh | tail -n1)"
packaging="$(hack/build-helm-kustomize.sh | tail -n1)"
crane="$tools/crane" helm="$packaging/helm" kustomize="$packaging/kustomize"
ca_args=()
if [[ -n ${REGISTRY_CA:-} ]]; then
    # Go reads SSL_CERT_FILE as its only roots: crane trusts this CA and nothing else.
    export SSL_CERT_FILE="$REGISTRY_CA"
    ca_args=(--ca-file "$REGISTRY_CA")
fi

images_dir="${CLI_MCP_IMAGES_DIR:-}"
if [[ -z $images_dir ]]; then
    say "building the release binaries and images (TAG=$VERSION)"
    cargo build --release -p cli-mcp-operator -p cli-mcp-server -p cli-mcp-proxy -p cli-mcp-agent >&2
    images_dir="$(TAG="$VERSION" hack/build-images.sh | tail -n1)"
fi
for n in "${names[@]}"; do
    [[ -f $images_dir/cli-mcp-$n.tar ]] || die "$images_dir/cli-mcp-$n.tar is missing (hack/build-images.sh writes it)"
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# push NAME: pushes cli-mcp-NAME.tar as REGISTRY/cli-mcp-NAME:VERSION; prints the digest.
push() {
    local n=$1 layout="$work/layout-$1" ref="$REGISTRY/cli-mcp-$1:$VERSION" pushed digest want
    mkdir -p "$layout"
    tar -xf "$images_dir/cli-mcp-$n.tar" -C "$layout"
    pushed="$("$crane" push "$layout" "$ref" 2>"$work/push-$n.log")" ||
        die "crane push $ref failed: $(tail -n3 "$work/push-$n.log")"
    rm -rf "$layout"
    digest="${pushed##*@}"
    [[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || die "crane push $ref printed no digest: $pushed"
    want="$(awk -F'\t' -v n="cli-mcp-$n" '$1 ~ "/" n ":" { print $2 }' "$images_dir/images.tsv" 2>/dev/null || true)"
    if [[ -n $want && $want != "$digest" ]]; then
        die "$ref: the registry holds $digest, $images_dir/images.tsv says $want"
    fi
    echo "$digest"
}

declare -A digest
for n in "${names[@]}"; do
    digest[$n]="$(push "$n")"
    say "$REGISTRY/cli-mcp-$n:$VERSION@${digest[$n]}"
done

if [[ $out != "$root" ]]; then
    mkdir -p "$out"
    rm -rf "${out:?}/config" "$out/charts" "$out/bundle"
    cp -a config charts bundle "$out/"
fi

# --- kustomize: the images of config/manager, by the names manager.yaml gives them -----------
(
    cd "$out/config/manager"
    for n in "${names[@]}"; do
        # The entry's `name:` (what manager.yaml says), whether it opens the list item or not
        # (kustomize edit writes `- digest:` first).
        name="$(awk -v n="cli-mcp-$n" '{ sub(/^ *- */, "") } $1 == "name:" && ($2 == n || $2 ~ "/" n "$") { print $2; exit }' kustomization.yaml)"
        [[ -n $name ]] || die "config/manager/kustomization.yaml has no images: entry for cli-mcp-$n"
        "$kustomize" edit set image "$name=$REGISTRY/cli-mcp-$n:$VERSION@${digest[$n]}"
    done
)

# --- the chart's values: the operator's image by parts, the others as name:tag@digest ---------
values="$out/charts/cli-mcp-operator/values.yaml"
set_value() {
    # set_value KEY VALUE: the first line `KEY: …` (KEY may be indented) gets VALUE, comments kept.
    local key=$1 value=$2
    grep -qE "^${key}:" "$values" || die "$values has no line '${key}:'"
    sed -i -E "0,/^${key}:.*/s||${key}: \"${value//|/\\|}\"|" "$values"
}
set_value "  repository" "$REGISTRY/cli-mcp-operator"
set_value "  tag" "$VERSION"
set_value "  digest" "${digest[operator]}"
set_value serverImage "$REGISTRY/cli-mcp-server:$VERSION@${digest[server]}"
set_value sandboxImage "$REGISTRY/cli-mcp-sandbox:$VERSION@${digest[sandbox]}"
set_value proxyImage "$REGISTRY/cli-mcp-proxy:$VERSION@${digest[proxy]}"

# --- the OLM bundle, regenerated from the pinned config/ (hack/olm-bundle.sh) -----------------
say "regenerating the OLM bundle from $out/config (hack/olm-bundle.sh)"
CLI_MCP_BUNDLE_ROOT="$out" hack/olm-bundle.sh >"$work/olm-bundle.log" 2>&1 ||
    die "hack/olm-bundle.sh failed: $(tail -n5 "$work/olm-bundle.log")"
if [[ $out == "$root" ]]; then
    # The chart's README lists every value with its default, the digests now among them.
    CLI_MCP_UPDATE_CHART_README=1 cargo test -q -p cli-mcp-operator --test packaging \
        chart_readme >&2
fi

# --- the chart, as an OCI artifact ------------------------------------------------------------
"$helm" package "$out/charts/cli-mcp-operator" --version "$VERSION" --app-version "$VERSION" \
    --destination "$work" >&2
"$helm" push "$work/cli-mcp-operator-$VERSION.tgz" "oci://$REGISTRY/charts" "${ca_args[@]}" >&2 ||
    die "helm push to oci://$REGISTRY/charts failed (output above)"
chart="oci://$REGISTRY/charts/cli-mcp-operator"
say "$chart --version $VERSION"

# --- the OLM bundle image, made by crane (see the header for why not operator-sdk) -------------
bundle_ref="$REGISTRY/cli-mcp-operator-bundle:$VERSION"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$out/bundle" \
    -cf "$work/bundle-layer.tar" manifests metadata
"$crane" append --oci-empty-base -f "$work/bundle-layer.tar" -t "$bundle_ref" >/dev/null 2>"$work/bundle.log" ||
    die "crane append $bundle_ref failed: $(tail -n3 "$work/bundle.log")"
labels=()
while IFS= read -r label; do labels+=(--label "$label"); done < <(
    sed -n -E 's/^LABEL ([^=]+)=(.*)$/\1=\2/p' "$out/bundle/bundle.Dockerfile")
bundle_pushed="$("$crane" mutate "$bundle_ref" "${labels[@]}" -t "$bundle_ref" 2>"$work/bundle.log")" ||
    die "crane mutate $bundle_ref failed: $(tail -n3 "$work/bundle.log")"
say "$bundle_pushed"

jq -n -c --arg registry "$REGISTRY" --arg version "$VERSION" --arg chart "$chart" \
    --arg bundle "$bundle_pushed" --arg manifests "$out" \
    --arg operator "$REGISTRY/cli-mcp-operator:$VERSION@${digest[operator]}" \
    --arg server "$REGISTRY/cli-mcp-server:$VERSION@${digest[server]}" \
    --arg proxy "$REGISTRY/cli-mcp-proxy:$VERSION@${digest[proxy]}" \
    --arg sandbox "$REGISTRY/cli-mcp-sandbox:$VERSION@${digest[sandbox]}" \
    '{registry: $registry, version: $version, chart: $chart, bundle: $bundle, manifests: $manifests,
      images: {operator: $operator, server: $server, proxy: $proxy, sandbox: $sandbox}}'
