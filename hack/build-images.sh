#!/usr/bin/env bash
# Build the cli-mcp-operator, cli-mcp-server, cli-mcp-proxy and cli-mcp-sandbox images as OCI image archives,
# with no container engine and no registry: mmdebstrap makes the Debian root filesystems
# (images/rootfs.sh), GNU tar makes reproducible layers, umoci assembles the OCI layout.
# See images/README.md for what is in each image and why these tools.
#
# Cached in two levels OUTSIDE the repo, each published atomically (built in a temporary
# directory, renamed into place):
#   $CLI_MCP_CACHE/images/rootfs/<hash>  the Debian layers, keyed by images/rootfs.sh,
#        images/debian-pins.sh, the package lists and their pins (images/*/debian-packages*),
#        ARCH and SOURCE_DATE_EPOCH: the pins name every package by version and sha256, so
#        nothing else in the archive can change these layers
#   $CLI_MCP_CACHE/images/<hash>         the archives, keyed by this script, images/**, the
#        Debian layers and their package versions, our binaries, kubectl and yq
#   $CLI_MCP_CACHE/debian-debs/<sha256>.deb  the pinned .debs, by content (images/debian-pins.sh)
#
# Same inputs (the pins, our binaries, kubectl, yq, SOURCE_DATE_EPOCH, TAG, ARCH) give the same
# bytes: every tar is sorted with fixed owners and clamped mtimes, every timestamp in a config
# is SOURCE_DATE_EPOCH, and no path of the build machine lands in a layer
# (e2e/tests/images_reproducible.rs builds twice and compares).
#
# The last line on stdout is the directory holding the archives (everything else: stderr):
#   dir="$(hack/build-images.sh | tail -n1)"
#   ctr -n k8s.io images import "$dir/cli-mcp-sandbox.tar"   # localhost/cli-mcp-sandbox:<TAG>
#
# Env:
#   ARCH               Debian architecture of the images (default: dpkg --print-architecture).
#                      Another architecture needs KUBECTL and CLI_MCP_BIN_DIR built for it
#                      and qemu-user-static for mmdebstrap.
#   TAG                image tag (default: the workspace version in Cargo.toml)
#   SOURCE_DATE_EPOCH  timestamps (default: commit time of the last commit touching images/
#                      or this script, so unrelated commits do not change the images)
#   CLI_MCP_BIN_DIR    cli-mcp-{operator,server,proxy,agent} (default: $CARGO_TARGET_DIR/release,
#                      built with cargo build --release when missing)
#   KUBECTL            kubectl binary (default: the one hack/build-control-plane.sh builds)
#   DEBIAN_MIRROR, DEBIAN_SECURITY_MIRROR  where the pinned .debs are downloaded from
#                      (default: deb.debian.org); not part of any key, the sha256 pins are
#   CLI_MCP_CACHE      (default /var/cache/cli-mcp); GOFLAGS/GOPROXY as usual for yq.
#   CLI_MCP_IMAGES_CACHE  the two image levels only (default $CLI_MCP_CACHE/images): a clean
#                      one rebuilds every layer while the .debs, yq and kubectl stay cached
set -euo pipefail
# The caller's locale, time zone and umask must not reach the bytes: globs and sort in one
# collation, dates in UTC, files and directories this script creates 0644/0755.
export LC_ALL=C TZ=UTC
umask 022

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGES_DIR="$root/images"
cache_root="${CLI_MCP_CACHE:-/var/cache/cli-mcp}"
cache="${CLI_MCP_IMAGES_CACHE:-$cache_root/images}"
YQ_VERSION=v4.54.3

say() { printf 'images: %s\n' "$*" >&2; }
die() {
    printf 'images: error: %s\n' "$*" >&2
    exit 1
}

# DEBIAN_SUITE and the mirrors' defaults are set there.
# shellcheck source=images/rootfs.sh
source "$IMAGES_DIR/rootfs.sh"
# shellcheck source=hack/lib/apt.sh
source "$root/hack/lib/apt.sh"

