#!/usr/bin/env bash
# Runs the workspace's tests as jobs in parallel lanes, on the one local cluster `make test`
# starts (run it under `cli-mcp-cluster exec --`, which sets CLI_MCP_KUBECONFIG).
#
# Why not `cargo test --workspace`: it runs one test binary after the other, and most of the
# suite's time is e2e binaries waiting on pods, containers and watches, not using the CPU.
# Why not cargo-nextest: it runs each test in a process of its own, and several binaries set
# up a fixture once per process and share it between their tests (the OAuth tests' PKI and
# the authentication config it installs into the shared cluster, the SDK installs); one
# process per test would redo them per test, or fight over them.
#
# A job is one test target name (`cargo test --workspace --test <name>`: with --workspace the
# features are the same as in the build `make test` made first, so nothing is rebuilt; two
# packages' targets of one name run in one job), plus one job for every library's and
# binary's unit tests and one for the doc tests, so a new test file is picked up with no
# list to keep. Jobs start longest first (the slow ones are named below;
# the order only shortens the run) on CLI_MCP_TEST_LANES lanes (default 3). Each job's output
# goes to a file and is printed whole when the job ends, so outputs never interleave; a table
# of every job's time and result closes the run. Extra arguments go to every test binary
# (e.g. `-- --nocapture`).
#
# Exit status: 0 when every job passed, 1 otherwise (every job runs, as --no-fail-fast).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CARGO=${CARGO:-cargo}
LANES=${CLI_MCP_TEST_LANES:-3}
[[ $LANES =~ ^[1-9][0-9]*$ ]] || { echo "CLI_MCP_TEST_LANES must be a positive number, got '$LANES'" >&2; exit 2; }

# The test targets that take longest, slowest first (measured; see docs/e2e.md). Targets
# not named here follow in the order cargo metadata lists them.
slow=(
  faults
  lifecycle
  journeys_lifecycle
  real_node_sandbox
  install
  journeys
  logs
  lifecycle_edges
  real_node_proxy
  real_node_identity
  journeys_real_node
  real_node_placement
)

out=$(mktemp -d "${TMPDIR:-/tmp}/cli-mcp-test-lanes.XXXXXX")
trap 'rm -rf "$out"' EXIT

# Every test target name of the workspace, once.
mapfile -t targets < <("$CARGO" metadata --format-version 1 --no-deps | python3 -c '
import json, sys
names = []
for p in json.load(sys.stdin)["packages"]:
    for t in p["targets"]:
        if "test" in t["kind"] and t["name"] not in names:
            names.append(t["name"])
print("\n".join(names))
')
((${#targets[@]} > 0)) || { echo "cargo metadata listed no test target" >&2; exit 2; }

jobs=()
for s in "${slow[@]}"; do
  for t in "${targets[@]}"; do [[ $t == "$s" ]] && jobs+=("$t"); done
done
for t in "${targets[@]}"; do
  [[ " ${slow[*]} " == *" $t "* ]] || jobs+=("$t")
done
jobs+=(unit doc)

# One job: its output to $out/<n>.log, its time and status to $out/<n>.result.
run_job() {
  local n=$1 job=$2 start status cmd
  local log="$out/$n.log"
  start=$(date +%s)
  case $job in
    unit) cmd=("$CARGO" test --workspace --no-fail-fast --lib --bins) ;;
    doc) cmd=("$CARGO" test --workspace --no-fail-fast --doc) ;;
    *) cmd=("$CARGO" test --workspace --no-fail-fast --test "$job") ;;
  esac
  # Word-split on purpose: the extra arguments travel as one exported string.
  # shellcheck disable=SC2206
  if [[ -n $TEST_ARGS ]]; then cmd+=(-- $TEST_ARGS); fi
  set +e
  "${cmd[@]}" >"$log" 2>&1
  status=$?
  set -e
  local took=$(($(date +%s) - start))
  {
    echo "=== $job: $([[ $status == 0 ]] && echo ok || echo "FAILED (exit $status)") in ${took}s: ${cmd[*]}"
    cat "$log"
  } >"$out/$n.print"
  echo "$job $status $took" >"$out/$n.result"
  # Printed whole, one job at a time (flock: lanes end at the same moment).
  flock "$out/print.lock" cat "$out/$n.print"
}
export -f run_job
export CARGO out
TEST_ARGS="${*-}"
export TEST_ARGS

echo "test-lanes: ${#jobs[@]} jobs on $LANES lanes"
began=$(date +%s)
for i in "${!jobs[@]}"; do echo "$i ${jobs[$i]}"; done |
  xargs -P "$LANES" -n 2 bash -c 'run_job "$@"' run_job

failed=0
echo
echo "test-lanes: every job, slowest first ($(($(date +%s) - began))s in all on $LANES lanes)"
printf '%-40s %8s  %s\n' job seconds result
for f in "$out"/*.result; do cat "$f"; done | sort -k3,3nr |
  while read -r job status took; do
    printf '%-40s %8s  %s\n' "$job" "$took" "$([[ $status == 0 ]] && echo ok || echo FAILED)"
  done
for f in "$out"/*.result; do
  read -r job status _ <"$f"
  if [[ $status != 0 ]]; then echo "test-lanes: FAILED: $job"; failed=1; fi
done
missing=$((${#jobs[@]} - $(ls "$out" | grep -c '\.result$' || true)))
if ((missing > 0)); then echo "test-lanes: $missing job(s) did not report a result"; failed=1; fi
exit $failed
