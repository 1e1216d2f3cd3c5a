//! Persistent-bash behaviour, through the real binary over real HTTP with real bash.

mod support;

use serde_json::{json, Value};
use support::{mem_kib, Agent};

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}

#[tokio::test]
async fn printf_without_trailing_newline_returns() {
    let a = Agent::start();
    let v = a
        .exec_with(json!({"command": "printf x", "timeout_ms": 20000}))
        .await;
    assert_eq!(s(&v, "stdout"), "x");
    assert_eq!(v["exit_code"], 0);
    assert_eq!(v["timed_out"], false);
}

#[tokio::test]
async fn output_containing_protocol_markers_comes_back_exactly() {
    let a = Agent::start();
    // Everything our framing uses: the record shape `<nonce> <status> <cwd>\0`, the command
    // line we send bash, fd 3, our note prefix, and a fake completion with a plausible nonce.
    let cmd = r#"printf '0123456789abcdef0123456789abcdef 0 /\0'
printf '%s\n' ". '/x/cmd' </dev/null >'/x/out' 2>'/x/err' 3>&-; builtin printf '%s %s %s\0' n \"\$?\" \"\$PWD\" >&3"
echo '[cli-mcp-agent: the shell exited]'
echo 'to fd3' >&3
printf 'no newline at end'
exit_code_marker=7; (exit $exit_code_marker)"#;
    let v = a.exec(cmd).await;
    let out = base64_or_text(&v, "stdout");
    let mut expected = b"0123456789abcdef0123456789abcdef 0 /\0".to_vec();
    expected.extend_from_slice(
        b". '/x/cmd' </dev/null >'/x/out' 2>'/x/err' 3>&-; builtin printf '%s %s %s\\0' n \"$?\" \"$PWD\" >&3\n",
    );
    expected.extend_from_slice(b"[cli-mcp-agent: the shell exited]\nno newline at end");
    assert_eq!(out, expected);
    assert_eq!(v["exit_code"], 7, "{v}");
    assert!(
        s(&v, "stderr").contains("Bad file descriptor"),
        "fd 3 is closed for commands: {v}"
    );
    assert_eq!(v["shell_restarted"], false);
    // And the shell still works normally afterwards.
    assert_eq!(s(&a.exec("echo ok").await, "stdout"), "ok\n");
}

fn base64_or_text(v: &Value, field: &str) -> Vec<u8> {
    let resp: cli_mcp_api::wire::ExecResponse =
        serde_json::from_value(v.clone()).expect("ExecResponse");
    match field {
        "stdout" => resp.stdout_bytes().expect("decodes"),
        _ => resp.stderr_bytes().expect("decodes"),
    }
}

#[tokio::test]
async fn binary_and_nul_output_is_exact() {
    let a = Agent::start();
    let v = a.exec(r"printf 'a\0b\xff\xfe'; printf '\0x' >&2").await;
    assert_eq!(v["stdout_encoding"], "base64");
    assert_eq!(base64_or_text(&v, "stdout"), b"a\0b\xff\xfe");
    assert_eq!(base64_or_text(&v, "stderr"), b"\0x");
}

#[tokio::test]
async fn ten_megabytes_are_truncated_head_and_tail_with_bounded_memory() {
    let a = Agent::start();
    a.exec("true").await; // shell up, steady state
    let before = mem_kib(a.pid(), "VmRSS:");
    let v = a
        .exec(
            "head -c 5000000 /dev/zero | tr '\\0' a; echo; head -c 5000000 /dev/zero | tr '\\0' z",
        )
        .await;
    let peak = mem_kib(a.pid(), "VmHWM:");
    assert_eq!(v["truncated"], true);
    assert_eq!(v["total_bytes"], 10_000_001);
    let out = s(&v, "stdout");
    assert!(out.len() < 64 * 1024 + 200, "kept {} bytes", out.len());
    assert!(out.starts_with(&"a".repeat(1000)));
    assert!(out.ends_with(&"z".repeat(1000)));
    let marker_start = out.find("[… ").expect("marker");
    let marker = &out[marker_start..out[marker_start..].find(" …]").expect("end") + marker_start];
    assert!(
        marker.contains("bytes truncated; full output in "),
        "{marker}"
    );
    let path = marker.rsplit("full output in ").next().expect("path");
    let spilled = std::fs::metadata(path).expect("spill file exists");
    assert_eq!(spilled.len(), 10_000_001);
    assert!(
        peak.saturating_sub(before) < 8 * 1024,
        "agent memory grew by {} KiB while printing 10 MB",
        peak.saturating_sub(before)
    );
}

