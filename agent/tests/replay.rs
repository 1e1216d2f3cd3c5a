//! A retried request is never run twice, even across an agent crash: the replay journal in
//! the state dir (see `agent/src/replay/`). Real agents, real bash, real HTTP, SIGKILL.

mod support;

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use support::{session_token, Agent, Opts};

fn opts(state: &Path) -> Opts<'_> {
    Opts {
        state_dir: Some(state),
        ..Default::default()
    }
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str()
        .unwrap_or_else(|| panic!("no string {k} in {v}"))
}

/// Lines in `marker`: how many times a command that appends to it ran.
fn runs(marker: &Path) -> usize {
    std::fs::read_to_string(marker)
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// A command that appends to `marker` on every run, and on its first run only announces
/// itself on `started` (a FIFO) and then blocks, so an agent can be killed under it. A second
/// run returns at once, so a regression shows as a second line in `marker`, not as a hang.
fn long_command(dir: &Path, marker: &Path, started: &Path) -> String {
    let once = dir.join("once");
    format!(
        "echo $$ >> {marker}; if [ ! -e {once} ]; then touch {once}; echo go > {started}; sleep 600; fi",
        marker = marker.display(),
        once = once.display(),
        started = started.display()
    )
}

fn fifo(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    nix::unistd::mkfifo(&p, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    p
}

/// Sends `command` with `request_id` in the background; the agent will die under it.
fn send_in_background(a: &Agent, command: &str, request_id: &str) -> tokio::task::JoinHandle<()> {
    let http = a.http.clone();
    let url = a.url("/exec");
    let body = json!({"command": command, "request_id": request_id});
    tokio::spawn(async move {
        // The connection breaks when the agent dies: that error is the point.
        let _ = http
            .post(url)
            .bearer_auth(session_token().expose())
            .json(&body)
            .send()
            .await;
    })
}

/// Blocks until the command wrote to `started`: it is running, so its record is on disk.
async fn wait_started(started: PathBuf) {
    tokio::task::spawn_blocking(move || std::fs::read_to_string(started).expect("read fifo"))
        .await
        .expect("join");
}

/// Kills the agent as the kubelet's container restart would: the agent, and the shell
/// session it left (in a container they die together; here bash would be orphaned).
fn crash_with_shell(a: &mut Agent, marker: &Path) {
    a.crash();
    let shell_pid = std::fs::read_to_string(marker)
        .expect("marker written")
        .lines()
        .next()
        .expect("a pid")
        .trim()
        .to_owned();
    // Exactly the processes of that shell's session (bash is a session leader).
    let _ = std::process::Command::new("pkill")
        .args(["-KILL", "-s", &shell_pid])
        .status();
}

#[tokio::test]
async fn a_command_interrupted_by_an_agent_crash_is_not_run_again() {
    let state = tempfile::tempdir().expect("tempdir");
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("runs");
    let started = fifo(dir.path(), "started");
    let cmd = long_command(dir.path(), &marker, &started);

    let mut a = Agent::start_with(opts(state.path()));
    a.exec("true").await; // the shell has been used: its state matters
    let pending = send_in_background(&a, &cmd, "r-1");
    wait_started(started).await;
    crash_with_shell(&mut a, &marker);
    pending.await.expect("join");
    assert_eq!(runs(&marker), 1);

    let b = Agent::start_with(opts(state.path()));
    let v = b
        .exec_with(json!({"command": cmd, "request_id": "r-1"}))
        .await;
    assert_eq!(runs(&marker), 1, "the retry ran the command again: {v}");
    assert_eq!(v["exit_code"], 137, "{v}");
    assert_eq!(v["shell_restarted"], true, "{v}");
    assert_eq!(v["stdout"], "", "{v}");
    assert!(
        s(&v, "stderr").contains("restarted while this command was running")
            && s(&v, "stderr").contains("was not run again")
            && s(&v, "stderr").contains("unknown"),
        "{v}"
    );
    // Asked again: the same answer, still not run.
    let again = b
        .exec_with(json!({"command": cmd, "request_id": "r-1"}))
        .await;
    assert_eq!(again, v);
    assert_eq!(runs(&marker), 1);
    // The same id for another command is refused, as for a record kept in memory.
    let (status, err) = b
        .post(
            "/exec",
            Some(session_token().expose()),
            json!({"command": "echo other", "request_id": "r-1"}),
        )
        .await;
    assert_eq!((status, s(&err, "code")), (409, "bad_request"), "{err}");

    // Another id runs normally, and the reset was already reported with the interruption.
    let other = b
        .exec_with(json!({"command": cmd, "request_id": "r-2"}))
        .await;
    assert_eq!(runs(&marker), 2, "{other}");
    assert_eq!(other["exit_code"], 0, "{other}");
    assert_eq!(other["shell_restarted"], false, "{other}");
}

#[tokio::test]
async fn a_completed_command_is_replayed_after_an_agent_crash() {
    let state = tempfile::tempdir().expect("tempdir");
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("runs");
    let cmd = format!(
        "echo $$ >> {m}; export K=kept; wc -l < {m}; echo err >&2; exit 3",
        m = marker.display()
    );

    let mut a = Agent::start_with(opts(state.path()));
    let first = a
        .exec_with(json!({"command": cmd, "request_id": "done-1"}))
        .await;
    assert_eq!(
        (s(&first, "stdout"), &first["exit_code"]),
        ("1\n", &json!(3))
    );
    a.crash();

    let b = Agent::start_with(opts(state.path()));
    let replayed = b
        .exec_with(json!({"command": cmd, "request_id": "done-1"}))
        .await;
    assert_eq!(replayed, first, "not the recorded response");
    assert_eq!(runs(&marker), 1, "the retry ran the command again");
    // The replay is about the old shell; the first new command learns of the reset.
    let next = b.exec("echo ${K:-gone}").await;
    assert_eq!(s(&next, "stdout"), "gone\n");
    assert_eq!(next["shell_restarted"], true, "{next}");
    assert!(s(&next, "stderr").contains("agent restarted"), "{next}");
}

/// Oversized, linked and FIFO records left in the state dir: the agent
/// starts, ignores them (and logs it), stays small, answers only the ids its own records
/// name, and a record reached through a symbolic link is not believed.
#[tokio::test]
async fn hostile_record_files_are_ignored_safely() {
    let state = tempfile::tempdir().expect("tempdir");
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("runs");
    let started = fifo(dir.path(), "started");
    let long = long_command(dir.path(), &marker, &started);
    let quick = format!("echo $$ >> {}", marker.display());

    // A real journal: a completed record (done-1) and an in-progress one (live-1).
    let mut a = Agent::start_with(opts(state.path()));
    a.exec_with(json!({"command": quick, "request_id": "done-1"}))
        .await;
    let pending = send_in_background(&a, &long, "live-1");
    wait_started(started).await;
    crash_with_shell(&mut a, &marker);
    pending.await.expect("join");
    assert_eq!(runs(&marker), 2);

    let journal = state.path().join("replay");
    let (mut completed, mut live, mut free) = (None, None, Vec::new());
    for slot in 0..4 {
        let request = journal.join(format!("{slot}.json"));
        if !request.exists() {
            free.push(request);
        } else if journal.join(format!("{slot}.response")).exists() {
            completed = Some(request);
        } else {
            live = Some(journal.join(format!("{slot}.response")));
        }
    }
    let completed = completed.expect("the completed record is on disk");
    let live_response = live.expect("the in-progress record is on disk");
    assert!(free.len() >= 2, "slots free: {free:?}");
    // The completed request moves out of the state dir and is linked back in.
    let outside = dir.path().join("record.json");
    std::fs::rename(&completed, &outside).expect("move record");
    std::os::unix::fs::symlink(&outside, &completed).expect("link record");
    // Huge sparse files (2 GiB each, which a careless reader would load into memory) as a
    // request and as the in-progress request's response, and a FIFO (which would block one).
    for p in [&free[0], &live_response] {
        std::fs::File::create(p)
            .and_then(|f| f.set_len(2 << 30))
            .expect("sparse file");
    }
    nix::unistd::mkfifo(&free[1], nix::sys::stat::Mode::S_IRWXU).expect("fifo");

    // A FIFO read without O_NONBLOCK would hang this start; the listen line times out then.
    let b = Agent::start_with(opts(state.path()));
    let ignored = b
        .logs
        .lock()
        .expect("logs")
        .iter()
        .filter(|l| l.contains("ignoring a replay"))
        .count();
    assert!(ignored >= 4, "junk not reported: {:?}", b.logs.lock());
    // The genuine in-progress record is still honoured next to the junk.
    let v = b
        .exec_with(json!({"command": long, "request_id": "live-1"}))
        .await;
    assert_eq!(v["exit_code"], 137, "{v}");
    assert_eq!(runs(&marker), 2, "{v}");
    // The linked record is not believed: done-1 runs again.
    let v = b
        .exec_with(json!({"command": quick, "request_id": "done-1"}))
        .await;
    assert_eq!(
        runs(&marker),
        3,
        "a record behind a symbolic link was replayed: {v}"
    );
    assert!(
        support::mem_kib(b.pid(), "VmHWM:") < 64 * 1024,
        "the agent read a huge file"
    );
}

/// A launcher for bash that a command can remove: once it is gone, the shell the command
/// exited cannot be replaced.
fn removable_shell(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("bash-launcher");
    std::fs::write(&p, "#!/bin/sh\nexec bash \"$@\"\n").expect("write launcher");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    p
}

/// The agent fails after the command ran (here: the command removed the shell's launcher and
/// exited, so no shell can be started to report its end). The command may have run, so its
/// record is kept: the retry is answered "effects unknown", also after an agent restart, and
/// never runs it a second time.
#[tokio::test]
async fn a_command_whose_result_was_lost_after_it_ran_is_not_run_again() {
    let state = tempfile::tempdir().expect("tempdir");
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("runs");
    let launcher = removable_shell(dir.path());
    let launcher_arg = launcher.display().to_string();
    let args = ["--shell", launcher_arg.as_str()];
    let with_launcher = || Opts {
        extra_args: &args,
        ..opts(state.path())
    };
    let cmd = format!(
        "echo $$ >> {m}; rm {l}; exit 0",
        m = marker.display(),
        l = launcher.display()
    );
    let body = json!({"command": cmd, "request_id": "lost-1"});

    let mut a = Agent::start_with(with_launcher());
    let (status, err) = a
        .post("/exec", Some(session_token().expose()), body.clone())
        .await;
    assert_eq!((status, s(&err, "code")), (500, "internal"), "{err}");
    assert!(s(&err, "error").contains("may have run"), "{err}");
    assert_eq!(runs(&marker), 1);

    let check = |v: &Value| {
        assert_eq!(runs(&marker), 1, "the retry ran the command again: {v}");
        assert_eq!(v["exit_code"], 130, "{v}");
        assert!(
            s(v, "stderr").contains("result was lost")
                && s(v, "stderr").contains("was not run again")
                && s(v, "stderr").contains("unknown"),
            "{v}"
        );
    };
    let retry = a.exec_with(body.clone()).await;
    check(&retry);
    // With a shell to start again, the session works.
    removable_shell(dir.path());
    assert_eq!(s(&a.exec("echo ok").await, "stdout"), "ok\n");

    // The answer is on disk: a restarted agent gives it too.
    a.crash();
    let b = Agent::start_with(with_launcher());
    let after_restart = b.exec_with(body).await;
    check(&after_restart);
    assert_eq!(after_restart, retry);
}
