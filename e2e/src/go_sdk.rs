//! The design's client journey with the official Go MCP SDK (`github.com/modelcontextprotocol/
//! go-sdk`, pinned in `e2e/tools/go-journey/go.mod`): the design's client is a Go service, so
//! the product is proven with the SDK such a service uses, through an instance's Service.
//!
//! - [`client_binary`]: the Go program of `e2e/tools/go-journey/`, built once into
//!   `$CLI_MCP_CACHE/mcp-sdk/go-<hash>/` (default `/var/cache/cli-mcp`; the hash of its go.mod,
//!   go.sum, main.go and the Go version) under a file lock, published by an atomic rename, as
//!   the server's SDK tests cache their Python and TypeScript SDKs next to it.
//! - [`GoClient`]: one run of it against an MCP endpoint, in its two phases.
//! - [`design_client_journey`]: the journey on an [`Env`], run on the real node by
//!   `e2e/tests/journeys_real_node.rs`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use cli_mcp_api::names::label;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::ResourceExt;
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::error::{Error, Result};
use crate::journey::{sandbox_selector, session_of, stdout, Env};
use crate::jsonrpc::{is_error, structured};
use crate::testing::{wait_for, workspace_root, TIMEOUT};

/// The Go program, relative to the workspace root.
pub const CLIENT_DIR: &str = "e2e/tools/go-journey";
/// What the cache key covers, in its order (plus the Go version).
const SOURCES: [&str; 3] = ["go.mod", "go.sum", "main.go"];
/// A cold build downloads the SDK from the Go module proxy and compiles it.
const BUILD_TIMEOUT: Duration = Duration::from_secs(600);
/// One phase of the client: a few calls, the first of which may start a sandbox.
const PHASE_TIMEOUT: Duration = Duration::from_secs(180);

/// `$CLI_MCP_CACHE/mcp-sdk`, shared with the server's SDK tests.
fn cache_root() -> PathBuf {
    std::env::var_os("CLI_MCP_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/cli-mcp"))
        .join("mcp-sdk")
}

/// Runs `cmd` to completion within `limit` (killed past it); its output.
async fn output(mut cmd: Command, what: &str, limit: Duration) -> Result<std::process::Output> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let failed = |detail: String| Error::Command {
        command: what.to_owned(),
        detail,
    };
    let child = cmd.spawn().map_err(|e| failed(e.to_string()))?;
    match tokio::time::timeout(limit, child.wait_with_output()).await {
        Err(_) => Err(failed(format!("did not finish within {limit:?}"))),
        Ok(Err(e)) => Err(failed(e.to_string())),
        Ok(Ok(out)) => Ok(out),
    }
}

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// The cache key: a new compiler or a new pin means a new binary.
fn key(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex::encode(h.finalize())[..16].to_owned()
}

/// Holds a cache entry's cross-process lock; the kernel releases it when the process dies,
/// so a killed build never leaves the entry locked.
struct CacheLock(#[allow(dead_code)] std::fs::File);

async fn lock(path: PathBuf) -> Result<CacheLock> {
    tokio::task::spawn_blocking(move || {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io("opening the lock file", &path, e))?;
        file.lock().map_err(|e| Error::io("locking", &path, e))?;
        Ok(CacheLock(file))
    })
    .await
    .map_err(|e| Error::Other(format!("lock task: {e}")))?
}

/// The go-journey binary, built on first use (the Go module proxy serves the SDK; with an
/// empty Go build cache the build takes ~40 s on 2 cores) and cached by its sources and the
/// Go version.
pub async fn client_binary() -> Result<PathBuf> {
    let src = workspace_root().join(CLIENT_DIR);
    let mut parts = Vec::new();
    for f in SOURCES {
        let path = src.join(f);
        parts.push(std::fs::read(&path).map_err(|e| Error::io("reading", &path, e))?);
    }
    let mut go_env = Command::new("go");
    go_env.args(["env", "GOVERSION"]);
    let version = output(go_env, "go env GOVERSION", Duration::from_secs(30))
        .await
        .map_err(|e| {
            Error::Prerequisite(format!(
                "{e}; the Go SDK journey needs Go >= 1.26 on PATH (hack/prereqs.sh checks it)"
            ))
        })?
        .stdout;
    parts.push(version);
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let hash = key(&refs);
    let root = cache_root();
    let dir = root.join(format!("go-{hash}"));
    let bin = dir.join("go-journey");
    std::fs::create_dir_all(&root).map_err(|e| Error::io("creating", &root, e))?;
    let _lock = lock(root.join(format!("go-{hash}.lock"))).await?;
    if bin.is_file() {
        return Ok(bin);
    }
    // Built aside and renamed into place: an interrupted build never looks complete.
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".go-{hash}."))
        .tempdir_in(&root)
        .map_err(|e| Error::io("creating a build directory in", &root, e))?;
    build(&src, &tmp.path().join("go-journey")).await?;
    let built = tmp.keep();
    std::fs::rename(&built, &dir).map_err(|e| Error::io("publishing", &dir, e))?;
    eprintln!("go_sdk: cached {}", bin.display());
    Ok(bin)
}

