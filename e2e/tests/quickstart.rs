//! `make run` as a new user meets it: hack/run.sh brings up the local Kubernetes, the operator
//! and the sample instance, then prints an MCP endpoint and client configurations. The test
//! uses what it printed exactly as printed: the curl line is run by bash, the VS Code
//! configuration is read back as JSON and used by an MCP client, and the DELETE line ends the
//! session. The printed audit one-liner finds the curl line's request in the proxy's audit log,
//! with its session and the printed client identity as the caller; the second instance's curl
//! line (`as-caller`, `identity: impersonateCaller`) shows that the API server saw that
//! instance's client identity and the session (`kubectl auth whoami`). Then a stop signal ends
//! everything.
//!
//! Then, on the same cluster, every attack of [`attacks`] is tried as the least identity
//! that could try it, and each must fail: the isolation a user's `make run` gives is the
//! one the tests prove.
//!
//! The script gets a quick-start dir and a cluster run dir of its own, so it runs beside the
//! shared test cluster and beside a user's own `make run`. It runs `make run`'s default lane,
//! the real node with the project's images (the `CLI_MCP_NODE` of the shared test cluster is
//! not passed on); on a host that cannot run the real node (`node::preflight`) it says so and
//! runs the process-kubelet lane instead.

mod attacks;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use cli_mcp_e2e::process::running;
use cli_mcp_e2e::testing::workspace_root;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// Builds are done by `make test` before the tests run, so this is cluster start (with the
/// image build, cached by the tests before, and import), operator rollout and the instance
/// becoming Ready, on a loaded machine.
const READY_WITHIN: Duration = Duration::from_secs(600);
const STOP_WITHIN: Duration = Duration::from_secs(90);
const LAST_LINE: &str = "Ctrl-C stops everything.";

fn tail(path: &Path) -> String {
    cli_mcp_e2e::process::log_tail(path, 40)
}

/// The answer of a JSON-RPC call as printed by the server: plain JSON, or the `data:` line of
/// an SSE event.
fn rpc_answer(body: &str) -> Value {
    let text = body
        .lines()
        .find_map(|l| l.strip_prefix("data:"))
        .unwrap_or(body)
        .trim();
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON-RPC ({e}): {body}"))
}

/// The value of header `name` in a printed curl line (`-H 'Name: value'`).
fn header_of(curl: &str, name: &str) -> String {
    let start = format!("-H '{name}: ");
    curl.split(start.as_str())
        .nth(1)
        .and_then(|rest| rest.split('\'').next())
        .unwrap_or_else(|| panic!("no {name} header in {curl}"))
        .to_owned()
}

/// How long the audit line of a request that was answered may take to be readable in the
/// proxy pods' logs (written when the response ended; read through the kubelet).
const AUDITED_WITHIN: Duration = Duration::from_secs(60);

