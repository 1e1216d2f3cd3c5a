//! The official MCP SDKs against the real server (local backend, loopback): the Python SDK
//! (`mcp` from PyPI) and the TypeScript SDK (`@modelcontextprotocol/sdk`, and its successor
//! package `@modelcontextprotocol/client`, which adds protocol 2026-07-28), each as a client
//! script committed under `server/tests/sdk/`.
//!
//! The scripts print what the SDK saw as JSON; the checks are here. The SDKs are installed
//! once per lock file into `$CLI_MCP_CACHE/mcp-sdk/` (default `/var/cache/cli-mcp`), outside
//! the repository, so a clean checkout installs them once and later runs reuse them.

mod support;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use sha2::{Digest as _, Sha256};
use tokio::process::Command;
use tokio::sync::OnceCell;

use cli_mcp_e2e::child::LocalServer;
use support::Server;

const INSTALL_TIMEOUT: Duration = Duration::from_secs(600);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

/// Text an admin gives with `--instructions` (the operator renders it from
/// `spec.server.instructions`); the SDKs must receive it as sent.
const ADMIN_INSTRUCTIONS: &str =
    "This sandbox has kubectl (context `prod-readonly`, read only) and jq.\nInvestigate; never apply.";

fn sdk_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk")
}

fn cache_root() -> PathBuf {
    let base = std::env::var_os("CLI_MCP_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/cli-mcp"));
    base.join("mcp-sdk")
}

/// Runs `cmd` to completion within `limit`; its output, or an error naming `what`.
async fn run(
    mut cmd: Command,
    what: &str,
    limit: Duration,
) -> Result<std::process::Output, String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|e| format!("cannot run {what}: {e}"))?;
    match tokio::time::timeout(limit, child.wait_with_output()).await {
        Err(_) => Err(format!("{what} did not finish within {limit:?}")),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Ok(Ok(out)) => Ok(out),
    }
}

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// The first line of `<program> <args>`'s output (a version), part of the cache key: a
/// venv or node_modules belongs to the interpreter that made it.
async fn version_of(program: &str, args: &[&str], hint: &str) -> Result<String, String> {
    let mut cmd = Command::new(program);
    cmd.args(args);
    let out = run(cmd, program, Duration::from_secs(30))
        .await
        .map_err(|e| format!("{e}; {hint}"))?;
    if !out.status.success() {
        return Err(format!("`{program} {}` failed; {hint}", args.join(" ")));
    }
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok(text.lines().next().unwrap_or_default().trim().to_owned())
}

fn key(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex::encode(h.finalize())[..16].to_owned()
}