async fn build(src: &Path, out: &Path) -> Result<()> {
    let t = Instant::now();
    let mut go = Command::new("go");
    // go.sum is committed complete, so the default -mod=readonly needs no edit; no VCS
    // stamp, which would read the checkout's git state.
    go.args(["build", "-trimpath", "-buildvcs=false", "-o"])
        .arg(out)
        .arg(".")
        .current_dir(src)
        .env("CGO_ENABLED", "0");
    let what = format!("go build in {}", src.display());
    let built = output(go, &what, BUILD_TIMEOUT).await?;
    if !built.status.success() {
        return Err(Error::Command {
            command: what,
            detail: format!(
                "{}; is the Go module proxy reachable (GOPROXY), and is go.sum complete \
                 (`go mod tidy` there)? go said:\n{}",
                built.status,
                tail(&built.stderr)
            ),
        });
    }
    eprintln!("go_sdk: go-journey built in {:.1?}", t.elapsed());
    Ok(())
}

/// Where and as whom the client calls.
pub struct Target {
    /// `https://<Service DNS name>:<port>/mcp`, the name the instance's certificate carries.
    pub endpoint: String,
    /// Where every connection goes (the loopback forward to the Service).
    pub connect: std::net::SocketAddr,
    pub ca_pem: String,
    pub token: String,
    /// The `X-Session-ID` the client injects.
    pub session: String,
}

/// One run of the Go client: phase 1 (connect, list tools, the calls) is printed as one
/// JSON line, then it waits for the test's go-ahead on stdin before `DELETE
/// /sessions/{id}` (phase 2, another line).
pub struct GoClient {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
    /// The CA, the token file and the client's stderr (a 0700 directory).
    dir: tempfile::TempDir,
}

impl GoClient {
    pub fn start(bin: &Path, target: &Target, commands: &[&str]) -> Result<GoClient> {
        use std::os::unix::fs::PermissionsExt as _;
        // Only this user may read the token in it (tempfile's default mode follows umask).
        let dir = tempfile::Builder::new()
            .prefix("go-journey.")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()
            .map_err(|e| Error::io("creating", std::env::temp_dir(), e))?;
        let write = |name: &str, data: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, data).map_err(|e| Error::io("writing", &path, e))?;
            Ok::<_, Error>(path)
        };
        let ca = write("ca.crt", &target.ca_pem)?;
        // Never on the command line, where every local user could read it.
        let token = write("token", &target.token)?;
        let stderr_path = dir.path().join("stderr");
        let stderr = std::fs::File::create(&stderr_path)
            .map_err(|e| Error::io("creating", &stderr_path, e))?;
        let commands = serde_json::to_string(commands).map_err(|e| Error::Other(e.to_string()))?;
        let mut child = Command::new(bin)
            .arg("-endpoint")
            .arg(&target.endpoint)
            .arg("-connect")
            .arg(target.connect.to_string())
            .arg("-ca")
            .arg(&ca)
            .arg("-token-file")
            .arg(&token)
            .args(["-session", &target.session, "-commands", &commands])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::Command {
                command: bin.display().to_string(),
                detail: e.to_string(),
            })?;
        let stdin = child.stdin.take();
        let out = child
            .stdout
            .take()
            .ok_or_else(|| Error::Other("no stdout".into()))?;
        Ok(GoClient {
            child,
            stdin,
            lines: BufReader::new(out).lines(),
            dir,
        })
    }

    /// What the client wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr")).unwrap_or_default()
    }

    /// The next JSON line of the client.
    async fn line(&mut self, what: &str) -> Result<Value> {
        let next = tokio::time::timeout(PHASE_TIMEOUT, self.lines.next_line()).await;
        let failed = |detail: String| {
            Error::Other(format!(
                "go-journey {what}: {detail}; its stderr:\n{}",
                self.stderr()
            ))
        };
        let line = match next {
            Err(_) => return Err(failed(format!("no answer within {PHASE_TIMEOUT:?}"))),
            Ok(Err(e)) => return Err(failed(format!("reading its stdout: {e}"))),
            Ok(Ok(None)) => return Err(failed("exited without printing it".into())),
            Ok(Ok(Some(line))) => line,
        };
        serde_json::from_str(&line).map_err(|e| failed(format!("not JSON ({e}): {line}")))
    }

    /// Phase 1: the connect, the tools and every call's result (or transport error).
    pub async fn calls(&mut self) -> Result<Value> {
        self.line("phase 1 (connect, tools/list, the calls)").await
    }

    /// Phase 2: lets the client DELETE the session; what it saw, once it exited cleanly.
    pub async fn delete_session(mut self) -> Result<Value> {
        let mut stdin = self
            .stdin
            .take()
            .ok_or_else(|| Error::Other("no stdin".into()))?;
        stdin
            .write_all(b"delete\n")
            .await
            .map_err(|e| Error::Other(format!("telling go-journey to go on: {e}")))?;
        drop(stdin);
        let end = self.line("phase 2 (DELETE /sessions/{id})").await?;
        let status = tokio::time::timeout(PHASE_TIMEOUT, self.child.wait())
            .await
            .map_err(|_| Error::Other("go-journey did not exit after phase 2".into()))?
            .map_err(|e| Error::Other(format!("waiting for go-journey: {e}")))?;
        if !status.success() {
            return Err(Error::Other(format!(
                "go-journey exited with {status}; its stderr:\n{}",
                self.stderr()
            )));
        }
        Ok(end)
    }
}

