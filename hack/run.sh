#!/usr/bin/env bash
# `make run`: the whole product on the local Kubernetes, in the foreground until Ctrl-C.
#
#   1. installs and sets what the host lacks (hack/prereqs.sh: apt packages, IPv4 forwarding,
#      the unreachable routes for the pod and Service ranges), prints a line per step it takes;
#   2. builds what is missing (control plane from the Go module proxy, cached; our binaries);
#   3. brings up the local Kubernetes: a real control plane and, by default, the real node
#      (kubelet + kube-proxy on containerd/runc) with the operator, server and sandbox images
#      built from those binaries (hack/build-images.sh, cached outside the repo) and imported
#      into it; CLI_MCP_NODE=process runs pods as host processes instead (faster to start,
#      nothing to build);
#   4. installs the operator from config/default, as an admin would;
#   5. creates namespace cli-mcp-demo with a read-only investigation kubeconfig Secret and the
#      sample CliMcpInstance `demo` — behind its credential proxy, which alone holds that
#      kubeconfig's token (a sandbox sees a placeholder) — and waits for it to be Ready;
#   6. creates a client identity allowed to use the instance, forwards a loopback port to the
#      MCP Service (plain HTTP on 127.0.0.1, TLS to the instance with its CA pinned) and prints
#      ready-to-paste MCP client configurations with a literal token, and a curl one-liner.
#
# Everything it writes stays under .run/ (gitignored). Needs root (network namespaces).
# Logs: .run/quickstart/cluster.log (and forward.log), each new for every run; the previous
# run's is kept as cluster.log.prev. A run started while the previous one is still tearing
# down waits for it (the cluster's run-dir lock).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=hack/lib/start.sh
source "$root/hack/lib/start.sh"
# CLI_MCP_QUICKSTART_DIR: another place for what this run writes (the quick-start test uses it).
run="${CLI_MCP_QUICKSTART_DIR:-$root/.run/quickstart}"
ns=cli-mcp-demo
name=demo
svc="cli-mcp-$name"
mkdir -p "$run"
# What this run writes includes tokens (the investigator kubeconfig, the client token in the
# MCP configurations): its directory and those files are the user's alone.
chmod 0700 "$run"
# Writes stdin to a new file $1 readable by its owner only (a umask in a subshell: the build
# below must keep its usual modes, since the images copy the binaries it makes; the file is
# removed first because a umask only shapes a file being created).
private() { rm -f "$1" && (umask 077 && cat >"$1"); }
node="${CLI_MCP_NODE:-real}"
case "$node" in
real | process) ;;
*) printf 'make run: CLI_MCP_NODE=%s: expected real or process\n' "$node" >&2; exit 2 ;;
esac

say() { printf '\n==> %s\n' "$*"; }
die() { printf '\nmake run: %s\n' "$*" >&2; exit 1; }

hack/prereqs.sh

say "building (the control plane is built once, ~8 min, then cached)"
make --no-print-directory control-plane
control_plane_bin="$(hack/build-control-plane.sh | tail -n1)"
cargo build --workspace --bins
target="${CARGO_TARGET_DIR:-$root/target}"
cluster_bin="$target/debug/cli-mcp-cluster"

