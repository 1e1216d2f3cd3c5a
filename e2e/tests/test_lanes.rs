//! `hack/test-lanes.sh`, the runner `make test` uses: test binaries on parallel lanes, every
//! job run, outputs printed whole, the run failed when a job failed.
//!
//! The test gives the script a stand-in `cargo` (through `$CARGO`): `metadata` answers a
//! fixed workspace, `test` prints a block of lines for its job and fails for the target
//! named `bad`. Nothing is built and nothing leaves the machine.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};

use cli_mcp_e2e::testing::workspace_root;

/// Two packages; target `a` in both (one job), `b`, `bad`, and a library (no job of its own:
/// the `unit` job covers it).
const METADATA: &str = r#"{"packages":[
 {"name":"p1","targets":[{"name":"a","kind":["test"]},{"name":"p1","kind":["lib"]}]},
 {"name":"p2","targets":[{"name":"b","kind":["test"]},{"name":"a","kind":["test"]},{"name":"bad","kind":["test"]}]}
]}"#;

/// The stand-in cargo. Job `a` finishes only once job `b` has started (bounded: after
/// `$WAIT_FOR_B` hundredths of a second it fails instead), so it passes only when two jobs run
/// at the same time.
const FAKE_CARGO: &str = r#"#!/bin/bash
set -u
dir="$(dirname "$0")"
case "$1" in
metadata) cat "$dir/metadata.json"; exit 0 ;;
test) ;;
*) echo "unexpected cargo $*" >&2; exit 3 ;;
esac
args=("$@")
job=unit
for ((i = 0; i < ${#args[@]}; i++)); do
  [[ ${args[$i]} == --test ]] && job=${args[$((i + 1))]}
  [[ ${args[$i]} == --doc ]] && job=doc
done
echo "$job" >>"$dir/started"
echo "begin $job"
echo "args $*"
if [[ $job == a ]]; then
  for _ in $(seq "$WAIT_FOR_B"); do grep -qx b "$dir/started" && break; sleep 0.01; done
  grep -qx b "$dir/started" || { echo "a ran alone"; exit 1; }
fi
for i in $(seq 200); do echo "$job line $i"; done
[[ $job == bad ]] && { echo "end $job"; exit 101; }
echo "end $job"
"#;

struct Rig {
    dir: PathBuf,
}

impl Rig {
    fn new(name: &str, fail: bool) -> Rig {
        let dir = std::env::temp_dir().join(format!("cli-mcp-lanes-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("temp dir");
        let metadata = if fail {
            METADATA.to_owned()
        } else {
            METADATA.replace(r#",{"name":"bad","kind":["test"]}"#, "")
        };
        fs::write(dir.join("metadata.json"), metadata).expect("metadata");
        let cargo = dir.join("cargo");
        fs::write(&cargo, FAKE_CARGO).expect("stand-in cargo");
        fs::set_permissions(&cargo, fs::Permissions::from_mode(0o755)).expect("chmod");
        Rig { dir }
    }

    /// The script on `lanes` lanes; job `a` waits up to `wait_for_b` hundredths of a second.
    fn run(&self, lanes: &str, wait_for_b: u32, args: &[&str]) -> Output {
        Command::new(workspace_root().join("hack/test-lanes.sh"))
            .args(args)
            .env("CARGO", self.dir.join("cargo"))
            .env("CLI_MCP_TEST_LANES", lanes)
            .env("TMPDIR", &self.dir)
            .env("WAIT_FOR_B", wait_for_b.to_string())
            .output()
            .expect("run hack/test-lanes.sh")
    }

    fn started(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_to_string(self.dir.join("started"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        v.sort();
        v
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Each job's lines form one unbroken block in the output.
fn assert_blocks_whole(out: &str, jobs: &[&str]) {
    let lines: Vec<&str> = out.lines().collect();
    for job in jobs {
        let begin = lines
            .iter()
            .position(|l| *l == format!("begin {job}"))
            .unwrap_or_else(|| panic!("no output of job {job}:\n{out}"));
        let end = lines
            .iter()
            .position(|l| *l == format!("end {job}"))
            .unwrap_or_else(|| panic!("job {job} did not end:\n{out}"));
        for l in &lines[begin..=end] {
            let own = l.starts_with(&format!("{job} line "))
                || *l == format!("begin {job}")
                || *l == format!("end {job}")
                || l.starts_with("args ");
            assert!(own, "job {job}'s output is broken by {l:?}:\n{out}");
        }
    }
}

#[test]
fn every_job_runs_in_parallel_lanes_and_a_failed_one_fails_the_run() {
    let rig = Rig::new("fail", true);
    let out = rig.run("2", 3000, &["--nocapture"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    // Every job once (target `a` of both packages in one job), the failed one too.
    assert_eq!(rig.started(), ["a", "b", "bad", "doc", "unit"]);
    // `a` waited for `b`: two lanes ran at once.
    assert!(stdout.contains("=== a: ok"), "{stdout}");
    assert!(stdout.contains("=== bad: FAILED (exit 101)"), "{stdout}");
    assert!(stdout.contains("test-lanes: FAILED: bad"), "{stdout}");
    assert!(
        !stdout.contains("FAILED: a\n") && !stdout.contains("FAILED: b\n"),
        "{stdout}"
    );
    assert_blocks_whole(&stdout, &["a", "b", "bad", "unit", "doc"]);
    // The arguments reach every test binary, after cargo's own.
    let args: Vec<&str> = stdout.lines().filter(|l| l.starts_with("args ")).collect();
    assert_eq!(args.len(), 5, "{stdout}");
    assert!(
        args.iter().all(|l| l.ends_with(" -- --nocapture")),
        "{args:?}"
    );
    assert!(stdout.contains("args test --workspace --no-fail-fast --test a -- --nocapture"));
}

#[test]
fn a_green_run_exits_zero_and_one_lane_runs_jobs_one_at_a_time() {
    let rig = Rig::new("green", false);
    let out = rig.run("2", 3000, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(rig.started(), ["a", "b", "doc", "unit"]);
    assert!(stdout.contains("4 jobs on 2 lanes"), "{stdout}");

    // On one lane, `a` (first) never sees `b` start: it reports running alone, and the run
    // fails for it. This is what the parallel run above is checked against.
    let rig = Rig::new("one-lane", false);
    let out = rig.run("1", 50, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("a ran alone"), "{stdout}");
}

#[test]
fn a_bad_lane_count_is_refused_with_what_to_give() {
    let rig = Rig::new("bad-lanes", false);
    for lanes in ["0", "x", "-1", "2x"] {
        let out = rig.run(lanes, 0, &[]);
        assert_eq!(out.status.code(), Some(2), "lanes {lanes:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("CLI_MCP_TEST_LANES must be a positive number"),
            "{stderr}"
        );
    }
    assert!(rig.started().is_empty(), "no job may run");
}
