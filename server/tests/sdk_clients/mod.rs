//! Installing the official MCP SDKs once into a cache outside the repository, and running
//! the client scripts under `server/tests/sdk/` (shared by the test binaries that use them).
// Each test binary uses a part of this module.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use sha2::{Digest as _, Sha256};
use tokio::process::Command;
use tokio::sync::OnceCell;

use crate::support::Server;

pub const INSTALL_TIMEOUT: Duration = Duration::from_secs(600);
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

/// The SDK test scripts of the checkout the test runs in: cargo gives the package's
/// directory at run time too; the compiled-in one is another checkout's when a target dir
/// is shared by two.
pub fn sdk_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join("tests/sdk")
}

pub fn cache_root() -> PathBuf {
    let base = std::env::var_os("CLI_MCP_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/cli-mcp"));
    base.join("mcp-sdk")
}

/// Runs `cmd` to completion within `limit`; its output, or an error naming `what`.
pub async fn run(
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

pub fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// The first line of `<program> <args>`'s output (a version), part of the cache key: a
/// venv or node_modules belongs to the interpreter that made it.
pub async fn version_of(program: &str, args: &[&str], hint: &str) -> Result<String, String> {
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

pub fn key(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex::encode(h.finalize())[..16].to_owned()
}

/// Holds the cross-process lock of one cache entry (released when dropped, also when the
/// process dies, so a killed install never leaves the cache locked).
pub struct CacheLock(#[allow(dead_code)] std::fs::File);

pub async fn lock(path: PathBuf) -> Result<CacheLock, String> {
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
pub async fn cached<F, Fut>(dir: PathBuf, install: F) -> Result<PathBuf, String>
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

pub fn python() -> String {
    std::env::var("CLI_MCP_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// A venv with the pinned Python SDK; returns its interpreter.
pub async fn python_sdk() -> Result<PathBuf, String> {
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
pub async fn typescript_sdk() -> Result<PathBuf, String> {
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

pub async fn python_interpreter() -> &'static Path {
    static CELL: OnceCell<Result<PathBuf, String>> = OnceCell::const_new();
    match CELL.get_or_init(python_sdk).await {
        Ok(p) => p,
        Err(e) => panic!("cannot prepare the MCP Python SDK: {e}"),
    }
}

pub async fn node_modules() -> &'static Path {
    static CELL: OnceCell<Result<PathBuf, String>> = OnceCell::const_new();
    match CELL.get_or_init(typescript_sdk).await {
        Ok(p) => p,
        Err(e) => panic!("cannot prepare the MCP TypeScript SDKs: {e}"),
    }
}

/// What a client script printed, and its stderr.
pub struct Report {
    pub json: Value,
    pub stderr: String,
}

/// Runs a client script. `server` is the HTTP server it talks to (for its log when the
/// script fails); a stdio server's log is in the script's stderr.
pub async fn run_client(what: &str, cmd: Command, server: Option<&Server>) -> Report {
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
