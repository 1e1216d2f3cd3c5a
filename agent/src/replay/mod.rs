//! Replay journal: what happened to the last few requests that carried a `request_id`, kept
//! in memory and in `<state-dir>/replay/`, so that a retry is answered instead of run twice
//! even when the agent process died in between.
//!
//! The server retries a command once, with the same `request_id`, after a broken connection.
//! If the agent crashed (OOM, SIGKILL) while the command ran, the kubelet restarts the
//! container and memory is gone, but the state dir (on the pod's `/tmp` emptyDir) is not.
//! Before a command runs, its record (request id hash, command hash, start time) is written
//! as "in progress"; when it is done, the response replaces it. A restarted agent loads the
//! records: a retry matching an in-progress record of the previous process is answered
//! "interrupted by an agent restart" and not run; a completed one is replayed.
//!
//! A command that fails after it was sent to bash (its output cannot be read, or the shell
//! cannot be replaced after it) may have run: its record is not forgotten but completed
//! with an "effects unknown" answer, so a retry is not run either. Only a command that
//! certainly never reached bash is forgotten, so that a retry runs it.
//!
//! The directory is writable by the sandbox user, so a record file is hostile input: it is
//! opened without following links or blocking, read only if it is a regular file under a
//! size cap, parsed strictly, and ignored (with a log line) when it is anything else. A
//! record answers only the request whose id hashes to the hash it holds, and a response
//! whose stdout or stderr is longer than a live one can be (the output budget plus room for
//! markers and notes) is not replayed, so a forged record cannot bypass truncation.
//! The directory is held open ([`HeldDir`]) and every record is read, written and removed
//! through that descriptor, never through the path, so a link swapped in for the directory
//! at any moment is never followed. Before every write or removal one `lstat` tells
//! whether the path still leads to the held directory (a restarted agent looks there);
//! otherwise a link or file in its place is removed and a real directory made and held.
//!
//! None of this stops the shell user from forging or deleting its own session's records:
//! the user that runs the caller's commands can write here, and there are no keyed
//! checksums. That user is the caller's own principal, so a forged record only lies to the
//! caller about commands it ran itself; a deleted record re-opens the run-twice window: a
//! retry after an agent crash runs the command again.
//!
//! Files are rewritten in place, not through a temp file and a rename: on ext4 (a
//! disk-backed emptyDir) replacing a file by rename forces its data out to disk
//! (`auto_da_alloc`), 0.15 ms per write, which would double the cost of a fast command. In
//! place is safe here because the journal must survive the death of the agent process, not
//! of the node: the page cache survives, and a dying process's `write` is cut, if at all,
//! only at page boundaries. So each slot has two files:
//! - `<slot>.json`: the request (sequence number, hashes of the id and of the command,
//!   start time), well under one page, hence written whole or not at all. Written before
//!   the command runs; alone, it means "in progress".
//! - `<slot>.response`: a header line with the sequence number, the request hash, and the
//!   length and SHA-256 of the response JSON that follows. A cut write fails the check and
//!   the request reads as in progress: the answer is "effects unknown", never a second run
//!   and never a response stitched from two writes.

mod record;

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

use cli_mcp_api::wire::ExecResponse;

use crate::state_files::{remove_all_at, remove_file_at, write_in_place_at, HeldDir};
use record::{encode_response, read_response, response_cap, within_output_budget, RequestFile};

/// Requests remembered. More than one, so a retry still finds its record when another
/// caller's command ran in between.
pub const RECORDS_KEPT: usize = 4;

/// What the journal knows about a request.
pub enum Lookup<'a> {
    /// Never seen (or forgotten): run it.
    Unknown,
    /// The id was used for another command: refuse rather than answer with an unrelated result.
    OtherCommand,
    /// Done: send this response again.
    Done(&'a ExecResponse),
    /// It was running when a previous agent process died; `started` is when it started.
    Interrupted { slot: usize, started: SystemTime },
}

#[derive(Debug, Clone)]
enum State {
    /// Running in this process (only seen if the task running it died).
    Running,
    /// Was running in a previous agent process, which died before it ended.
    Interrupted,
    Done(ExecResponse),
}

#[derive(Debug, Clone)]
struct Record {
    request: RequestFile,
    state: State,
}

pub struct Journal {
    state_dir: PathBuf,
    /// `None` while it cannot be made (records are then kept in memory only).
    dir: Option<HeldDir>,
    output_budget: usize,
    response_cap: u64,
    slots: [Option<Record>; RECORDS_KEPT],
    next_seq: u64,
}

