# shellcheck shell=bash disable=SC2034 # sourced: start_pid, waited_line, cluster_json are its results
# Sourced by hack/run.sh (and by e2e/tests/run_twice.rs, which tests it): start a background
# process with its output in a log file of its own, and wait for the line that process prints
# when it is ready. Nothing here can read what an earlier run left behind.
#
# The waits run in the calling shell (no command substitution around them), so its INT/TERM
# traps still run within 0.2 s while it waits.

# start_logged LOG CMD [ARGS...]: run CMD in the background with stdout and stderr in LOG and
# set start_pid. The previous run's LOG is kept as LOG.prev (renamed) and LOG starts empty
# here, in this shell, before CMD exists: a wait on LOG only ever sees CMD's own lines.
# CMD gets SIGTERM should this shell die without stopping it (killed outright): setpriv's
# parent-death signal, kept across its exec of CMD, so start_pid is CMD's pid.
start_logged() {
    local log=$1
    shift
    if [[ -e $log ]]; then mv -f "$log" "$log.prev"; fi
    : >"$log"
    if command -v setpriv >/dev/null; then
        setpriv --pdeathsig TERM -- "$@" >>"$log" 2>&1 &
    else
        "$@" >>"$log" 2>&1 &
    fi
    start_pid=$!
}

# wait_line LOG PID PREFIX SECONDS: wait until LOG has a line starting with PREFIX and set
# waited_line to the rest of it. Returns 1 when PID exits first or SECONDS pass.
wait_line() {
    local log=$1 pid=$2 prefix=$3 deadline=$((SECONDS + $4))
    waited_line=
    while :; do
        waited_line="$(grep -m1 "^$prefix" "$log" || true)"
        if [[ -n $waited_line ]]; then
            waited_line="${waited_line#"$prefix"}"
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || return 1
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

# wait_cluster_ready LOG PID SECONDS: wait until the `cli-mcp-cluster up` started as PID with
# start_logged LOG is ready: it printed `CLI_MCP_READY <cluster.json>` and that cluster.json
# records PID as its owner. Sets cluster_json. Returns 1, saying why on stderr with the tail of
# LOG, when PID exits first or is not ready within SECONDS.
wait_cluster_ready() {
    local log=$1 pid=$2 timeout=$3 owner
    cluster_json=
    if ! wait_line "$log" "$pid" 'CLI_MCP_READY ' "$timeout"; then
        tail -n 20 "$log" >&2
        if kill -0 "$pid" 2>/dev/null; then
            echo "the cluster (pid $pid) was not ready within $timeout s (log: $log)" >&2
        else
            echo "the cluster (pid $pid) exited before it was ready (log: $log)" >&2
        fi
        return 1
    fi
    owner="$(jq -r .pid "$waited_line" 2>/dev/null || true)"
    if [[ $owner != "$pid" ]]; then
        echo "$waited_line names owner pid ${owner:-none}, not the cluster started here ($pid)" >&2
        return 1
    fi
    cluster_json=$waited_line
}
