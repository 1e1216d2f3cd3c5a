//! Finding and signalling the processes a command started, from `/proc`.
//!
//! With `set -m` bash puts every job (foreground or background) in its own process group,
//! so "the command's processes" are the process groups of shell descendants that did not
//! exist before the command started. Killing those groups leaves the shell — and with it
//! `cd`, `export` and functions — alive.

use std::collections::{BTreeSet, HashMap};
use std::fs;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
    /// Exited, not yet reaped: nothing left to kill.
    pub zombie: bool,
}

/// Parses `/proc/<pid>/stat`. The command name may contain spaces and parentheses, so
/// fields are read after the last `)`.
pub fn parse_stat(stat: &str) -> Option<ProcInfo> {
    let (head, rest) = stat.rsplit_once(')')?;
    let pid = head.split_once('(')?.0.trim().parse().ok()?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgid = fields.next()?.parse().ok()?;
    Some(ProcInfo {
        pid,
        ppid,
        pgid,
        zombie: matches!(state, "Z" | "X"),
    })
}

/// Every process visible in `/proc` (processes that vanish while scanning are skipped).
pub fn snapshot() -> Vec<ProcInfo> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|s| parse_stat(&s))
        .collect()
}

/// Pids of all descendants of `root` in `table` (not `root` itself).
pub fn descendants(table: &[ProcInfo], root: i32) -> BTreeSet<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for p in table {
        children.entry(p.ppid).or_default().push(p.pid);
    }
    let mut out = BTreeSet::new();
    let mut stack = vec![root];
    while let Some(pid) = stack.pop() {
        for &c in children.get(&pid).into_iter().flatten() {
            if out.insert(c) {
                stack.push(c);
            }
        }
    }
    out
}

/// Process groups of `root`'s descendants that are not in `existing`, excluding `root`'s own
/// group: the jobs a command started.
pub fn new_job_groups(table: &[ProcInfo], root: i32, existing: &BTreeSet<i32>) -> BTreeSet<i32> {
    let root_pgid = table.iter().find(|p| p.pid == root).map(|p| p.pgid);
    let desc = descendants(table, root);
    table
        .iter()
        .filter(|p| desc.contains(&p.pid) && !existing.contains(&p.pid))
        .map(|p| p.pgid)
        .filter(|g| Some(*g) != root_pgid && *g > 1)
        .collect()
}

/// Process group of `pid` in `table`.
pub fn pgid_of(table: &[ProcInfo], pid: i32) -> Option<i32> {
    table.iter().find(|p| p.pid == pid).map(|p| p.pgid)
}

/// Process groups of `root` and of all its descendants.
pub fn all_groups(table: &[ProcInfo], root: i32) -> BTreeSet<i32> {
    let desc = descendants(table, root);
    table
        .iter()
        .filter(|p| p.pid == root || desc.contains(&p.pid))
        .map(|p| p.pgid)
        .filter(|g| *g > 1)
        .collect()
}

/// A `/proc` file's text: an open, reads until a short one, a close. (`fs::read_to_string`
/// also asks for the file's size, which `/proc` does not know: one system call more, on
/// every command.)
fn read_proc(path: &str) -> Option<String> {
    read_from_start(&fs::File::open(path).ok()?)
}

/// The text of an open `/proc` file, read from its start (`pread` at offset 0, which makes
/// the kernel generate it anew, so a file held open reads the current state each time). A
/// `/proc` file hands over all it has in each read until the end, so a read that leaves
/// room in the buffer was the last.
fn read_from_start(file: &fs::File) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    loop {
        let n = file.read_at(&mut buf[len..], len as u64).ok()?;
        len += n;
        if n == 0 || len < buf.len() {
            break;
        }
        buf.resize(buf.len() * 2, 0);
    }
    buf.truncate(len);
    String::from_utf8(buf).ok()
}

/// This process's pid (`std::process::id` asks the kernel on every call).
fn own_pid() -> i32 {
    static PID: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *PID.get_or_init(|| std::process::id() as i32)
}