/// The session id the design's client injects.
pub const SESSION: &str = "go-service-1";

/// The calls of the journey, in order; [`check_calls`] reads their results by index.
const COMMANDS: [&str; 9] = [
    "echo \"$HOSTNAME\"",
    "kubectl get ns -o name",
    "export X=1",
    "cd /tmp",
    "echo \"$X\"; pwd",
    "false",
    "(exit 3)",
    "echo \"$X\"; pwd; echo \"$HOSTNAME\"",
    // Ends the shell itself: still a result, which says the shell was restarted.
    "exit 3",
];

/// Phase 1's tool result of call `i`, which must not have failed in transport.
fn result(phase1: &Value, i: usize) -> &Value {
    let call = &phase1["calls"][i];
    assert_eq!(call["command"], COMMANDS[i], "{phase1}");
    assert!(
        call.get("error").is_none() && call["result"].is_object(),
        "`{}` failed in the Go SDK instead of giving a tool result: {call}",
        COMMANDS[i]
    );
    &call["result"]
}

/// Phase 1 as the design's client needs it; returns the sandbox's pod name.
fn check_calls(phase1: &Value, namespace: &str) -> String {
    assert!(
        !phase1["protocol_version"]
            .as_str()
            .unwrap_or_default()
            .is_empty(),
        "{phase1}"
    );
    assert!(
        !phase1["instructions"]
            .as_str()
            .unwrap_or_default()
            .is_empty(),
        "{phase1}"
    );
    assert!(
        phase1["tools"]
            .as_array()
            .is_some_and(|t| t.iter().any(|n| n == "bash")),
        "{phase1}"
    );
    let ok = |i: usize| {
        let r = result(phase1, i);
        assert!(
            !is_error(r) && structured(r)["exit_code"] == 0,
            "`{}`: {r}",
            COMMANDS[i]
        );
        stdout(r).to_owned()
    };
    let pod = ok(0).trim().to_owned();
    assert!(!pod.is_empty(), "{phase1}");
    let ns = ok(1);
    assert!(
        ns.lines()
            .any(|l| l.trim() == format!("namespace/{namespace}")),
        "kubectl in the sandbox lists this test's namespace: {ns}"
    );
    ok(2);
    ok(3);
    assert_eq!(ok(4), "1\n/tmp\n", "state kept across calls");
    // A failing command is a tool result with its exit code, not a transport failure.
    for (i, code) in [(5, 1), (6, 3)] {
        let r = result(phase1, i);
        assert!(
            is_error(r),
            "`{}` is reported with isError: {r}",
            COMMANDS[i]
        );
        assert_eq!(structured(r)["exit_code"], code, "{r}");
    }
    assert_eq!(
        ok(7),
        format!("1\n/tmp\n{pod}\n"),
        "the failures kept the shell, its state and its sandbox"
    );
    let r = result(phase1, 8);
    assert!(
        is_error(r) && structured(r)["exit_code"] == 3 && structured(r)["shell_restarted"] == true,
        "`exit 3` is a result saying the shell restarted: {r}"
    );
    pod
}

