# shellcheck shell=bash
# Debian root filesystems of the images, sourced by hack/build-images.sh (not run on its own).
# Its sha256 is part of the cache key of the root filesystems: change anything here and they
# are built again.
#
#   rootfs_build OUT   writes OUT/sandbox.tar and OUT/base.tar (one image layer each) and
#                      OUT/sandbox.packages and OUT/base.packages ("name version arch" lines)
#   layer_tar DIR OUT  a reproducible layer tar of DIR (used for every layer)
#
# Needs: ARCH (Debian architecture), SOURCE_DATE_EPOCH, the package lists
# images/sandbox/debian-packages and images/base/debian-packages (one name a line) and their
# pins, images/{sandbox,base}/debian-packages.$ARCH.lock (images/debian-pins.sh). The .debs
# are the pinned ones only: each is downloaded from DEBIAN_MIRROR / DEBIAN_SECURITY_MIRROR,
# checked against its pinned sha256, and offered to mmdebstrap as the only repository.
#
# sandbox: mmdebstrap --variant=essential (dpkg, coreutils, dash, ... no apt) plus the listed
#          packages, installed properly (maintainer scripts run, so the CA bundle exists);
#          documentation, man pages and translations are left out (copyright files kept).
#          User sandbox (1001, group 0, home /workspace); /workspace owned 1001:0 with
#          mode 0770, so any UID in group 0 (OpenShift's restricted SCC) can write there.
#          /var/lib/cli-mcp/termination owned root:root with mode 0700 (not 0750: group 0
#          is the sandbox's on OpenShift): the pod's terminationMessagePath is in there.
# base:    mmdebstrap --variant=extract of the listed packages (libc6, libgcc-s1: what our
#          dynamically linked binaries need), nothing else: no shell, no dpkg. The CA bundle is
#          the sandbox's /etc/ssl/certs/ca-certificates.crt (Debian ca-certificates). A dpkg
#          status file lists what is in it, for image scanners.

IMAGES_DIR="${IMAGES_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN_SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

# One layer tar: sorted names, numeric owners, no atime/ctime, mtimes clamped to
# SOURCE_DATE_EPOCH, device nodes under /dev left out (the runtime creates them).
layer_tar() {
    tar -C "$1" --sort=name --format=posix --numeric-owner \
        --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
        --mtime="@$SOURCE_DATE_EPOCH" --clamp-mtime \
        --exclude='./dev/*' -cf "$2" .
}

rootfs_packages() {
    grep -v '^[[:space:]]*\(#\|$\)' "$1" | paste -sd, -
}