fn parse_pids(text: &str) -> BTreeSet<i32> {
    text.split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Direct children of `pid`, from `/proc/<pid>/task/<pid>/children` (one read instead of a
/// scan of every process). `None` when the kernel does not offer that file.
pub fn children(pid: i32) -> Option<BTreeSet<i32>> {
    Some(parse_pids(&read_proc(&format!(
        "/proc/{pid}/task/{pid}/children"
    ))?))
}

/// The `children` file of one process (`/proc/<pid>/task/<pid>/children`), held open for the
/// process's life: each read starts again at offset 0, where the kernel lists the children
/// anew. The shell's and the agent's own are read before every command; held, each read
/// is one `pread` instead of a walk of the `/proc` path, an open, a read and a close. The
/// file belongs to the process, not to its pid: once the process is gone it reads empty,
/// even if the pid is used again.
pub struct ChildrenFile(Option<fs::File>);

impl ChildrenFile {
    pub fn open(pid: i32) -> Self {
        Self(fs::File::open(format!("/proc/{pid}/task/{pid}/children")).ok())
    }

    /// The children now; `None` when the kernel does not offer the file.
    pub fn read(&self) -> Option<BTreeSet<i32>> {
        Some(parse_pids(&read_from_start(self.0.as_ref()?)?))
    }
}

/// The agent's own `children` file (of its main thread, which spawns the shell and adopts
/// orphans).
fn own_children() -> &'static ChildrenFile {
    static OWN: std::sync::OnceLock<ChildrenFile> = std::sync::OnceLock::new();
    OWN.get_or_init(|| ChildrenFile::open(own_pid()))
}

fn stat_of(pid: i32) -> Option<ProcInfo> {
    parse_stat(&read_proc(&format!("/proc/{pid}/stat"))?)
}

/// What exists under the shell before a command starts, to be spared when it is stopped.
/// With `set -m` every job leader is a direct child of bash, so the children are enough.
pub fn jobs_before(shell: i32) -> BTreeSet<i32> {
    children(shell).unwrap_or_else(|| descendants(&snapshot(), shell))
}

/// Process groups of the jobs the shell started since `before` was taken.
pub fn jobs_since(shell: i32, before: &BTreeSet<i32>) -> BTreeSet<i32> {
    match children(shell) {
        Some(kids) => kids
            .difference(before)
            .filter_map(|&p| stat_of(p))
            .map(|p| p.pgid)
            .filter(|&g| g != shell && g > 1)
            .collect(),
        None => new_job_groups(&snapshot(), shell, before),
    }
}

/// The processes in the shell's own group that it started since `before`, with all their
/// descendants: command and process substitutions (`$(…)`, `<(…)`), which bash runs in its
/// own group rather than as jobs. bash waits for them, so stopping a command must reach them
/// too; by pid, as a signal to the group would reach bash as well.
pub fn substitutions_since(shell: i32, before: &BTreeSet<i32>) -> BTreeSet<i32> {
    let ours = |p: &ProcInfo| p.pgid == shell && p.pid != shell && !before.contains(&p.pid);
    let mut out = BTreeSet::new();
    let Some(kids) = children(shell) else {
        let table = snapshot();
        for p in table.iter().filter(|p| p.ppid == shell && ours(p)) {
            out.insert(p.pid);
            out.extend(descendants(&table, p.pid));
        }
        return out;
    };
    let mut stack: Vec<i32> = kids
        .difference(before)
        .copied()
        .filter(|&p| stat_of(p).is_some_and(|info| ours(&info)))
        .collect();
    while let Some(pid) = stack.pop() {
        if out.insert(pid) {
            stack.extend(children(pid).into_iter().flatten());
        }
    }
    out
}

/// The process groups of the jobs that existed before a command (`before`, the shell's
/// children then) and still do.
pub fn jobs_from_before(shell: i32, before: &BTreeSet<i32>) -> BTreeSet<i32> {
    before
        .iter()
        .filter_map(|&p| stat_of(p))
        .filter(|p| p.ppid == shell && p.pgid != shell && p.pgid > 1)
        .map(|p| p.pgid)
        .collect()
}

/// The shell's processes: its descendants, and the orphans they left, which the agent (a
/// subreaper) adopted. Walked through the `children` files of each process's main thread,
/// so a session of a few processes costs a few reads; the walk stops once `cap` processes
/// are found. Children of a multi-threaded program's other threads are not seen: this is a
/// count for spotting a runaway, the kernel's limit is the bound. `None` when the kernel
/// offers no `children` files. Also returns the shell's direct children, which are what
/// [`jobs_before`] would read a moment later. `shell_children` is the shell's `children`
/// file.
pub fn session_count(
    shell: i32,
    shell_children: &ChildrenFile,
    cap: usize,
) -> Option<(usize, BTreeSet<i32>)> {
    let mut stack: Vec<i32> = own_children()
        .read()?
        .into_iter()
        .filter(|&p| p != shell)
        .collect();
    let shell_children = shell_children.read()?;
    stack.extend(shell_children.iter().copied());
    let mut seen = BTreeSet::new();
    while let Some(pid) = stack.pop() {
        if seen.len() >= cap {
            break;
        }
        if seen.insert(pid) {
            stack.extend(children(pid).into_iter().flatten());
        }
    }
    Some((seen.len(), shell_children))
}

/// The shell's processes as [`session_count`] finds them (every process below the agent
/// but the shell), with their groups, from a full scan.
pub fn session(shell: i32) -> Vec<ProcInfo> {
    let me = std::process::id() as i32;
    let table = snapshot();
    let below = descendants(&table, me);
    table
        .into_iter()
        .filter(|p| p.pid != shell && below.contains(&p.pid))
        .collect()
}

/// Threads of this process (`Threads:` in its status), 0 if unknown.
pub fn own_threads() -> u64 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Marks every descriptor this process inherited (fd >= 3) close-on-exec, so nothing the
/// agent's launcher left open (a runtime's pipe, a test harness socket) reaches bash and the
/// commands it runs. Call once at startup, before anything else opens files.
#[allow(unsafe_code)]
pub fn cloexec_inherited_fds() {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    use std::os::fd::BorrowedFd;
    let Ok(dir) = fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = dir
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd >= 3)
        .collect(); // the directory's own fd is closed once `dir` is consumed
    for fd in fds {
        // SAFETY: `fd` was listed as open a moment ago and nothing in this process closes
        // inherited descriptors; if it is gone anyway, fcntl fails with EBADF, which is
        // ignored. The borrow lives only for this call.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        if let Ok(flags) = fcntl(borrowed, FcntlArg::F_GETFD) {
            let flags = FdFlag::from_bits_truncate(flags) | FdFlag::FD_CLOEXEC;
            let _ = fcntl(borrowed, FcntlArg::F_SETFD(flags));
        }
    }
}

