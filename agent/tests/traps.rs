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