# rootfs_mmdebstrap VARIANT PACKAGES DIR LOG SOURCE... [-- OPTION...]
rootfs_mmdebstrap() {
    local variant="$1" packages="$2" dir="$3" log="$4"
    shift 4
    local sources=()
    while (($#)) && [[ $1 != -- ]]; do sources+=("$1"); shift; done
    (($# == 0)) || shift
    mmdebstrap --variant="$variant" --include="$packages" --architectures="$ARCH" \
        --format=directory \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/lintian/*' \
        "$@" "$DEBIAN_SUITE" "$dir" "${sources[@]}" >"$log" 2>&1
}

# Files a container runtime provides, and state that only records when the build ran.
rootfs_scrub() {
    local d="$1"
    rm -f "$d/etc/resolv.conf" "$d/etc/hostname" "$d/etc/fstab" "$d/var/cache/ldconfig/aux-cache"
    rm -f "$d"/var/cache/debconf/*-old "$d"/var/lib/dpkg/*-old
    [[ ! -e $d/etc/machine-id ]] || : >"$d/etc/machine-id"
    find "$d/var/log" -type f -delete 2>/dev/null || true
    find "$d/dev" -mindepth 1 -delete 2>/dev/null || true
}

rootfs_build() {
    local out="$1" work
    work="$(mktemp -d "$out/.work.XXXXXX")"
    local sbx="$work/sandbox" base="$work/base"
    local sbx_pkgs base_pkgs
    sbx_pkgs="$(rootfs_packages "$IMAGES_DIR/sandbox/debian-packages")"
    base_pkgs="$(rootfs_packages "$IMAGES_DIR/base/debian-packages")"

    # Each root filesystem gets a repository of its pinned .debs only (downloaded and
    # checked against the pinned sha256 by images/debian-pins.sh), so apt has exactly one
    # candidate per package and no other package to reach for.
    local rfs
    for rfs in sandbox base; do
        "$IMAGES_DIR/debian-pins.sh" fetch "$IMAGES_DIR/$rfs/debian-packages.$ARCH.lock" "$work/repo-$rfs" ||
            return 1
    done

    # Both at once. copy: makes apt copy the .debs into the chroot's apt cache, as it does
    # for a download (a file: repository would be read in place, outside the chroot).
    rootfs_mmdebstrap essential "$sbx_pkgs" "$sbx" "$out/sandbox.log" \
        "deb [trusted=yes] copy://$work/repo-sandbox $DEBIAN_SUITE main" &
    local sbx_pid=$!
    rootfs_mmdebstrap extract "$base_pkgs" "$base" "$out/base.log" \
        "deb [trusted=yes] copy://$work/repo-base $DEBIAN_SUITE main" -- --skip=cleanup/apt/cache &
    local base_pid=$!
    local failed=
    wait "$sbx_pid" || failed+=" sandbox (log: $out/sandbox.log)"
    wait "$base_pid" || failed+=" base (log: $out/base.log)"
    if [[ -n $failed ]]; then
        tail -n 20 "$out/sandbox.log" "$out/base.log" >&2
        echo "error: mmdebstrap failed for$failed from the pinned packages; a dependency missing from a lock means the lock is stale: images/debian-pins.sh refresh" >&2
        return 1
    fi

    # --- sandbox ---
    rootfs_scrub "$sbx"
    echo 'sandbox:x:1001:0:cli-mcp sandbox:/workspace:/bin/bash' >>"$sbx/etc/passwd"
    install -d -o 1001 -g 0 -m 0770 "$sbx/workspace"
    install -d -o 0 -g 0 -m 0700 "$sbx/var/lib/cli-mcp/termination"
    # The sources apt read were the build's own repository (a path of this build); the image
    # names Debian's own archive, whichever mirror the .debs came from, so that the mirror
    # does not change the image.
    printf 'deb %s %s main\n' http://deb.debian.org/debian "$DEBIAN_SUITE" \
        http://deb.debian.org/debian "$DEBIAN_SUITE-updates" \
        http://deb.debian.org/debian-security "$DEBIAN_SUITE-security" >"$sbx/etc/apt/sources.list"
    dpkg-query --admindir="$sbx/var/lib/dpkg" -W -f '${Package} ${Version} ${Architecture}\n' |
        LC_ALL=C sort >"$out/sandbox.packages"
    "$IMAGES_DIR/debian-pins.sh" check "$IMAGES_DIR/sandbox/debian-packages.$ARCH.lock" "$out/sandbox.packages" ||
        return 1
    install -d -m 0755 "$sbx/usr/share/cli-mcp"
    install -m 0644 "$out/sandbox.packages" "$sbx/usr/share/cli-mcp/debian-packages.txt"

    # --- base ---
    local deb
    : >"$out/base.packages"
    install -d -m 0755 "$work/status"
    for deb in "$base"/var/cache/apt/archives/*.deb; do
        dpkg-deb -f "$deb" Package Version Architecture | awk -F': ' '{printf "%s%s", (NR>1?" ":""), $2} END {print ""}' >>"$out/base.packages"
        { dpkg-deb -f "$deb"; echo "Status: install ok installed"; echo; } >>"$work/status/status"
    done
    LC_ALL=C sort -o "$out/base.packages" "$out/base.packages"
    "$IMAGES_DIR/debian-pins.sh" check "$IMAGES_DIR/base/debian-packages.$ARCH.lock" "$out/base.packages" ||
        return 1
    # Keep only what the packages put there (plus the root directories they live in).
    rm -rf "$base/etc/apt" "$base/etc/dpkg" "$base/var/cache" "$base/var/lib/apt" \
        "$base/var/lib/dpkg" "$base/var/log"
    rootfs_scrub "$base"
    install -d -m 0755 "$base/var/lib/dpkg" "$base/etc/ssl/certs" "$base/usr/share/cli-mcp"
    install -m 0644 "$work/status/status" "$base/var/lib/dpkg/status"
    install -m 0644 "$sbx/etc/ssl/certs/ca-certificates.crt" "$base/etc/ssl/certs/ca-certificates.crt"
    grep '^ca-certificates ' "$out/sandbox.packages" >>"$out/base.packages"
    install -m 0644 "$out/base.packages" "$base/usr/share/cli-mcp/debian-packages.txt"
    printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' \
        'cli-mcp:x:1001:0:cli-mcp:/home/cli-mcp:/sbin/nologin' \
        'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$base/etc/passwd"
    printf '%s\n' 'root:x:0:' 'nonroot:x:65532:' >"$base/etc/group"
    printf '%s\n' 'passwd: files' 'group: files' 'hosts: files dns' >"$base/etc/nsswitch.conf"
    chmod 0644 "$base/etc/passwd" "$base/etc/group" "$base/etc/nsswitch.conf"
    install -d -m 1777 "$base/tmp"
    install -d -m 0700 "$base/root"
    install -d -o 1001 -g 0 -m 0770 "$base/home/cli-mcp"
    install -d -o 65532 -g 65532 -m 0700 "$base/home/nonroot"

    layer_tar "$sbx" "$out/sandbox.tar"
    layer_tar "$base" "$out/base.tar"
    rm -rf "$work"
}
