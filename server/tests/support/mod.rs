//! Test support: run the real `cli-mcp-server` binary, talk MCP to it over HTTP.
// Each test binary uses a part of this module.
#![allow(dead_code, unused_imports)]

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use cli_mcp_e2e::child::LocalServer;
use cli_mcp_e2e::{http, jsonrpc};
use serde_json::{json, Value};

pub use cli_mcp_e2e::jsonrpc::{is_error, structured, text, ACCEPT};

pub const SERVER_BIN: &str = env!("CARGO_BIN_EXE_cli-mcp-server");

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

/// A running server process (`cli_mcp_e2e::child::LocalServer`: its address, health
/// address, log, `url`, `health_url`, `log_text`); SIGTERM on drop.
pub struct Server(LocalServer);

impl Deref for Server {
    type Target = LocalServer;
    fn deref(&self) -> &LocalServer {
        &self.0
    }
}

impl Server {
    /// Starts the server with `args` (plus `--listen 127.0.0.1:0 --health-listen
    /// 127.0.0.1:0 --log-json`) and waits for its ready line.
    pub async fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
        match LocalServer::start(Path::new(SERVER_BIN), args, env, "info,rmcp=warn").await {
            Ok(s) => Server(s),
            Err(e) => panic!("cli-mcp-server did not become ready: {e}"),
        }
    }

    /// Waits (on log events, no polling) for a log line matching `pred`.
    pub async fn wait_log(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        match self.log.wait_for(Duration::from_secs(60), pred).await {
            Some(line) => line,
            None => panic!("no log line {what} within 60s; log:\n{}", self.log_text()),
        }
    }

    /// SIGTERM and wait for the exit status.
    pub async fn stop(self) -> std::process::ExitStatus {
        self.0
            .stop(Duration::from_secs(40))
            .await
            .expect("server exits after SIGTERM")
            .expect("wait for server")
    }
}

pub fn http() -> reqwest::Client {
    http::client(None).build().expect("HTTP client")
}

/// A client trusting `ca_pem` (the test's self-signed serving certificate).
pub fn https(ca_pem: &str) -> reqwest::Client {
    http::client(Some(ca_pem)).build().expect("HTTPS client")
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
        let resp = jsonrpc::post(
            &self.http,
            &self.url,
            self.session.as_deref(),
            self.bearer.as_deref(),
        )
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("POST /mcp");
        let status = resp.status();
        let text = resp.text().await.expect("body");
        let body = serde_json::from_str(&text).unwrap_or(Value::Null);
        Answer { status, body, text }
    }

    pub async fn rpc(&self, method: &str, params: Value) -> Answer {
        self.post_raw(jsonrpc::request(method, params).to_string())
            .await
    }

    /// `tools/call` of bash; returns the JSON-RPC `result`.
    pub async fn bash(&self, command: &str) -> Value {
        self.bash_with(json!({ "command": command })).await
    }

    pub async fn bash_with(&self, arguments: Value) -> Value {
        let a = self.post_raw(jsonrpc::bash(arguments).to_string()).await;
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
