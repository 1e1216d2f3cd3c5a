//! The agent's disk use when output floods it and when its state dir is full. Each test puts
//! the state dir on a tmpfs of its own (the pod's `/tmp` emptyDir is one, with a size
//! limit), so the figures are exact, deleted-but-open files included, and filling it fills
//! nothing else. Failure messages carry the bytes in use.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{disk_bytes, Agent, Opts, Tmpfs};

const MIB: u64 = 1024 * 1024;

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str()
        .unwrap_or_else(|| panic!("no string {k} in {v}"))
}

/// Removes the command directory the agent keeps for the next command. A kept directory
/// needs no space for the next command (its files are rewritten in place), so a full state
/// dir only shows once a new one has to be made, as when a background job still holds the
/// last one's output.
fn drop_kept_command_dir(tmpfs: &Tmpfs) {
    for e in std::fs::read_dir(tmpfs.path().join("cmd"))
        .expect("cmd/")
        .flatten()
    {
        std::fs::remove_dir_all(e.path()).expect("remove the kept directory");
    }
}

fn on(tmpfs: &Tmpfs) -> Opts<'_> {
    Opts {
        state_dir: Some(tmpfs.path()),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_flood_of_output_stays_within_the_spill_caps() {
    // The pod's /tmp emptyDir is 256 MiB by default.
    let Some(tmp) = Tmpfs::mount(256 * MIB) else {
        return;
    };
    let a = Agent::start_with(on(&tmp));
    // What the agent keeps there anyway (its directories, marker and reserve).
    a.exec("true").await;
    let base = tmp.used();
    // What `yes` does in a few seconds, bounded here so the old behaviour cannot hang the test.
    let v = a
        .exec_with(json!({"command": "yes | head -c 300000000; echo end", "timeout_ms": 120000}))
        .await;
    // Less than before is fine: the directory kept from `true` was given up for one of its own.
    let used = tmp.used().saturating_sub(base);
    assert!(
        used <= 64 * MIB + MIB,
        "the state dir's tmpfs holds {used} more bytes after 300000000 bytes of output (per-spill \
         cap 64 MiB); response: {}",
        &s(&v, "stderr")[..s(&v, "stderr").len().min(400)]
    );
    assert_eq!(v["total_bytes"], 300_000_004u64, "{}", v["stderr"]);
    let out = s(&v, "stdout");
    assert!(
        out.starts_with("y\ny\n") && out.ends_with("y\nend\n"),
        "{}",
        &out[out.len() - 20..]
    );
    let marker = out
        .find("\n[… ")
        .map(|i| &out[i..out[i..].find(" …]").map_or(out.len(), |j| i + j + 4)])
        .unwrap_or("no marker");
    assert!(
        marker.contains("the first 67108864 bytes are in ")
            && marker.contains("the 232891140 bytes after them were not kept"),
        "the marker does not say what was dropped: {marker}"
    );

    // Three more big outputs: the total stays under the 128 MiB cap, oldest spills go first.
    for i in 0..3 {
        let v = a
            .exec_with(json!({"command": format!("head -c 60000000 /dev/zero | tr '\\0' {i}"), "timeout_ms": 120000}))
            .await;
        // Less than before is fine: the directory kept from `true` was given up for one of its own.
        let used = tmp.used().saturating_sub(base);
        assert!(
            used <= 128 * MIB + MIB,
            "the state dir's tmpfs holds {used} more bytes (spills: {} bytes) after spill {i}, \
             over the 128 MiB total cap",
            disk_bytes(&a.state_dir.join("spill"))
        );
        let out = s(&v, "stdout");
        let path = out
            .split("full output in ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .unwrap_or_else(|| panic!("no spill path in {}", &out[32 * 1024..32 * 1024 + 300]));
        let kept = std::fs::metadata(path).map(|m| m.len());
        assert_eq!(
            kept.ok(),
            Some(60_000_000),
            "the newest spill {path} is whole"
        );
    }
}

#[tokio::test]
async fn output_of_a_background_job_after_its_call_never_reaches_the_disk() {
    let Some(tmp) = Tmpfs::mount(256 * MIB) else {
        return;
    };
    let mut a = Agent::start_with(on(&tmp));
    a.exec("true").await;
    let base = tmp.used();
    let dir = tempfile::tempdir().expect("tempdir");
    let go = dir.path().join("go");
    nix::unistd::mkfifo(&go, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    let written = dir.path().join("written");
    // The job writes only once the call is over, then keeps its stdout open.
    let v = a
        .exec(&format!(
            "(read x < {go}; head -c 100000000 /dev/zero; touch {written}; sleep 60) & echo started",
            go = go.display(),
            written = written.display()
        ))
        .await;
    assert_eq!(s(&v, "stdout"), "started\n");
    std::fs::write(&go, "go\n").expect("release the job");
    let done = support::eventually(Duration::from_secs(60), || written.exists()).await;
    assert!(done, "the background job did not finish writing");
    // Less than before is fine: the directory kept from `true` was given up for one of its own.
    let used = tmp.used().saturating_sub(base);
    assert!(
        used < MIB,
        "the state dir's tmpfs holds {used} more bytes (du sees {} in all) once a background job \
         wrote 100000000 bytes after its call",
        disk_bytes(tmp.path())
    );
    // The job is still there and the session is fine.
    assert_eq!(s(&a.exec("jobs -r | wc -l").await, "stdout"), "1\n");
    a.terminate();
}

/// Writes zeros to `path` until the filesystem is full; returns the bytes written.
fn fill(path: &std::path::Path) -> u64 {
    use std::io::Write;
    let mut f = std::fs::File::create(path).expect("create filler");
    let chunk = vec![0u8; 4096];
    let mut written = 0;
    while f.write_all(&chunk).is_ok() {
        written += chunk.len() as u64;
    }
    written
}

#[tokio::test]
async fn a_full_state_dir_keeps_the_session_usable() {
    let Some(tmp) = Tmpfs::mount(8 * MIB) else {
        return;
    };
    let a = Agent::start_with(on(&tmp));
    let state = tmp.path().display().to_string();
    // A spill of the agent's own, then the state dir fills up to the last page.
    let v = a.exec("head -c 1000000 /dev/zero | tr '\\0' a").await;
    assert_eq!(v["truncated"], true);
    drop_kept_command_dir(&tmp);
    fill(&tmp.path().join("fill"));
    let (status, v) = a
        .post(
            "/exec",
            Some(support::session_token().expose()),
            json!({"command": "echo still here; df -k . | tail -1 >&2"}),
        )
        .await;
    assert_eq!(
        (status, v["stdout"].as_str()),
        (200, Some("still here\n")),
        "with the state dir full ({} bytes in use): {v}",
        tmp.used()
    );
    assert!(
        s(&v, "stderr").contains("full") && s(&v, "stderr").contains("spill"),
        "the condition is not reported: {v}"
    );
    // Full again, with no spill of the agent's left to remove: the command that frees the
    // space still runs (with a request_id, which the journal cannot record while full).
    drop_kept_command_dir(&tmp);
    fill(&tmp.path().join("fill2"));
    let (status, v) = a
        .post(
            "/exec",
            Some(support::session_token().expose()),
            json!({"command": format!("rm {state}/fill {state}/fill2; echo freed"), "request_id": "r-1"}),
        )
        .await;
    assert_eq!(
        (status, v["stdout"].as_str()),
        (200, Some("freed\n")),
        "with the state dir full again ({} bytes in use): {v}",
        tmp.used()
    );
    let v = a.exec("echo fine").await;
    assert_eq!(s(&v, "stdout"), "fine\n");
    assert!(!s(&v, "stderr").contains("full"), "{v}");

    // Full with the reserve gone as well (here removed by hand): the command is given to bash
    // inline, and its output still comes back.
    std::fs::remove_file(tmp.path().join("reserve")).expect("remove the reserve");
    drop_kept_command_dir(&tmp);
    fill(&tmp.path().join("fill3"));
    let v = a.exec("cd /; echo 'inline'\\''s fine'").await;
    assert_eq!(
        s(&v, "stdout"),
        "inline's fine\n",
        "with the state dir full and no reserve ({} bytes in use): {v}",
        tmp.used()
    );
    assert!(s(&v, "stderr").contains("inline"), "{v}");
    assert_eq!(s(&v, "cwd"), "/", "the shell state is kept: {v}");
}

#[tokio::test]
async fn a_state_dir_out_of_inodes_still_runs_commands() {
    let Some(tmp) = Tmpfs::mount_with(8 * MIB, "nr_inodes=64") else {
        return;
    };
    let a = Agent::start_with(on(&tmp));
    a.exec("true").await;
    drop_kept_command_dir(&tmp);
    // Every inode taken: not even a directory or a FIFO can be made.
    let mut taken = 0;
    while std::fs::File::create(tmp.path().join(format!("i{taken}"))).is_ok() {
        taken += 1;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let ran = dir.path().join("ran");
    let (status, v) = a
        .post(
            "/exec",
            Some(support::session_token().expose()),
            json!({"command": format!("touch {}; echo lost", ran.display())}),
        )
        .await;
    assert_eq!(
        status, 200,
        "with every inode of the state dir taken ({taken} files made): {v}"
    );
    assert!(ran.exists(), "the command did not run: {v}");
    assert!(s(&v, "stderr").contains("output discarded"), "{v}");
}

/// An agent on `tmpfs` with small spill caps: 1 MiB a spill, 2 MiB in all.
fn small_spill_caps(tmpfs: &Tmpfs) -> Opts<'_> {
    Opts {
        extra_args: &[
            "--output-budget",
            "1024",
            "--spill-max-bytes",
            "1048576",
            "--spill-total-bytes",
            "2097152",
        ],
        ..on(tmpfs)
    }
}

/// Runs `step` (a command, `{S}` for the state dir) before a 1.5 MB output, `times` times;
/// returns the bytes the state dir's tmpfs holds more than before.
async fn spill_after(tmp: &Tmpfs, a: &Agent, step: &str, times: usize) -> u64 {
    let state = tmp.path().display().to_string();
    a.exec("true").await;
    let base = tmp.used();
    for i in 0..times {
        let step = step.replace("{S}", &state).replace("{i}", &i.to_string());
        let v = a.exec(&format!("{step}; head -c 1500000 /dev/zero")).await;
        assert_eq!(v["truncated"], true, "{v}");
    }
    // Less than before is fine: the directory kept from `true` was given up for one of its own.
    tmp.used().saturating_sub(base)
}

#[tokio::test]
async fn a_spill_dir_whose_mode_a_command_changes_keeps_its_spills_counted() {
    let Some(tmp) = Tmpfs::mount(64 * MIB) else {
        return;
    };
    let a = Agent::start_with(small_spill_caps(&tmp));
    // The agent gives the directory its mode back and holds it again: the same directory,
    // with the same spills in it, which must still count against the total cap.
    let used = spill_after(&tmp, &a, "chmod 755 {S}/spill", 6).await;
    assert!(
        used <= 2 * MIB + MIB / 2,
        "the state dir's tmpfs holds {used} more bytes (spill/: {} bytes) after six 1 MiB \
         spills each preceded by a chmod of spill/, over the 2 MiB total cap",
        disk_bytes(&tmp.path().join("spill"))
    );
}

#[tokio::test]
async fn spills_in_a_spill_dir_a_command_moved_away_are_removed() {
    let Some(tmp) = Tmpfs::mount(64 * MIB) else {
        return;
    };
    let a = Agent::start_with(small_spill_caps(&tmp));
    // The moved directory, with the previous spill in it, is out of the caller's sight (its
    // path now leads to a new one) and no longer where the agent makes spills.
    let used = spill_after(&tmp, &a, "mv {S}/spill {S}/moved{i}", 6).await;
    let moved: u64 = (0..6)
        .map(|i| disk_bytes(&tmp.path().join(format!("moved{i}"))))
        .sum();
    assert!(
        used <= 2 * MIB + MIB / 2 && moved == 0,
        "the state dir's tmpfs holds {used} more bytes, {moved} of them in the moved spill \
         directories, after six 1 MiB spills each preceded by a move of spill/"
    );
}

#[tokio::test]
async fn an_empty_spill_is_removed_from_the_agents_directory_never_through_a_link() {
    let Some(tmp) = Tmpfs::mount(8 * MIB) else {
        return;
    };
    // No spill keeps anything: the one a long output makes is removed when the call ends.
    let a = Agent::start_with(Opts {
        extra_args: &["--output-budget", "1024", "--spill-max-bytes", "0"],
        ..on(&tmp)
    });
    let spill = tmp.path().join("spill");
    let (real, other) = (tmp.path().join("real"), tmp.path().join("other"));
    let dir = tempfile::tempdir().expect("tempdir");
    let go = dir.path().join("go");
    nix::unistd::mkfifo(&go, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    let command = format!("head -c 2000 /dev/zero; read x < {}", go.display());
    // While the command waits, spill/ is swapped for a link to a directory with a file of the
    // spill's name.
    let swap = async {
        let mut name = None;
        support::eventually(Duration::from_secs(30), || {
            name = std::fs::read_dir(&spill)
                .ok()
                .and_then(|mut d| d.next())
                .and_then(Result::ok)
                .map(|e| e.file_name());
            name.is_some()
        })
        .await;
        if let Some(name) = &name {
            std::fs::rename(&spill, &real).expect("move spill/ away");
            std::fs::create_dir(&other).expect("mkdir");
            std::fs::write(other.join(name), "keep\n").expect("plant a file");
            std::os::unix::fs::symlink(&other, &spill).expect("link");
        }
        std::fs::write(&go, "go\n").expect("release the command");
        name
    };
    let (v, name) = tokio::join!(a.exec(&command), swap);
    let name = name.expect("the agent made no spill file");
    assert!(
        s(&v, "stdout").contains("the output was not kept"),
        "{}",
        s(&v, "stdout")
    );
    assert_eq!(
        std::fs::read_to_string(other.join(&name)).ok().as_deref(),
        Some("keep\n"),
        "the file the link leads to was removed"
    );
    assert!(
        !real.join(&name).exists(),
        "the empty spill was left in the agent's directory"
    );
}

#[tokio::test]
async fn a_reserve_with_another_hard_link_is_replaced_never_allocated_through() {
    let Some(tmp) = Tmpfs::mount(8 * MIB) else {
        return;
    };
    use std::os::unix::fs::MetadataExt;
    // Planted by a command before it killed the agent (`kill -9 $PPID`): the restarted agent
    // allocates its reserve again.
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, "keep\n").expect("victim");
    std::fs::hard_link(&victim, tmp.path().join("reserve")).expect("hard link");
    let a = Agent::start_with(on(&tmp));
    assert_eq!(s(&a.exec("echo fine").await, "stdout"), "fine\n");
    let kept = std::fs::read(&victim).expect("victim");
    let held = std::fs::metadata(&victim).expect("victim").blocks() * 512;
    assert!(
        kept == b"keep\n" && held < MIB,
        "the file linked as the reserve was allocated through: it is {} bytes, {held} allocated",
        kept.len()
    );
    let reserve = std::fs::symlink_metadata(tmp.path().join("reserve")).expect("reserve");
    assert!(
        reserve.is_file() && reserve.nlink() == 1 && reserve.blocks() * 512 >= MIB,
        "the reserve is not a file of its own, allocated: {reserve:?}"
    );
}
