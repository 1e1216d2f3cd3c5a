//! Test support: run the real `cli-mcp-server` binary, talk MCP to it over HTTP.
// Each test binary uses a part of this module.
#![allow(dead_code, unused_imports)]

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use cli_mcp_e2e::child::LocalServer;
use cli_mcp_e2e::testing::TestNamespace;
use cli_mcp_e2e::{http, jsonrpc};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{ObjectMeta, PostParams};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair, SanType,
};
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
        for v in cli_mcp_e2e::workspace::cargo_test_env() {
            cmd.env_remove(v);
        }
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

/// A test CA (its PEM, and the same in `ca.crt` of its directory) that signs serving
/// certificates for 127.0.0.1, so a client trusts one PEM for every server of a test.
pub struct Pki {
    pub ca_pem: String,
    pub ca_file: PathBuf,
    issuer: Issuer<'static, KeyPair>,
    dir: PathBuf,
}

impl Pki {
    pub fn new(dir: &Path) -> Pki {
        let ca_key = KeyPair::generate().expect("key");
        let mut ca = CertificateParams::default();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // Distinct names: OpenSSL (the Python SDK's TLS) takes a leaf whose subject equals
        // its issuer for a self-signed certificate.
        ca.distinguished_name = DistinguishedName::new();
        ca.distinguished_name
            .push(DnType::CommonName, "cli-mcp test CA");
        let ca_cert = ca.self_signed(&ca_key).expect("CA");
        let ca_file = dir.join("ca.crt");
        std::fs::write(&ca_file, ca_cert.pem()).expect("write CA");
        Pki {
            ca_pem: ca_cert.pem(),
            ca_file,
            issuer: Issuer::new(ca, ca_key),
            dir: dir.to_path_buf(),
        }
    }

    /// A serving certificate for 127.0.0.1 and localhost, as `<name>.crt` and `<name>.key`:
    /// (cert file, key file).
    pub fn leaf(&self, name: &str) -> (String, String) {
        let key = KeyPair::generate().expect("key");
        let mut leaf = CertificateParams::new(vec!["localhost".to_string()]).expect("params");
        leaf.distinguished_name = DistinguishedName::new();
        leaf.distinguished_name.push(DnType::CommonName, name);
        leaf.subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        let cert = leaf.signed_by(&key, &self.issuer).expect("leaf");
        let cert_path = self.dir.join(format!("{name}.crt"));
        let key_path = self.dir.join(format!("{name}.key"));
        std::fs::write(&cert_path, cert.pem()).expect("write cert");
        std::fs::write(&key_path, key.serialize_pem()).expect("write key");
        (
            cert_path.display().to_string(),
            key_path.display().to_string(),
        )
    }
}

/// A Role `name` with `verbs` on climcpinstances/mcp of `instance`, bound to `subjects`.
pub async fn grant_mcp(
    ns: &TestNamespace,
    name: &str,
    instance: &str,
    verbs: &[&str],
    subjects: Vec<Subject>,
) {
    let meta = ObjectMeta {
        name: Some(name.into()),
        ..Default::default()
    };
    let role = Role {
        metadata: meta.clone(),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec!["cli-mcp.redhat.com".into()]),
            resources: Some(vec!["climcpinstances/mcp".into()]),
            resource_names: Some(vec![instance.into()]),
            verbs: verbs.iter().map(|v| v.to_string()).collect(),
            ..Default::default()
        }]),
    };
    ns.api::<Role>()
        .create(&PostParams::default(), &role)
        .await
        .expect("create Role");
    let binding = RoleBinding {
        metadata: meta,
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: name.into(),
        },
        subjects: Some(subjects),
    };
    ns.api::<RoleBinding>()
        .create(&PostParams::default(), &binding)
        .await
        .expect("create RoleBinding");
}

/// A FIFO in a fresh temporary directory, for a command to say it has started.
pub fn fifo() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("started");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    (dir, fifo)
}

/// Waits until `pid` no longer runs, up to `within`; how long that took, or an error that
/// says it still runs (the process is then SIGKILLed, so a failed test leaves nothing).
pub async fn gone_within(pid: i32, within: Duration) -> Result<Duration, String> {
    let t0 = std::time::Instant::now();
    loop {
        if !cli_mcp_e2e::process::running(pid) {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() >= within {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            return Err(format!(
                "process {pid} still runs {within:?} later (now killed)"
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The command a cancel test starts: it writes its pid to `fifo` once it runs, sleeps 30 s,
/// and then (only if it was not interrupted) creates `marker`.
pub fn long_command(fifo: &Path, marker: &Path) -> String {
    format!(
        "sh -c 'echo $$ > {}; exec sleep 30' && touch {}",
        fifo.display(),
        marker.display()
    )
}

/// Seals a sandbox pod just created by a test, as its writer (the operator for a pool pod,
/// the server for a session pod) does right after its create: sandbox pods are trusted by
/// their seal, bound to the uid the API server gave `created`. Returns the sealed pod.
pub async fn seal_pod(
    pods: &kube::Api<k8s_openapi::api::core::v1::Pod>,
    created: &k8s_openapi::api::core::v1::Pod,
    key: &cli_mcp_api::token::HmacKey,
) -> k8s_openapi::api::core::v1::Pod {
    use kube::ResourceExt;
    let seal = cli_mcp_api::seal::seal_for(created, key).expect("a created pod has a uid");
    let patch = json!({"metadata": {
        "uid": created.uid(),
        "annotations": {cli_mcp_api::names::annotation::SEAL: seal},
    }});
    pods.patch(
        &created.name_any(),
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    )
    .await
    .expect("seal the pod")
}
