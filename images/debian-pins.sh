#!/usr/bin/env bash
# The pinned Debian packages of the images: images/<rootfs>/debian-packages.<arch>.lock, one
# line per package of the root filesystem, its dependencies included (a closed set):
#
#   name=version architecture sha256 archive pool-path
#   bash=5.2.15-2+b7 amd64 1f8b…e0 debian pool/main/b/bash/bash_5.2.15-2+b7_amd64.deb
#
# sha256 is the one Debian's Packages index (signed through InRelease) gave for that file
# when the pins were taken; archive is `debian` (DEBIAN_MIRROR) or `debian-security`
# (DEBIAN_SECURITY_MIRROR). snapshot.debian.org is not reachable from where this project is
# built, so the .debs come from the live archive, which serves a version only until a newer
# one replaces it (a point release, a security fix): then the build stops and says to refresh.
#
#   images/debian-pins.sh fetch LOCK REPO
#       Downloads each pinned .deb (through a cache keyed by its sha256), checks its sha256
#       and writes REPO as an apt repository of suite DEBIAN_SUITE, component main (the .debs,
#       a Packages index and a Release file; mmdebstrap picks the essential set by suite) that
#       holds exactly the pinned versions, so mmdebstrap can install nothing else.
#   images/debian-pins.sh check LOCK LIST
#       LIST ("name version architecture" lines, what the root filesystem holds) must be
#       exactly the lock's packages: a pin nothing installed means the lock is stale.
#   images/debian-pins.sh refresh
#       Resolves the package lists (images/*/debian-packages) against the live archive with
#       mmdebstrap, as the build did before pinning, and rewrites every lock of ARCH.
#   images/debian-pins.sh lock LIST LISTS
#       The lock lines refresh writes: for each package of LIST ("name version architecture"
#       lines), its Filename and SHA256 in the Packages indices of the apt lists directory
#       LISTS (an index of the suite's -security gives archive debian-security).
#
# Env: ARCH (default: the host's), DEBIAN_MIRROR, DEBIAN_SECURITY_MIRROR (defaults: the
# deb.debian.org ones, images/rootfs.sh), CLI_MCP_CACHE (the .deb cache lives in
# $CLI_MCP_CACHE/debian-debs; default /var/cache/cli-mcp).
set -euo pipefail

pins_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=images/rootfs.sh
source "$pins_root/images/rootfs.sh"
ARCH="${ARCH:-$(dpkg --print-architecture)}"
debs_cache="${CLI_MCP_CACHE:-/var/cache/cli-mcp}/debian-debs"
refresh_hint="refresh the pins with \`images/debian-pins.sh refresh\` (as root, ARCH=$ARCH; it rewrites images/*/debian-packages.$ARCH.lock from the live archive), look over the version changes and commit the lock files"

pins_die() {
    printf 'images: error: %s\n' "$*" >&2
    exit 1
}