#[tokio::test]
async fn stdin_is_dev_null() {
    let a = Agent::start();
    let v = a
        .exec_with(
            json!({"command": "cat; echo cat=$?; read x; echo read=$?", "timeout_ms": 20000}),
        )
        .await;
    assert_eq!(s(&v, "stdout"), "cat=0\nread=1\n");
    assert_eq!(v["timed_out"], false);
}

#[tokio::test]
async fn timeout_kills_the_command_and_keeps_shell_state() {
    let a = Agent::start();
    a.exec("cd /tmp; export A=1; greet() { echo hi; }").await;
    let v = a
        .exec_with(json!({"command": "echo partial; sleep 100.5", "timeout_ms": 500}))
        .await;
    assert_eq!(v["timed_out"], true);
    assert_eq!(v["exit_code"], 124);
    assert_eq!(v["shell_restarted"], false);
    assert_eq!(s(&v, "stdout"), "partial\n");
    assert!(s(&v, "stderr").contains("timed out after 500ms"), "{v}");
    let v = a.exec("pwd; echo $A; greet").await;
    assert_eq!(s(&v, "stdout"), "/tmp\n1\nhi\n");
    let leftover = a.exec("pgrep -f 'sleep 100[.]5' || echo none").await;
    assert_eq!(
        s(&leftover, "stdout"),
        "none\n",
        "the timed-out sleep must be gone"
    );
}

#[tokio::test]
async fn timeout_abandons_the_rest_of_the_command_line_like_ctrl_c() {
    let a = Agent::start();
    let v = a
        .exec_with(json!({"command": "cd /; sleep 100.6; echo after; cd /tmp", "timeout_ms": 300}))
        .await;
    assert_eq!(v["timed_out"], true);
    assert_eq!(
        v["stdout"], "",
        "nothing after the killed command may run: {v}"
    );
    assert_eq!(v["cwd"], "/");
    assert_eq!(v["shell_restarted"], false);
}

/// A command or process substitution runs in bash's own process group, not in a job's: a
/// timeout must stop it as Ctrl-C does (bash waits for it, so a SIGINT to bash alone
/// changes nothing) and keep the shell.
#[tokio::test]
async fn timeout_in_a_command_or_process_substitution_keeps_the_shell() {
    let a = Agent::start();
    a.exec("cd /tmp; export K=1").await;
    for command in [
        "x=$(sleep 100.7)",
        "for f in $(echo a; sleep 100.7); do echo $f; done",
        "cat <(sleep 100.7)",
        "x=$(trap '' INT; sleep 100.7)",
    ] {
        let v = a
            .exec_with(json!({"command": command, "timeout_ms": 500}))
            .await;
        assert_eq!(v["timed_out"], true, "{command}: {v}");
        assert_eq!(v["shell_restarted"], false, "{command}: {v}");
        let v = a.exec("pwd; echo $K").await;
        assert_eq!(s(&v, "stdout"), "/tmp\n1\n", "{command}: {v}");
        let leftover = a.exec("pgrep -f 'sleep 100[.]7' || echo none").await;
        assert_eq!(s(&leftover, "stdout"), "none\n", "{command}");
    }
}

/// `fg` makes an earlier call's background job the command: bash waits for it, and without
/// a terminal nothing tells which job that is. A timeout stops the earlier calls' jobs then,
/// says so, and keeps the shell (a restart would have ended those jobs too).
#[tokio::test]
async fn timeout_of_an_earlier_job_brought_to_the_foreground_keeps_the_shell() {
    let a = Agent::start();
    a.exec("cd /tmp; export K=1; sleep 100.8 & sleep 100.9 &")
        .await;
    let v = a
        .exec_with(json!({"command": "fg %1", "timeout_ms": 500}))
        .await;
    assert_eq!(v["timed_out"], true, "{v}");
    assert_eq!(v["shell_restarted"], false, "{v}");
    assert!(
        s(&v, "stderr").contains(
            "bash still waited after the command's processes were stopped: for a job of an \
             earlier call brought to the foreground (fg)? The earlier calls' jobs (2 process \
             group(s)) were interrupted too, and killed if they ignored it"
        ),
        "{v}"
    );
    let v = a.exec("pwd; echo $K").await;
    assert_eq!(s(&v, "stdout"), "/tmp\n1\n", "{v}");
    let left = a.exec("pgrep -f 'sleep 100[.][89]' || echo none").await;
    assert_eq!(s(&left, "stdout"), "none\n", "{left}");
}

