//! `hack/lib/apt.sh`: two of the project's scripts installing at once on a fresh machine.
//!
//! apt's lock on its package lists does not wait: a second `apt-get update` while one runs
//! fails at once ("Could not get lock /var/lib/apt/lists/lock"). That failed `make test` on a
//! fresh machine, where two test binaries built the images at the same moment and each ran
//! `hack/build-images.sh`'s install. `apt_install` queues the project's installs behind one
//! lock and re-checks what is missing after it.
//!
//! The test puts a stand-in `apt-get` and `dpkg-query` first on PATH (no package is installed
//! and nothing leaves the machine): the stand-in `apt-get` refuses to run next to another one
//! exactly as apt does, and holds its `update` open until the test lets it finish.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use cli_mcp_e2e::process::processes_with_arg;
use cli_mcp_e2e::testing::workspace_root;

const WITHIN: Duration = Duration::from_secs(30);

/// The stand-in `apt-get`: `update` takes the "lists" lock without waiting (as apt does),
/// says it is in and waits for the test's `release` file; `install` marks the packages
/// installed and counts itself.
const FAKE_APT_GET: &str = r#"#!/bin/bash
set -u
dir="$(dirname "$(dirname "$0")")"
case " $* " in
*" update "*)
    exec 7>"$dir/lists.lock"
    flock -n 7 || { echo "E: Could not get lock $dir/lists.lock" >&2; exit 100; }
    echo "$$" >>"$dir/updates-in"
    for _ in $(seq 3000); do [[ -e "$dir/release" ]] && exit 0; sleep 0.01; done
    echo "the test never released the update" >&2; exit 1 ;;
*" install "*)
    for p in "$@"; do [[ $p == -* || $p == install ]] || touch "$dir/installed-$p"; done
    echo install >>"$dir/installs" ;;
esac
"#;

/// The stand-in `dpkg-query -W -f='${Status}' PKG`: installed once the stand-in apt-get
/// installed it.
const FAKE_DPKG_QUERY: &str = r#"#!/bin/bash
dir="$(dirname "$(dirname "$0")")"
pkg="${!#}"
[[ -e "$dir/installed-$pkg" ]] && printf 'install ok installed' && exit 0
exit 1
"#;

struct Rig {
    dir: PathBuf,
}

impl Rig {
    fn new(name: &str) -> Rig {
        let dir = std::env::temp_dir().join(format!("cli-mcp-apt-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("bin")).expect("temp dir");
        for (file, text) in [("apt-get", FAKE_APT_GET), ("dpkg-query", FAKE_DPKG_QUERY)] {
            let path = dir.join("bin").join(file);
            fs::write(&path, text).expect("stand-in");
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        Rig { dir }
    }

    fn lock(&self) -> PathBuf {
        self.dir.join("project-apt.lock")
    }

    /// `apt_install pkg` in a bash of its own, as one script of the project calls it.
    fn install(&self, pkg: &str) -> Child {
        let lib = workspace_root().join("hack/lib/apt.sh");
        let path = format!(
            "{}:{}",
            self.dir.join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        Command::new("bash")
            .arg("-c")
            .arg(format!("source '{}' && apt_install {pkg}", lib.display()))
            .env("PATH", path)
            .env("CLI_MCP_APT_LOCK", self.lock())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("bash")
    }

    fn lines(&self, file: &str) -> usize {
        fs::read_to_string(self.dir.join(file))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WITHIN;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what} within {WITHIN:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether a `flock` process holds (or waits for) `lock` on one of its descriptors.
fn waiting_on(lock: &str) -> bool {
    processes_with_arg("flock").into_iter().any(|(pid, argv)| {
        argv.first().is_some_and(|a| a.ends_with("flock"))
            && fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
                fds.flatten()
                    .any(|fd| fs::read_link(fd.path()).is_ok_and(|t| t.to_str() == Some(lock)))
            })
    })
}

fn finish(child: Child) -> (ExitStatus, String) {
    let out = child.wait_with_output().expect("wait");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_second_install_waits_for_the_first_and_finds_its_package_there() {
    let rig = Rig::new("queue");
    let first = rig.install("pkg-a");
    until("the first install inside apt-get update", || {
        (rig.lines("updates-in") == 1).then_some(())
    });

    let mut second = rig.install("pkg-a");
    // Either the second is queued on the project's lock (a `flock` naming it runs), or it
    // reached apt-get and failed on apt's lock, as it did before the project had one.
    let lock = rig.lock().display().to_string();
    let queued = until("the second install queued or ended", || {
        if let Ok(Some(status)) = second.try_wait() {
            return Some(Err(status));
        }
        waiting_on(&lock).then_some(Ok(()))
    });
    if let Err(status) = queued {
        let (_, err) = finish(second);
        panic!("the second install ran next to the first and ended with {status}: {err}");
    }

    fs::write(rig.dir.join("release"), b"").expect("release");
    let (s1, e1) = finish(first);
    let (s2, e2) = finish(second);
    assert!(s1.success(), "first install: {s1}: {e1}");
    assert!(s2.success(), "second install: {s2}: {e2}");
    // The second found the package installed after the wait: apt ran once.
    assert_eq!(rig.lines("updates-in"), 1, "apt-get update runs");
    assert_eq!(rig.lines("installs"), 1, "apt-get install runs");
}

#[test]
fn nothing_missing_runs_no_apt_and_a_failed_apt_says_so() {
    let rig = Rig::new("noop");
    fs::write(rig.dir.join("installed-pkg-b"), b"").expect("mark");
    let (status, err) = finish(rig.install("pkg-b"));
    assert!(status.success(), "{status}: {err}");
    assert_eq!(
        rig.lines("updates-in"),
        0,
        "no apt-get update for an installed package"
    );

    // apt's lists lock held by someone else: the install fails, with apt's own words shown.
    let lists = fs::File::create(rig.dir.join("lists.lock")).expect("lock file");
    nix::fcntl::Flock::lock(lists, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map(|held| {
            let (status, err) = finish(rig.install("pkg-c"));
            assert!(!status.success(), "an apt failure must fail the install");
            assert!(
                err.contains("Could not get lock"),
                "apt's message shown: {err}"
            );
            drop(held);
        })
        .map_err(|(_, e)| e)
        .expect("flock");
}