/// The audit line of `session`'s request for `path`, found by the printed audit one-liner,
/// run as printed after the printed `export KUBECONFIG=...`; polled until [`AUDITED_WITHIN`].
async fn audit_line(printed: &[String], session: &str, path: &str) -> Value {
    let out = printed.join("\n");
    let export = printed
        .iter()
        .find_map(|l| l.split_once("export KUBECONFIG=").map(|(_, k)| k.trim()))
        .unwrap_or_else(|| panic!("no KUBECONFIG printed:\n{out}"));
    let one_liner = printed
        .iter()
        .map(|l| l.trim())
        .find(|l| l.starts_with("kubectl ") && l.contains(" logs ") && l.contains("\"outcome\""))
        .unwrap_or_else(|| panic!("no audit one-liner printed:\n{out}"));
    let script = format!("export KUBECONFIG={export}\n{one_liner}");
    let deadline = tokio::time::Instant::now() + AUDITED_WITHIN;
    loop {
        let ran = Command::new("bash")
            .arg("-c")
            .arg(&script)
            .output()
            .await
            .expect("bash -c kubectl logs");
        let text = String::from_utf8_lossy(&ran.stdout);
        let lines: Vec<Value> = text
            .lines()
            // `--prefix`: `[pod/<name>/<container>] {...}`.
            .filter_map(|l| l.find('{').map(|i| &l[i..]))
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        if let Some(found) = lines
            .iter()
            .find(|a| a["session"] == session && a["path"] == path)
        {
            return found.clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no audit line of session {session} for {path} within {AUDITED_WITHIN:?} from \
             {script}: {ran:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A chat of an MCP client configured as `make run` printed: the configuration's headers,
/// and the MCP session the server hands out at `initialize` (handshake-era transport).
struct Chat {
    http: reqwest::Client,
    url: String,
    headers: Vec<(String, String)>,
    handle: String,
}

impl Chat {
    const PROTOCOL: &str = "2025-06-18";

    async fn open(
        http: &reqwest::Client,
        url: &str,
        config: &serde_json::Map<String, Value>,
    ) -> Chat {
        let headers: Vec<(String, String)> = config
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().expect("header value").to_owned()))
            .collect();
        let mut chat = Chat {
            http: http.clone(),
            url: url.to_owned(),
            headers,
            handle: String::new(),
        };
        let r = chat
            .post(json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": Self::PROTOCOL, "capabilities": {},
                           "clientInfo": {"name": "quickstart", "version": "1"}}}))
            .send()
            .await
            .expect("POST initialize");
        assert_eq!(r.status(), 200, "initialize");
        chat.handle = r
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .expect("initialize without X-Session-ID hands out an MCP session")
            .to_owned();
        let r = chat
            .post(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .send()
            .await
            .expect("POST notifications/initialized");
        assert!(r.status().is_success(), "initialized: {}", r.status());
        chat
    }

    fn post(&self, body: Value) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .post(&self.url)
            .header("Content-Type", "application/json")
            .header("Accept", "application/json, text/event-stream")
            .header("MCP-Protocol-Version", Self::PROTOCOL);
        if !self.handle.is_empty() {
            req = req.header("Mcp-Session-Id", &self.handle);
        }
        for (k, v) in &self.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        req.json(&body)
    }

    /// Runs `command` in this chat's shell; its stdout.
    async fn bash(&self, command: &str) -> String {
        let r = self
            .post(json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "bash", "arguments": {"command": command}}}))
            .send()
            .await
            .expect("POST tools/call");
        let answer = rpc_answer(&r.text().await.expect("body"));
        let result = &answer["result"];
        assert_eq!(result["isError"], false, "{answer}");
        assert_eq!(
            result["structuredContent"]["session_id"],
            self.handle.as_str(),
            "{answer}"
        );
        result["structuredContent"]["stdout"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Ends the chat's shell, as a client does when the chat is closed.
    async fn end(&self) {
        let r = self
            .http
            .delete(
                self.url
                    .replace("/mcp", &format!("/sessions/{}", self.handle)),
            )
            .header(
                "Authorization",
                self.headers
                    .iter()
                    .find(|(k, _)| k == "Authorization")
                    .map(|(_, v)| v.as_str())
                    .unwrap_or_default(),
            )
            .send()
            .await
            .expect("DELETE /sessions");
        assert_eq!(r.status(), 204, "ending chat {}", self.handle);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn make_run_prints_an_endpoint_that_works_as_printed() {
    let base = workspace_root().join(".run/e2e-quickstart");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("mkdir");
    let stderr_log = base.join("run.sh.stderr");
    let mut cmd = Command::new("bash");
    cmd.env_remove(cli_mcp_e2e::node::NODE_ENV);
    // run.sh runs `cargo build`.
    for v in cli_mcp_e2e::workspace::cargo_test_env() {
        cmd.env_remove(v);
    }
    let lane_ok = cli_mcp_e2e::cluster::locate_control_plane(None)
        .and_then(|bin| cli_mcp_e2e::node::preflight(&bin));
    let real_node = lane_ok.is_ok();
    if let Err(e) = lane_ok {
        // CI runs on the real node's kind of machine: there, a missing node is a failure.
        assert!(
            std::env::var_os("CI").is_none(),
            "quickstart: the real node cannot run in CI: {e}"
        );
        eprintln!("quickstart: the real node cannot run here ({e}); testing CLI_MCP_NODE=process");
        cmd.env(cli_mcp_e2e::node::NODE_ENV, "process");
    }
    let mut child = cmd
        .arg(workspace_root().join("hack/run.sh"))
        .current_dir(workspace_root())
        .env("CLI_MCP_QUICKSTART_DIR", base.join("quickstart"))
        .env("CLI_MCP_CLUSTER_RUN_DIR", base.join("cluster"))
        // Not the shared test cluster's: run.sh starts its own.
        .env_remove("KUBECONFIG")
        .env_remove("CLI_MCP_KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_log).expect("stderr log"))
        .kill_on_drop(true)
        .spawn()
        .expect("bash hack/run.sh");
    let pid = child.id().expect("pid") as i32;
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut printed = Vec::new();
    let read = async {
        while let Some(line) = lines.next_line().await.expect("read stdout") {
            let done = line.trim() == LAST_LINE;
            printed.push(line);
            if done {
                return true;
            }
        }
        false
    };
    let finished = tokio::time::timeout(READY_WITHIN, read).await;
    assert!(
        matches!(finished, Ok(true)),
        "run.sh did not print {LAST_LINE:?} ({finished:?}); stdout:\n{}\nstderr:\n{}",
        printed.join("\n"),
        tail(&stderr_log)
    );
    let out = printed.join("\n");
    std::fs::write(base.join("run.sh.stdout"), &out).expect("keep what run.sh printed");

    // The endpoint is plain HTTP on loopback: nothing to trust, no /etc/hosts entry.
    let url = printed
        .iter()
        .map(|l| l.trim())
        .find(|l| l.starts_with("http://127.0.0.1:") && l.ends_with("/mcp"))
        .unwrap_or_else(|| panic!("no loopback endpoint printed:\n{out}"))
        .to_string();
    assert!(!out.contains("<output of"), "nothing to fill in:\n{out}");

    // The curl line, run as printed.
    let curl = printed
        .iter()
        .map(|l| l.trim())
        .find(|l| l.starts_with("curl -s http://") && l.contains("tools/call"))
        .unwrap_or_else(|| panic!("no curl line printed:\n{out}"))
        .to_string();
    let ran = Command::new("bash")
        .arg("-c")
        .arg(&curl)
        .output()
        .await
        .expect("bash -c curl");
    assert!(ran.status.success(), "{curl}: {ran:?}");
    let answer = rpc_answer(&String::from_utf8_lossy(&ran.stdout));
    assert_eq!(answer["result"]["isError"], false, "{answer}");
    let stdout = answer["result"]["structuredContent"]["stdout"]
        .as_str()
        .unwrap_or_default();
    assert!(
        stdout.contains("kube-system") && stdout.contains("cli-mcp-demo"),
        "`kubectl get ns` in the sandbox lists the namespaces: {answer}"
    );

    // Who did what: the printed audit one-liner finds that request, with its session and
    // the printed client identity as the caller.
    let session = header_of(&curl, "X-Session-ID");
    let audited = audit_line(&printed, &session, "/api/v1/namespaces").await;
    eprintln!("quickstart: audited: {audited}");
    assert_eq!(
        audited["caller"]["user"], "system:serviceaccount:cli-mcp-demo:cli-mcp-demo-client",
        "{audited}"
    );
    assert_eq!(audited["outcome"], "forwarded", "{audited}");
    assert_eq!(audited["status"], 200, "{audited}");

    // The second instance acts as its caller: its curl line, run as printed, shows what the
    // API server saw (`kubectl auth whoami`): the printed client identity, and the session.
    let whoami = printed
        .iter()
        .map(|l| l.trim())
        .find(|l| l.starts_with("curl -s http://") && l.contains("kubectl auth whoami"))
        .unwrap_or_else(|| panic!("no as-caller curl line printed:\n{out}"))
        .to_string();
    assert!(
        !whoami.contains(&url),
        "the as-caller line has an endpoint of its own:\n{out}"
    );
    let ran = Command::new("bash")
        .arg("-c")
        .arg(&whoami)
        .output()
        .await
        .expect("bash -c curl");
    assert!(ran.status.success(), "{whoami}: {ran:?}");
    let answer = rpc_answer(&String::from_utf8_lossy(&ran.stdout));
    assert_eq!(answer["result"]["isError"], false, "{answer}");
    let review: Value = serde_json::from_str(
        answer["result"]["structuredContent"]["stdout"]
            .as_str()
            .unwrap_or_default(),
    )
    .unwrap_or_else(|e| panic!("`kubectl auth whoami -o json` printed JSON ({e}): {answer}"));
    eprintln!("quickstart: as-caller's kubectl auth whoami: {review}");
    let seen = &review["status"]["userInfo"];
    assert_eq!(
        seen["username"], "system:serviceaccount:cli-mcp-demo:cli-mcp-as-caller-client",
        "the API server saw the caller: {review}"
    );
    assert_eq!(
        seen["extra"]["cli-mcp.redhat.com/session"],
        json!([header_of(&whoami, "X-Session-ID")]),
        "the API server saw the session: {review}"
    );

    // The VS Code configuration, used by an MCP client as it is: same URL, its headers only.
    let vscode = printed
        .iter()
        .find_map(|l| l.split("also in ").nth(1))
        .map(|rest| rest.trim_end_matches("):").trim().to_string())
        .unwrap_or_else(|| panic!("no configuration file named:\n{out}"));
    let text = std::fs::read_to_string(&vscode).expect("vscode-mcp.json");
    assert!(
        out.contains(text.trim()),
        "the printed configuration is the file's"
    );
    let config: Value = serde_json::from_str(&text).expect("JSON");
    let server = &config["servers"]["cli-mcp"];
    assert_eq!(server["url"], url.as_str(), "{config}");
    let http = cli_mcp_e2e::http::client(None).build().expect("client");
    let mut call = http
        .post(&url)
        .header("Content-Type", "application/json")
        .header("Accept", "application/json, text/event-stream");
    for (k, v) in server["headers"].as_object().expect("headers") {
        call = call.header(k.as_str(), v.as_str().expect("header value"));
    }
    let body = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "bash", "arguments": {"command": "echo $((6 * 7))"}}});
    let r = call.json(&body).send().await.expect("POST");
    assert_eq!(r.status(), 200);
    let answer = rpc_answer(&r.text().await.expect("body"));
    assert_eq!(
        answer["result"]["structuredContent"]["stdout"], "42\n",
        "{answer}"
    );

    // One shell per chat out of the box: the configurations name no session, so each chat of
    // a client (an MCP session, opened by `initialize`) gets a shell of its own, and keeps it.
    let headers = server["headers"].as_object().expect("headers");
    assert!(
        !headers.contains_key("X-Session-ID"),
        "the printed configuration pins no shared session: {config}"
    );
    let chat_a = Chat::open(&http, &url, headers).await;
    let chat_b = Chat::open(&http, &url, headers).await;
    assert_ne!(chat_a.handle, chat_b.handle, "two chats, two sessions");
    assert_eq!(
        chat_a.bash("export CHAT=a; echo \"[$CHAT]\"").await,
        "[a]\n"
    );
    assert_eq!(
        chat_b.bash("echo \"[$CHAT]\"").await,
        "[]\n",
        "chat b has its own shell"
    );
    assert_eq!(
        chat_a.bash("echo \"[$CHAT]\"").await,
        "[a]\n",
        "chat a kept its shell"
    );
    // On the real node the quick start's sandboxes run under gVisor, and say so: the shell's
    // kernel is gVisor's, not the host's (a host that cannot run gVisor falls back to runc,
    // printed; CI's machines can, so there a fallback fails this test).
    if real_node {
        assert!(
            out.contains("Its sandboxes run under gVisor"),
            "the printout names the runtime:\n{out}"
        );
        let kernel = chat_a.bash("uname -r").await;
        assert!(
            kernel.contains("gvisor"),
            "uname -r in the sandbox: {kernel}"
        );
    }
    for chat in [&chat_a, &chat_b] {
        chat.end().await;
    }

    // The DELETE line, as printed.
    let delete = printed
        .iter()
        .map(|l| l.trim())
        .find(|l| l.starts_with("curl -s -X DELETE "))
        .unwrap_or_else(|| panic!("no DELETE line printed:\n{out}"))
        .to_string();
    let ran = Command::new("bash")
        .arg("-c")
        .arg(format!("{delete} -o /dev/null -w '%{{http_code}}'"))
        .output()
        .await
        .expect("bash -c curl -X DELETE");
    assert_eq!(String::from_utf8_lossy(&ran.stdout), "204", "{ran:?}");

    // What holds a token is the user's alone.
    let quickstart = base.join("quickstart");
    for (file, mode) in [
        (quickstart.clone(), 0o700),
        (quickstart.join("investigator.kubeconfig"), 0o600),
        (quickstart.join("vscode-mcp.json"), 0o600),
        (quickstart.join("mcp-servers.json"), 0o600),
    ] {
        let found = std::fs::metadata(&file)
            .expect("quick-start file")
            .permissions()
            .mode();
        assert_eq!(found & 0o777, mode, "{}: mode {found:o}", file.display());
    }

    // The boundary, as attackers meet it on this same cluster.
    if real_node {
        let bearer = server["headers"]["Authorization"]
            .as_str()
            .and_then(|h| h.strip_prefix("Bearer "))
            .expect("the configuration's bearer token");
        let target =
            attacks::Target::new(&base.join("cluster"), &url, bearer, "cli-mcp-demo", "demo").await;
        let outcomes = attacks::run_all(&target).await;
        assert_eq!(outcomes.len(), 14, "every attack ran");
    }

    // Stopping (SIGTERM; Ctrl-C's SIGINT takes the same trap, but a test runner may start
    // its children with SIGINT ignored): run.sh stops the forward and the cluster, exits 0.
    kill(Pid::from_raw(pid), Signal::SIGTERM).expect("SIGTERM");
    let status = tokio::time::timeout(STOP_WITHIN, child.wait())
        .await
        .unwrap_or_else(|_| panic!("run.sh still runs {STOP_WITHIN:?} after SIGTERM"))
        .expect("wait");
    assert!(status.success(), "{status}; {}", tail(&stderr_log));
    assert!(!running(pid));
}
