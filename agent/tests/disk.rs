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
    // What `yes` does in a few seconds, bounded here so the old behaviour cannot hang the test.
    let v = a
        .exec_with(json!({"command": "yes | head -c 300000000; echo end", "timeout_ms": 120000}))
        .await;
    let used = tmp.used();
    assert!(
        used <= 64 * MIB + MIB,
        "the state dir's tmpfs holds {used} bytes after 300000000 bytes of output (per-spill cap \
         64 MiB); response: {}",
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
        let used = tmp.used();
        assert!(
            used <= 128 * MIB + MIB,
            "the state dir's tmpfs holds {used} bytes (spills: {} bytes) after spill {i}, over \
             the 128 MiB total cap",
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
    let used = tmp.used();
    assert!(
        used < MIB,
        "the state dir's tmpfs holds {used} bytes (du sees {}) once a background job wrote \
         100000000 bytes after its call",
        disk_bytes(tmp.path())
    );
    // The job is still there and the session is fine.
    assert_eq!(s(&a.exec("jobs -r | wc -l").await, "stdout"), "1\n");
    a.terminate();
}
