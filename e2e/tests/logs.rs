//! `kubectl logs` and log collectors read a binary's stderr through a pipe: no ANSI colour
//! codes there. A terminal gets colour, unless `NO_COLOR` is set. Checked on the built
//! agent, server, operator and credential proxy (from [`binaries_dir`], like the cluster's images: build them
//! with `cargo build --workspace --bins`); none needs a cluster.

use std::io::{BufRead as _, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use cli_mcp_api::token::{HmacKey, SandboxNonce};
use cli_mcp_api::SessionId;
use cli_mcp_e2e::testing::{binaries_dir, workspace_root};

const ESC: &str = "\x1b[";

/// Runs `cmd` with stderr on a pipe or, with `terminal`, on a pseudo-terminal; once a line
/// contains `until` the process gets SIGTERM. Returns everything it wrote to stderr. A
/// process that neither says `until` nor exits within a minute is killed.
fn stderr_of(mut cmd: Command, terminal: bool, until: &str) -> String {
    let (reader, writer): (Box<dyn Read + Send>, Stdio) = if terminal {
        let pty = nix::pty::openpty(None, None).expect("openpty");
        (Box::new(std::fs::File::from(pty.master)), pty.slave.into())
    } else {
        let (r, w) = std::io::pipe().expect("pipe");
        (Box::new(r), w.into())
    };
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(writer);
    let mut child = cmd.spawn().expect("start the binary");
    // Our copy of the write end must go, or the end of the output never comes.
    drop(cmd);
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if done_rx.recv_timeout(Duration::from_secs(60)).is_err() {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
    });
    let mut out = String::new();
    let mut reader = BufReader::new(reader);
    let mut signalled = false;
    loop {
        let mut line = Vec::new();
        // A pseudo-terminal's master reads EIO once the last holder of the slave exits.
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let line = String::from_utf8_lossy(&line);
        out.push_str(&line);
        if !signalled && line.contains(until) {
            signalled = true;
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        }
    }
    let _ = child.wait();
    let _ = done_tx.send(());
    let _ = watchdog.join();
    assert!(signalled, "the process never logged {until:?}:\n{out}");
    out
}

/// One binary, started so that it logs `until` at `level` soon.
struct Case {
    /// `cli-mcp-<binary>`.
    binary: &'static str,
    until: &'static str,
    level: &'static str,
    /// Flags and environment beyond the shared ones; gets a fresh directory of its own.
    setup: fn(&mut Command, &Path),
}

fn binary(name: &str) -> PathBuf {
    let path = binaries_dir().expect("binaries dir").join(name);
    assert!(
        path.is_file(),
        "{} is missing; build it with `cargo build --workspace --bins`",
        path.display()
    );
    path
}

/// `case`'s command, with `NO_COLOR` set to `no_color` or unset, in a fresh directory
/// `.run/e2e-logs/<binary>-<run>` (cleared on a rerun).
fn command(case: &Case, run: &str, no_color: Option<&str>) -> Command {
    let dir = workspace_root().join(format!(".run/e2e-logs/{}-{run}", case.binary));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("run dir");
    let mut cmd = Command::new(binary(case.binary));
    // The packaged manifests log JSON; these runs must take the text path.
    cmd.env_remove("CLI_MCP_LOG_JSON")
        .env_remove("CLI_MCP_AGENT_LOG_JSON")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("RUST_LOG", "info");
    match no_color {
        Some(v) => cmd.env("NO_COLOR", v),
        None => cmd.env_remove("NO_COLOR"),
    };
    (case.setup)(&mut cmd, &dir);
    cmd
}

fn check(case: &Case) {
    let out = stderr_of(command(case, "pipe", None), false, case.until);
    assert!(out.contains(case.level), "{out}");
    assert!(!out.contains(ESC), "escape codes in piped logs:\n{out:?}");
    // Also proves the check above can fail: the same binary does colour a terminal.
    let out = stderr_of(command(case, "tty", None), true, case.until);
    assert!(out.contains(ESC), "no colour on a terminal:\n{out:?}");
    let out = stderr_of(command(case, "no-color", Some("1")), true, case.until);
    assert!(out.contains(case.level), "{out}");
    assert!(
        !out.contains(ESC),
        "escape codes despite NO_COLOR:\n{out:?}"
    );
}