/// Full SHA-256 of `s`, lowercase hex.
pub fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

impl Journal {
    /// Loads the records a previous agent process left in `<state_dir>/replay`. Never fails:
    /// a journal that cannot be read or written only costs replay across restarts, which
    /// is logged.
    pub fn open(state_dir: &Path, output_budget: usize) -> Self {
        let path = state_dir.join("replay");
        let replaced = std::fs::symlink_metadata(&path).is_ok_and(|m| !m.is_dir());
        if replaced {
            tracing::warn!(path = %path.display(),
                "the replay directory is not a directory; replacing it");
        }
        let dir = HeldDir::open(state_dir, Some("replay"))
            .inspect_err(|e| {
                tracing::warn!(path = %path.display(), error = %e,
                    "cannot make the replay directory; records are kept in memory only")
            })
            .ok();
        let mut journal = Self {
            state_dir: state_dir.to_path_buf(),
            dir,
            output_budget,
            response_cap: response_cap(output_budget),
            slots: Default::default(),
            next_seq: 1,
        };
        if replaced {
            return journal;
        }
        let mut max_seq = 0;
        for slot in 0..RECORDS_KEPT {
            match journal.load(slot) {
                Ok(None) => {}
                Ok(Some(rec)) => {
                    max_seq = max_seq.max(rec.request.seq);
                    journal.slots[slot] = Some(rec);
                }
                Err((name, why)) => {
                    tracing::warn!(path = %path.join(name).display(), why, "ignoring a replay record")
                }
            }
        }
        journal.next_seq = max_seq.wrapping_add(1);
        let loaded = journal.slots.iter().flatten().count();
        if loaded > 0 {
            tracing::info!(
                records = loaded,
                "replay records of a previous agent process loaded"
            );
        }
        journal
    }