#[tokio::test]
async fn timeout_of_wait_for_an_earlier_job_keeps_the_shell_and_the_job() {
    let a = Agent::start();
    a.exec("cd /tmp; export K=1; sleep 100.8 &").await;
    let v = a
        .exec_with(json!({"command": "wait", "timeout_ms": 500}))
        .await;
    assert_eq!(v["timed_out"], true, "{v}");
    assert_eq!(v["shell_restarted"], false, "{v}");
    let v = a.exec("pwd; echo $K; jobs").await;
    assert!(s(&v, "stdout").starts_with("/tmp\n1\n[1]"), "{v}");
    a.exec("kill %1").await;
}

#[tokio::test]
async fn builtin_loop_is_interrupted_and_keeps_the_shell() {
    let a = Agent::start();
    a.exec("export B=2").await;
    let v = a
        .exec_with(json!({"command": "while :; do :; done", "timeout_ms": 300}))
        .await;
    assert_eq!(v["timed_out"], true);
    assert_eq!(v["exit_code"], 124);
    assert_eq!(v["shell_restarted"], false, "{v}");
    assert_eq!(s(&a.exec("echo B=$B").await, "stdout"), "B=2\n");
}

#[tokio::test]
async fn a_shell_that_ignores_interrupts_is_restarted_with_a_note() {
    let a = Agent::start();
    a.exec("export B=2").await;
    let v = a
        .exec_with(json!({"command": "trap '' INT; while :; do :; done", "timeout_ms": 300}))
        .await;
    assert_eq!(v["timed_out"], true);
    assert_eq!(v["exit_code"], 124);
    assert_eq!(v["shell_restarted"], true);
    assert!(s(&v, "stderr").contains("was restarted"), "{v}");
    let v = a.exec("echo \"B=${B:-unset}\"").await;
    assert_eq!(s(&v, "stdout"), "B=unset\n");
    assert_eq!(v["shell_restarted"], false);
}

/// A command that removes the session's working directory and ends its shell: the next
/// shell starts in it again, made anew, and the session goes on.
#[tokio::test]
async fn a_removed_working_directory_is_made_again_for_the_next_shell() {
    let a = Agent::start();
    let work = s(&a.exec("pwd").await, "stdout").trim_end().to_owned();
    let v = a.exec("cd / && rm -rf \"$OLDPWD\" && exit 4").await;
    assert_eq!(v["shell_restarted"], true, "{v}");
    let v = a.exec("pwd; ls -A | wc -l").await;
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(s(&v, "stdout"), format!("{work}\n0\n"), "{v}");
    assert_eq!(v["cwd"], work.as_str());
}

/// bash does not bound `PWD`: a working directory deeper than any path the kernel takes
/// whole is reported like any other, and the shell is kept.
#[tokio::test]
async fn a_working_directory_longer_than_path_max_is_reported() {
    let a = Agent::start();
    let v = a
        .exec("n=$(printf %0200d 0); for i in $(seq 150); do mkdir $n && cd $n || break; done; echo ${#PWD}")
        .await;
    let len: usize = s(&v, "stdout").trim().parse().expect("a length");
    assert!(len > 30_000, "{v}");
    assert_eq!(v["shell_restarted"], false, "{v}");
    assert_eq!(v["cwd"].as_str().map(str::len), Some(len), "{v}");
    let v = a.exec("echo ${#PWD}").await;
    assert_eq!(s(&v, "stdout").trim(), len.to_string(), "{v}");
    assert_eq!(v["shell_restarted"], false, "{v}");
}

