//! Starts the real `cli-mcp-agent` binary on loopback and talks to it over real HTTP.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cli_mcp_api::token::{HmacKey, Token};
use cli_mcp_api::SessionId;
use serde_json::Value;

pub const POD: &str = "cli-mcp-t-pool-abcdefghij";

/// The agent binary with its state dir and working directory in `dir`, for a test that runs
/// it to see how it refuses to start: by default the state dir is the host's
/// `/tmp/cli-mcp-agent` (and the working directory `$HOME`), which a test must not touch.
pub fn agent_command(dir: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cli-mcp-agent"));
    cmd.arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--workdir")
        .arg(dir);
    cmd
}

pub fn key() -> HmacKey {
    HmacKey::from_bytes([9; 32])
}

pub fn session_token() -> Token {
    key().session_token(
        &SessionId::parse("s1").expect("valid"),
        &cli_mcp_api::token::SandboxNonce::from_bytes([4; 16]),
    )
}

pub fn assign_token() -> Token {
    key().assign_token(POD)
}

pub enum Mode {
    Assigned,
    Pool,
    /// Neither env var: recovery from the annotations file only.
    AnnotationsOnly,
}

pub struct Agent {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub state_dir: PathBuf,
    pub logs: Arc<Mutex<Vec<String>>>,
    _tmp: Option<tempfile::TempDir>,
    pub http: reqwest::Client,
}

pub struct Opts<'a> {
    pub mode: Mode,
    pub extra_args: &'a [&'a str],
    pub state_dir: Option<&'a Path>,
    pub annotations: Option<&'a Path>,
    /// Launch through a shell that leaves fd 7 open, as a careless launcher would.
    pub leak_fd7: bool,
    /// Launch through a shell that ignores SIGQUIT, SIGTSTP and SIGHUP, as a terminal's job
    /// control or `nohup` would (ignored signals survive exec).
    pub ignore_signals: bool,
    /// Run the agent (and so its shell) as this uid and gid; needs root. Its temporary
    /// directory is handed to that user.
    pub run_as: Option<u32>,
    /// The agent's working directory (relative paths in its flags resolve against it).
    pub cwd: Option<&'a Path>,
    /// Extra environment of the agent (as a pod spec would set it).
    pub env: &'a [(&'a str, &'a str)],
    /// RLIMIT_NPROC for the agent and everything it starts, as a last bound for tests that
    /// fork a lot (it counts every process of the agent's uid).
    pub nproc_limit: Option<u64>,
}

impl Default for Opts<'_> {
    fn default() -> Self {
        Self {
            mode: Mode::Assigned,
            extra_args: &[],
            state_dir: None,
            annotations: None,
            leak_fd7: false,
            ignore_signals: false,
            run_as: None,
            cwd: None,
            env: &[],
            nproc_limit: None,
        }
    }
}

impl Agent {
    pub fn start() -> Self {
        Self::start_with(Opts::default())
    }

