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

/// A signal ignored when the agent starts (a terminal's job control, `nohup`) used to stay
/// ignored in its shell, where `trap` listed it as set: on the status pipe after every
/// command, and to the user who asked which traps are set. The shell starts with the
/// default handling.
#[tokio::test]
async fn signals_ignored_by_the_agents_launcher_are_not_ignored_in_its_shell() {
    let a = Agent::start_with(Opts {
        ignore_signals: true,
        ..Default::default()
    });
    let v = a.exec("trap").await;
    assert_eq!(
        (s(&v, "stdout"), v["exit_code"].as_i64()),
        ("", Some(0)),
        "{v}"
    );
    let v = a.exec("trap 'echo hup' HUP; trap -p HUP").await;
    assert_eq!(s(&v, "stdout"), "trap -- 'echo hup' SIGHUP\n", "{v}");
    answers(&a, false).await;
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
/// with `enable -n`, once made every later call a false timeout; a `PROMPT_COMMAND` that
/// redefined `builtin` made every later command a silent no-op, and a prompt that read
/// bash's input ate the agent's next line. Each is set in a command of its own, and the
/// next call must still run normally in the same shell.
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
        "printf() { :; }; eval() { :; }; command() { :; }",
        "unset() { :; }; builtin() { return 3; }",
        "alias unset=false enable=false; builtin() { :; }",
        "unalias -a; set -o posix; builtin() { :; }",
        "set +o posix; set -u; unset PWD",
        // What bash runs on its own between two lines, before it reads the agent's next
        // one: a hook that redefines `builtin` there, or a prompt that reads the line.
        "PROMPT_COMMAND='builtin() { :; }'",
        "PROMPT_COMMAND=(: 'builtin() { :; }')",
        "PS1='$(read -r line)'",
        "PS0='$(builtin() { :; }; read -r line)'",
        "readonly PROMPT_COMMAND='builtin() { :; }'",
        // The status goes through a quoted variable: with digits in `IFS` an unquoted
        // expansion of it would vanish.
        "IFS=0123456789",
        "builtin() { builtin \"$@\"; }",
        "set -e; builtin() { return 1; }",
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

/// A uid of its own for a test that must run as non-root (root ignores file modes and
/// process limits): nothing else on the machine runs as it, so counting or killing its
/// processes touches only the test's.
fn own_uid(salt: u32) -> Option<u32> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root to run the agent as a uid of its own");
        return None;
    }
    Some(3_000_000 + (std::process::id() % 100_000) * 10 + salt)
}

fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p)
        .map(|m| m.mode() & 0o7777)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Every file and directory under `dir` with its mode.
fn modes(dir: &Path) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        out.push((p.display().to_string(), mode(&p)));
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(modes(&p));
        }
    }
    out
}

/// The state dir is writable by the shell user, who can take the agent's access to it
/// away (`chmod 000`); the agent owns it and gives itself access back. Its files are the
/// session's and readable by nobody else (0700 directories, 0600 files).
#[tokio::test]
async fn the_state_dir_is_private_and_a_chmod_000_of_it_is_repaired() {
    let Some(uid) = own_uid(1) else { return };
    let a = Agent::start_with(Opts {
        run_as: Some(uid),
        extra_args: &["--output-budget", "1024"],
        ..Default::default()
    });
    let state = a.state_dir.display().to_string();
    let spilled = |v: &Value| s(v, "stdout").contains("full output in");
    let big = json!({"command": "head -c 5000 /dev/zero | tr '\\0' x", "request_id": "r1"});
    let first = a.exec_with(big).await;
    assert!(spilled(&first), "{first}");
    assert_eq!(mode(&a.state_dir), 0o700);
    let open: Vec<_> = modes(&a.state_dir)
        .into_iter()
        .filter(|(_, m)| m & 0o077 != 0)
        .map(|(p, m)| format!("{p} {m:o}"))
        .collect();
    assert!(open.is_empty(), "open to others: {open:?}");

    for target in ["", "/cmd", "/spill", "/replay", "/cmd /spill /replay"] {
        let paths: Vec<String> = target.split(' ').map(|t| format!("{state}{t}")).collect();
        let v = a.exec(&format!("chmod 000 {}", paths.join(" "))).await;
        assert_eq!(v["exit_code"], 0, "{v}");
        answers(&a, false).await;
        let req = json!({
            "command": "head -c 5000 /dev/zero | tr '\\0' y",
            "request_id": format!("after {target}"),
        });
        let v = a.exec_with(req.clone()).await;
        assert!(spilled(&v), "after chmod 000 {target}: {v}");
        assert_eq!(
            a.exec_with(req).await,
            v,
            "replayed after chmod 000 {target}"
        );
        let modes_now: Vec<_> = ["", "cmd", "spill", "replay"]
            .iter()
            .map(|d| mode(&a.state_dir.join(d)))
            .collect();
        assert_eq!(modes_now, [0o700; 4], "after chmod 000 {target}");
    }
}