#[tokio::test]
async fn history_expansion_is_off() {
    let a = Agent::start();
    assert_eq!(
        s(&a.exec("echo \"hi!\" 'a!b'").await, "stdout"),
        "hi! a!b\n"
    );
}

#[tokio::test]
async fn exit_exec_and_kill_self_respawn_the_shell() {
    let a = Agent::start();
    let v = a.exec("exit 3").await;
    assert_eq!(v["exit_code"], 3);
    assert_eq!(v["shell_restarted"], true);
    assert!(s(&v, "stderr").contains("exited with status 3"), "{v}");
    assert_eq!(s(&a.exec("echo ok").await, "stdout"), "ok\n");

    let v = a.exec("exec true").await;
    assert_eq!(v["shell_restarted"], true);
    assert_eq!(s(&a.exec("echo ok").await, "stdout"), "ok\n");

    let v = a.exec("kill -9 $$").await;
    assert_eq!(v["exit_code"], 137);
    assert_eq!(v["shell_restarted"], true);
    let v = a.exec("echo ok").await;
    assert_eq!(s(&v, "stdout"), "ok\n");
    assert_eq!(v["shell_restarted"], false);
}

#[tokio::test]
async fn background_jobs_do_not_block_and_survive() {
    let a = Agent::start();
    let v = a
        .exec_with(json!({"command": "sleep 100 & echo started", "timeout_ms": 20000}))
        .await;
    assert_eq!(v["timed_out"], false);
    assert_eq!(s(&v, "stdout"), "started\n");
    // The job is still there (and a later timeout must not kill it).
    let t = a
        .exec_with(json!({"command": "sleep 100", "timeout_ms": 2000}))
        .await;
    assert_eq!(t["shell_restarted"], false, "{t}");
    let v = a.exec("jobs -r | grep -c 'sleep 100'").await;
    assert_eq!(s(&v, "stdout"), "1\n");
    // Its own process group outlives a killed test agent: ended here.
    a.exec("kill %1").await;
}

#[tokio::test]
async fn environment_is_non_interactive_and_holds_no_token() {
    let a = Agent::start();
    let v = a
        .exec("echo $PAGER $GIT_PAGER $TERM $GIT_TERMINAL_PROMPT; env | grep -c -e SHA256 -e CLI_MCP_AGENT || true")
        .await;
    assert_eq!(s(&v, "stdout"), "cat cat dumb 0\n0\n");
}

#[tokio::test]
async fn syntax_errors_are_reported_by_bash_and_keep_the_shell() {
    let a = Agent::start();
    a.exec("export C=3").await;
    let v = a.exec("if then fi (").await;
    assert_eq!(v["exit_code"], 2, "{v}");
    assert!(s(&v, "stderr").contains("syntax error"), "{v}");
    assert_eq!(s(&a.exec("echo $C").await, "stdout"), "3\n");
}

#[tokio::test]
async fn agent_restart_is_reported_on_the_next_response() {
    let state = tempfile::tempdir().expect("tempdir");
    let opts = || support::Opts {
        state_dir: Some(state.path()),
        ..Default::default()
    };
    let mut a = Agent::start_with(opts());
    let first = a.exec("export D=4").await;
    assert_eq!(first["shell_restarted"], false);
    a.crash();
    let b = Agent::start_with(opts());
    let v = b.exec("echo ${D:-gone}").await;
    assert_eq!(s(&v, "stdout"), "gone\n");
    assert_eq!(v["shell_restarted"], true);
    assert!(s(&v, "stderr").contains("agent restarted"), "{v}");
}

#[tokio::test]
async fn agent_restart_is_reported_even_when_a_command_cleaned_the_state_dir() {
    let state = tempfile::tempdir().expect("tempdir");
    let opts = || support::Opts {
        state_dir: Some(state.path()),
        ..Default::default()
    };
    let dir = state.path().display().to_string();
    let mut a = Agent::start_with(opts());
    // What a user cleaning /tmp does; the restart marker goes with it.
    a.exec(&format!("export D=4; rm -rf {dir}/*")).await;
    a.crash();
    let mut b = Agent::start_with(opts());
    let v = b.exec("echo ${D:-gone}").await;
    assert_eq!(s(&v, "stdout"), "gone\n");
    assert_eq!(v["shell_restarted"], true, "restart not reported: {v}");

    // A link planted as the marker is never written through.
    let victim = tempfile::NamedTempFile::new().expect("victim file");
    std::fs::write(victim.path(), "keep").expect("write victim");
    b.exec(&format!(
        "rm -f {dir}/shell-used; ln -s {} {dir}/shell-used",
        victim.path().display()
    ))
    .await;
    b.crash();
    let c = Agent::start_with(opts());
    let v = c.exec("true").await;
    assert_eq!(v["shell_restarted"], true, "{v}");
    assert_eq!(
        std::fs::read_to_string(victim.path()).expect("victim"),
        "keep"
    );
}

