#!/usr/bin/env bash
# `make run`: the whole product on the local Kubernetes, in the foreground until Ctrl-C.
#
#   1. installs and sets what the host lacks (hack/prereqs.sh: apt packages, IPv4 forwarding,
#      the unreachable routes for the pod and Service ranges), prints a line per step it takes;
#   2. builds what is missing (control plane from the Go module proxy, cached; our binaries);
#   3. brings up the local Kubernetes: a real control plane and, by default, the real node
#      (kubelet + kube-proxy on containerd/runc) with its own OCI registry (TLS on loopback)
#      and the operator, server, proxy and sandbox images built from those binaries
#      (hack/build-images.sh, cached outside the repo); CLI_MCP_NODE=process runs pods as host
#      processes instead (faster to start, nothing to build);
#   4. on the real node, publishes a release to that registry as a release is published
#      (make publish: images, chart and bundle image pushed, the manifests pinned to their
#      digests, written to .run/quickstart/published) and installs the operator from those
#      manifests, as an admin would: the node pulls every image by digest. On the process
#      kubelet it installs config/default as it is (image names map to the binaries);
#   5. creates namespace cli-mcp-demo with a read-only investigation kubeconfig Secret and the
#      sample CliMcpInstance `demo` — behind its credential proxy, which alone holds that
#      kubeconfig's token (a sandbox sees a placeholder) — and, beside it, the instance
#      `as-caller` of config/samples/as-caller, whose proxy holds the same kubeconfig but
#      impersonates each session's MCP caller (identity: impersonateCaller, with the RBAC for
#      it); waits for both to be Ready. On the real node their sandboxes run under gVisor
#      (RuntimeClass `gvisor`, a user-space kernel between the shell and the host's) when the
#      host can run it; CLI_MCP_RUNTIME=runc keeps runc, and a host where gVisor cannot run
#      falls back to runc, saying why;
#   6. creates a client identity allowed to use each instance, forwards a loopback port to each
#      MCP Service (plain HTTP on 127.0.0.1, TLS to the instance with its CA pinned) and prints
#      ready-to-paste MCP client configurations of `demo` with a literal token, a curl
#      one-liner for each instance (`as-caller`'s runs `kubectl auth whoami`: the caller and
#      the session), and how to read the proxy's audit log (who did what, in which session).
#
# Everything it writes stays under .run/ (gitignored). Needs root (network namespaces).
# Logs: .run/quickstart/cluster.log (and forward.log, forward-as-caller.log), each new for
# every run; the previous run's is kept as cluster.log.prev. A run started while the previous
# one is still tearing down waits for it (the cluster's run-dir lock).
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
# The second sample instance, whose sandboxes act as their caller (config/samples/as-caller).
as_name=as-caller
as_svc="cli-mcp-$as_name"
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
runtime="${CLI_MCP_RUNTIME:-gvisor}"
case "$runtime" in
gvisor | runc) ;;
*) printf 'make run: CLI_MCP_RUNTIME=%s: expected gvisor or runc\n' "$runtime" >&2; exit 2 ;;
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

# The sandboxes' runtime: gVisor when asked for (the default) and the node has it. The
# cluster registers it only where `runsc` runs here, and says why not in its log otherwise.
runtime_note="runc (CLI_MCP_RUNTIME=runc)"
if [[ $node == process ]]; then
    runtime=runc
    runtime_note="host processes (CLI_MCP_NODE=process)"
elif [[ $runtime == gvisor ]]; then
    if kubectl get runtimeclass gvisor >/dev/null 2>&1; then
        runtime_note="gVisor (RuntimeClass gvisor): \`uname -r\` in a session prints its kernel, 4.19.0-gvisor"
    else
        why="$(grep -m1 -o 'gVisor unavailable.*' "$run/cluster.log" || echo 'no RuntimeClass gvisor')"
        printf '\nmake run: sandboxes fall back to runc: %s\n' "$why" >&2
        runtime=runc
        runtime_note="runc (gVisor cannot run on this host: $why)"
    fi
fi

manifests="$root" shown=config/default
if [[ $node == real ]]; then
    registry="$(jq -r '.registry.host // empty' "$cluster_json")"
    [[ -n $registry ]] || die "the real node names no image registry in $cluster_json"
    say "publishing the release to the node's registry $registry/release (make publish; log: $run/publish.log)"
    images_dir="$(CLI_MCP_BIN_DIR="$target/debug" hack/build-images.sh 2>>"$run/publish.log" | tail -n1)"
    REGISTRY="$registry/release" REGISTRY_CA="$(jq -r .registry.ca "$cluster_json")" \
        CLI_MCP_IMAGES_DIR="$images_dir" PUBLISH_OUT="$run/published" \
        hack/publish.sh >>"$run/publish.log" 2>&1 || die "make publish failed (log: $run/publish.log)"
    manifests="$run/published" shown="$run/published/config/default (images by digest from $registry/release)"
