//! `kubectl logs` and log collectors read the agent's stderr through a pipe: no ANSI colour
//! codes there. A terminal gets colour, unless `NO_COLOR` is set.

mod support;

use std::io::{BufRead as _, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::Duration;

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

fn agent(no_color: Option<&str>) -> (Command, tempfile::TempDir) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cli-mcp-agent"));
    cmd.args(["--listen", "127.0.0.1:0"])
        .arg("--state-dir")
        .arg(tmp.path().join("state"))
        .arg("--workdir")
        .arg(tmp.path())
        .arg("--podinfo-annotations")
        .arg(tmp.path().join("no-annotations"))
        .env(
            cli_mcp_api::wire::ENV_TOKEN_SHA256,
            support::session_token().commitment().to_hex(),
        )
        .env_remove(cli_mcp_api::wire::ENV_ASSIGN_SHA256)
        .env_remove("CLI_MCP_AGENT_LOG_JSON")
        .env("RUST_LOG", "info");
    match no_color {
        Some(v) => cmd.env("NO_COLOR", v),
        None => cmd.env_remove("NO_COLOR"),
    };
    (cmd, tmp)
}

#[test]
fn logs_to_a_pipe_carry_no_colour_codes() {
    let (cmd, _tmp) = agent(None);
    let out = stderr_of(cmd, false, "cli-mcp-agent ready");
    assert!(out.contains("INFO"), "{out}");
    assert!(!out.contains(ESC), "escape codes in piped logs:\n{out:?}");
}

/// Also proves the check above can fail: the same binary does colour a terminal.
#[test]
fn a_terminal_gets_colour_unless_no_color_is_set() {
    let (cmd, _tmp) = agent(None);
    let out = stderr_of(cmd, true, "cli-mcp-agent ready");
    assert!(out.contains(ESC), "no colour on a terminal:\n{out:?}");
    let (cmd, _tmp) = agent(Some("1"));
    let out = stderr_of(cmd, true, "cli-mcp-agent ready");
    assert!(out.contains("INFO"), "{out}");
    assert!(
        !out.contains(ESC),
        "escape codes despite NO_COLOR:\n{out:?}"
    );
}