#[tokio::test]
async fn descriptors_the_agent_inherited_never_reach_commands() {
    let a = Agent::start_with(support::Opts {
        leak_fd7: true,
        ..Default::default()
    });
    let v = a.exec("ls /proc/self/fd | sort -n | tr '\\n' ' '").await;
    let fds: Vec<u32> = s(&v, "stdout")
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    // 0-2, plus the descriptor `ls` itself opened on /proc/self/fd.
    assert_eq!(fds.len(), 4, "unexpected descriptors {fds:?} in {v}");
    assert!(
        !fds.contains(&7),
        "fd 7 of the launcher leaked into a command: {fds:?}"
    );
}

#[tokio::test]
async fn a_stopped_shell_with_a_full_stdin_is_replaced_not_waited_for() {
    let a = Agent::start();
    // Flood the shell's own stdin pipe and stop the shell: the agent can neither deliver the
    // next command nor get an answer.
    let v = a
        .exec_with(json!({
            "command": "head -c 200000 /dev/zero | tr '\\0' '\\n' > /proc/$$/fd/0 & kill -STOP $$",
            "timeout_ms": 500
        }))
        .await;
    assert_eq!(v["timed_out"], true, "{v}");
    assert_eq!(v["shell_restarted"], true, "{v}");
    let v = a
        .exec_with(json!({"command": "echo alive", "timeout_ms": 5000}))
        .await;
    assert_eq!(s(&v, "stdout"), "alive\n");
}

#[tokio::test]
async fn output_files_replaced_by_links_or_fifos_change_nothing() {
    let a = Agent::start();
    // The agent reads the pipes bash opened, never the paths again.
    let v = a
        .exec("o=$(readlink /proc/$$/fd/1); rm \"$o\"; ln -s /dev/zero \"$o\"; e=$(readlink /proc/$$/fd/2); rm \"$e\"; mkfifo \"$e\"; echo out; echo err >&2")
        .await;
    assert_eq!(
        (s(&v, "stdout"), s(&v, "stderr")),
        ("out\n", "err\n"),
        "{v}"
    );
    assert_eq!(s(&a.exec("echo fine").await, "stdout"), "fine\n");
}

/// A job that keeps its call's output FIFO open for reading (its own output sent elsewhere,
/// so it is no writer and the call ends) would take part of what a later call printed into
/// that FIFO, were its directory used again. It is not.
#[tokio::test]
async fn a_reader_left_on_an_output_fifo_takes_nothing_from_later_calls() {
    let a = Agent::start();
    // Reads its call's stdout FIFO; at end of file (no writer) it waits 1 ms and reads again.
    // The call ends once it has the FIFO open (it says so on `$r`, with its pid). It ends
    // when its shell does (its parent changes) or after a minute, whatever the test does.
    let thief = r#"o=$(readlink /proc/$$/fd/1); r=$(mktemp -u); mkfifo "$r"; perl -e 'open(my $f, "<", $ARGV[0]) or die; open(my $r, ">", $ARGV[1]) or die; print $r "$$\n"; close $r; my ($pp, $end) = (getppid(), time + 60); while (getppid() == $pp && time < $end) { sysread($f, my $b, 65536) or select(undef, undef, undef, 0.001) }' "$o" "$r" </dev/null >/dev/null 2>&1 & read -r pid < "$r"; rm "$r"; echo "$pid" >&2"#;
    // (Its own stdout is the FIFO it reads: the call says so on stderr.)
    let v = a.exec(thief).await;
    let pid = s(&v, "stderr").trim().to_owned();
    assert!(
        !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()),
        "{v}"
    );
    let expected: String = (1..=200).map(|i| format!("line {i}\n")).collect();
    for call in 0..4 {
        let v = a
            .exec("for i in $(seq 200); do echo \"line $i\"; sleep 0.001; done")
            .await;
        assert_eq!(s(&v, "stdout"), expected, "call {call}: {v}");
    }
    let v = a.exec(&format!("kill {pid} && echo stopped")).await;
    assert_eq!(s(&v, "stdout"), "stopped\n", "{v}");
}