# The pins of LOCK as "name version arch sha256 archive path" lines (comments dropped).
pins_read() {
    [[ -s $1 ]] || pins_die "no pinned Debian packages for $ARCH: $1 is missing; $refresh_hint"
    awk -v lock="$1" '
        /^[[:space:]]*(#|$)/ { next }
        NF != 5 || $1 !~ /^[a-z0-9][a-z0-9+.-]*=[^=]+$/ || length($3) != 64 || $3 ~ /[^0-9a-f]/ ||
            ($4 != "debian" && $4 != "debian-security") || $5 !~ /^pool\/[^ ]+\.deb$/ {
            printf "images: error: %s line %d is not \"name=version arch sha256 debian|debian-security pool/…deb\": %s\n",
                lock, NR, $0 > "/dev/stderr"
            bad = 1; next
        }
        { split($1, nv, "="); print nv[1], nv[2], $2, $3, $4, $5 }
        END { exit bad }' "$1"
}

pins_fetch() {
    local lock="$1" repo="$2" name version arch sha archive path url cached got tmp
    local pins
    pins="$(pins_read "$lock")" || exit 1
    local index="$repo/dists/$DEBIAN_SUITE/main/binary-$ARCH"
    mkdir -p "$debs_cache" "$repo/pool" "$index"
    : >"$index/Packages"
    while read -r name version arch sha archive path; do
        cached="$debs_cache/$sha.deb"
        if [[ ! -s $cached ]]; then
            case "$archive" in
            debian) url="$DEBIAN_MIRROR/$path" ;;
            *) url="$DEBIAN_SECURITY_MIRROR/$path" ;;
            esac
            tmp="$(mktemp "$debs_cache/.fetch.XXXXXX")"
            local rc=0
            curl -fsSL --retry 3 -o "$tmp" "$url" 2>"$tmp.err" || rc=$?
            if ((rc != 0)); then
                local err
                err="$(tail -n1 "$tmp.err")"
                rm -f "$tmp" "$tmp.err"
                # 22: an HTTP error such as 404; 37: no such file (a file:// mirror).
                [[ $rc == 22 || $rc == 37 ]] ||
                    pins_die "downloading $name=$version ($arch) from $url failed ($err); check that the mirror is reachable"
                pins_die "$name=$version ($arch), pinned in ${lock#"$pins_root"/}, is not served by the archive any more ($url: $err). Debian keeps only the current version of a package; $refresh_hint"
            fi
            rm -f "$tmp.err"
            got="$(sha256sum <"$tmp" | cut -d' ' -f1)"
            if [[ $got != "$sha" ]]; then
                rm -f "$tmp"
                pins_die "$url has sha256 $got, but ${lock#"$pins_root"/} pins $name=$version ($arch) to $sha: the mirror serves another file under this version; check DEBIAN_MIRROR / DEBIAN_SECURITY_MIRROR"
            fi
            mv "$tmp" "$cached"
        fi
        # A file in the cache is used only when its content still has the pinned hash.
        got="$(sha256sum <"$cached" | cut -d' ' -f1)"
        [[ $got == "$sha" ]] || pins_die "$cached has sha256 $got, not $sha: remove it and build again"
        local file="${name}_${version//:/%3a}_$arch.deb"
        ln -f "$cached" "$repo/pool/$file" 2>/dev/null || cp "$cached" "$repo/pool/$file"
        # The control stanza plus what apt needs to fetch and verify the file.
        { dpkg-deb -f "$repo/pool/$file"
          printf 'Filename: pool/%s\nSize: %s\nSHA256: %s\n\n' "$file" "$(stat -c %s "$repo/pool/$file")" "$sha"
        } >>"$index/Packages"
    done <<<"$pins"
    printf '%s\n' "Origin: cli-mcp pins" "Suite: $DEBIAN_SUITE" "Codename: $DEBIAN_SUITE" \
        "Architectures: $ARCH" "Components: main" "SHA256:" \
        " $(sha256sum <"$index/Packages" | cut -d' ' -f1) $(stat -c %s "$index/Packages") main/binary-$ARCH/Packages" \
        >"$repo/dists/$DEBIAN_SUITE/Release"
}

pins_check() {
    local lock="$1" list="$2" diff
    diff="$(diff <(pins_read "$lock" | awk '{print $1, $2, $3}' | LC_ALL=C sort) <(LC_ALL=C sort "$list"))" && return 0
    pins_die "the root filesystem does not hold exactly the packages of ${lock#"$pins_root"/} (< pinned only, > installed only):
$diff
$refresh_hint"
}

