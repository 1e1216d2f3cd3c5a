//! The state dir is the shell user's to change at any moment, also in the instant between
//! the agent's check of a directory and its use of it. A job that keeps swapping the
//! agent's directories for links to somewhere else must never make the agent create,
//! write or remove anything there.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::fcntl::{renameat2, RenameFlags, AT_FDCWD};
use serde_json::{json, Value};
use support::{session_token, Agent, Opts};

/// Every entry under `dir` (recursively, relative names): a regular file with its content,
/// anything else by its type (a FIFO is never opened: that would wait for a writer).
fn snapshot(dir: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            let name = p.strip_prefix(root).unwrap_or(&p).display().to_string();
            let Ok(t) = e.file_type() else { continue };
            if t.is_dir() {
                out.insert(name, "a directory".into());
                walk(root, &p, out);
            } else if t.is_file() {
                let bytes = std::fs::read(&p).unwrap_or_default();
                out.insert(name, String::from_utf8_lossy(&bytes).into_owned());
            } else {
                out.insert(name, format!("{t:?}"));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

fn is_link(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

/// Swaps `<state>/<d>` with `<state>/<d>.swap`, a link to `outside/<d>`, over and over (one
/// atomic exchange each time, so the directory is a link about half of the time), until
/// `stop`. When the agent has replaced the link with a directory of its own, a new link is
/// planted. Returns how many swaps were made.
fn swapper(state: PathBuf, outside: PathBuf, names: &[&str], stop: Arc<AtomicBool>) -> u64 {
    let swaps = AtomicU64::new(0);
    let plant = |d: &str| {
        let (real, swap) = (state.join(d), state.join(format!("{d}.swap")));
        if !is_link(&real) && !is_link(&swap) {
            // Keep whatever directory is at `.swap` out of the way, and link again.
            let _ = std::fs::rename(&swap, state.join(format!("{d}.old-{}", rand_suffix())));
            let _ = std::os::unix::fs::symlink(outside.join(d), &swap);
        }
    };
    for d in names {
        plant(d);
    }
    while !stop.load(Ordering::Relaxed) {
        for d in names {
            let (real, swap) = (state.join(d), state.join(format!("{d}.swap")));
            if renameat2(
                AT_FDCWD,
                &real,
                AT_FDCWD,
                &swap,
                RenameFlags::RENAME_EXCHANGE,
            )
            .is_ok()
            {
                swaps.fetch_add(1, Ordering::Relaxed);
            }
            plant(d);
        }
    }
    // Leave the real directories in place.
    for d in names {
        let (real, swap) = (state.join(d), state.join(format!("{d}.swap")));
        if is_link(&real) {
            let _ = renameat2(
                AT_FDCWD,
                &real,
                AT_FDCWD,
                &swap,
                RenameFlags::RENAME_EXCHANGE,
            );
        }
    }
    swaps.into_inner()
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now())
}

/// Seeds `outside/<d>` with files named as the agent names its own (journal slots, a
/// command directory, spills), so that a write, a removal or a listing through a link shows.
fn seed(outside: &Path) {
    for d in ["replay", "spill", "cmd"] {
        std::fs::create_dir_all(outside.join(d)).expect("mkdir outside");
    }
    for slot in 0..4 {
        for ext in ["json", "response"] {
            std::fs::write(outside.join(format!("replay/{slot}.{ext}")), "seed").expect("seed");
        }
    }
    std::fs::write(outside.join("spill/1-00000000.stdout"), "seed").expect("seed");
    std::fs::create_dir_all(outside.join("cmd/1-0000000000000000")).expect("seed");
    std::fs::write(outside.join("cmd/1-0000000000000000/cmd"), "echo seed").expect("seed");
    std::fs::write(outside.join("victim"), "keep").expect("seed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directories_swapped_for_links_at_any_moment_are_never_followed() {
    let a = Agent::start_with(Opts {
        // Every command below spills, and the spill cap removes old spills all the time.
        extra_args: &["--output-budget", "1024", "--spill-total-bytes", "8192"],
        ..Default::default()
    });
    let outside = tempfile::tempdir().expect("tempdir");
    seed(outside.path());
    let before = snapshot(outside.path());
    // Records in every slot and spills, before the swapping starts.
    for i in 0..6 {
        let v = a
            .exec_with(json!({
                "command": format!("head -c 3000 /dev/zero | tr '\\0' x; echo {i}"),
                "request_id": format!("warm-{i}"),
            }))
            .await;
        assert!(
            v["stdout"]
                .as_str()
                .is_some_and(|s| s.contains("full output in")),
            "{v}"
        );
    }

    let stop = Arc::new(AtomicBool::new(false));
    let swapping = {
        let (state, outside, stop) = (
            a.state_dir.clone(),
            outside.path().to_path_buf(),
            stop.clone(),
        );
        std::thread::spawn(move || swapper(state, outside, &["replay", "spill", "cmd"], stop))
    };
    // Commands that spill, with new and repeated request ids, for as long as the deadline
    // allows or until enough have run; whatever the swap does to a command, the agent must
    // keep answering it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut answered = 0;
    let mut statuses: BTreeMap<u16, u32> = BTreeMap::new();
    for i in 0..600 {
        if Instant::now() > deadline {
            break;
        }
        let id = if i % 3 == 2 { i - 1 } else { i };
        let body = json!({
            "command": format!("head -c 3000 /dev/zero | tr '\\0' y; echo {id}"),
            "request_id": format!("race-{id}"),
            "timeout_ms": 15_000,
        });
        let res = a
            .http
            .post(a.url("/exec"))
            .bearer_auth(session_token().expose())
            .json(&body)
            .send()
            .await;
        let res = res
            .unwrap_or_else(|e| panic!("the agent stopped answering after {answered} calls: {e}"));
        *statuses.entry(res.status().as_u16()).or_default() += 1;
        let _: Value = res.json().await.expect("a JSON answer");
        answered += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swapping.join().expect("swapper");
    assert!(
        swaps > 1000,
        "only {swaps} swaps: the race was hardly tried"
    );
    assert!(answered >= 50, "only {answered} calls in the time");

    assert_eq!(
        snapshot(outside.path()),
        before,
        "the agent created, wrote or removed files through a link ({answered} calls, {swaps} swaps, statuses {statuses:?})"
    );
    // The session still works, with output spilled where the response says.
    let v = a
        .exec_with(json!({"command": "head -c 3000 /dev/zero | tr '\\0' z; echo end"}))
        .await;
    let out = v["stdout"].as_str().unwrap_or_default();
    assert!(out.ends_with("end\n"), "{v}");
    let spill = out
        .split_whitespace()
        .find(|w| w.contains("/spill/"))
        .unwrap_or_else(|| panic!("no spill path in {v}"));
    let kept = std::fs::read(spill).unwrap_or_else(|e| panic!("{spill}: {e}"));
    assert_eq!(kept.len(), 3004, "{spill}");
    let v = a.exec("echo ok").await;
    assert_eq!(
        (v["stdout"].as_str(), v["exit_code"].as_i64()),
        (Some("ok\n"), Some(0)),
        "{v}"
    );
    for d in ["replay", "spill", "cmd"] {
        let m = std::fs::symlink_metadata(a.state_dir.join(d)).expect("lstat");
        assert!(m.is_dir(), "{d} is not a real directory: {m:?}");
    }
    let logs = a.logs.lock().map(|l| l.join("\n")).unwrap_or_default();
    assert!(!logs.contains("panicked"), "{logs}");
    eprintln!("{answered} calls ({statuses:?}), {swaps} swaps");
}