/// Holds the cross-process lock of one cache entry (released when dropped, also when the
/// process dies, so a killed install never leaves the cache locked).
struct CacheLock(#[allow(dead_code)] std::fs::File);

async fn lock(path: PathBuf) -> Result<CacheLock, String> {
    tokio::task::spawn_blocking(move || {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot open the lock file {}: {e}", path.display()))?;
        file.lock()
            .map_err(|e| format!("cannot lock {}: {e}", path.display()))?;
        Ok(CacheLock(file))
    })
    .await
    .map_err(|e| format!("lock task failed: {e}"))?
}

/// Makes the cache entry `dir` with `install` unless a complete one is there. Only a
/// finished install writes the marker, so an interrupted one is redone.
async fn cached<F, Fut>(dir: PathBuf, install: F) -> Result<PathBuf, String>
where
    F: FnOnce(PathBuf) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let root = dir.parent().map(Path::to_path_buf).unwrap_or_default();
    std::fs::create_dir_all(&root)
        .map_err(|e| format!("cannot create the SDK cache {}: {e}", root.display()))?;
    let _lock = lock(dir.with_extension("lock")).await?;
    let marker = dir.join(".complete");
    if marker.is_file() {
        return Ok(dir);
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)
            .map_err(|e| format!("cannot remove the partial install {}: {e}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    install(dir.clone()).await?;
    std::fs::write(&marker, b"").map_err(|e| format!("cannot write {}: {e}", marker.display()))?;
    Ok(dir)
}

fn python() -> String {
    std::env::var("CLI_MCP_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// A venv with the pinned Python SDK; returns its interpreter.
async fn python_sdk() -> Result<PathBuf, String> {
    let python = python();
    let requirements = sdk_dir().join("python/requirements.txt");
    let pins = std::fs::read(&requirements)
        .map_err(|e| format!("cannot read {}: {e}", requirements.display()))?;
    let version = version_of(
        &python,
        &["--version"],
        "the Python SDK test needs python3 >= 3.10 with venv (hack/prereqs.sh installs python3-venv)",
    )
    .await?;
    let dir = cache_root().join(format!("python-{}", key(&[&pins, version.as_bytes()])));
    let dir = cached(dir, |dir| async move {
        let mut venv = Command::new(&python);
        venv.args(["-m", "venv"]).arg(&dir);
        let out = run(venv, "python3 -m venv", Duration::from_secs(120)).await?;
        if !out.status.success() {
            return Err(format!(
                "`{python} -m venv {}` failed (on Debian: apt-get install python3-venv, which \
                 hack/prereqs.sh does):\n{}",
                dir.display(),
                tail(&out.stderr)
            ));
        }
        let mut pip = Command::new(dir.join("bin/python"));
        pip.args([
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--disable-pip-version-check",
            "--no-input",
            "-r",
        ])
        .arg(&requirements);
        let out = run(pip, "pip install", INSTALL_TIMEOUT).await?;
        if !out.status.success() {
            return Err(format!(
                "cannot install the MCP Python SDK pinned in {} from PyPI; is PyPI reachable \
                 (proxy settings, PIP_INDEX_URL)? pip said:\n{}",
                requirements.display(),
                tail(&out.stderr)
            ));
        }
        Ok(())
    })
    .await?;
    Ok(dir.join("bin/python"))
}

/// `node_modules` with the TypeScript SDKs of the committed package-lock.json.
async fn typescript_sdk() -> Result<PathBuf, String> {
    let ts = sdk_dir().join("typescript");
    let lock_file = std::fs::read(ts.join("package-lock.json"))
        .map_err(|e| format!("cannot read {}/package-lock.json: {e}", ts.display()))?;
    let manifest = std::fs::read(ts.join("package.json"))
        .map_err(|e| format!("cannot read {}/package.json: {e}", ts.display()))?;
    let hint = "the TypeScript SDK test needs node >= 20 and npm (hack/prereqs.sh installs them)";
    let node = version_of("node", &["--version"], hint).await?;
    version_of("npm", &["--version"], hint).await?;
    let dir = cache_root().join(format!(
        "typescript-{}",
        key(&[&lock_file, &manifest, node.as_bytes()])
    ));
    let dir = cached(dir, |dir| async move {
        for f in ["package.json", "package-lock.json"] {
            std::fs::copy(ts.join(f), dir.join(f))
                .map_err(|e| format!("cannot copy {f} to {}: {e}", dir.display()))?;
        }
        let mut npm = Command::new("npm");
        npm.args(["ci", "--no-audit", "--no-fund", "--ignore-scripts"])
            .current_dir(&dir);
        let out = run(npm, "npm ci", INSTALL_TIMEOUT).await?;
        if !out.status.success() {
            return Err(format!(
                "cannot install the MCP TypeScript SDKs of {}/package-lock.json from npm; is the \
                 npm registry reachable (proxy settings, npm config registry)? npm said:\n{}",
                ts.display(),
                tail(&out.stderr)
            ));
        }
        Ok(())
    })
    .await?;
    Ok(dir.join("node_modules"))
}

async fn python_interpreter() -> &'static Path {
    static CELL: OnceCell<Result<PathBuf, String>> = OnceCell::const_new();
    match CELL.get_or_init(python_sdk).await {
        Ok(p) => p,
        Err(e) => panic!("cannot prepare the MCP Python SDK: {e}"),
    }
}

async fn node_modules() -> &'static Path {
    static CELL: OnceCell<Result<PathBuf, String>> = OnceCell::const_new();
    match CELL.get_or_init(typescript_sdk).await {
        Ok(p) => p,
        Err(e) => panic!("cannot prepare the MCP TypeScript SDKs: {e}"),
    }
}

async fn local_server() -> Server {
    support::ensure_built(false);
    let agent = support::agent_bin();
    let agent = agent.to_str().expect("utf-8 path");
    let mut args = LocalServer::local_backend(agent);
    args.extend_from_slice(&["--instructions", ADMIN_INSTRUCTIONS]);
    Server::start(&args, &[]).await
}

/// What a client script printed, and its stderr.
struct Report {
    json: Value,
    stderr: String,
}

/// Runs a client script. `server` is the HTTP server it talks to (for its log when the
/// script fails); a stdio server's log is in the script's stderr.
async fn run_client(what: &str, cmd: Command, server: Option<&Server>) -> Report {
    let log = || server.map(|s| s.log_text()).unwrap_or_default();
    let out = match run(cmd, what, CLIENT_TIMEOUT).await {
        Ok(out) => out,
        Err(e) => panic!("{e}; server log:\n{}", log()),
    };
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stderr}\nserver log:\n{}",
        out.status,
        log()
    );
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{what} printed no JSON report ({e}):\n{}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    Report { json, stderr }
}

