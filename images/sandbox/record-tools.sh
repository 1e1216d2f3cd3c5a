#!/bin/bash
# Prints the tools of the cli-mcp-sandbox image that the sandbox briefing names, each with the
# version its binary reports, as one line of JSON:
#   [{"name":"bash","version":"5.2.15"},{"name":"kubectl","version":"v1.37.2"},...]
# It runs inside the image's root filesystem (hack/build-images.sh: in a chroot of it; the
# Containerfile: a RUN step), so the versions are those of the binaries shipped, never of a
# list kept by hand. The output becomes /etc/cli-mcp/tools.json, the image label
# io.cli-mcp.tools and, beside the archives, sandbox-tools.json, which the operator is given
# (CLI_MCP_SANDBOX_TOOLS in config/manager/manager.yaml).
# A tool that is missing, or whose output has no version, fails the build: a briefing that
# names a tool the image lacks would send a model down a dead end.
set -euo pipefail
export LC_ALL=C

# The tools a model is likely to reach for, in the order the briefing names them. Each one's
# version should change only with the image's own pins (Kubernetes, yq, the Debian release):
# openssl is left out because Debian's security updates move it to new upstream releases.
names=(bash kubectl jq yq curl perl mawk grep sed less ps)

# What the tool prints about its version (the version is on the first line).
version_output() {
    case "$1" in
    kubectl) kubectl version --client 2>&1 ;;
    perl) perl -e 'print "$^V\n"' 2>&1 ;;
    mawk) mawk -W version 2>&1 ;;
    # ps reads /proc before it says anything, and the build's chroot has none; pgrep is of
    # the same procps-ng release.
    ps) pgrep --version 2>&1 ;;
    *) "$1" --version 2>&1 ;;
    esac
}

json="["
sep=""
for name in "${names[@]}"; do
    command -v "$name" >/dev/null 2>&1 || {
        echo "record-tools: $name is not on PATH ($PATH); install it or drop it from the list in images/sandbox/record-tools.sh" >&2
        exit 1
    }
    out="$(version_output "$name")" || true
    first="${out%%$'\n'*}"
    # The first word that is a version: `5.2.15(1)-release` -> 5.2.15, `jq-1.6` -> 1.6,
    # `v4.54.3` stays as it is.
    version=""
    for word in $first; do
        word="${word#"${word%%[0-9v]*}"}"
        if [[ $word =~ ^(v?[0-9]+(\.[0-9]+)*) ]]; then
            version="${BASH_REMATCH[1]}"
            break
        fi
    done
    [[ -n $version ]] || {
        echo "record-tools: no version in the first line of $name's output: ${first@Q}" >&2
        exit 1
    }
    json+="$sep{\"name\":\"$name\",\"version\":\"$version\"}"
    sep=","
done
echo "$json]"