/// Names under `dir`, sorted, recursively (`a/b`).
fn listing(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = walk(dir, dir);
    out.sort();
    out
}

fn walk(root: &Path, dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        out.push(p.strip_prefix(root).unwrap_or(&p).display().to_string());
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(walk(root, &p));
        }
    }
    out
}

/// A state dir that is a link when the agent starts (a command of an earlier agent process
/// put it there) is replaced by a real directory, never followed.
#[tokio::test]
async fn a_state_dir_replaced_by_a_link_is_replaced_at_start() {
    let base = tempfile::tempdir().expect("tempdir");
    let elsewhere = base.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).expect("mkdir");
    let link = base.path().join("state");
    std::os::unix::fs::symlink(&elsewhere, &link).expect("symlink");
    let a = Agent::start_with(Opts {
        state_dir: Some(&link),
        ..Default::default()
    });
    answers(&a, false).await;
    let m = std::fs::symlink_metadata(&link).expect("lstat");
    assert!(m.is_dir(), "the state dir is not a real directory: {m:?}");
    assert_eq!(
        listing(&elsewhere),
        Vec::<String>::new(),
        "written through the link"
    );
}

/// A command can replace the agent's directories with links to somewhere else (copies of
/// the agent's files included, so that removing "old spills" would remove those): the agent
/// must neither write there nor remove anything there, and must put real directories back.
#[tokio::test]
async fn directories_replaced_by_links_are_never_followed() {
    let a = Agent::start_with(Opts {
        extra_args: &["--output-budget", "1024"],
        ..Default::default()
    });
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let big = |i: usize| {
        json!({
            "command": format!("head -c 5000 /dev/zero | tr '\\0' x; echo {i}"),
            "request_id": format!("big-{i}"),
        })
    };
    // Spill files and journal records to copy.
    for i in 0..3 {
        a.exec_with(big(i)).await;
    }
    let state = a.state_dir.display().to_string();
    let other = elsewhere.path().display().to_string();
    let v = a
        .exec(&format!(
            "set -e; for d in replay spill cmd; do mkdir {other}/$d; cp -a {state}/$d/. {other}/$d/ 2>/dev/null || :; \
             mv {state}/$d {state}/$d.moved; ln -s {other}/$d {state}/$d; done; echo planted"
        ))
        .await;
    assert_eq!(s(&v, "stdout"), "planted\n", "{v}");
    let planted = listing(elsewhere.path());
    // More spills than are kept, so old ones are removed; records in every journal slot.
    for i in 3..24 {
        let v = a.exec_with(big(i)).await;
        assert!(s(&v, "stdout").ends_with(&format!("{i}\n")), "{v}");
    }
    answers(&a, false).await;
    assert_eq!(
        listing(elsewhere.path()),
        planted,
        "the agent wrote or removed files through the links"
    );
    for d in ["replay", "spill", "cmd"] {
        let m = std::fs::symlink_metadata(a.state_dir.join(d)).expect("lstat");
        assert!(m.is_dir(), "{d} is not a real directory again: {m:?}");
    }
}

/// Pids of the processes whose real uid is `uid`.
fn processes_of(uid: u32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .and_then(|v| v.split_whitespace().next()?.parse::<u32>().ok())
                    == Some(uid)
            })
        })
        .collect()
}

/// Kills every process of a test's own uid when dropped (also when the test fails): a fork
/// bomb must not outlive its test.
struct KillAll(u32);

