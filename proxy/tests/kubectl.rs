//! The real `kubectl` through the proxy against the test run's real kube-apiserver, with the
//! dummy kubeconfig a sandbox gets: reads and watches work, the workload subresources are
//! refused by the proxy although the token behind it may use them.
//!
//! kubectl finds the proxy through `HTTPS_PROXY`, exactly as in a sandbox (the API server
//! listens on a host address, not loopback, so Go's proxy-from-environment applies).

mod support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader, Lines};

use cli_mcp_api::kubeconfig;
use cli_mcp_e2e::testing::{self, TestCluster, TestNamespace};
use support::cluster::{admin_kubeconfig, admin_token, cluster_ca};
use support::*;

const KUBECTL_TIMEOUT: Duration = Duration::from_secs(60);

struct World {
    _cluster: TestCluster,
    ns: TestNamespace,
    inputs: Inputs,
    proxy: Running,
    dummy: PathBuf,
    apiserver: String,
    ca_pem: String,
}

fn kubectl_bin() -> PathBuf {
    std::env::var_os("KUBECTL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("kubectl"))
}

async fn world(prefix: &str) -> World {
    let c = testing::cluster()
        .await
        .expect("the local cluster must come up (see docs/local-kubernetes.md)");
    let ns = c.namespace(prefix).await.expect("a test namespace");
    let token = admin_token(&ns, "admin").await;
    let ca_pem = cluster_ca(&c.info.kubeconfig);
    let apiserver = c.info.apiserver.clone();
    let admin = admin_kubeconfig(&apiserver, &ca_pem, &token, &ns.name);
    let kc = kubeconfig::validate(&admin).expect("a valid admin kubeconfig");
    let inputs = Inputs::new(kc.routes());
    inputs.publish_kubeconfig(&admin);
    let proxy = Running::start(inputs.config()).await;
    let dummy = inputs.dir.path().join("sandbox-kubeconfig");
    let dummy_text = kc.dummy(&inputs.ca.cert_pem);
    assert!(!dummy_text.contains(&token), "the dummy holds no token");
    std::fs::write(&dummy, dummy_text).unwrap();
    World {
        _cluster: c,
        ns,
        inputs,
        proxy,
        dummy,
        apiserver,
        ca_pem,
    }
}

/// kubectl's words for a 401.
fn unauthenticated(stderr: &str) -> bool {
    stderr.contains("Unauthorized") || stderr.contains("provide credentials")
}

struct Out {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl World {
    fn command(&self, args: &[&str], through_proxy: bool) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(kubectl_bin());
        cmd.env("KUBECONFIG", &self.dummy)
            .env_remove("NO_PROXY")
            .env_remove("no_proxy")
            .env_remove("HTTP_PROXY")
            .env_remove("http_proxy")
            .env_remove("https_proxy")
            .env("HOME", self.inputs.dir.path())
            .args(args)
            .kill_on_drop(true);
        if through_proxy {
            cmd.env("HTTPS_PROXY", self.proxy.proxy_url());
        } else {
            cmd.env_remove("HTTPS_PROXY");
        }
        cmd
    }

    async fn kubectl(&self, args: &[&str]) -> Out {
        self.kubectl_via(args, true).await
    }

    async fn kubectl_via(&self, args: &[&str], through_proxy: bool) -> Out {
        let out = tokio::time::timeout(
            KUBECTL_TIMEOUT,
            self.command(args, through_proxy)
                .stdin(Stdio::null())
                .output(),
        )
        .await
        .unwrap_or_else(|_| panic!("kubectl {} did not finish", args.join(" ")))
        .expect("run kubectl (set KUBECTL or put it in PATH)");
        Out {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// A pod bound to a node that does not exist, so nothing runs it; its status says
    /// Running so kubectl's own checks (port-forward wants a running pod) pass and the
    /// request reaches the proxy.
    async fn parked_pod(&self, name: &str) {
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": name },
            "spec": {
                "nodeName": "cli-mcp-proxy-test-no-such-node",
                "containers": [{ "name": "main", "image": "cli-mcp-shell:1",
                                 "ports": [{ "containerPort": 80 }] }]
            }
        }))
        .unwrap();
        let pods = self.ns.api::<Pod>();
        pods.create(&PostParams::default(), &pod)
            .await
            .expect("create the parked pod");
        pods.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": "Running" } })),
        )
        .await
        .expect("mark the parked pod Running");
    }
}

