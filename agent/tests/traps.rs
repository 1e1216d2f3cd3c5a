//! Traps a hostile (or careless) shell user can set for the agent: redefined builtins,
//! `TMOUT`, broken modes and links in the state dir, fork bombs. After each, the session must
//! still answer the next call with exact output.

mod support;

use std::path::Path;

use serde_json::{json, Value};
use support::{Agent, Opts};

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}

/// Bound on a call that should answer at once: a false timeout fails the test quickly.
const QUICK_MS: u64 = 15_000;

/// The session answers a plain command exactly, with its state intact unless `reset`.
async fn answers(a: &Agent, reset: bool) {
    let v = a
        .exec_with(json!({"command": "echo ok", "timeout_ms": QUICK_MS}))
        .await;
    assert_eq!(
        (
            s(&v, "stdout"),
            v["exit_code"].as_i64(),
            v["timed_out"].as_bool()
        ),
        ("ok\n", Some(0), Some(false)),
        "{v}"
    );
    if !reset {
        assert_eq!(v["shell_restarted"], false, "{v}");
    }
}

/// A relative `--state-dir` is resolved against the agent's directory at start: the shell
/// changes directory, the agent's paths must not.
#[tokio::test]
async fn a_relative_state_dir_works_from_any_directory() {
    let base = tempfile::tempdir().expect("tempdir");
    let a = Agent::start_with(Opts {
        state_dir: Some(Path::new("relative-state")),
        cwd: Some(base.path()),
        ..Default::default()
    });
    let v = a.exec("cd /; echo here").await;
    assert_eq!(
        (s(&v, "stdout"), v["exit_code"].as_i64()),
        ("here\n", Some(0)),
        "{v}"
    );
    answers(&a, false).await;
    assert!(
        base.path().join("relative-state/cmd").is_dir(),
        "the state dir is not under the agent's directory"
    );
}

/// Whether `pid` exists and is not a zombie.
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

async fn shell_pid(a: &Agent) -> i32 {
    let v = a.exec("echo $$").await;
    s(&v, "stdout").trim().parse().expect("shell pid")
}

/// An idle interactive bash with `TMOUT` set exits after that many seconds ("timed out
/// waiting for input"), so every call would start a new shell. Neither the pod's
/// environment nor the user may set it.
#[tokio::test]
async fn tmout_from_the_environment_or_the_user_never_ends_the_idle_shell() {
    let a = Agent::start_with(Opts {
        env: &[("TMOUT", "1")],
        ..Default::default()
    });
    let pid = shell_pid(&a).await;
    // Idle for longer than TMOUT: the wait is the condition under test, and it ends early if
    // the shell dies.
    let idle = std::time::Duration::from_millis(2500);
    let died = support::eventually(idle, || !running(pid)).await;
    assert!(
        !died,
        "the idle shell (pid {pid}) exited with TMOUT=1 in the agent's environment; logs: {:?}",
        a.logs.lock().map(|l| l.clone())
    );
    assert_eq!(shell_pid(&a).await, pid);

    for attempt in [
        "TMOUT=1",
        "readonly TMOUT=1",
        "declare -r TMOUT=1",
        "export TMOUT=1",
        "unset TMOUT",
    ] {
        let v = a.exec(attempt).await;
        assert!(
            s(&v, "stderr").contains("TMOUT: readonly variable")
                || s(&v, "stderr").contains("TMOUT: cannot unset"),
            "{attempt}: {v}"
        );
    }
    assert_eq!(s(&a.exec("echo \"[$TMOUT]\"").await, "stdout"), "[]\n");
    let died = support::eventually(idle, || !running(pid)).await;
    assert!(
        !died,
        "the idle shell (pid {pid}) exited after the user set TMOUT=1"
    );
    answers(&a, false).await;
    assert_eq!(shell_pid(&a).await, pid);
}

/// The agent's own lines must not depend on names a command can redefine: a function or an
/// alias named `builtin`, `.`, `eval`, `printf`, `unset` or `enable`, or a builtin disabled
/// with `enable -n`, once made every later call a false timeout. Each is set in a command of
/// its own, and the next call must still run normally in the same shell.
#[tokio::test]
async fn redefined_or_disabled_builtins_do_not_break_the_framing() {
    let a = Agent::start();
    a.exec("cd /tmp; export KEPT=yes").await;
    let traps = [
        "builtin() { :; }",
        "alias builtin=false",
        "enable -n printf",
        "enable -n builtin",
        "enable -n builtin; enable() { :; }",
        "enable -n .; enable -n eval",
        ".() { echo hijacked; }; source() { :; }",
        "alias .=false source=false eval=false",
        "printf() { :; }; eval() { :; }",
        "unset() { :; }; builtin() { return 3; }",
        "alias unset=false enable=false; builtin() { :; }",
        "unalias -a; set -o posix; builtin() { :; }",
        "set +o posix; set -u; unset PWD",
    ];
    for trap in traps {
        let v = a
            .exec_with(json!({"command": trap, "timeout_ms": QUICK_MS}))
            .await;
        assert_eq!(v["timed_out"], false, "{trap}: {v}");
        let v = a
            .exec_with(json!({"command": "echo \"$KEPT\"; pwd", "timeout_ms": QUICK_MS}))
            .await;
        assert_eq!(
            (
                s(&v, "stdout"),
                v["exit_code"].as_i64(),
                v["timed_out"].as_bool()
            ),
            ("yes\n/tmp\n", Some(0), Some(false)),
            "after {trap}: {v}"
        );
        assert_eq!(v["shell_restarted"], false, "after {trap}: {v}");
    }
    // The user's own posix mode is left as it was.
    let v = a.exec("set -o posix; :").await;
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(
        s(&a.exec("shopt -o posix").await, "stdout"),
        "posix          \ton\n"
    );
    answers(&a, false).await;
}