#[tokio::test]
async fn a_broken_state_dir_is_repaired() {
    let a = Agent::start();
    let state = a.state_dir.display().to_string();
    // A file where the directory should be (a mode change would not stop root, which runs
    // this test; a file stops anyone).
    a.exec(&format!("rm -rf {state}/cmd && touch {state}/cmd"))
        .await;
    assert_eq!(s(&a.exec("echo ok").await, "stdout"), "ok\n");
    a.exec(&format!("rm -rf {state}/cmd")).await;
    assert_eq!(s(&a.exec("echo ok").await, "stdout"), "ok\n");
}

#[tokio::test]
async fn processes_that_escape_the_shell_die_with_it() {
    let a = Agent::start();
    // A unique duration marks this run's process (others may linger from killed agents).
    let marker = format!("100.{}", std::process::id());
    let count = format!("pgrep -f 'sleep {marker}' | wc -l");
    // A setsid'd, disowned process is re-parented to the agent (a subreaper), not the shell.
    // The command returns only once the process exists (fork and exec race with pgrep).
    a.exec(&format!(
        "setsid sleep {marker} >/dev/null 2>&1 < /dev/null & disown; \
         until pgrep -f 'sleep {marker}' >/dev/null; do sleep 0.01; done"
    ))
    .await;
    assert_eq!(s(&a.exec(&count).await, "stdout"), "1\n");
    let v = a.exec("exit 0").await;
    assert_eq!(v["shell_restarted"], true);
    let after = a.exec(&count).await;
    let _ = std::process::Command::new("pkill")
        .args(["-f", &format!("sleep {marker}")])
        .status();
    assert_eq!(
        s(&after, "stdout"),
        "0\n",
        "escaped process survived the shell"
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

/// A SIGKILLed agent cannot stop its shell, so the shell dies with it (parent-death signal);
/// before, a shell busy with a command (one that never reads its stdin, so never sees the
/// agent's end) went on running without an owner.
#[tokio::test]
async fn the_shell_dies_with_a_sigkilled_agent() {
    let mut a = Agent::start();
    let v = a.exec("echo $$").await;
    let shell: i32 = s(&v, "stdout").trim().parse().expect("shell pid");
    let dir = tempfile::tempdir().expect("tempdir");
    let started = dir.path().join("started");
    let busy = format!("touch {}; while :; do :; done", started.display());
    let call = {
        let http = a.http.clone();
        let url = a.url("/exec");
        let token = support::session_token();
        tokio::spawn(async move {
            let _ = http
                .post(url)
                .bearer_auth(token.expose())
                .json(&json!({"command": busy, "timeout_ms": 60000}))
                .send()
                .await;
        })
    };
    assert!(
        support::eventually(std::time::Duration::from_secs(10), || started.exists()).await,
        "the busy command never started"
    );
    a.crash();
    let gone = support::eventually(std::time::Duration::from_secs(10), || !running(shell)).await;
    if !gone {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(shell),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    call.abort();
    assert!(
        gone,
        "the shell (pid {shell}) still ran 10 s after its agent was SIGKILLed (now killed)"
    );
}

/// `--parent-pid` that is not the agent's parent (it has exited): the agent refuses to
/// start rather than run on without an owner.
#[tokio::test]
async fn a_wrong_parent_pid_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = support::agent_command(dir.path())
        .args(["--listen", "127.0.0.1:0", "--parent-pid", "1"])
        .env(
            cli_mcp_api::wire::ENV_TOKEN_SHA256,
            support::session_token().commitment().to_hex(),
        )
        .output()
        .expect("run the agent");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--parent-pid 1 is not this agent's parent"),
        "{err}"
    );
}
