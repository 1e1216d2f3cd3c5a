#!/usr/bin/env bash
# What the local Kubernetes needs from a fresh machine of this kind (Debian, root), installed or
# set when it is missing. `make run`, `make cluster`, `make test`, `make bench` and .ci/run call
# it first. It prints one line per step it performs and nothing for what is already there, so a
# second run is silent; apt-get update only runs when a package is missing.
#
#   hack/prereqs.sh           for the local cluster (make run, make cluster, make bench)
#   hack/prereqs.sh --test    also the Rust lint tools that make test runs (rustfmt, clippy)
#   hack/prereqs.sh --check   change nothing: list what is missing, exit 1 if anything is
#
# What it sees to:
#   apt packages  containernetworking-plugins  CNI ptp, host-local, loopback in /usr/lib/cni
#                                              (the process kubelet's pod network)
#                 iproute2                     ip (addresses on lo, routes, network namespaces)
#                 procps, util-linux           kill, pkill, nsenter, flock, setpriv (tests, kubelet,
#                                              make run)
#                 curl, jq                     used by make run, the tests and sandbox shells
#                 ca-certificates              TLS to the Go module proxy
#                 gcc, libc6-dev               the C compiler and linker cargo needs
#                 containerd, runc             the real node's container runtime (containerd 1.6,
#                                              ctr, containerd-shim-runc-v2; runc 1.1)
#                 iptables, conntrack, ipset   kube-proxy of the real node (iptables-nft)
#                 catatonit                    the real node's pause image (static binary)
#                 busybox-static               the real-node test's image (static shell, httpd, nc)
#                 mmdebstrap, umoci            the project's images (hack/build-images.sh), which
#                                              the real node runs
#                 python3, python3-venv,       the MCP SDK clients of server/tests/sdk.rs (the SDKs
#                 nodejs, npm                  themselves come from PyPI and npm, cached)
#   kernel        net.ipv4.ip_forward=1        pods reach each other and the API server through
#                                              the host (set at runtime, not persisted)
#                 net.ipv4.neigh.default.      room for a neighbour entry per pod (1024/4096/8192;
#                 gc_thresh1/2/3               the default overflows after a few hundred pods)
#   routes        unreachable 10.244.0.0/16    pod and Service addresses exist only on this host:
#                 unreachable 10.96.0.0/12     never route them off it (see docs/local-kubernetes.md)
#   checked only  go >= 1.26, cargo            Debian's packages are too old; install them yourself
#
# CLI_MCP_PREREQS_EXTRA="pkg ..." adds packages to install (used to test the apt path).
set -euo pipefail
# shellcheck source=hack/lib/apt.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib/apt.sh"

mode=run
case "${1:-}" in
"") ;;
--test) mode="test" ;;
--check) mode="check" ;;
*)
    echo "usage: hack/prereqs.sh [--test|--check]" >&2
    exit 2
    ;;
esac

say() { printf 'prereqs: %s\n' "$*"; }
die() {
    printf 'prereqs: error: %s\n' "$*" >&2
    exit 1
}
missing=()
# In --check mode a step is reported instead of performed.
step() {
    if [[ $mode == check ]]; then
        missing+=("$1")
        return 1
    fi
    say "$1"
}

if [[ $mode != check && $EUID -ne 0 ]]; then
    die "must run as root: the local cluster needs network namespaces, routes and addresses on lo, \
and this script installs packages (run \`make run\` / \`make test\` as root, e.g. with sudo)"
fi

# --- apt packages -------------------------------------------------------------------------------
# The packages whose files are missing (CLI_MCP_PREREQS_EXTRA aside).
missing_packages() {
    pkgs=()
    local p
    for p in ptp host-local loopback; do
        [[ -x /usr/lib/cni/$p ]] || {
            pkgs+=(containernetworking-plugins)
            break
        }
    done
    command -v ip >/dev/null || pkgs+=(iproute2)
    { command -v pkill >/dev/null && command -v kill >/dev/null; } || pkgs+=(procps)
    { command -v nsenter >/dev/null && command -v flock >/dev/null && command -v setpriv >/dev/null; } ||
        pkgs+=(util-linux)
    command -v curl >/dev/null || pkgs+=(curl)
    command -v jq >/dev/null || pkgs+=(jq)
    [[ -s /etc/ssl/certs/ca-certificates.crt ]] || pkgs+=(ca-certificates)
    command -v cc >/dev/null || pkgs+=(gcc libc6-dev)
    [[ -x /usr/lib/cni/portmap ]] || [[ " ${pkgs[*]} " == *" containernetworking-plugins "* ]] ||
        pkgs+=(containernetworking-plugins)
    { command -v containerd >/dev/null && command -v ctr >/dev/null &&
        command -v containerd-shim-runc-v2 >/dev/null; } || pkgs+=(containerd)
    command -v runc >/dev/null || pkgs+=(runc)
    command -v iptables >/dev/null || pkgs+=(iptables)
    command -v conntrack >/dev/null || pkgs+=(conntrack)
    command -v ipset >/dev/null || pkgs+=(ipset)
    [[ -x /usr/bin/catatonit ]] || pkgs+=(catatonit)
    # The test copies /bin/busybox into an image: it must be the static build.
    [[ "$(dpkg-query -W -f='${db:Status-Status}' busybox-static 2>/dev/null)" == installed ]] ||
        pkgs+=(busybox-static)
    command -v mmdebstrap >/dev/null || pkgs+=(mmdebstrap)
    command -v umoci >/dev/null || pkgs+=(umoci)
    command -v python3 >/dev/null || pkgs+=(python3)
    python3 -c 'import ensurepip, venv' 2>/dev/null || pkgs+=(python3-venv)
    command -v node >/dev/null || pkgs+=(nodejs)
    command -v npm >/dev/null || pkgs+=(npm)
}
missing_packages
# shellcheck disable=SC2206 # word splitting of the list is intended
[[ -z ${CLI_MCP_PREREQS_EXTRA:-} ]] || pkgs+=(${CLI_MCP_PREREQS_EXTRA})