async fn python_client(server: &Server, session: &str, mode: &str) -> Report {
    let mut cmd = Command::new(python_interpreter().await);
    cmd.arg(sdk_dir().join("python/client.py")).args([
        "--url",
        &server.url("/mcp"),
        "--session",
        session,
        "--mode",
        mode,
    ]);
    run_client(
        &format!("the Python SDK client (mode {mode})"),
        cmd,
        Some(server),
    )
    .await
}

/// The command line of a stdio server for session `sid`.
fn stdio_server(sid: &str) -> String {
    support::ensure_built(false);
    let agent = support::agent_bin();
    let line = [
        support::SERVER_BIN,
        "--transport",
        "stdio",
        "--session-id",
        sid,
        "--backend",
        "local",
        "--auth",
        "none",
        "--agent-binary",
        agent.to_str().expect("utf-8 path"),
        "--instructions",
        ADMIN_INSTRUCTIONS,
    ];
    serde_json::to_string(&line).expect("JSON")
}

async fn typescript_client(server: &Server, sdk: &str, session: &str, mode: &str) -> Report {
    let mut cmd = Command::new("node");
    cmd.env("NODE_PATH", node_modules().await)
        .arg(sdk_dir().join("typescript/client.cjs"))
        .args(["--sdk", sdk, "--url", &server.url("/mcp")])
        .args(["--session", session, "--mode", mode]);
    run_client(
        &format!("the TypeScript SDK client ({sdk}, mode {mode})"),
        cmd,
        Some(server),
    )
    .await
}

fn first_text(result: &Value) -> &str {
    result["text"][0].as_str().unwrap_or_default()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Http,
    Stdio,
}