/// SIGKILLs every process below this process, and their groups (never our own group), until
/// none is left or `within` has passed; returns how many were still alive then. One pass is
/// not enough: a process killed in it may have forked (into a new session, even) after the
/// scan, and its child, re-parented to us as a subreaper, is seen only by the next scan.
pub async fn kill_descendants_of_self(within: std::time::Duration) -> usize {
    let me = std::process::id() as i32;
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let table = snapshot();
        let own = pgid_of(&table, me);
        let below = descendants(&table, me);
        let alive: Vec<&ProcInfo> = table
            .iter()
            .filter(|p| below.contains(&p.pid) && !p.zombie)
            .collect();
        if alive.is_empty() || tokio::time::Instant::now() >= deadline {
            return alive.len();
        }
        let groups = alive
            .iter()
            .map(|p| p.pgid)
            .filter(|g| Some(*g) != own && *g > 1)
            .collect();
        signal_groups(&groups, Signal::SIGKILL);
        for p in &alive {
            let _ = nix::sys::signal::kill(Pid::from_raw(p.pid), Signal::SIGKILL);
        }
        // The kernel delivers the signals and our reaper reaps; then look again.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Sends `sig` to each group; groups that are already gone are ignored.
pub fn signal_groups(groups: &BTreeSet<i32>, sig: Signal) {
    for &g in groups {
        let _ = killpg(Pid::from_raw(g), sig);
    }
}

pub fn signal_pids(pids: &BTreeSet<i32>, sig: Signal) {
    for &p in pids {
        let _ = nix::sys::signal::kill(Pid::from_raw(p), sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_odd_command_names() {
        let s = "4242 (we ird) (x) S 10 4242 10 0 -1 4194560 0 0";
        assert_eq!(
            parse_stat(s),
            Some(ProcInfo {
                pid: 4242,
                ppid: 10,
                pgid: 4242,
                zombie: false,
            })
        );
        assert_eq!(parse_stat("7 (z) Z 1 7 7 0").map(|p| p.zombie), Some(true));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x)"), None);
    }

    #[test]
    fn groups_of_new_jobs_only() {
        let p = |pid, ppid, pgid| ProcInfo {
            pid,
            ppid,
            pgid,
            zombie: false,
        };
        // shell 10 (group 10); old background job 11; new job 12 with child 13 in group 12;
        // an unrelated process 20.
        let table = [
            p(10, 1, 10),
            p(11, 10, 11),
            p(12, 10, 12),
            p(13, 12, 12),
            p(20, 1, 20),
        ];
        let existing = BTreeSet::from([11]);
        assert_eq!(new_job_groups(&table, 10, &existing), BTreeSet::from([12]));
        assert_eq!(descendants(&table, 10), BTreeSet::from([11, 12, 13]));
        assert_eq!(all_groups(&table, 10), BTreeSet::from([10, 11, 12]));
    }

    #[test]
    fn children_of_a_single_threaded_shell_are_listed() {
        let _serial = crate::test_support::PROCESSES.blocking_lock();
        use std::io::BufRead;
        // `children` is per thread; bash (like the agent's shell) has only its main thread.
        use std::os::unix::process::CommandExt;
        let mut bash = std::process::Command::new("bash")
            .args(["-c", "sleep 5 & echo $!; wait"])
            .process_group(0) // like the agent's shell: leader of its own group
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn bash");
        let mut line = String::new();
        std::io::BufReader::new(bash.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read pid");
        let sleep: i32 = line.trim().parse().expect("pid");
        let pid = bash.id() as i32;
        let kids = children(pid).unwrap_or_else(|| descendants(&snapshot(), pid));
        let since = jobs_since(pid, &BTreeSet::new());
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(sleep), Signal::SIGKILL);
        let _ = bash.wait();
        assert!(kids.contains(&sleep), "{kids:?}");
        // `bash -c` has no job control, so the sleep is in bash's own group: not a job.
        assert!(since.is_empty(), "{since:?}");
    }

    #[test]
    fn a_held_children_file_lists_the_children_of_the_moment() {
        let _serial = crate::test_support::PROCESSES.blocking_lock();
        use std::io::{BufRead, Write};
        let mut bash = std::process::Command::new("bash")
            .args(["-c", "read _; sleep 5 & echo $!; wait"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn bash");
        let pid = bash.id() as i32;
        let held = ChildrenFile::open(pid);
        let before = held.read();
        writeln!(bash.stdin.take().expect("stdin")).expect("go on");
        let mut line = String::new();
        std::io::BufReader::new(bash.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read pid");
        let sleep: i32 = line.trim().parse().expect("pid");
        let during = held.read();
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(sleep), Signal::SIGKILL);
        let _ = bash.wait();
        let after = held.read();
        if before.is_none() {
            return; // a kernel without `children` files
        }
        assert_eq!(before, Some(BTreeSet::new()));
        assert_eq!(during, Some(BTreeSet::from([sleep])));
        // Reaped: the file reads empty (never another process's children).
        assert_eq!(after, Some(BTreeSet::new()));
    }

    #[test]
    fn snapshot_sees_this_process() {
        let me = std::process::id() as i32;
        assert!(snapshot().iter().any(|p| p.pid == me));
    }
}
