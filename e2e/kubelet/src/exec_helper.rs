//! `cli-mcp-kubelet __exec --spec FILE [--join-pid PID] [-- ARGV...]`: the small,
//! single-threaded helper that turns itself into a container process.
//!
//! New container: enter the pod's network namespace, unshare a mount and UTS namespace, make
//! every mount private (so nothing propagates back to the host), bind-mount the volumes, set the
//! hostname, drop to the pod's uid/gid, `chdir` and `execve`.
//!
//! `--join-pid`: enter the network, UTS and mount namespaces of a running container instead
//! (exec probes, preStop hooks), then drop privileges and `execve` the given argv.
//!
//! Errors before `execve` are written to fd 3 (a close-on-exec status pipe from the kubelet);
//! EOF on that pipe without data means `execve` succeeded.

use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::mount::{mount, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};
use nix::unistd::{Gid, Uid};
use serde::{Deserialize, Serialize};

/// The argv[1] that selects helper mode.
pub const SUBCOMMAND: &str = "__exec";
/// Exit code of the helper when it fails before `execve`.
pub const SETUP_FAILED: i32 = 128;

/// One bind mount inside the container's mount namespace.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BindMount {
    pub source: PathBuf,
    pub target: PathBuf,
    pub read_only: bool,
}

/// Everything the helper needs; written by the kubelet as JSON (mode 0600).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct ExecSpec {
    pub netns: Option<PathBuf>,
    pub hostname: Option<String>,
    pub mounts: Vec<BindMount>,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub working_dir: Option<PathBuf>,
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub no_new_privs: bool,
}

struct Args {
    spec: PathBuf,
    join_pid: Option<i32>,
    argv: Option<Vec<String>>,
}

fn parse_args(args: &[String]) -> Result<Args, String> {
    let mut spec = None;
    let mut join_pid = None;
    let mut argv = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--spec" => spec = it.next().map(PathBuf::from),
            "--join-pid" => {
                let v = it.next().ok_or("--join-pid needs a value")?;
                join_pid = Some(v.parse().map_err(|_| format!("bad --join-pid {v:?}"))?);
            }
            "--" => {
                argv = Some(it.by_ref().cloned().collect());
            }
            other => return Err(format!("unknown helper argument {other:?}")),
        }
    }
    Ok(Args {
        spec: spec.ok_or("--spec FILE is required")?,
        join_pid,
        argv,
    })
}

/// Entry point of helper mode; never returns.
pub fn main(args: &[String]) -> ! {
    // SAFETY: fd 3 is the status pipe the kubelet put there (or not open at all, checked by
    // F_GETFD), and nothing else in this fresh process owns it.
    let status: Option<File> = unsafe {
        if libc::fcntl(3, libc::F_GETFD) >= 0 {
            libc::fcntl(3, libc::F_SETFD, libc::FD_CLOEXEC);
            Some(File::from(OwnedFd::from_raw_fd(3)))
        } else {
            None
        }
    };
    let err = match run(args) {
        Ok(never) => match never {},
        Err(e) => e,
    };
    let msg = format!("cli-mcp-kubelet: cannot start container process: {err}");
    eprintln!("{msg}");
    if let Some(mut f) = status {
        let _ = f.write_all(msg.as_bytes());
    }
    std::process::exit(SETUP_FAILED);
}

enum Never {}

fn run(args: &[String]) -> Result<Never, String> {
    let args = parse_args(args)?;
    let text = std::fs::read_to_string(&args.spec)
        .map_err(|e| format!("reading {}: {e}", args.spec.display()))?;
    let mut spec: ExecSpec =
        serde_json::from_str(&text).map_err(|e| format!("parsing {}: {e}", args.spec.display()))?;
    if let Some(argv) = args.argv {
        spec.argv = argv;
    }
    // The program as seen from the host, in case a volume later hides its path (e.g. an
    // emptyDir at /tmp over a binary below /tmp).
    let host_program = spec
        .argv
        .first()
        .and_then(|p| lookup_program(p, path_var(&spec)))
        .and_then(|p| open_source(&p).ok());
    match args.join_pid {
        Some(pid) => join_namespaces(pid)?,
        None => enter_new_namespaces(&spec)?,
    }
    drop_privileges(&spec)?;
    let dir = spec
        .working_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("/"));
    nix::unistd::chdir(&dir).map_err(|e| {
        format!(
            "workingDir {}: {e} (uid {} must be able to enter it)",
            dir.display(),
            spec.uid
        )
    })?;
    exec(&spec, host_program.as_ref())
}