impl Drop for KillAll {
    fn drop(&mut self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let left = processes_of(self.0);
            if left.is_empty() || std::time::Instant::now() > deadline {
                break;
            }
            for pid in left {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

/// A fork bomb started in the background returns at once and then holds every process the
/// uid may have: each later fork in the session fails. The shell's process limit bounds it
/// (also below the test's own, larger limit on the whole agent), and the agent kills it before
/// the next command, keeping the shell.
#[tokio::test]
async fn a_fork_bomb_is_bounded_and_killed_and_the_shell_is_kept() {
    let Some(uid) = own_uid(2) else { return };
    // The agent's own flag is 40; 100 for everything of the uid bounds the test even if the
    // agent set no limit at all.
    const MAX: usize = 40;
    const OUTER: u64 = 100;
    let _cleanup = KillAll(uid);
    let a = Agent::start_with(Opts {
        run_as: Some(uid),
        nproc_limit: Some(OUTER),
        extra_args: &["--max-processes", "40"],
        ..Default::default()
    });
    a.exec("cd /tmp; export KEPT=yes").await;
    let before = processes_of(uid).len();
    let v = a
        .exec_with(json!({"command": ":(){ :|:& };:", "timeout_ms": QUICK_MS}))
        .await;
    assert_eq!(v["timed_out"], false, "{v}");
    // The bomb grows to the limit; the largest count seen is the bound that held.
    let mut most = 0;
    let grew = support::eventually(std::time::Duration::from_secs(20), || {
        most = most.max(processes_of(uid).len());
        most >= MAX * 3 / 4
    })
    .await;
    assert!(
        grew,
        "the bomb never grew: at most {most} processes of uid {uid}"
    );
    support::eventually(std::time::Duration::from_secs(2), || {
        most = most.max(processes_of(uid).len());
        false
    })
    .await;
    let threads = std::fs::read_to_string(format!("/proc/{}/status", a.pid()))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0usize);
    assert!(
        most <= MAX + threads,
        "the bomb reached {most} processes, over --max-processes {MAX} (+ {threads} agent threads)"
    );

    let v = a
        .exec_with(json!({"command": "echo \"$KEPT\"; pwd; /bin/true && echo forked", "timeout_ms": QUICK_MS}))
        .await;
    assert_eq!(s(&v, "stdout"), "yes\n/tmp\nforked\n", "{v}");
    assert_eq!(v["shell_restarted"], false, "{v}");
    assert!(s(&v, "stderr").contains("--max-processes"), "{v}");
    let mut now = usize::MAX;
    let fell = support::eventually(std::time::Duration::from_secs(20), || {
        now = processes_of(uid).len();
        now <= before
    })
    .await;
    assert!(
        fell,
        "{now} processes of uid {uid} are left after the bomb was stopped ({before} before it, \
         at most {most})"
    );
    answers(&a, false).await;

    // In the foreground, the bomb is the command: its timeout kills it.
    let v = a
        .exec_with(json!({"command": "bomb() { bomb | bomb; }; bomb", "timeout_ms": 3000}))
        .await;
    assert_eq!(
        (v["timed_out"].as_bool(), v["exit_code"].as_i64()),
        (Some(true), Some(124)),
        "{v}"
    );
    let fell = support::eventually(std::time::Duration::from_secs(20), || {
        now = processes_of(uid).len();
        now <= before
    })
    .await;
    assert!(
        fell,
        "{now} processes of uid {uid} are left after the foreground bomb timed out"
    );
    let v = a.exec("echo \"$KEPT\"").await;
    assert_eq!(s(&v, "stdout"), "yes\n", "the shell was replaced: {v}");
    answers(&a, false).await;
}

/// Some damage leaves no builtin to restore the others with: a read-only function named
/// `builtin`, `enable -n enable`. The agent sees at once that the shell ran the command but
/// could not report on it, and replaces the shell instead of waiting for the timeout.
#[tokio::test]
async fn builtins_broken_beyond_repair_get_a_new_shell_at_once() {
    let a = Agent::start();
    for trap in [
        "builtin() { :; }; readonly -f builtin; echo ran",
        "enable -n printf; enable -n enable; echo ran",
        "builtin() { :; }; enable() { :; }; readonly -f builtin enable; echo ran",
    ] {
        let t0 = std::time::Instant::now();
        let v = a
            .exec_with(json!({"command": trap, "timeout_ms": QUICK_MS}))
            .await;
        assert_eq!(
            (
                s(&v, "stdout"),
                v["timed_out"].as_bool(),
                v["shell_restarted"].as_bool()
            ),
            ("ran\n", Some(false), Some(true)),
            "{trap}: {v} after {:?}",
            t0.elapsed()
        );
        assert!(s(&v, "stderr").contains("could not report"), "{trap}: {v}");
        answers(&a, false).await;
    }
}

/// A process limit the agent's launcher set lower than `--max-processes` (a container
/// runtime's `nproc`) cannot be raised by a non-root agent: the shell gets that one instead
/// of failing to start.
#[tokio::test]
async fn a_lower_inherited_process_limit_is_kept_not_fatal() {
    let Some(uid) = own_uid(3) else { return };
    let _cleanup = KillAll(uid);
    let a = Agent::start_with(Opts {
        run_as: Some(uid),
        nproc_limit: Some(64),
        extra_args: &["--max-processes", "4096"],
        ..Default::default()
    });
    answers(&a, false).await;
    let v = a.exec("ulimit -u; ulimit -Hu").await;
    assert_eq!(s(&v, "stdout"), "64\n64\n", "{v}");
}

/// A `DEBUG` trap runs before every simple command at the shell's top level, the agent's own
/// lines included, and a `RETURN` trap each time a sourced file (every command) returns: a
/// slow one made every later call slow or a false timeout. The agent removes both after the
/// command that set them (which pays for its own trap), and says so; later calls run at
/// full speed in the same shell.
#[tokio::test]
async fn debug_and_return_traps_are_removed_after_the_command_that_set_them() {
    let a = Agent::start();
    a.exec("cd /tmp; export KEPT=yes").await;
    // Each firing costs a second: the later calls must see none.
    for trap in ["trap 'sleep 1' DEBUG", "trap 'sleep 1' RETURN"] {
        let v = a
            .exec_with(json!({"command": trap, "timeout_ms": 120_000}))
            .await;
        assert_eq!(v["timed_out"], false, "{trap}: {v}");
        assert!(
            s(&v, "stderr").contains("trap this command set was removed"),
            "{trap}: {v}"
        );
        for _ in 0..2 {
            let v = a
                .exec_with(json!({"command": "echo \"$KEPT\"; pwd", "timeout_ms": QUICK_MS}))
                .await;
            assert_eq!(
                (
                    s(&v, "stdout"),
                    v["timed_out"].as_bool(),
                    v["shell_restarted"].as_bool()
                ),
                ("yes\n/tmp\n", Some(false), Some(false)),
                "after {trap}: {v}"
            );
            let ms = v["duration_ms"].as_u64().unwrap_or(u64::MAX);
            assert!(ms < 1000, "after {trap} a call took {ms} ms: {v}");
            assert_eq!(s(&v, "stderr"), "", "after {trap}: {v}");
        }
    }
    // A trap that runs no command costs nothing, but is removed all the same: it would
    // still run before the agent's lines.
    let v = a.exec("trap ': dbg' DEBUG; trap -p DEBUG").await;
    assert!(s(&v, "stdout").contains("dbg"), "{v}");
    assert_eq!(s(&a.exec("trap -p DEBUG RETURN").await, "stdout"), "");
}

/// The agent reports on fd 3, and the command runs with it closed, so a command's own use
/// of fd 3 (`exec 3>file … exec 3>&-`) is its business. Closing or redirecting the shell's
/// descriptors — also the copies bash keeps of fd 3 and of its input while a command runs
/// — must not cost later calls: at worst the shell is replaced at once, and the answer says
/// why.
#[tokio::test]
async fn closing_or_redirecting_the_framing_descriptors_never_costs_later_calls() {
    let a = Agent::start();
    a.exec("cd /tmp; export KEPT=yes").await;
    for trap in [
        "exec 3>&-",
        "exec 3>/dev/null",
        "exec 3>&1 4>&1",
        "exec 3>\"$PWD/fd3-$$\"; echo mine >&3; exec 3>&-; rm \"$PWD/fd3-$$\"",
    ] {
        let v = a
            .exec_with(json!({"command": trap, "timeout_ms": QUICK_MS}))
            .await;
        assert_eq!(
            (v["timed_out"].as_bool(), v["shell_restarted"].as_bool()),
            (Some(false), Some(false)),
            "{trap}: {v}"
        );
        let v = a
            .exec_with(json!({"command": "echo \"$KEPT\"; pwd", "timeout_ms": QUICK_MS}))
            .await;
        assert_eq!(
            (s(&v, "stdout"), v["shell_restarted"].as_bool()),
            ("yes\n/tmp\n", Some(false)),
            "after {trap}: {v}"
        );
    }
    // Every descriptor the shell has, bash's saved copies of fd 3 and of its input
    // included: the shell cannot go on, and the call says so at once.
    let close_all = "for fd in /proc/$$/fd/*; do fd=${fd##*/}; \
                     [ \"$fd\" -gt 2 ] && eval \"exec $fd>&-\"; done; echo closed";
    let t0 = std::time::Instant::now();
    let v = a
        .exec_with(json!({"command": close_all, "timeout_ms": QUICK_MS}))
        .await;
    assert_eq!(
        (
            s(&v, "stdout"),
            v["timed_out"].as_bool(),
            v["shell_restarted"].as_bool()
        ),
        ("closed\n", Some(false), Some(true)),
        "{v} after {:?}",
        t0.elapsed()
    );
    assert!(
        s(&v, "stderr").contains("status channel"),
        "the note does not say what broke: {v}"
    );
    answers(&a, false).await;
}

/// `set -e`, `set -u` and `set -o pipefail` are the user's to keep: the agent's lines work
/// under them, and the state stays. An `errexit` shell that a failing command ends is the
/// user's choice too, but the call says the shell was reset and why, and the next call runs
/// in a new shell.
#[tokio::test]
async fn strict_modes_are_kept_and_an_errexit_exit_is_reported() {
    let a = Agent::start();
    a.exec("cd /tmp; export KEPT=yes; set -euo pipefail").await;
    for _ in 0..2 {
        let v = a
            .exec_with(json!({"command": "echo \"$KEPT\" $-; pwd", "timeout_ms": QUICK_MS}))
            .await;
        let out = s(&v, "stdout");
        assert!(
            out.starts_with("yes ")
                && out.ends_with("\n/tmp\n")
                && out.contains('e')
                && out.contains('u'),
            "{v}"
        );
        assert_eq!(v["shell_restarted"], false, "{v}");
    }
    // A timeout under errexit: the interrupted command fails, which ends the shell.
    let v = a
        .exec_with(json!({"command": "sleep 30", "timeout_ms": 500}))
        .await;
    assert_eq!(v["timed_out"], true, "{v}");
    answers(&a, true).await;
    a.exec("set -e").await;
    let v = a
        .exec_with(json!({"command": "false", "timeout_ms": QUICK_MS}))
        .await;
    assert_eq!(
        (v["exit_code"].as_i64(), v["shell_restarted"].as_bool()),
        (Some(1), Some(true)),
        "{v}"
    );
    assert!(s(&v, "stderr").contains("set -e"), "{v}");
    answers(&a, false).await;
}

/// A command's directory is kept for the next command, so a command can change it for the
/// next one: replace its FIFOs with files or links, replace the command file with a link to
/// a file elsewhere, leave a job that holds a FIFO open, or remove it. None of it may reach
/// the next command (its output and status stay exact) or the file elsewhere.
#[tokio::test]
async fn a_command_that_plants_files_in_its_own_directory_changes_nothing_for_the_next() {
    let a = Agent::start();
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let victim = elsewhere.path().join("victim");
    std::fs::write(&victim, "keep").expect("victim");
    let victim = victim.display().to_string();
    // The command's own directory, from the path of its stdout.
    let dir = "d=$(dirname \"$(readlink /proc/$$/fd/1)\")";
    let plants = [
        format!("{dir}; rm \"$d/out\"; echo planted > \"$d/out\""),
        format!("{dir}; rm \"$d/err\"; ln -s /dev/null \"$d/err\""),
        format!("{dir}; rm \"$d/cmd\"; ln -s {victim} \"$d/cmd\""),
        format!("{dir}; ln \"$d/cmd\" \"$d/cmd2\""),
        format!("{dir}; rm \"$d/done\"; mkfifo \"$d/done\"; (exec 7<>\"$d/done\"; sleep 3) >/dev/null 2>&1 &"),
        format!("{dir}; (exec 7>\"$d/out\"; sleep 3; echo late >&7) >/dev/null 2>&1 &"),
        format!("{dir}; rm -rf \"$d\"; mkdir \"$d\"; mkfifo \"$d/out\" \"$d/err\" \"$d/done\""),
        format!("{dir}; chmod 000 \"$d\""),
        // The line ends by opening and closing `done`: with no `done` to open, the record
        // must still come, and the directory is never used again.
        format!("{dir}; rm -rf \"$d\""),
        format!("{dir}; rm \"$d/done\"; mkdir \"$d/done\""),
    ];
    for (i, plant) in plants.iter().enumerate() {
        let v = a.exec(plant).await;
        assert_eq!(v["exit_code"], 0, "{plant}: {v}");
        for round in 0..3 {
            let v = a
                .exec_with(json!({
                    "command": format!("echo out {i} {round}; echo err {i} {round} >&2; exit_status_{i}() {{ return 7; }}; exit_status_{i}"),
                    "timeout_ms": QUICK_MS,
                }))
                .await;
            assert_eq!(
                (
                    s(&v, "stdout"),
                    s(&v, "stderr"),
                    v["exit_code"].as_i64(),
                    v["shell_restarted"].as_bool()
                ),
                (
                    format!("out {i} {round}\n").as_str(),
                    format!("err {i} {round}\n").as_str(),
                    Some(7),
                    Some(false)
                ),
                "after `{plant}`: {v}"
            );
        }
        assert_eq!(
            std::fs::read_to_string(elsewhere.path().join("victim")).expect("victim"),
            "keep",
            "after `{plant}`"
        );
    }
    answers(&a, false).await;
}