    /// What is known about `request_id` with the command hashing to `command_sha256`
    /// ([`sha256_hex`]).
    pub fn lookup(&self, request_id: &str, command_sha256: &str) -> Lookup<'_> {
        let request = sha256_hex(request_id);
        let Some((slot, rec)) = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((i, r.as_ref()?)))
            .filter(|(_, r)| r.request.request_sha256 == request)
            .max_by_key(|(_, r)| r.request.seq)
        else {
            return Lookup::Unknown;
        };
        if rec.request.command_sha256 != command_sha256 {
            return Lookup::OtherCommand;
        }
        match &rec.state {
            // Its task died without an answer in this process: nothing to replay, and the
            // command may not have started; run it as before the journal existed.
            State::Running => Lookup::Unknown,
            State::Interrupted => Lookup::Interrupted {
                slot,
                started: rec.request.started(),
            },
            State::Done(resp) => Lookup::Done(resp),
        }
    }

    /// Records that `request_id` starts running the command hashing to `command_sha256`, on
    /// disk before it runs. Returns the slot to pass to [`Journal::finish`] or
    /// [`Journal::forget`].
    pub fn begin(&mut self, request_id: &str, command_sha256: &str) -> usize {
        let seq = self.next_seq;
        self.next_seq = seq.wrapping_add(1);
        let slot = (seq % RECORDS_KEPT as u64) as usize;
        let request = RequestFile::new(seq, sha256_hex(request_id), command_sha256.to_owned());
        match serde_json::to_vec(&request) {
            Ok(bytes) => self.write(&request_name(slot), &bytes),
            Err(e) => tracing::warn!(error = %e, "cannot encode a replay record"),
        }
        self.slots[slot] = Some(Record {
            request,
            state: State::Running,
        });
        slot
    }

    /// Records the response of the command begun in `slot`.
    pub fn finish(&mut self, slot: usize, response: &ExecResponse) {
        let Some(rec) = self.slots.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        rec.state = State::Done(response.clone());
        if let Some(bytes) = encode_response(&rec.request, response) {
            self.write(&response_name(slot), &bytes);
        }
    }

    /// Drops the record in `slot`, so a retry runs the command. Only for a command that
    /// certainly never reached bash ([`crate::shell::ShellError::command_may_have_run`] is
    /// false); one that may have run is [`Journal::finish`]ed with an "effects unknown"
    /// answer instead, or a retry would run it a second time.
    pub fn forget(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
            if let Some(dir) = self.dir() {
                let _ = remove_file_at(dir.fd(), &request_name(slot));
            }
        }
    }

    /// Keeps the answer given to an interrupted request (in memory only: after another
    /// restart the in-progress record on disk means the same).
    pub fn settle(&mut self, slot: usize, response: &ExecResponse) {
        if let Some(Some(rec)) = self.slots.get_mut(slot) {
            rec.state = State::Done(response.clone());
        }
    }

    fn load(&self, slot: usize) -> Result<Option<Record>, (String, String)> {
        let Some(dir) = self.dir.as_ref() else {
            return Ok(None);
        };
        let name = request_name(slot);
        let Some(request) = RequestFile::read(dir.fd(), &name).map_err(|why| (name, why))? else {
            return Ok(None);
        };
        let name = response_name(slot);
        let path = dir.path().join(&name);
        let state = match read_response(dir.fd(), &name, self.response_cap, &request) {
            Ok(Some(resp)) if within_output_budget(&resp, self.output_budget) => State::Done(resp),
            Ok(Some(_)) => {
                // The shell user can write here: never replay more than a live answer holds.
                tracing::warn!(path = %path.display(),
                    "ignoring a replay response whose output is over the output budget");
                State::Interrupted
            }
            Ok(None) => State::Interrupted,
            Err(why) => {
                // The request stands: an unreadable response means "effects unknown".
                tracing::warn!(path = %path.display(), why, "ignoring a replay response");
                State::Interrupted
            }
        };
        Ok(Some(Record { request, state }))
    }

    /// Rewrites `name` in place (see the module docs for why not temp + rename). Anything
    /// but our own regular file there (a link, a FIFO, a directory, a hard link to another
    /// file) is removed and the write tried once more.
    fn write(&mut self, name: &str, bytes: &[u8]) {
        if let Some(dir) = self.dir() {
            if write_in_place_at(dir.fd(), name, bytes).is_ok() {
                return;
            }
        }
        // Off the hot path: only after a failure (a command broke the directory).
        self.repair_dir();
        let result = match &self.dir {
            Some(dir) => {
                let _ = remove_all_at(dir.fd(), name.as_ref());
                write_in_place_at(dir.fd(), name, bytes)
            }
            None => Err(std::io::Error::other("no replay directory")),
        };
        if let Err(e) = result {
            tracing::warn!(path = %self.state_dir.join("replay").join(name).display(), error = %e,
                "cannot write a replay record; a retry after an agent restart would run the command again");
        }
    }

    /// The journal directory, made again first if its path no longer leads to it (one
    /// `lstat`): a command replaced it (by a link?) or changed its mode.
    fn dir(&mut self) -> Option<&HeldDir> {
        if !self.dir.as_ref().is_some_and(HeldDir::in_place) {
            tracing::warn!(path = %self.state_dir.join("replay").display(),
                "the replay directory was replaced (by a link?) or its mode changed; making it again");
            self.repair_dir();
        }
        self.dir.as_ref()
    }

    /// The state dir first: a command may have taken the access to it away.
    fn repair_dir(&mut self) {
        match &mut self.dir {
            Some(dir) => {
                if dir.reopen().is_err() {
                    self.dir = None;
                }
            }
            None => self.dir = HeldDir::open(&self.state_dir, Some("replay")).ok(),
        }
    }
}

fn request_name(slot: usize) -> String {
    format!("{slot}.json")
}

fn response_name(slot: usize) -> String {
    format!("{slot}.response")
}

#[cfg(test)]
mod tests {
    use super::record::STREAM_SLACK;
    use super::*;
    use std::fs;

    fn response(stdout: &str) -> ExecResponse {
        ExecResponse {
            stdout: stdout.into(),
            stderr: String::new(),
            stdout_encoding: Default::default(),
            stderr_encoding: Default::default(),
            exit_code: 0,
            duration_ms: 1,
            timed_out: false,
            truncated: false,
            total_bytes: stdout.len() as u64,
            cwd: "/w".into(),
            shell_restarted: false,
        }
    }