# --- host tools -------------------------------------------------------------------------------
pkgs=()
command -v mmdebstrap >/dev/null || pkgs+=(mmdebstrap)
command -v umoci >/dev/null || pkgs+=(umoci)
command -v jq >/dev/null || pkgs+=(jq)
command -v curl >/dev/null || pkgs+=(curl)
command -v dpkg >/dev/null || die "dpkg not found: this script needs a Debian or Ubuntu host"
if ((${#pkgs[@]})); then
    [[ $EUID -eq 0 ]] || die "missing ${pkgs[*]}; install them (apt-get install ${pkgs[*]}) or run as root"
    say "installing ${pkgs[*]} (apt-get)"
    apt_install "${pkgs[@]}" ||
        die "apt-get could not install ${pkgs[*]} (output above); install them by hand, then run again"
fi
[[ $EUID -eq 0 ]] || die "must run as root (mmdebstrap installs packages into a chroot and the \
layers need files owned by other users)"
command -v go >/dev/null || die "'go' not found in PATH; install Go >= 1.26 (yq is built with it)"

# --- parameters -------------------------------------------------------------------------------
host_arch="$(dpkg --print-architecture)"
ARCH="${ARCH:-$host_arch}"
case "$ARCH" in
amd64 | arm64 | s390x | riscv64) goarch="$ARCH" ;;
armhf) goarch=arm ;;
i386) goarch=386 ;;
ppc64el) goarch=ppc64le ;;
*) die "ARCH=$ARCH: no Go/OCI name known for this Debian architecture" ;;
esac
TAG="${TAG:-$(awk -F'"' '/^\[workspace.package\]/ {p=1} p && $1 ~ /^version *= */ {print $2; exit}' "$root/Cargo.toml")}"
[[ -n $TAG ]] || die "cannot read the workspace version from Cargo.toml; set TAG"
# The Debian layers get the time of the last change to their own inputs, so that editing
# the rest of images/ does not rebuild them.
commit_time() { git -C "$root" log -1 --format=%ct -- "$@" 2>/dev/null || true; }
if [[ -n ${SOURCE_DATE_EPOCH:-} ]]; then
    ROOTFS_EPOCH="$SOURCE_DATE_EPOCH"
else
    SOURCE_DATE_EPOCH="$(commit_time images hack/build-images.sh)"
    ROOTFS_EPOCH="$(commit_time images/rootfs.sh images/debian-pins.sh images/base images/sandbox/debian-packages \
        'images/sandbox/debian-packages.*.lock')"
    [[ -n $SOURCE_DATE_EPOCH ]] || die "cannot read a commit time from git; set SOURCE_DATE_EPOCH"
    ROOTFS_EPOCH="${ROOTFS_EPOCH:-$SOURCE_DATE_EPOCH}"
fi
export SOURCE_DATE_EPOCH
created="$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"

# --- inputs: our binaries, kubectl, yq --------------------------------------------------------
bin_dir="${CLI_MCP_BIN_DIR:-${CARGO_TARGET_DIR:-$root/target}/release}"
bins=(cli-mcp-operator cli-mcp-server cli-mcp-proxy cli-mcp-agent)
have_bins() {
    local b
    for b in "${bins[@]}"; do [[ -x $bin_dir/$b ]] || return 1; done
}
if ! have_bins; then
    [[ -z ${CLI_MCP_BIN_DIR:-} ]] || die "CLI_MCP_BIN_DIR=$bin_dir lacks one of ${bins[*]}"
    [[ $ARCH == "$host_arch" ]] || die "ARCH=$ARCH: build ${bins[*]} for it and set CLI_MCP_BIN_DIR"
    say "building ${bins[*]} (cargo build --release) into $bin_dir"
    (cd "$root" && cargo build --release -p cli-mcp-operator -p cli-mcp-server -p cli-mcp-proxy -p cli-mcp-agent >&2) ||
        die "cargo build --release failed (output above)"
    have_bins || die "cargo build succeeded but $bin_dir lacks one of ${bins[*]}; is CARGO_TARGET_DIR set differently?"
fi
if [[ -z ${KUBECTL:-} ]]; then
    [[ $ARCH == "$host_arch" ]] || die "ARCH=$ARCH: set KUBECTL to a kubectl built for $ARCH"
    say "kubectl from hack/build-control-plane.sh (cached; a cold build takes many minutes)"
    KUBECTL="$("$root/hack/build-control-plane.sh" | tail -n1)/kubectl"
fi
[[ -x $KUBECTL ]] || die "kubectl not found at $KUBECTL"