/// The checks every SDK, protocol mode and transport must pass.
fn check(report: &Report, protocol: &str, transport: Transport) {
    let r = &report.json;
    assert_eq!(r["protocol_version"], protocol, "{r}");
    assert_eq!(r["server_name"], "cli-mcp-server", "{r}");
    assert_eq!(
        r["instructions"],
        cli_mcp_server::mcp::instructions(transport == Transport::Stdio, Some(ADMIN_INSTRUCTIONS)),
        "the server's instructions, then the admin's as written"
    );
    if transport == Transport::Stdio {
        for http_only in ["X-Session-ID", "DELETE", "/sessions"] {
            assert!(
                !r["instructions"]
                    .as_str()
                    .unwrap_or_default()
                    .contains(http_only),
                "a stdio client cannot use {http_only}: {}",
                r["instructions"]
            );
        }
    }
    let instructions = r["instructions"].as_str().unwrap_or_default();
    assert!(
        instructions.contains("`exit` ends the shell") && instructions.contains("(exit N)"),
        "{instructions}"
    );

    let tools = r["tools"].as_array().expect("tools");
    assert_eq!(tools.len(), 1, "{r}");
    assert_eq!(tools[0]["name"], "bash");
    assert_eq!(
        tools[0]["inputSchema"]["required"],
        serde_json::json!(["command"])
    );
    assert_eq!(tools[0]["outputSchema"]["type"], "object");

    let echo = &r["echo"];
    assert_eq!(echo["is_error"], false, "{echo}");
    assert_eq!(echo["structured"]["stdout"], "hi\n", "{echo}");
    assert_eq!(echo["structured"]["exit_code"], 0, "{echo}");
    assert!(first_text(echo).starts_with("hi\n[exit 0 | "), "{echo}");

    assert_eq!(r["set_state"]["is_error"], false, "{}", r["set_state"]);
    assert_eq!(
        r["read_state"]["structured"]["stdout"], "/tmp kept\n",
        "cd and export persist between calls: {}",
        r["read_state"]
    );

    let failed = &r["exit_3"];
    assert_eq!(failed["is_error"], true, "{failed}");
    assert_eq!(failed["structured"]["exit_code"], 3, "{failed}");

    let unknown = &r["unknown_tool"]["mcp_error"];
    assert_eq!(unknown["code"], -32602, "an MCP (JSON-RPC) error: {r}");
    assert!(
        unknown["message"]
            .as_str()
            .is_some_and(|m| m.contains("unknown tool \"no-such-tool\"")),
        "{unknown}"
    );

    let bad = &r["bad_arguments"];
    assert_eq!(bad["is_error"], true, "{bad}");
    assert!(
        first_text(bad).contains("argument `command` must be a string"),
        "{bad}"
    );

    if transport == Transport::Http {
        let missing = &r["no_session"];
        assert_eq!(missing["is_error"], true, "{missing}");
        assert!(
            first_text(missing).starts_with("missing X-Session-ID header"),
            "{missing}"
        );
    }

    assert!(
        !report.stderr.contains("unknown format"),
        "the SDK's JSON Schema validator warned about a non-standard format:\n{}",
        report.stderr
    );
}

#[tokio::test]
async fn python_sdk_legacy_handshake() {
    let server = local_server().await;
    let report = python_client(&server, "py-legacy", "legacy").await;
    check(&report, "2025-11-25", Transport::Http);
}

#[tokio::test]
async fn python_sdk_negotiates_2026_07_28() {
    let server = local_server().await;
    let report = python_client(&server, "py-modern", "auto").await;
    check(&report, "2026-07-28", Transport::Http);
}

#[tokio::test]
async fn typescript_sdk_legacy_handshake() {
    let server = local_server().await;
    let report = typescript_client(&server, "v1", "ts-v1", "legacy").await;
    check(&report, "2025-11-25", Transport::Http);
    assert_eq!(
        report.json["mcp_session_id"],
        Value::Null,
        "stateless: no Mcp-Session-Id is handed out"
    );
}

#[tokio::test]
async fn typescript_client_package_negotiates_2026_07_28() {
    let server = local_server().await;
    let report = typescript_client(&server, "v2", "ts-v2", "auto").await;
    check(&report, "2026-07-28", Transport::Http);
}

#[tokio::test]
async fn python_sdk_over_stdio() {
    let mut cmd = Command::new(python_interpreter().await);
    cmd.arg(sdk_dir().join("python/client.py")).args([
        "--stdio",
        &stdio_server("py-stdio"),
        "--mode",
        "legacy",
    ]);
    let report = run_client("the Python SDK client (stdio)", cmd, None).await;
    check(&report, "2025-11-25", Transport::Stdio);
    assert_eq!(report.json["echo"]["structured"]["session_id"], "py-stdio");
}

#[tokio::test]
async fn typescript_sdk_over_stdio() {
    let mut cmd = Command::new("node");
    cmd.env("NODE_PATH", node_modules().await)
        .arg(sdk_dir().join("typescript/client.cjs"))
        // v2: v1's stdio transport does not expose the negotiated protocol version.
        .args(["--sdk", "v2", "--stdio", &stdio_server("ts-stdio")]);
    let report = run_client("the TypeScript SDK client (stdio)", cmd, None).await;
    check(&report, "2025-11-25", Transport::Stdio);
    assert_eq!(report.json["echo"]["structured"]["session_id"], "ts-stdio");
}