#[tokio::test]
async fn kubectl_reads_through_the_proxy_with_the_dummy_kubeconfig() {
    let w = world("proxy-read").await;
    let out = w.kubectl(&["get", "pods", "-o", "name"]).await;
    assert!(out.ok, "kubectl get pods: {}", out.stderr);
    let out = w.kubectl(&["auth", "can-i", "create", "pods/exec"]).await;
    assert!(
        out.ok && out.stdout.trim() == "yes",
        "the token behind the proxy may exec: {} {}",
        out.stdout,
        out.stderr
    );
    // Without the proxy the dummy kubeconfig opens nothing: its CA is the proxy's and its
    // token a placeholder.
    let out = w.kubectl_via(&["get", "pods", "-o", "name"], false).await;
    assert!(!out.ok, "the dummy kubeconfig worked without the proxy");
    // Nor does the placeholder token authenticate against the API server itself.
    let direct = admin_kubeconfig(
        &w.apiserver,
        &w.ca_pem,
        cli_mcp_api::proxy::PLACEHOLDER_TOKEN,
        &w.ns.name,
    );
    let direct_path = w.inputs.dir.path().join("placeholder-direct");
    std::fs::write(&direct_path, direct).unwrap();
    let out = tokio::process::Command::new(kubectl_bin())
        .env("KUBECONFIG", &direct_path)
        .env_remove("HTTPS_PROXY")
        .args(["get", "pods"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(unauthenticated(&stderr), "{stderr}");
    w.ns.delete().await.ok();
}

#[tokio::test]
async fn kubectl_exec_attach_port_forward_and_debug_are_refused_by_the_proxy() {
    let w = world("proxy-refuse").await;
    w.parked_pod("target").await;
    let cases: [&[&str]; 4] = [
        &["exec", "target", "--", "true"],
        &["attach", "target"],
        &["port-forward", "pod/target", "0:80"],
        &["debug", "target", "--image=cli-mcp-shell:1"],
    ];
    for args in cases {
        let out = w.kubectl(args).await;
        assert!(
            !out.ok,
            "kubectl {} succeeded: {}",
            args.join(" "),
            out.stdout
        );
        eprintln!("kubectl {}: {}", args.join(" "), out.stderr.trim());
        assert!(
            out.stderr.contains("the proxy never allows"),
            "kubectl {}: the refusal is the proxy's: {}",
            args.join(" "),
            out.stderr
        );
    }
    let m = w.proxy.metrics().await;
    assert!(
        metric(
            &m,
            "cli_mcp_proxy_refusals_total{reason=\"forbidden_subresource\"}"
        ) >= 4.0,
        "{m}"
    );
    w.ns.delete().await.ok();
}

/// Whether kubectl prints the line `name` within [`KUBECTL_TIMEOUT`].
async fn printed<R: AsyncBufRead + Unpin>(lines: &mut Lines<R>, name: &str) -> bool {
    let found = async {
        while let Ok(Some(line)) = lines.next_line().await {
            if line.trim() == name {
                return true;
            }
        }
        false
    };
    tokio::time::timeout(KUBECTL_TIMEOUT, found)
        .await
        .unwrap_or(false)
}

#[tokio::test]
async fn kubectl_get_pods_watch_streams_through_the_proxy() {
    let w = world("proxy-watch").await;
    // kubectl lists, prints what it found, then watches from the list's resourceVersion:
    // once the listed pod is printed, a pod created after it is reported by the watch,
    // whenever the watch request itself reaches the API server.
    w.parked_pod("listed").await;
    let mut child = w
        .command(&["get", "pods", "-w", "-o", "name"], true)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .expect("kubectl get pods -w");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    assert!(printed(&mut lines, "pod/listed").await, "kubectl listed");
    w.parked_pod("watched").await;
    assert!(
        printed(&mut lines, "pod/watched").await,
        "the watch event streamed through the proxy"
    );
    let _ = child.kill().await;
    w.ns.delete().await.ok();
}

#[tokio::test]
async fn kubectl_uses_a_rotated_token_without_a_proxy_restart() {
    let w = world("proxy-rotate").await;
    assert!(w.kubectl(&["get", "pods"]).await.ok);
    // A token that cannot authenticate, then a fresh valid one: kubectl's result follows
    // the file each time.
    let bad = admin_kubeconfig(&w.apiserver, &w.ca_pem, "not-a-valid-token", &w.ns.name);
    w.inputs.publish_kubeconfig(&bad);
    let out = w.kubectl(&["get", "pods"]).await;
    assert!(!out.ok && unauthenticated(&out.stderr), "{}", out.stderr);
    let fresh = admin_token(&w.ns, "admin").await;
    w.inputs.publish_kubeconfig(&admin_kubeconfig(
        &w.apiserver,
        &w.ca_pem,
        &fresh,
        &w.ns.name,
    ));
    let out = w.kubectl(&["get", "pods"]).await;
    assert!(out.ok, "{}", out.stderr);
    w.ns.delete().await.ok();
}