# yq (mikefarah, Go) from the Go module proxy, pinned by version; its go.sum pins the rest.
yq_cache="$cache_root/yq"
yq_hash="$( (echo "$YQ_VERSION $goarch"; go env GOVERSION) | sha256sum | cut -c1-16)"
yq="$yq_cache/$yq_hash/bin/yq"
if [[ ! -x $yq ]]; then
    mkdir -p "$yq_cache"
    yq_tmp="$(mktemp -d "$yq_cache/.build-$yq_hash.XXXXXX")"
    trap 'rm -rf "$yq_tmp"' EXIT
    say "building yq $YQ_VERSION for $goarch from the Go module proxy into $yq_cache/$yq_hash"
    mkdir -p "$yq_tmp/bin"
    yq_env=(env GOTOOLCHAIN=local CGO_ENABLED=0 GOOS=linux GOARCH="$goarch")
    yq_pkg="github.com/mikefarah/yq/v4@$YQ_VERSION"
    if [[ $goarch == "$(go env GOHOSTARCH)" ]]; then
        "${yq_env[@]}" GOBIN="$yq_tmp/bin" go install -trimpath -ldflags "-s -w" "$yq_pkg" >&2
    else
        # go install refuses GOBIN when cross-compiling; it installs into GOPATH/bin/linux_ARCH.
        "${yq_env[@]}" GOBIN= go install -trimpath -ldflags "-s -w" "$yq_pkg" >&2 &&
            cp "$(go env GOPATH | cut -d: -f1)/bin/linux_$goarch/yq" "$yq_tmp/bin/yq"
    fi || die "building yq $YQ_VERSION failed (output above); check that the Go module proxy is reachable"
    mv -T "$yq_tmp" "$yq_cache/$yq_hash" 2>/dev/null || rm -rf "$yq_tmp"
    trap - EXIT
fi

mkdir -p "$cache"
# Concurrent callers (make images and the e2e test) wait for one build instead of building twice.
exec 9>"$cache/.lock"
flock 9

# --- level 1: the Debian layers ---------------------------------------------------------------
for lock in "$IMAGES_DIR"/{sandbox,base}/debian-packages."$ARCH".lock; do
    [[ -s $lock ]] || die "no pinned Debian packages for ARCH=$ARCH: ${lock#"$root"/} is missing; \
create it with \`ARCH=$ARCH images/debian-pins.sh refresh\` (as root) and commit it"
done
rootfs_key="$( (cat "$IMAGES_DIR/rootfs.sh" "$IMAGES_DIR/debian-pins.sh" "$IMAGES_DIR/sandbox/debian-packages" \
    "$IMAGES_DIR/base/debian-packages" "$IMAGES_DIR"/{sandbox,base}/debian-packages."$ARCH".lock
    echo "$ARCH $ROOTFS_EPOCH $DEBIAN_SUITE"
    mmdebstrap --version
) | sha256sum | cut -c1-16)"
rootfs="$cache/rootfs/$rootfs_key"
if [[ ! -s $rootfs/sandbox.tar || ! -s $rootfs/base.tar ]]; then
    mkdir -p "$cache/rootfs"
    rootfs_tmp="$(mktemp -d "$cache/rootfs/.build-$rootfs_key.XXXXXX")"
    trap 'rm -rf "$rootfs_tmp"' EXIT
    chmod 755 "$rootfs_tmp"
    start=$(date +%s)
    say "building the Debian $DEBIAN_SUITE $ARCH root filesystems with mmdebstrap into $rootfs (a few minutes)"
    (SOURCE_DATE_EPOCH="$ROOTFS_EPOCH" rootfs_build "$rootfs_tmp") || die "building the root filesystems failed (see above)"
    say "root filesystems built in $(($(date +%s) - start)) s"
    mv -T "$rootfs_tmp" "$rootfs" 2>/dev/null || rm -rf "$rootfs_tmp"
    trap - EXIT
fi

# --- level 2: the images ----------------------------------------------------------------------
key="$( (cat "${BASH_SOURCE[0]}"
    find "$IMAGES_DIR" -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sed "s|$IMAGES_DIR/||"
    echo "$rootfs_key"
    cat "$rootfs/sandbox.packages" "$rootfs/base.packages"
    for b in "${bins[@]}"; do sha256sum <"$bin_dir/$b"; done
    sha256sum <"$KUBECTL"
    sha256sum <"$yq"
    echo "$ARCH $TAG $SOURCE_DATE_EPOCH"
    umoci --version
    tar --version | head -n1
) | sha256sum | cut -c1-16)"
final="$cache/$key"
names=(operator server proxy sandbox)
complete() {
    local n
    for n in "${names[@]}"; do [[ -s $1/cli-mcp-$n.tar ]] || return 1; done
}
if complete "$final"; then
    echo "$final"
    exit 0
fi

tmp="$(mktemp -d "$cache/.build-$key.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
start=$(date +%s)
say "assembling ${names[*]} ($ARCH, tag $TAG) into $final"