    #[test]
    fn records_survive_a_new_journal_on_the_same_dir() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut j = Journal::open(d.path(), 1024);
        let a = j.begin("a", &sha256_hex("echo a"));
        j.finish(a, &response("a\n"));
        j.begin("b", &sha256_hex("sleep 9"));
        drop(j);
        let j = Journal::open(d.path(), 1024);
        assert!(
            matches!(j.lookup("a", &sha256_hex("echo a")), Lookup::Done(r) if r.stdout == "a\n")
        );
        assert!(matches!(
            j.lookup("b", &sha256_hex("sleep 9")),
            Lookup::Interrupted { .. }
        ));
        assert!(matches!(
            j.lookup("b", &sha256_hex("sleep 8")),
            Lookup::OtherCommand
        ));
        assert!(matches!(
            j.lookup("c", &sha256_hex("echo a")),
            Lookup::Unknown
        ));
    }

    #[test]
    fn only_the_last_records_are_kept_and_slots_continue_after_a_restart() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut j = Journal::open(d.path(), 1024);
        for i in 0..RECORDS_KEPT + 2 {
            let s = j.begin(&format!("r{i}"), &sha256_hex("true"));
            j.finish(s, &response(""));
        }
        let mut j = Journal::open(d.path(), 1024);
        assert!(matches!(
            j.lookup("r0", &sha256_hex("true")),
            Lookup::Unknown
        ));
        assert!(matches!(
            j.lookup("r1", &sha256_hex("true")),
            Lookup::Unknown
        ));
        assert!(matches!(
            j.lookup("r2", &sha256_hex("true")),
            Lookup::Done(_)
        ));
        // The next record overwrites the oldest one (r2), not the newest.
        let s = j.begin("new", &sha256_hex("true"));
        j.finish(s, &response(""));
        assert!(matches!(
            j.lookup("r2", &sha256_hex("true")),
            Lookup::Unknown
        ));
        assert!(matches!(
            j.lookup("r5", &sha256_hex("true")),
            Lookup::Done(_)
        ));
        let files = fs::read_dir(d.path().join("replay")).expect("dir").count();
        assert_eq!(
            files,
            2 * RECORDS_KEPT,
            "a request and a response file per slot"
        );
    }

    #[test]
    fn a_record_running_in_this_process_is_not_an_interruption() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut j = Journal::open(d.path(), 1024);
        let s = j.begin("a", &sha256_hex("true"));
        assert!(matches!(
            j.lookup("a", &sha256_hex("true")),
            Lookup::Unknown
        ));
        j.forget(s);
        assert!(!d.path().join("replay").join(format!("{s}.json")).exists());
    }

    #[test]
    fn junk_is_ignored_and_then_overwritten() {
        let d = tempfile::tempdir().expect("tempdir");
        let dir = d.path().join("replay");
        fs::create_dir_all(&dir).expect("dir");
        fs::write(dir.join("0.json"), "{\"v\":1").expect("junk");
        fs::write(dir.join("1.json"), "[".repeat(100_000)).expect("deep");
        fs::create_dir(dir.join("2.json")).expect("a directory");
        nix::unistd::mkfifo(&dir.join("3.json"), nix::sys::stat::Mode::S_IRWXU).expect("fifo");
        let mut j = Journal::open(d.path(), 1024);
        assert!(j.slots.iter().all(Option::is_none));
        for i in 0..RECORDS_KEPT {
            let s = j.begin(&format!("r{i}"), &sha256_hex("true"));
            j.finish(s, &response("x"));
        }
        let j = Journal::open(d.path(), 1024);
        assert_eq!(j.slots.iter().flatten().count(), RECORDS_KEPT);
    }

    #[test]
    fn a_journal_dir_replaced_by_a_file_or_a_link_is_repaired() {
        let d = tempfile::tempdir().expect("tempdir");
        let elsewhere = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink(elsewhere.path(), d.path().join("replay")).expect("link");
        let mut j = Journal::open(d.path(), 1024);
        let s = j.begin("a", &sha256_hex("true"));
        j.finish(s, &response(""));
        assert!(fs::symlink_metadata(d.path().join("replay"))
            .expect("exists")
            .is_dir());
        assert_eq!(fs::read_dir(elsewhere.path()).expect("dir").count(), 0);
        fs::remove_dir_all(d.path().join("replay")).expect("rm");
        fs::write(d.path().join("replay"), "").expect("file in its place");
        let s = j.begin("b", &sha256_hex("true"));
        j.finish(s, &response(""));
        let j = Journal::open(d.path(), 1024);
        assert!(matches!(
            j.lookup("b", &sha256_hex("true")),
            Lookup::Done(_)
        ));
    }

    #[test]
    fn a_cut_or_stale_response_reads_as_interrupted_never_as_another_answer() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut j = Journal::open(d.path(), 1024);
        let s = j.begin("a", &sha256_hex("echo a"));
        j.finish(s, &response(&"a".repeat(500)));
        let resp = d.path().join("replay").join(format!("{s}.response"));
        let whole = fs::read(&resp).expect("response file");
        // Cut anywhere: never a response, always "interrupted".
        for cut in [whole.len() - 1, whole.len() / 2, 10] {
            fs::write(&resp, &whole[..cut]).expect("cut");
            let j = Journal::open(d.path(), 1024);
            assert!(
                matches!(
                    j.lookup("a", &sha256_hex("echo a")),
                    Lookup::Interrupted { .. }
                ),
                "cut at {cut}"
            );
        }
        // Same length, one byte changed in the body: the checksum catches it.
        let mut flipped = whole.clone();
        let last = flipped.len() - 3;
        flipped[last] ^= 1;
        fs::write(&resp, &flipped).expect("flip");
        let j = Journal::open(d.path(), 1024);
        assert!(matches!(
            j.lookup("a", &sha256_hex("echo a")),
            Lookup::Interrupted { .. }
        ));
        // The response of the request that used the slot before: not this request's.
        fs::write(&resp, &whole).expect("restore");
        let mut j = Journal::open(d.path(), 1024);
        for i in 0..RECORDS_KEPT - 1 {
            j.begin(&format!("x{i}"), &sha256_hex("true"));
        }
        let again = j.begin("b", &sha256_hex("echo b"));
        assert_eq!(again, s, "the slot came round again");
        let j = Journal::open(d.path(), 1024);
        assert!(matches!(
            j.lookup("b", &sha256_hex("echo b")),
            Lookup::Interrupted { .. }
        ));
        assert!(matches!(
            j.lookup("a", &sha256_hex("echo a")),
            Lookup::Unknown
        ));
    }

    #[test]
    fn a_forged_response_over_the_output_budget_is_not_replayed() {
        let d = tempfile::tempdir().expect("tempdir");
        let budget = 1024;
        let mut j = Journal::open(d.path(), budget);
        // Well-formed, checksum and all, but more output than a live answer could hold.
        let big = "x".repeat(budget + STREAM_SLACK + 1);
        let s = j.begin("a", &sha256_hex("true"));
        j.finish(s, &response(&big));
        let mut b64 = response("");
        b64.stderr = "QUFB".repeat((budget + STREAM_SLACK) / 3 + 1);
        b64.stderr_encoding = cli_mcp_api::wire::Encoding::Base64;
        let s = j.begin("b", &sha256_hex("true"));
        j.finish(s, &b64);
        // At the limit: replayed.
        let fits = "y".repeat(budget + STREAM_SLACK);
        let s = j.begin("c", &sha256_hex("true"));
        j.finish(s, &response(&fits));
        let j = Journal::open(d.path(), budget);
        for id in ["a", "b"] {
            assert!(
                matches!(
                    j.lookup(id, &sha256_hex("true")),
                    Lookup::Interrupted { .. }
                ),
                "{id}"
            );
        }
        assert!(matches!(j.lookup("c", &sha256_hex("true")), Lookup::Done(r) if r.stdout == fits));
    }

    #[test]
    fn a_shorter_rewrite_cut_before_its_truncation_still_reads() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut j = Journal::open(d.path(), 1024);
        let s = j.begin("a", &sha256_hex("true"));
        let req = d.path().join("replay").join(format!("{s}.json"));
        // The process died between the write and the cut: the old, longer tail remains.
        let mut bytes = fs::read(&req).expect("request file");
        bytes.extend_from_slice(b"0000\"}  tail of an older record");
        fs::write(&req, &bytes).expect("tail");
        let j = Journal::open(d.path(), 1024);
        assert!(matches!(
            j.lookup("a", &sha256_hex("true")),
            Lookup::Interrupted { .. }
        ));
    }

    #[test]
    fn a_hard_link_in_a_slot_is_replaced_not_written_through() {
        let d = tempfile::tempdir().expect("tempdir");
        let dir = d.path().join("replay");
        fs::create_dir_all(&dir).expect("dir");
        let victim = d.path().join("victim");
        fs::write(&victim, "keep").expect("victim");
        fs::hard_link(&victim, dir.join("1.json")).expect("link");
        let mut j = Journal::open(d.path(), 1024);
        let s = j.begin("a", &sha256_hex("true"));
        assert_eq!(s, 1);
        assert_eq!(fs::read_to_string(&victim).expect("victim"), "keep");
        let j = Journal::open(d.path(), 1024);
        assert!(matches!(
            j.lookup("a", &sha256_hex("true")),
            Lookup::Interrupted { .. }
        ));
    }
}
