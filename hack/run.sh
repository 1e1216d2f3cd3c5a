#!/usr/bin/env bash
# `make run`: the whole product on the local Kubernetes, in the foreground until Ctrl-C.
#
#   1. builds what is missing (control plane from the Go module proxy, cached; our binaries);
#   2. brings up the local Kubernetes (real control plane + process kubelet);
#   3. installs the operator from config/default, as an admin would;
#   4. creates namespace cli-mcp-demo with a read-only investigation kubeconfig Secret and the
#      sample CliMcpInstance `demo`, and waits for it to be Ready;
#   5. creates a client identity allowed to use the instance, forwards a loopback port to the
#      MCP Service and prints a ready-to-paste MCP client configuration and a curl one-liner.
#
# Everything it writes stays under .run/ (gitignored). Needs root (network namespaces).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
run="$root/.run/quickstart"
ns=cli-mcp-demo
name=demo
svc="cli-mcp-$name"
mkdir -p "$run"

say() { printf '\n==> %s\n' "$*"; }
die() { printf '\nmake run: %s\n' "$*" >&2; exit 1; }

say "building (the control plane is built once, ~8 min, then cached)"
make --no-print-directory control-plane
cargo build --workspace --bins
target="${CARGO_TARGET_DIR:-$root/target}"
cluster_bin="$target/debug/cli-mcp-cluster"

pids=()
cleanup() {
    trap - EXIT INT TERM
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    echo "make run: stopped; the cluster is gone."
}
trap cleanup EXIT
# Stopping is what the user asked for: exit 0, so `make` does not report an error for it.
trap 'cleanup; exit 0' INT TERM

say "starting the local Kubernetes"
"$cluster_bin" up >"$run/cluster.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do
    grep -q '^CLI_MCP_READY ' "$run/cluster.log" && break
    kill -0 "${pids[0]}" 2>/dev/null || { tail -20 "$run/cluster.log" >&2; die "the cluster did not start (log: $run/cluster.log)"; }
    sleep 0.5
done
grep -q '^CLI_MCP_READY ' "$run/cluster.log" || die "the cluster was not ready within 150 s (log: $run/cluster.log)"
export KUBECONFIG="$root/.run/cluster/kubeconfig"
kubectl get nodes

say "installing the operator (kustomize: config/default)"
kubectl kustomize config/default | kubectl apply --server-side -f - >/dev/null
kubectl -n cli-mcp-system rollout status deployment/cli-mcp-operator --timeout=180s

say "namespace $ns: read-only investigation identity and its kubeconfig Secret"
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl -n "$ns" apply -f config/samples/investigation-kubeconfig.yaml >/dev/null
for _ in $(seq 1 120); do
    token="$(kubectl -n "$ns" get secret cli-mcp-investigator-token -o jsonpath='{.data.token}' 2>/dev/null | base64 -d)"
    [[ -n "$token" ]] && break
    sleep 0.5
done
[[ -n "${token:-}" ]] || die "the investigator token was never issued"
ca="$(kubectl -n "$ns" get secret cli-mcp-investigator-token -o jsonpath='{.data.ca\.crt}')"
# The local cluster has no cluster DNS or kube-proxy: the sandbox talks to the API server's
# own address (reachable from every pod), which is what the admin kubeconfig uses too.
server="$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')"
cat >"$run/investigator.kubeconfig" <<KC
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

say "the sample CliMcpInstance"
kubectl -n "$ns" apply -f config/samples/cli-mcp_v1alpha1_climcpinstance.yaml
kubectl -n "$ns" wait "climcpinstance/$name" --for=condition=Ready --timeout=180s
kubectl -n "$ns" get climcpinstances

say "a client identity allowed to use instance $name (verbs on climcpinstances/mcp)"
kubectl -n "$ns" apply -f - >/dev/null <<YAML
apiVersion: v1
kind: ServiceAccount
metadata: {name: mcp-client}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: mcp-client}
rules:
  - apiGroups: [cli-mcp.redhat.com]
    resources: [climcpinstances/mcp]
    resourceNames: [$name]
    verbs: [get, create, delete]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: mcp-client}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: mcp-client}
subjects: [{kind: ServiceAccount, name: mcp-client, namespace: $ns}]
YAML
kubectl -n "$ns" get configmap "$svc-ca" -o jsonpath='{.data.ca\.crt}' >"$run/ca.crt"

say "forwarding a loopback port to svc/$svc:8443"
"$cluster_bin" forward --kubeconfig "$KUBECONFIG" -n "$ns" "$svc" --port 8443 >"$run/forward.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 60); do
    grep -q '^CLI_MCP_FORWARD ' "$run/forward.log" && break
    kill -0 "${pids[1]}" 2>/dev/null || { cat "$run/forward.log" >&2; die "the port-forward failed"; }
    sleep 0.5
done
local_addr="$(sed -n 's/^CLI_MCP_FORWARD //p' "$run/forward.log")"
[[ -n "$local_addr" ]] || die "the port-forward did not start (log: $run/forward.log)"
port="${local_addr##*:}"
host="$svc.$ns.svc"
url="https://$host:$port/mcp"

cat <<EOF

cli-mcp is running. The MCP endpoint of instance $ns/$name is forwarded to $local_addr.
The serving certificate is for $host, signed by the instance CA in $run/ca.crt.

  kubeconfig   export KUBECONFIG=$KUBECONFIG
  token        kubectl -n $ns create token mcp-client
  name         add to /etc/hosts for MCP clients:   127.0.0.1 $host

MCP client configuration (Streamable HTTP):
{
  "mcpServers": {
    "cli-mcp": {
      "type": "http",
      "url": "$url",
      "headers": {
        "Authorization": "Bearer <output of: kubectl -n $ns create token mcp-client>",
        "X-Session-ID": "my-session-1"
      }
    }
  }
}
(the client must trust $run/ca.crt, e.g. NODE_EXTRA_CA_CERTS=$run/ca.crt)

Try it (runs \`kubectl get ns\` in your sandbox, read-only identity):

  curl -s --cacert $run/ca.crt --resolve $host:$port:127.0.0.1 $url \\
    -H "Authorization: Bearer \$(KUBECONFIG=$KUBECONFIG kubectl -n $ns create token mcp-client)" \\
    -H 'X-Session-ID: my-session-1' -H 'Content-Type: application/json' \\
    -H 'Accept: application/json, text/event-stream' \\
    -d '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"bash","arguments":{"command":"kubectl get ns"}}}'

End a session:  curl -s -X DELETE --cacert $run/ca.crt --resolve $host:$port:127.0.0.1 \\
    -H "Authorization: Bearer \$(kubectl -n $ns create token mcp-client)" https://$host:$port/sessions/my-session-1

Ctrl-C stops everything.
EOF
wait "${pids[0]}"