if ((${#pkgs[@]})) && step "installing ${pkgs[*]} (apt-get)"; then
    command -v apt-get >/dev/null ||
        die "apt-get not found; install the equivalent of these Debian packages by hand: ${pkgs[*]}"
    apt_install "${pkgs[@]}" ||
        die "apt-get could not install ${pkgs[*]} (output above); check the network and /etc/apt/sources.list, or install them by hand, then run again"
    installed=("${pkgs[@]}")
    missing_packages
    ((${#pkgs[@]} == 0)) ||
        die "apt-get installed ${installed[*]}, but files of ${pkgs[*]} are still missing \
(/usr/lib/cni/{ptp,host-local,loopback,portmap}, ip, pkill, nsenter, flock, setpriv, curl, jq, cc, containerd, \
ctr, containerd-shim-runc-v2, runc, iptables, conntrack, ipset, /usr/bin/catatonit, /bin/busybox); check the packages (dpkg -L)"
fi

# --- kernel and routes --------------------------------------------------------------------------
if [[ "$(cat /proc/sys/net/ipv4/ip_forward 2>/dev/null)" != 1 ]] &&
    step "enabling IPv4 forwarding (net.ipv4.ip_forward=1)"; then
    echo 1 >/proc/sys/net/ipv4/ip_forward || die "could not set net.ipv4.ip_forward=1"
fi
# Every pod is a neighbour of the host: the kernel's default table (gc_thresh3 1024, pruned
# from 512) overflows once a few hundred pods have come and gone ("neighbour table
# overflow"), and then new pods are unreachable from the host until entries expire.
neigh=/proc/sys/net/ipv4/neigh/default
for kv in gc_thresh1=1024 gc_thresh2=4096 gc_thresh3=8192; do
    key="${kv%%=*}" want="${kv#*=}"
    have="$(cat "$neigh/$key" 2>/dev/null || echo 0)"
    if ((have < want)) && step "raising net.ipv4.neigh.default.$key to $want (many pod neighbours)"; then
        echo "$want" >"$neigh/$key" || die "could not set net.ipv4.neigh.default.$key=$want"
    fi
done
for range in 10.244.0.0/16 10.96.0.0/12; do
    if command -v ip >/dev/null && [[ -n "$(ip -4 route show exact "$range" type unreachable 2>/dev/null)" ]]; then
        continue
    fi
    if step "adding route unreachable $range (cluster addresses never leave this host)"; then
        ip route replace unreachable "$range" || die "could not add route unreachable $range"
    fi
done

# --- tools this script does not install ---------------------------------------------------------
# Missing ones are fatal (reported by --check): Debian's packages are too old for this project.
lack() {
    if [[ $mode == check ]]; then
        missing+=("$1")
    else
        die "$1 is required: $2"
    fi
}
if ! command -v go >/dev/null; then
    lack "Go >= 1.26" "install it from https://go.dev/dl and put it on PATH"
else
    gover="$(go env GOVERSION)"
    if [[ ! $gover =~ ^go1\.([0-9]+) ]] || ((BASH_REMATCH[1] < 26)); then
        lack "Go >= 1.26 (found $gover at $(command -v go))" "install it from https://go.dev/dl"
    fi
fi
if ! command -v cargo >/dev/null; then
    lack "cargo" "install Rust with rustup (https://rustup.rs)"
elif [[ $mode != run ]]; then
    comps=()
    cargo fmt --version >/dev/null 2>&1 || comps+=(rustfmt)
    cargo clippy --version >/dev/null 2>&1 || comps+=(clippy)
    if ((${#comps[@]})) && step "installing ${comps[*]} (rustup component add)"; then
        command -v rustup >/dev/null ||
            die "${comps[*]} missing and rustup not found; install them with your Rust toolchain"
        rustup component add "${comps[@]}" || die "rustup could not add ${comps[*]}"
    fi
fi

if [[ $mode == check ]]; then
    ((${#missing[@]} == 0)) && exit 0
    printf 'prereqs: not done yet: %s\n' "${missing[@]}"
    exit 1
fi