pids=()
cleanup() {
    # Once stopping, stop for good: a second Ctrl-C must not leave the cluster tearing down on
    # its own (its teardown is bounded: the kubelet 45 s at most, then 10 s per component).
    trap '' INT TERM
    trap - EXIT
    if ((${#pids[@]})); then
        echo "make run: stopping the cluster (pid ${pids[0]}) ..."
        for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
        wait 2>/dev/null || true
    fi
    echo "make run: stopped; the cluster is gone."
}
trap cleanup EXIT
# Stopping is what the user asked for: exit 0, so `make` does not report an error for it.
trap 'cleanup; exit 0' INT TERM

if [[ $node == real ]]; then
    say "starting the local Kubernetes on the real node, with the project's images (log: $run/cluster.log;
    the first run builds the images' Debian layers, a few minutes; CLI_MCP_NODE=process for the process kubelet)"
else
    say "starting the local Kubernetes on the process kubelet (log: $run/cluster.log)"
fi
start_logged "$run/cluster.log" "$cluster_bin" up --node "$node" --control-plane-bin "$control_plane_bin"
pids+=("$start_pid")
wait_cluster_ready "$run/cluster.log" "$start_pid" 1200 ||
    die "the local Kubernetes did not start (log: $run/cluster.log)"
KUBECONFIG="$(jq -r .kubeconfig "$cluster_json")"
export KUBECONFIG
kubectl get nodes

say "installing the operator (kustomize: config/default)"
kubectl kustomize config/default | kubectl apply --server-side -f - >/dev/null
kubectl -n cli-mcp-system rollout status deployment/cli-mcp-operator --timeout=180s

say "namespace $ns (Pod Security restricted enforced): read-only investigation identity and its kubeconfig Secret"
kubectl apply -f config/samples/namespace.yaml >/dev/null
kubectl -n "$ns" apply -f config/samples/investigation-kubeconfig.yaml >/dev/null
for _ in $(seq 1 120); do
    token="$(kubectl -n "$ns" get secret cli-mcp-investigator-token -o jsonpath='{.data.token}' 2>/dev/null | base64 -d)"
    [[ -n "$token" ]] && break
    sleep 0.5
done
[[ -n "${token:-}" ]] || die "the investigator token was never issued"
ca="$(kubectl -n "$ns" get secret cli-mcp-investigator-token -o jsonpath='{.data.ca\.crt}')"
# The credential proxy talks to the API server's own address (reachable from every pod on
# either node), as the admin kubeconfig does.
server="$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')"
private "$run/investigator.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters: [{name: cluster, cluster: {server: "$server", certificate-authority-data: "$ca"}}]
users: [{name: investigator, user: {token: "$token"}}]
contexts: [{name: investigator, context: {cluster: cluster, user: investigator}}]
current-context: investigator
KC
kubectl -n "$ns" create secret generic "cli-mcp-$name-kubeconfig" \
    --from-file=kubeconfig="$run/investigator.kubeconfig" --dry-run=client -o yaml |
    kubectl apply -f - >/dev/null

# Every instance reaches the API through its credential proxy: it alone holds the
# investigator's token and injects it; a shell in the sandbox sees a placeholder.
say "the sample CliMcpInstance (its credential proxy cli-mcp-$name-proxy holds the kubeconfig)"
kubectl -n "$ns" apply -f config/samples/cli-mcp_v1alpha1_climcpinstance.yaml
kubectl -n "$ns" wait "climcpinstance/$name" --for=condition=Ready --timeout=180s
kubectl -n "$ns" get climcpinstances

# The operator makes each instance's client identity: ServiceAccount cli-mcp-<n>-client,
# bound to a Role with exactly the verbs the server checks on this instance's
# climcpinstances/mcp (spec.server.clients adds people and groups).
client_sa="cli-mcp-$name-client"
say "the instance's client identity: ServiceAccount $client_sa (made by the operator)"
kubectl -n "$ns" get serviceaccount "$client_sa" >/dev/null
kubectl -n "$ns" get configmap "$svc-ca" -o jsonpath='{.data.ca\.crt}' >"$run/ca.crt"
# A literal token to paste: the cluster (and its signing key) lives only as long as this run,
# so the token stops working when `make run` stops.
client_token="$(kubectl -n "$ns" create token "$client_sa" --duration=24h)"
host="$svc.$ns.svc"

say "forwarding 127.0.0.1 to svc/$svc:8443 (TLS to the instance, its CA pinned)"
start_logged "$run/forward.log" "$cluster_bin" forward --kubeconfig "$KUBECONFIG" -n "$ns" "$svc" \
    --port 8443 --tls-ca "$run/ca.crt" --tls-server-name "$host"
pids+=("$start_pid")
wait_line "$run/forward.log" "$start_pid" 'CLI_MCP_FORWARD ' 30 || {
    cat "$run/forward.log" >&2
    die "the port-forward did not start (log: $run/forward.log)"
}
local_addr=$waited_line
url="http://$local_addr/mcp"
# curl has no chat, so its lines name a session; the clients' configurations do not, and the
# server gives each of their chats a shell of its own.
session=my-session-1
auth="Authorization: Bearer $client_token"

# The same configuration in the shapes clients read, also written to files to copy from.
jq -n --arg url "$url" --arg auth "Bearer $client_token" \
    '{servers: {"cli-mcp": {type: "http", url: $url, headers: {Authorization: $auth}}}}' |
    private "$run/vscode-mcp.json"
jq -n --arg url "$url" --arg auth "Bearer $client_token" \
    '{mcpServers: {"cli-mcp": {type: "http", url: $url, headers: {Authorization: $auth}}}}' |
    private "$run/mcp-servers.json"

cat <<EOF

cli-mcp is running. The MCP endpoint of instance $ns/$name (Streamable HTTP):

  $url

The forward on $local_addr speaks TLS to the instance and checks its certificate ($host,
instance CA $run/ca.crt), so clients use plain HTTP on loopback: nothing to trust, no
/etc/hosts entry. The token below is valid while this \`make run\` lives (a new cluster has
new keys). Each chat of a client configured below gets a shell of its own. To make chats
share one shell, add the header X-Session-ID with an id of your choice (e.g.
--header "X-Session-ID: shared-1" for Claude Code, "X-Session-ID": "shared-1" in the JSON).

Claude Code:

  claude mcp add --transport http cli-mcp $url --header "$auth"

VS Code (.vscode/mcp.json; also in $run/vscode-mcp.json):
$(cat "$run/vscode-mcp.json")

Cursor (~/.cursor/mcp.json) and other clients that read "mcpServers" (also in $run/mcp-servers.json):
$(cat "$run/mcp-servers.json")

Try it (runs \`kubectl get ns\` in the shell of session $session, read-only identity):

  curl -s $url -H '$auth' -H 'X-Session-ID: $session' -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' -d '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"bash","arguments":{"command":"kubectl get ns"}}}'

End the session (the next call starts a fresh shell):

  curl -s -X DELETE http://$local_addr/sessions/$session -H '$auth'

Admin access to the local cluster:  export KUBECONFIG=$KUBECONFIG
Another token:                      kubectl -n $ns create token $client_sa

Ctrl-C stops everything.
EOF
wait "${pids[0]}"
