//! Traps a hostile (or careless) shell user can set for the agent: redefined builtins,
//! `TMOUT`, broken modes and links in the state dir, fork bombs. After each, the session must
//! still answer the next call with exact output.

mod support;

use std::path::Path;

use serde_json::Value;
use support::{Agent, Opts};

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}

/// The session answers a plain command exactly, with its state intact unless `reset`.
async fn answers(a: &Agent, reset: bool) {
    let v = a.exec("echo ok").await;
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