/// Every request carried the session header and the token; the DELETE ended the session.
fn check_requests(phase2: &Value) {
    assert_eq!(phase2["delete_status"], 204, "{phase2}");
    let requests = phase2["requests"].as_array().cloned().unwrap_or_default();
    let posts = requests.iter().filter(|r| r["method"] == "POST").count();
    assert!(posts > COMMANDS.len(), "{phase2}");
    for r in &requests {
        assert!(
            r["x_session_id"] == SESSION && r["bearer"] == true,
            "every request went through the injecting http.Client: {r}"
        );
        // Accepted, which the server does only with a token it could review; a GET /mcp
        // (a standalone SSE stream, which the server does not offer) may get 405.
        let status = r["status"].as_u64().unwrap_or_default();
        assert!(
            (200..300).contains(&status) || (r["method"] == "GET" && status == 405),
            "{r}"
        );
    }
    let last = requests.last().cloned().unwrap_or_default();
    assert_eq!(
        (&last["method"], &last["path"], &last["status"]),
        (
            &"DELETE".into(),
            &format!("/sessions/{SESSION}").into(),
            &204.into()
        ),
        "{phase2}"
    );
}

/// The design's client journey with the official Go SDK: a Go service injects
/// `X-Session-ID` and a bearer token on every request, runs `kubectl` in its sandbox with
/// state kept across calls, sees failures as tool results, and ends with `DELETE
/// /sessions/{id}`, after which the sandbox pod is gone. `client` is [`client_binary`]'s.
pub async fn design_client_journey(mut env: Env, client: PathBuf) {
    const NAME: &str = "go";
    env.investigation_kubeconfig(NAME).await;
    env.apply_cr(&env.cr(NAME, 1)).await;
    env.wait_ready(NAME).await;
    let mcp = env.client(NAME).await;
    let ca_pem = env
        .api::<ConfigMap>()
        .get(&format!("cli-mcp-{NAME}-ca"))
        .await
        .expect("the instance CA ConfigMap")
        .data
        .unwrap_or_default()
        .remove("ca.crt")
        .expect("ca.crt in the CA ConfigMap");
    let target = Target {
        endpoint: format!("{}/mcp", mcp.base),
        connect: mcp.forward_addr(),
        ca_pem,
        token: mcp.token.clone(),
        session: SESSION.into(),
    };
    let t = Instant::now();
    let mut go = GoClient::start(&client, &target, &COMMANDS).unwrap_or_else(|e| panic!("{e}"));
    let phase1 = go
        .calls()
        .await
        .unwrap_or_else(|e| panic!("{e}\nserver:\n{}", env.logs("server")));
    let pod = check_calls(&phase1, &env.ns.name);
    let pods = env.list::<Pod>(&sandbox_selector(NAME)).await;
    let mine: Vec<String> = pods
        .iter()
        .filter(|p| session_of(p) == Some(SESSION))
        .map(|p| p.name_any())
        .collect();
    assert_eq!(
        mine,
        std::slice::from_ref(&pod),
        "one sandbox pod for {SESSION}, the one that answered"
    );

    let phase2 = go.delete_session().await.unwrap_or_else(|e| panic!("{e}"));
    check_requests(&phase2);
    let gone = wait_for(
        env.api::<Pod>(),
        &pod,
        "the session's pod gone",
        TIMEOUT,
        |p: Option<&Pod>| p.is_none(),
    )
    .await;
    assert!(gone.is_ok(), "{gone:?}\nserver:\n{}", env.logs("server"));
    let left = env
        .list::<Pod>(&format!("{}={SESSION}", label::SESSION_ID))
        .await;
    assert!(left.is_empty(), "no pod of {SESSION} left: {left:?}");
    eprintln!(
        "go_sdk: the Go SDK journey ({} over protocol {}) took {:.1?}",
        phase1["server"],
        phase1["protocol_version"],
        t.elapsed()
    );
    drop(mcp);
    env.finish(Some(NAME)).await;
}