fn open_ns(path: &Path) -> Result<File, String> {
    File::open(path).map_err(|e| format!("opening namespace {}: {e}", path.display()))
}

fn join_namespaces(pid: i32) -> Result<(), String> {
    // Open all first: after entering the mount namespace /proc may look different.
    let net = open_ns(Path::new(&format!("/proc/{pid}/ns/net")))?;
    let uts = open_ns(Path::new(&format!("/proc/{pid}/ns/uts")))?;
    let mnt = open_ns(Path::new(&format!("/proc/{pid}/ns/mnt")))?;
    setns(&net, CloneFlags::CLONE_NEWNET).map_err(|e| format!("setns net of {pid}: {e}"))?;
    setns(&uts, CloneFlags::CLONE_NEWUTS).map_err(|e| format!("setns uts of {pid}: {e}"))?;
    setns(&mnt, CloneFlags::CLONE_NEWNS).map_err(|e| format!("setns mnt of {pid}: {e}"))?;
    Ok(())
}

fn enter_new_namespaces(spec: &ExecSpec) -> Result<(), String> {
    if let Some(netns) = &spec.netns {
        let f = open_ns(netns)?;
        setns(&f, CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("entering network namespace {}: {e}", netns.display()))?;
    }
    unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWUTS)
        .map_err(|e| format!("unshare mount+uts namespace: {e}"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| format!("making / private in the new mount namespace: {e}"))?;
    let mut mounts = spec.mounts.clone();
    // Parents before children, whatever order the pod listed them in.
    mounts.sort_by_key(|m| m.target.components().count());
    // Open every source before the first mount: a volume mounted at e.g. /tmp would
    // otherwise hide the sources of later mounts that live below /tmp on the host.
    let sources = mounts
        .iter()
        .map(|m| open_source(&m.source))
        .collect::<Result<Vec<_>, _>>()?;
    for (m, src) in mounts.iter().zip(&sources) {
        bind(m, src)?;
    }
    if let Some(h) = &spec.hostname {
        nix::unistd::sethostname(h).map_err(|e| format!("sethostname {h:?}: {e}"))?;
    }
    Ok(())
}

/// An `O_PATH` handle on a mount source; mounted through `/proc/self/fd/N`.
fn open_source(path: &Path) -> Result<File, String> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("volume source {}: {e}", path.display()))
}

fn bind(m: &BindMount, src: &File) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let src_meta = src
        .metadata()
        .map_err(|e| format!("volume source {}: {e}", m.source.display()))?;
    if !m.target.exists() {
        // Mount points are created on the shared filesystem (visible on the host, empty).
        let made = if src_meta.is_dir() {
            std::fs::create_dir_all(&m.target)
        } else {
            m.target
                .parent()
                .map(std::fs::create_dir_all)
                .unwrap_or(Ok(()))
                .and_then(|_| File::create(&m.target).map(|_| ()))
        };
        made.map_err(|e| format!("creating mount point {}: {e}", m.target.display()))?;
    }
    let fd_path = format!("/proc/self/fd/{}", src.as_raw_fd());
    mount(
        Some(fd_path.as_str()),
        &m.target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| {
        format!(
            "bind-mounting {} at {}: {e}",
            m.source.display(),
            m.target.display()
        )
    })?;
    if m.read_only {
        mount(
            None::<&str>,
            &m.target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .map_err(|e| format!("remounting {} read-only: {e}", m.target.display()))?;
    }
    Ok(())
}