fi
say "installing the operator (kustomize: $shown)"
kubectl kustomize "$manifests/config/default" | kubectl apply --server-side -f - >/dev/null
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
for n in "$name" "$as_name"; do
    kubectl -n "$ns" create secret generic "cli-mcp-$n-kubeconfig" \
        --from-file=kubeconfig="$run/investigator.kubeconfig" --dry-run=client -o yaml |
        kubectl apply -f - >/dev/null
done

# Every instance reaches the API through its credential proxy: it alone holds the
# investigator's token and injects it; a shell in the sandbox sees a placeholder. The proxy of
# `as-caller` impersonates each session's caller with it (config/samples/as-caller/rbac.yaml
# lets the investigator impersonate that instance's client, and lets the client read).
say "the sample CliMcpInstances: $name (its credential proxy $svc-proxy holds the kubeconfig),
    and $as_name, whose proxy acts as each session's caller (config/samples/as-caller)"
# apply_sample FILE: the sample instance of FILE, its sandboxes under the chosen runtime.
apply_sample() {
    if [[ $runtime == gvisor ]]; then
        kubectl -n "$ns" create --dry-run=client -o json -f "$1" |
            jq '.spec.sandbox.runtimeClassName = "gvisor"' | kubectl -n "$ns" apply -f -
    else
        kubectl -n "$ns" apply -f "$1"
    fi
}
say "sandboxes run under $runtime_note"
apply_sample config/samples/cli-mcp_v1alpha1_climcpinstance.yaml
kubectl -n "$ns" apply -f config/samples/as-caller/rbac.yaml >/dev/null
apply_sample config/samples/as-caller/climcpinstance.yaml
# Both start at once; one wait, one deadline for both.
kubectl -n "$ns" wait "climcpinstance/$name" "climcpinstance/$as_name" --for=condition=Ready --timeout=240s
kubectl -n "$ns" get climcpinstances

# The operator makes each instance's client identity: ServiceAccount cli-mcp-<n>-client,
# bound to a Role with exactly the verbs the server checks on this instance's
# climcpinstances/mcp (spec.server.clients adds people and groups).
client_sa="cli-mcp-$name-client"
as_client_sa="cli-mcp-$as_name-client"
say "the instances' client identities: ServiceAccounts $client_sa and $as_client_sa (made by the operator)"
kubectl -n "$ns" get serviceaccount "$client_sa" "$as_client_sa" >/dev/null
# A literal token to paste: the cluster (and its signing key) lives only as long as this run,
# so the token stops working when `make run` stops.
client_token="$(kubectl -n "$ns" create token "$client_sa" --duration=24h)"
as_client_token="$(kubectl -n "$ns" create token "$as_client_sa" --duration=24h)"
host="$svc.$ns.svc"

# forward_instance SVC CA LOG: forwards a loopback port to svc/SVC:8443, TLS to the instance
# with its CA (written to CA) pinned, logging to LOG; sets forwarded to the local address.
forward_instance() {
    local svc=$1 ca=$2 log=$3
    say "forwarding 127.0.0.1 to svc/$svc:8443 (TLS to the instance, its CA pinned)"
    kubectl -n "$ns" get configmap "$svc-ca" -o jsonpath='{.data.ca\.crt}' >"$ca"
    start_logged "$log" "$cluster_bin" forward --kubeconfig "$KUBECONFIG" -n "$ns" "$svc" \
        --port 8443 --tls-ca "$ca" --tls-server-name "$svc.$ns.svc"
    pids+=("$start_pid")
    wait_line "$log" "$start_pid" 'CLI_MCP_FORWARD ' 30 || {
        cat "$log" >&2
        die "the port-forward did not start (log: $log)"
    }
    forwarded=$waited_line
}
forward_instance "$svc" "$run/ca.crt" "$run/forward.log"
local_addr=$forwarded
url="http://$local_addr/mcp"
forward_instance "$as_svc" "$run/$as_name-ca.crt" "$run/forward-$as_name.log"
as_url="http://$forwarded/mcp"
# curl has no chat, so its lines name a session; the clients' configurations do not, and the
# server gives each of their chats a shell of its own.
session=my-session-1
auth="Authorization: Bearer $client_token"
as_session=my-session-2
as_auth="Authorization: Bearer $as_client_token"

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

Its sandboxes run under $runtime_note.

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

Instance $ns/$as_name acts as its caller: its proxy impersonates the MCP client
(ServiceAccount $as_client_sa here) with the session id, so the cluster's RBAC
decides and its audit log names the person. Its endpoint, and \`kubectl auth whoami\` in the
shell of session $as_session:

  $as_url

  curl -s $as_url -H '$as_auth' -H 'X-Session-ID: $as_session' -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' -d '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"bash","arguments":{"command":"kubectl auth whoami -o json"}}}'

Admin access to the local cluster:  export KUBECONFIG=$KUBECONFIG
Another token:                      kubectl -n $ns create token $client_sa
Who did what, with that KUBECONFIG: the audit log of $name's proxies, a JSON line per request:

  kubectl -n $ns logs -l cli-mcp.redhat.com/instance=$name,cli-mcp.redhat.com/component=proxy --prefix --tail=-1 | grep '"outcome"'

Ctrl-C stops everything.
EOF
wait "${pids[0]}"