/// The agent up to readiness, as a session's sandbox (any token commitment does), until
/// SIGTERM stops it.
#[test]
fn the_agent_colours_only_a_terminal() {
    check(&Case {
        binary: "cli-mcp-agent",
        until: "cli-mcp-agent ready",
        level: "INFO",
        setup: |cmd, dir| {
            let token = HmacKey::from_bytes([9; 32]).session_token(
                &SessionId::parse("s1").expect("valid"),
                &SandboxNonce::from_bytes([4; 16]),
            );
            cmd.args(["--listen", "127.0.0.1:0"])
                .arg("--state-dir")
                .arg(dir.join("state"))
                .arg("--workdir")
                .arg(dir)
                .arg("--podinfo-annotations")
                .arg(dir.join("no-annotations"))
                .env(
                    cli_mcp_api::wire::ENV_TOKEN_SHA256,
                    token.commitment().to_hex(),
                )
                .env_remove(cli_mcp_api::wire::ENV_ASSIGN_SHA256);
        },
    });
}

/// A flag error the server logs (as an ERROR line) before it exits.
#[test]
fn the_server_colours_only_a_terminal() {
    check(&Case {
        binary: "cli-mcp-server",
        until: "--tls-cert is set but --tls-key is not",
        level: "ERROR",
        setup: |cmd, _| {
            cmd.args(["--tls-cert", "/nonexistent/cert.pem"]);
        },
    });
}

/// The operator up to its first log line: an API server address nobody listens on is
/// enough (the client connects lazily; the platform is named, as `auto` would wait for an
/// API server to ask), and SIGTERM stops it.
#[test]
fn the_operator_colours_only_a_terminal() {
    check(&Case {
        binary: "cli-mcp-operator",
        until: "starting",
        level: "INFO",
        setup: |cmd, dir| {
            let kubeconfig = dir.join("kubeconfig");
            std::fs::write(
                &kubeconfig,
                "apiVersion: v1\nkind: Config\n\
                 clusters: [{name: c, cluster: {server: \"https://127.0.0.1:1\"}}]\n\
                 users: [{name: u, user: {token: t}}]\n\
                 contexts: [{name: c, context: {cluster: c, user: u, namespace: default}}]\n\
                 current-context: c\n",
            )
            .expect("write kubeconfig");
            cmd.args(["--health-listen", "127.0.0.1:0", "--leader-elect", "false"])
                .args(["--server-image", "cli-mcp-server:test"])
                .args(["--platform", "kubernetes"])
                .env("KUBECONFIG", kubeconfig);
        },
    });
}

/// The credential proxy up to serving, with a fresh CA and no routes (it refuses every
/// CONNECT, which is all a log check needs), until SIGTERM drains it. Its own API client
/// (for the sandbox identity check) connects lazily: an API server address nobody listens
/// on is enough, as for the operator.
#[test]
fn the_proxy_colours_only_a_terminal() {
    check(&Case {
        binary: "cli-mcp-proxy",
        until: "proxy serving",
        level: "INFO",
        setup: |cmd, dir| {
            let key = rcgen::KeyPair::generate().expect("CA key");
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
            let cert = params.self_signed(&key).expect("self-signed CA");
            let write = |name: &str, text: &str| {
                let path = dir.join(name);
                std::fs::write(&path, text).expect("write proxy input");
                path
            };
            cmd.arg("--routes")
                .arg(write("routes.json", r#"{"routes":[]}"#))
                .arg("--ca-cert")
                .arg(write("ca.crt", &cert.pem()))
                .arg("--ca-key")
                .arg(write("ca.key", &key.serialize_pem()))
                .args(["--listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0"])
                .args(["--instance", "demo", "--namespace", "default"])
                .arg("--hmac-key-file")
                .arg(write("hmac-key", &"ab".repeat(32)))
                .env(
                    "KUBECONFIG",
                    write(
                        "kubeconfig",
                        "apiVersion: v1\nkind: Config\n\
                         clusters: [{name: c, cluster: {server: \"https://127.0.0.1:1\"}}]\n\
                         users: [{name: u, user: {token: t}}]\n\
                         contexts: [{name: c, context: {cluster: c, user: u}}]\n\
                         current-context: c\n",
                    ),
                )
                .env_remove("CLI_MCP_PROXY_LOG_JSON");
        },
    });
}