    pub fn start_with(opts: Opts<'_>) -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        let state_dir = opts
            .state_dir
            .map(Path::to_path_buf)
            .unwrap_or_else(|| tmp.path().join("state"));
        let workdir = tmp.path().join("work");
        std::fs::create_dir_all(&workdir).expect("workdir");
        if let Some(id) = opts.run_as {
            let (uid, gid) = (
                Some(nix::unistd::Uid::from_raw(id)),
                Some(nix::unistd::Gid::from_raw(id)),
            );
            for dir in [tmp.path(), workdir.as_path()] {
                nix::unistd::chown(dir, uid, gid).expect("hand the test dir to the agent's user");
            }
        }
        let agent_bin = env!("CARGO_BIN_EXE_cli-mcp-agent");
        // A careless launcher: bash opens fd 7 without close-on-exec, or ignores signals
        // (both survive exec), then execs the agent.
        let launcher: String = [
            (opts.leak_fd7, "exec 7</dev/null; "),
            (opts.ignore_signals, "trap '' QUIT TSTP HUP; "),
        ]
        .into_iter()
        .filter_map(|(on, step)| on.then_some(step))
        .collect();
        let mut cmd = if launcher.is_empty() {
            Command::new(agent_bin)
        } else {
            let mut c = Command::new("bash");
            c.args(["-c", &format!("{launcher}exec \"$0\" \"$@\""), agent_bin]);
            c
        };
        // A generous grace: with twenty agents on two loaded cores a healthy shell can take
        // over a second to answer an interrupt, and must not be judged wedged.
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--log-json",
            "--kill-grace-ms",
            "3000",
        ])
        .arg("--state-dir")
        .arg(&state_dir)
        .arg("--workdir")
        .arg(&workdir)
        .arg("--podinfo-annotations")
        .arg(
            opts.annotations
                .map(Path::to_path_buf)
                .unwrap_or_else(|| tmp.path().join("no-annotations")),
        )
        .args(opts.extra_args)
        .env_remove("TOKEN_SHA256")
        .env_remove("ASSIGN_SHA256")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        if let Some(id) = opts.run_as {
            use std::os::unix::process::CommandExt;
            cmd.uid(id).gid(id);
        }
        if let Some(dir) = opts.cwd {
            cmd.current_dir(dir);
        }
        cmd.envs(opts.env.iter().copied());
        if let Some(limit) = opts.nproc_limit {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit(2) is async-signal-safe and touches no memory of the parent.
            #[allow(unsafe_code)]
            unsafe {
                cmd.pre_exec(move || {
                    nix::sys::resource::setrlimit(
                        nix::sys::resource::Resource::RLIMIT_NPROC,
                        limit,
                        limit,
                    )
                    .map_err(std::io::Error::from)
                });
            }
        }
        match opts.mode {
            Mode::Assigned => {
                cmd.env("TOKEN_SHA256", session_token().commitment().to_hex());
            }
            Mode::Pool => {
                cmd.env("ASSIGN_SHA256", assign_token().commitment().to_hex());
            }
            Mode::AnnotationsOnly => {}
        }
        let mut child = cmd.spawn().expect("spawn cli-mcp-agent");
        let stderr = child.stderr.take().expect("stderr piped");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = logs.clone();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    if let Some(addr) = v.get("listen").and_then(Value::as_str) {
                        if let Some(tx) = tx.take() {
                            let _ = tx.send(addr.to_owned());
                        }
                    }
                }
                sink.lock().expect("log lock").push(line);
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| {
                panic!(
                    "agent did not report its address; logs: {:?}",
                    logs.lock().map(|l| l.clone())
                )
            })
            .parse()
            .expect("socket address");
        Self {
            child: Some(child),
            addr,
            state_dir,
            logs,
            _tmp: Some(tmp),
            // A regression that hangs must fail the test, not the CI run.
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .expect("HTTP client"),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// POSTs `body` with `bearer` (None: no Authorization header).
    pub async fn post(&self, path: &str, bearer: Option<&str>, body: Value) -> (u16, Value) {
        let mut req = self.http.post(self.url(path)).json(&body);
        if let Some(b) = bearer {
            req = req.bearer_auth(b);
        }
        let res = req.send().await.expect("request reaches the agent");
        let status = res.status().as_u16();
        let json = res.json::<Value>().await.expect("JSON body");
        (status, json)
    }

    /// Runs a command with the session token and returns the JSON response (status 200).
    pub async fn exec(&self, command: &str) -> Value {
        self.exec_with(serde_json::json!({"command": command}))
            .await
    }

    pub async fn exec_with(&self, body: Value) -> Value {
        let (status, v) = self
            .post("/exec", Some(session_token().expose()), body)
            .await;
        assert_eq!(status, 200, "exec failed: {v}");
        v
    }

    /// Sends SIGTERM and waits for the process to exit; returns its exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        child.wait().expect("wait agent")
    }

    /// Kills the agent at once (a container crash).
    pub fn crash(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.crash();
    }
}

/// `VmRSS`/`VmHWM` of a process in KiB.
pub fn mem_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("field present")
}

/// Sockets the process holds open (its listener included): the connections it serves.
pub fn sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// Polls `cond` until it holds or `within` has passed; true if it held.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if std::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A tmpfs of its own, so that filling it fills nothing else; unmounted when dropped, also
/// when the test fails. Needs root (CAP_SYS_ADMIN): `None` otherwise.
pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    pub fn mount(bytes: u64) -> Option<Self> {
        Self::mount_with(bytes, "")
    }

    /// With more mount options (`nr_inodes=64`).
    pub fn mount_with(bytes: u64, options: &str) -> Option<Self> {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut data = format!("size={bytes},mode=0755");
        if !options.is_empty() {
            data = format!("{data},{options}");
        }
        match nix::mount::mount(
            Some("tmpfs"),
            dir.path(),
            Some("tmpfs"),
            nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
            Some(data.as_str()),
        ) {
            Ok(()) => Some(Self { dir }),
            Err(e) => {
                eprintln!("SKIPPED: cannot mount a tmpfs (needs root): {e}");
                None
            }
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Bytes in use on it: every file, also ones deleted but still held open, which `du`
    /// cannot see.
    pub fn used(&self) -> u64 {
        let s = nix::sys::statvfs::statvfs(self.dir.path()).expect("statvfs");
        (s.blocks() - s.blocks_free()) as u64 * s.fragment_size() as u64
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazy: a process of a failed test may still hold a file on it.
        let _ = nix::mount::umount2(self.dir.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Bytes `du` would count under `dir`: allocated blocks of every file.
pub fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match std::fs::symlink_metadata(e.path()) {
            Ok(m) if m.is_dir() => disk_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}