kubectl_version="$("$KUBECTL" version --client -o json 2>/dev/null | jq -r '.clientVersion.gitVersion // "unknown"')"
path_env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# A layer of files: "layer OUT SRC:NAME..." puts programs under /usr/local/bin (root-owned,
# mode 0755), "SRC:/ABSOLUTE/PATH" a data file there (mode 0644, its directories 0755).
strip=
if [[ $ARCH == "$host_arch" ]]; then strip="$(command -v strip || true)"; fi
layer() {
    local out="$1" d="$tmp/layer-dir"
    shift
    rm -rf "$d"
    install -d -m 0755 "$d/usr" "$d/usr/local" "$d/usr/local/bin"
    local spec
    for spec in "$@"; do
        if [[ ${spec##*:} == /* ]]; then
            # umask 022: the directories install -D makes are 0755, like the base's.
            (umask 022 && install -D -m 0644 "${spec%%:*}" "$d${spec##*:}")
            continue
        fi
        install -m 0755 "${spec%%:*}" "$d/usr/local/bin/${spec##*:}"
        # Our debug builds (what the tests and make run put in the images) are half debug
        # info; release builds are stripped already, so this changes nothing for them.
        if [[ -n $strip && ${spec##*:} == cli-mcp-* ]]; then
            "$strip" --strip-debug "$d/usr/local/bin/${spec##*:}"
        fi
    done
    layer_tar "$d" "$out"
    rm -rf "$d"
}
layer "$tmp/operator.tar" "$bin_dir/cli-mcp-operator:cli-mcp-operator"
layer "$tmp/server.tar" "$bin_dir/cli-mcp-server:cli-mcp-server"
layer "$tmp/proxy.tar" "$bin_dir/cli-mcp-proxy:cli-mcp-proxy"

# The tools the sandbox briefing names, with the versions the shipped binaries report: run
# images/sandbox/record-tools.sh in a chroot of the sandbox's root filesystem with kubectl and
# yq added (another ARCH runs through qemu-user-static, as mmdebstrap did).
record="$tmp/record-root"
mkdir "$record"
tar -xf "$rootfs/sandbox.tar" -C "$record"
install -m 0755 "$KUBECTL" "$record/usr/local/bin/kubectl"
install -m 0755 "$yq" "$record/usr/local/bin/yq"
tools_json="$(chroot "$record" /usr/bin/env -i "$path_env" HOME=/tmp LC_ALL=C /bin/bash -s \
    <"$IMAGES_DIR/sandbox/record-tools.sh")" ||
    die "recording the sandbox's tool versions failed (images/sandbox/record-tools.sh, output above)"
rm -rf "$record"
printf '%s\n' "$tools_json" >"$tmp/sandbox-tools.json"
say "sandbox tools: $tools_json"

layer "$tmp/tools.tar" "$KUBECTL:kubectl" "$yq:yq" "$tmp/sandbox-tools.json:/etc/cli-mcp/tools.json"
layer "$tmp/agent.tar" "$bin_dir/cli-mcp-agent:cli-mcp-agent"

debian_label() { awk '{printf "%s%s=%s", (NR>1?",":""), $1, $2}' "$1"; }

# image NAME USER ENTRYPOINT "PORTS" "ENV..." WORKDIR PACKAGES LAYER:COMMENT...
image() {
    local name="$1" user="$2" entrypoint="$3" ports="$4" envs="$5" workdir="$6" packages="$7"
    shift 7
    local ref="localhost/cli-mcp-$name:$TAG" layout="$tmp/oci-$name" spec
    umoci init --layout "$layout"
    umoci new --image "$layout:$TAG"
    for spec in "$@"; do
        umoci raw add-layer --image "$layout:$TAG" --history.created "$created" \
            --history.created_by "hack/build-images.sh" --history.comment "${spec#*:}" "${spec%%:*}"
    done
    local args=(--no-history --created "$created" --architecture "$goarch" --os linux
        --author "cli-mcp hack/build-images.sh"
        --config.user "$user" --config.entrypoint "$entrypoint" --config.workingdir "$workdir"
        --config.label "org.opencontainers.image.title=cli-mcp-$name"
        --config.label "org.opencontainers.image.version=$TAG"
        --config.label "org.opencontainers.image.created=$created"
        --config.label "org.opencontainers.image.base.name=debian:$DEBIAN_SUITE"
        --config.label "io.cli-mcp.debian-packages=$(debian_label "$packages")")
    local p e
    for p in $ports; do args+=(--config.exposedports "$p/tcp"); done
    for e in $envs; do args+=(--config.env "$e"); done
    [[ $name != sandbox ]] || args+=(--config.label "io.cli-mcp.kubectl-version=$kubectl_version"
        --config.label "io.cli-mcp.yq-version=$YQ_VERSION"
        --config.label "io.cli-mcp.tools=$tools_json")
    umoci config --image "$layout:$TAG" "${args[@]}"
    umoci gc --layout "$layout"
    # containerd (ctr images import, the kubelet's image store) names the image after
    # io.containerd.image.name; org.opencontainers.image.ref.name stays the tag (skopeo,
    # podman: oci-archive:FILE:TAG).
    jq --arg ref "$ref" --arg arch "$goarch" -c \
        '.manifests[0].annotations["io.containerd.image.name"] = $ref
         | .manifests[0].platform = {architecture: $arch, os: "linux"}' \
        "$layout/index.json" >"$layout/index.json.new"
    mv "$layout/index.json.new" "$layout/index.json"
    layer_tar "$layout" "$tmp/cli-mcp-$name.tar"
    local manifest compressed uncompressed=0
    manifest="$(jq -r '.manifests[0].digest' "$layout/index.json")"
    compressed="$(stat -c %s "$tmp/cli-mcp-$name.tar")"
    for spec in "$@"; do uncompressed=$((uncompressed + $(stat -c %s "${spec%%:*}"))); done
    printf '%s\t%s\t%s\t%s\t%s\n' "$ref" "$manifest" "$compressed" "$uncompressed" "$#" >>"$tmp/images.tsv"
    rm -rf "$layout"
    say "$ref: $manifest, archive $((compressed / 1024)) KiB, layers $((uncompressed / 1024)) KiB uncompressed"
}

printf 'ref\tmanifest\tarchive_bytes\tuncompressed_bytes\tlayers\n' >"$tmp/images.tsv"
image operator 65532:65532 /usr/local/bin/cli-mcp-operator 8081 "$path_env" / "$rootfs/base.packages" \
    "$rootfs/base.tar:debian $DEBIAN_SUITE libc6 libgcc-s1 ca-certificates" \
    "$tmp/operator.tar:cli-mcp-operator"
image server 1001:0 /usr/local/bin/cli-mcp-server "8443 8081" "$path_env" / "$rootfs/base.packages" \
    "$rootfs/base.tar:debian $DEBIAN_SUITE libc6 libgcc-s1 ca-certificates" \
    "$tmp/server.tar:cli-mcp-server"
image proxy 1001:0 /usr/local/bin/cli-mcp-proxy "8080 8081" "$path_env" / "$rootfs/base.packages" \
    "$rootfs/base.tar:debian $DEBIAN_SUITE libc6 libgcc-s1 ca-certificates" \
    "$tmp/proxy.tar:cli-mcp-proxy"
image sandbox 1001:0 /usr/local/bin/cli-mcp-agent 8090 "$path_env HOME=/workspace PAGER=cat" /workspace \
    "$rootfs/sandbox.packages" \
    "$rootfs/sandbox.tar:debian $DEBIAN_SUITE essential + $(rootfs_packages "$IMAGES_DIR/sandbox/debian-packages")" \
    "$tmp/tools.tar:kubectl $kubectl_version, yq $YQ_VERSION, /etc/cli-mcp/tools.json" \
    "$tmp/agent.tar:cli-mcp-agent"
cp "$rootfs/sandbox.packages" "$tmp/sandbox.packages"
cp "$rootfs/base.packages" "$tmp/base.packages"
rm -f "$tmp"/{operator,server,proxy,tools,agent}.tar
(cd "$tmp" && sha256sum cli-mcp-*.tar >SHA256SUMS)
say "assembled in $(($(date +%s) - start)) s"

if mv -T "$tmp" "$final" 2>/dev/null; then
    trap - EXIT
else
    say "another build already published $final; using it"
fi
# Keep the three newest image builds and root filesystems; drop abandoned build directories.
find "$cache" "$cache/rootfs" -mindepth 1 -maxdepth 1 -name '.build-*' -mmin +720 -exec rm -rf {} + 2>/dev/null || true
ls -1dt "$cache"/????????????????/ 2>/dev/null | tail -n +4 | while IFS= read -r old; do rm -rf "$old"; done
ls -1dt "$cache"/rootfs/*/ 2>/dev/null | tail -n +3 | while IFS= read -r old; do rm -rf "$old"; done
echo "$final"
