# shellcheck shell=bash
# apt_install PKG...: install Debian packages, one apt run on this machine at a time.
#
# apt's own locks do not queue: `apt-get update` fails at once ("Could not get lock
# /var/lib/apt/lists/lock") while another `apt-get update` runs, whatever
# DPkg::Lock::Timeout says (that option covers the dpkg lock only). Two of our scripts can
# install at the same moment (make test builds the images from two test binaries at once on
# a fresh machine), so every install of ours takes this lock first, and the caller re-checks
# what is missing after it: the other run may have installed it meanwhile.
#
# Prints apt's last lines and returns 1 on failure; the caller says what to do.
apt_install() {
    local lock="${CLI_MCP_APT_LOCK:-/run/lock/cli-mcp-apt.lock}" log
    mkdir -p "$(dirname "$lock")"
    (
        # flock is util-linux's (Essential in Debian); without it, go on unlocked.
        if command -v flock >/dev/null; then
            exec 8>"$lock"
            flock -w 900 8 || { echo "waited 15 min for another apt run of this project ($lock)" >&2; exit 1; }
        fi
        local missing=()
        local p
        for p in "$@"; do
            dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
        done
        ((${#missing[@]})) || exit 0
        export DEBIAN_FRONTEND=noninteractive
        local apt=(apt-get -q -o DPkg::Lock::Timeout=300)
        if ! log="$("${apt[@]}" update 2>&1)" ||
            ! log="$("${apt[@]}" install -y --no-install-recommends "${missing[@]}" 2>&1)"; then
            printf '%s\n' "$log" | tail -n 20 >&2
            exit 1
        fi
    )
}