# Lock lines for LIST ("name version arch" lines) from the apt lists of a chroot: the
# Filename and SHA256 of each package in its Packages index.
pins_from_lists() {
    local list="$1" lists="$2" f
    for f in "$lists"/*_Packages; do
        case "$f" in
        *_dists_"$DEBIAN_SUITE"-security_*) echo "@archive debian-security" ;;
        *) echo "@archive debian" ;;
        esac
        # The blank line ends the last stanza of a file that does not end with one.
        cat "$f"
        echo
    done | awk -v list="$list" '
        BEGIN { while ((getline l < list) > 0) { split(l, p, " "); want[p[1] " " p[2] " " p[3]] = 1 } }
        /^@archive / { archive = $2; next }
        /^Package: / { pkg = $2 } /^Version: / { ver = $2 } /^Architecture: / { arch = $2 }
        /^Filename: / { file = $2 } /^SHA256: / { sha = $2 }
        /^$/ { k = pkg " " ver " " arch
               if ((k in want) && !(k in done)) { done[k] = 1; print pkg "=" ver, arch, sha, archive, file }
               pkg = ver = arch = file = sha = "" }
        END { for (k in want) if (!(k in done)) { print "no Packages entry for " k > "/dev/stderr"; bad = 1 }
              exit bad }' | LC_ALL=C sort
}

pins_refresh() {
    [[ $EUID -eq 0 ]] || pins_die "must run as root (mmdebstrap installs into a chroot)"
    local work sources=("deb $DEBIAN_MIRROR $DEBIAN_SUITE main"
        "deb $DEBIAN_MIRROR $DEBIAN_SUITE-updates main"
        "deb $DEBIAN_SECURITY_MIRROR $DEBIAN_SUITE-security main")
    work="$(mktemp -d "${TMPDIR:-/tmp}/cli-mcp-pins.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    local keep=--skip=cleanup/apt/lists,cleanup/apt/cache,essential/unlink
    echo "images: resolving the package lists against $DEBIAN_MIRROR ($DEBIAN_SUITE, $ARCH)" >&2
    rootfs_mmdebstrap essential "$(rootfs_packages "$IMAGES_DIR/sandbox/debian-packages")" \
        "$work/sandbox" "$work/sandbox.log" "${sources[@]}" -- "$keep" ||
        { tail -n 20 "$work/sandbox.log" >&2; pins_die "mmdebstrap failed (sandbox)"; }
    rootfs_mmdebstrap extract "$(rootfs_packages "$IMAGES_DIR/base/debian-packages")" \
        "$work/base" "$work/base.log" "${sources[@]}" -- "$keep" ||
        { tail -n 20 "$work/base.log" >&2; pins_die "mmdebstrap failed (base)"; }
    dpkg-query --admindir="$work/sandbox/var/lib/dpkg" -W -f '${Package} ${Version} ${Architecture}\n' >"$work/sandbox.list"
    local deb
    for deb in "$work"/base/var/cache/apt/archives/*.deb; do
        dpkg-deb -f "$deb" Package Version Architecture | awk -F': ' '{printf "%s%s", (NR>1?" ":""), $2} END {print ""}'
    done >"$work/base.list"
    local rfs
    for rfs in sandbox base; do
        local lock="$IMAGES_DIR/$rfs/debian-packages.$ARCH.lock"
        { echo "# Pinned by images/debian-pins.sh refresh from $DEBIAN_SUITE ($ARCH); do not edit by hand."
          echo "# name=version architecture sha256 archive pool-path (images/debian-pins.sh)"
          pins_from_lists "$work/$rfs.list" "$work/$rfs/var/lib/apt/lists"
        } >"$lock.new" || pins_die "reading the Packages indices of the $rfs build failed"
        mv "$lock.new" "$lock"
        echo "images: wrote ${lock#"$pins_root"/} ($(grep -vc '^#' "$lock") packages)" >&2
    done
}

case "${1:-}" in
fetch) [[ $# -eq 3 ]] || pins_die "usage: $0 fetch LOCK REPO"; pins_fetch "$2" "$3" ;;
check) [[ $# -eq 3 ]] || pins_die "usage: $0 check LOCK LIST"; pins_check "$2" "$3" ;;
refresh) pins_refresh ;;
lock) [[ $# -eq 3 ]] || pins_die "usage: $0 lock LIST LISTS"; pins_from_lists "$2" "$3" ;;
*) pins_die "usage: $0 fetch LOCK REPO | check LOCK LIST | refresh | lock LIST LISTS" ;;
esac
