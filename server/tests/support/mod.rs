//! Test support: run the real `cli-mcp-server` binary, talk MCP to it over HTTP.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub const SERVER_BIN: &str = env!("CARGO_BIN_EXE_cli-mcp-server");
pub const ACCEPT: &str = "application/json, text/event-stream";

/// `target/debug` (where cargo put the server binary).
pub fn bin_dir() -> PathBuf {
    Path::new(SERVER_BIN)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

pub fn agent_bin() -> PathBuf {
    bin_dir().join("cli-mcp-agent")
}

/// Builds the other binaries the tests run (the agent; for cluster tests also the cluster
/// harness and kubelet), once per test process. `cargo test -p cli-mcp-server` alone does not
/// build them. A failed build is fatal only when the binaries do not exist at all.
pub fn ensure_built(cluster: bool) {
    static AGENT: OnceLock<()> = OnceLock::new();
    static CLUSTER: OnceLock<()> = OnceLock::new();
    let (cell, packages, bins): (&OnceLock<()>, &[&str], &[&str]) = if cluster {
        (
            &CLUSTER,
            &["cli-mcp-agent", "cli-mcp-e2e", "cli-mcp-kubelet"],
            &["cli-mcp-agent", "cli-mcp-cluster", "cli-mcp-kubelet"],
        )
    } else {
        (&AGENT, &["cli-mcp-agent"], &["cli-mcp-agent"])
    };
    cell.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = std::process::Command::new(cargo);
        cmd.arg("build");
        for p in packages {
            cmd.arg("-p").arg(p);
        }
        cmd.arg("--bins");
        let out = cmd.output();
        let ok = out.as_ref().is_ok_and(|o| o.status.success());
        let missing: Vec<_> = bins.iter().filter(|b| !bin_dir().join(b).is_file()).collect();
        if !ok {
            let detail = match &out {
                Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            assert!(
                missing.is_empty(),
                "cannot build {packages:?} and {missing:?} do not exist:\n{detail}"
            );
            eprintln!("warning: `cargo build` of {packages:?} failed; using the existing binaries:\n{detail}");
        }
    });
}

/// A running server process; SIGTERM on drop.
pub struct Server {
    pub child: Child,
    pub addr: String,
    pub health: String,
    pub log: Arc<Mutex<VecDeque<String>>>,
    pub log_event: Arc<tokio::sync::Notify>,
    pub scheme: &'static str,
}

impl Server {
    /// Starts the server with `args` (plus `--listen 127.0.0.1:0 --health-listen
    /// 127.0.0.1:0 --log-json`) and waits for its ready line.
    pub async fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(SERVER_BIN);
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--health-listen",
            "127.0.0.1:0",
            "--log-json",
        ])
        .args(args)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("RUST_LOG", "info,rmcp=warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start cli-mcp-server");
        let stderr = child.stderr.take().expect("stderr pipe");
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, rx) = tokio::sync::oneshot::channel::<(String, String)>();
        let log2 = log.clone();
        let log_event = Arc::new(tokio::sync::Notify::new());
        let event2 = log_event.clone();
        tokio::spawn(async move {
            let mut tx = Some(tx);
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    if v["message"] == "cli-mcp-server ready" {
                        if let Some(tx) = tx.take() {
                            let _ = tx.send((
                                v["listen"].as_str().unwrap_or_default().to_owned(),
                                v["health_listen"].as_str().unwrap_or_default().to_owned(),
                            ));
                        }
                    }
                }
                let mut l = log2.lock().unwrap_or_else(|p| p.into_inner());
                if l.len() > 2000 {
                    l.pop_front();
                }
                l.push_back(line);
                drop(l);
                event2.notify_waiters();
            }
        });
        let ready = tokio::time::timeout(Duration::from_secs(30), rx).await;
        let (addr, health) = match ready {
            Ok(Ok(a)) => a,
            _ => panic!(
                "cli-mcp-server did not become ready; its log:\n{}",
                log.lock()
                    .map(|l| l.iter().cloned().collect::<Vec<_>>().join("\n"))
                    .unwrap_or_default()
            ),
        };
        let scheme = if args.contains(&"--tls-cert") {
            "https"
        } else {
            "http"
        };
        Server {
            child,
            addr,
            health,
            log,
            log_event,
            scheme,
        }
    }

    /// Waits (on log events, no polling) for a log line matching `pred`.
    pub async fn wait_log(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let wait = async {
            loop {
                let notified = self.log_event.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let found = self
                    .log
                    .lock()
                    .ok()
                    .and_then(|l| l.iter().find(|l| pred(l)).cloned());
                if let Some(line) = found {
                    return line;
                }
                notified.await;
            }
        };
        match tokio::time::timeout(Duration::from_secs(60), wait).await {
            Ok(line) => line,
            Err(_) => panic!("no log line {what} within 60s; log:\n{}", self.log_text()),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}://{}{path}", self.scheme, self.addr)
    }

    pub fn health_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.health)
    }

    pub fn log_text(&self) -> String {
        self.log
            .lock()
            .map(|l| l.iter().cloned().collect::<Vec<_>>().join("\n"))
            .unwrap_or_default()
    }

    /// SIGTERM and wait for the exit status.
    pub async fn stop(mut self) -> std::process::ExitStatus {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status();
        }
        tokio::time::timeout(Duration::from_secs(40), self.child.wait())
            .await
            .expect("server exits after SIGTERM")
            .expect("wait for server")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status();
        }
    }
}

pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("HTTP client")
}

/// A client trusting `ca_pem` (the test's self-signed serving certificate).
pub fn https(ca_pem: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(120))
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).expect("CA PEM"))
        .build()
        .expect("HTTPS client")
}

/// A raw JSON-RPC MCP client over reqwest.
#[derive(Clone)]
pub struct Mcp {
    pub http: reqwest::Client,
    pub url: String,
    pub session: Option<String>,
    pub bearer: Option<String>,
}

/// One HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: reqwest::StatusCode,
    pub body: Value,
    pub text: String,
}

impl Mcp {
    pub fn new(server: &Server, session: Option<&str>) -> Self {
        Self {
            http: http(),
            url: server.url("/mcp"),
            session: session.map(str::to_owned),
            bearer: None,
        }
    }

    pub fn with_bearer(mut self, token: &str) -> Self {
        self.bearer = Some(token.to_owned());
        self
    }

    pub fn session(&self, sid: &str) -> Self {
        Self {
            session: Some(sid.to_owned()),
            ..self.clone()
        }
    }

    pub async fn post_raw(&self, body: String) -> Answer {
        let mut req = self
            .http
            .post(&self.url)
            .header("content-type", "application/json")
            .header("accept", ACCEPT)
            .body(body);
        if let Some(s) = &self.session {
            req = req.header("x-session-id", s);
        }
        if let Some(b) = &self.bearer {
            req = req.bearer_auth(b);
        }
        let resp = req.send().await.expect("POST /mcp");
        let status = resp.status();
        let text = resp.text().await.expect("body");
        let body = serde_json::from_str(&text).unwrap_or(Value::Null);
        Answer { status, body, text }
    }

    pub async fn rpc(&self, method: &str, params: Value) -> Answer {
        self.post_raw(
            json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string(),
        )
        .await
    }

    /// `tools/call` of bash; returns the JSON-RPC `result`.
    pub async fn bash(&self, command: &str) -> Value {
        self.bash_with(json!({ "command": command })).await
    }

    pub async fn bash_with(&self, arguments: Value) -> Value {
        let a = self
            .rpc(
                "tools/call",
                json!({"name": "bash", "arguments": arguments}),
            )
            .await;
        assert_eq!(
            a.status, 200,
            "tools/call answered {}: {}",
            a.status, a.text
        );
        a.body
            .get("result")
            .cloned()
            .unwrap_or_else(|| panic!("no result in {}", a.text))
    }
}

/// Text of a tool result.
pub fn text(result: &Value) -> String {
    result["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

pub fn is_error(result: &Value) -> bool {
    result["isError"].as_bool().unwrap_or(false)
}

pub fn structured(result: &Value) -> &Value {
    &result["structuredContent"]
}