fn drop_privileges(spec: &ExecSpec) -> Result<(), String> {
    let groups: Vec<Gid> = spec.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    nix::unistd::setgroups(&groups).map_err(|e| format!("setgroups {:?}: {e}", spec.groups))?;
    let gid = Gid::from_raw(spec.gid);
    nix::unistd::setresgid(gid, gid, gid).map_err(|e| format!("setgid {}: {e}", spec.gid))?;
    let uid = Uid::from_raw(spec.uid);
    nix::unistd::setresuid(uid, uid, uid).map_err(|e| format!("setuid {}: {e}", spec.uid))?;
    if spec.no_new_privs {
        nix::sys::prctl::set_no_new_privs().map_err(|e| format!("no_new_privs: {e}"))?;
    }
    Ok(())
}

/// Finds `argv[0]` on the container's PATH when it has no slash.
pub fn lookup_program(program: &str, path_var: Option<&str>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    path_var
        .unwrap_or(crate::env::DEFAULT_PATH)
        .split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(program))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

fn cstring(s: &[u8]) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{:?} contains a NUL byte", String::from_utf8_lossy(s)))
}

fn path_var(spec: &ExecSpec) -> Option<&str> {
    spec.env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str())
}

/// Executes argv[0] as found in the container's view; if it is not there (hidden by a
/// volume), executes the file found on the host before the mounts (`execveat` on its fd).
fn exec(spec: &ExecSpec, host_program: Option<&File>) -> Result<Never, String> {
    let program = spec.argv.first().ok_or("empty command line")?;
    let argv = spec
        .argv
        .iter()
        .map(|a| cstring(a.as_bytes()))
        .collect::<Result<Vec<_>, _>>()?;
    let envp = spec
        .env
        .iter()
        .map(|(k, v)| cstring(format!("{k}={v}").as_bytes()))
        .collect::<Result<Vec<_>, _>>()?;
    let in_view = lookup_program(program, path_var(spec)).filter(|p| p.exists());
    let result = match (in_view, host_program) {
        (Some(resolved), _) => {
            let file = cstring(resolved.as_os_str().as_bytes())?;
            nix::unistd::execve(&file, &argv, &envp)
                .map_err(|e| format!("execve {}: {e}", resolved.display()))
        }
        (None, Some(fd)) => {
            nix::unistd::execveat(fd, c"", &argv, &envp, nix::fcntl::AtFlags::AT_EMPTY_PATH)
                .map_err(|e| format!("execveat {program:?} (hidden by a volume mount): {e}"))
        }
        (None, None) => Err(format!("executable {program:?} not found in PATH")),
    };
    match result {
        Err(e) => Err(e),
        Ok(never) => match never {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_helper_args() {
        let a = parse_args(&strings(&[
            "--spec",
            "/x.json",
            "--join-pid",
            "42",
            "--",
            "cat",
            "/f",
        ]))
        .expect("valid");
        assert_eq!(a.spec, PathBuf::from("/x.json"));
        assert_eq!(a.join_pid, Some(42));
        assert_eq!(a.argv, Some(strings(&["cat", "/f"])));
        assert!(parse_args(&strings(&["--join-pid", "x", "--spec", "/s"])).is_err());
        assert!(parse_args(&strings(&[])).is_err());
    }

    #[test]
    fn finds_programs_on_path() {
        assert_eq!(
            lookup_program("/bin/x", None),
            Some(PathBuf::from("/bin/x"))
        );
        let sh = lookup_program("sh", Some("/nonexistent:/bin:/usr/bin"));
        assert!(sh.is_some_and(|p| p.ends_with("sh")));
        assert_eq!(lookup_program("no-such-program-xyz", None), None);
    }

    #[test]
    fn spec_round_trips() {
        let spec = ExecSpec {
            netns: Some("/run/netns/cm-1".into()),
            argv: strings(&["/bin/true"]),
            env: vec![("A".into(), "b".into())],
            mounts: vec![BindMount {
                source: "/s".into(),
                target: "/t".into(),
                read_only: true,
            }],
            ..Default::default()
        };
        let text = serde_json::to_string(&spec).expect("serializes");
        assert_eq!(serde_json::from_str::<ExecSpec>(&text).ok(), Some(spec));
    }
}
