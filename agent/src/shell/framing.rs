//! The lines the agent writes to bash and the records bash writes back on the status pipe.
//!
//! After each command bash writes `\0<nonce> <status> <flags> <cwd>\0` to fd 3, a pipe only the
//! agent reads, with a fresh nonce per command (`<flags>` is `$-`). The traps set when the
//! command ended, if any, come just before it as a segment of their own (the `trap` listing;
//! the agent notes the `DEBUG` and `RETURN` ones it removed). Command output goes to FIFOs
//! and is never parsed, so nothing a command prints can end it early or change its result.

use std::fmt::Write as _;
use std::path::Path;

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;

/// Most bytes kept from the status pipe while looking for a record: junk someone wrote on
/// the pipe is dropped past it. A record is a nonce, a status, the flags and the working
/// directory, whose length bash does not bound: `cd` into a deep enough tree gives a `PWD`
/// of tens of KiB (each step relative, so no `PATH_MAX` applies), whose record was taken
/// for junk at 16 KiB and the shell replaced as unable to report. 1 MiB is a tree over
/// 4,000 levels deep of the longest names, and still little memory.
const STATUS_BUF_MAX: usize = 1024 * 1024;

/// A status record: the nonce it was tagged with, an exit status, the shell's option flags
/// (`$-`), a working directory, and the `DEBUG`/`RETURN` traps removed before it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Record {
    pub nonce: String,
    pub status: i32,
    pub flags: String,
    pub cwd: String,
    /// `trap -p` of the traps removed (the segment just before the record), if any.
    pub traps: Option<String>,
}

/// The line that runs one command file. Only our paths and nonce appear in it.
pub(super) fn command_line(dir: &Path, nonce: &str) -> String {
    let q = |name: &str| sh_quote(&dir.join(name).display().to_string());
    format!(
        "\\builtin . {} </dev/null >{} 2>{} 3>&-; {}\n",
        q("cmd"),
        q("out"),
        q("err"),
        report_status(nonce, Some(&q("done"))),
    )
}

/// The line that runs `command` given inline, for a state dir with no room for a command
/// file: `eval` of the command single-quoted (inside single quotes every byte but `'` is
/// literal, and `'` is written `'\''`), so no text can end the quoting early. Output goes to
/// the FIFOs in `dir`, or to `/dev/null` when even those could not be made.
pub(super) fn inline_command_line(command: &str, dir: Option<&Path>, nonce: &str) -> String {
    let q = |dir: &Path, name: &str| sh_quote(&dir.join(name).display().to_string());
    let (out, err, done) = match dir {
        Some(dir) => (q(dir, "out"), q(dir, "err"), Some(q(dir, "done"))),
        None => ("/dev/null".to_owned(), "/dev/null".to_owned(), None),
    };
    format!(
        "\\builtin eval {} </dev/null >{out} 2>{err} 3>&-; {}\n",
        sh_quote(command),
        report_status(nonce, done.as_deref()),
    )
}

/// A line that only reports `status` under `nonce`: bash answers it once it is back at
/// its top level and reading lines again.
pub(super) fn sync_line(nonce: &str, status: i32) -> String {
    format!(
        "{}\\builtin printf '\\0%s %s %s %s\\0' {nonce} {status} \"$-\" \"${{PWD-}}\" >&3\n",
        restore_builtins(nonce)
    )
}

/// After a command: its status, kept in a variable no command can have made read-only (its
/// name holds the nonce), the builtins restored, then the record, written to fd 3 while the
/// command's `done` FIFO (the quoted path `done`) is open: bash opens it, writes the record
/// and closes it, and the agent, reading it, sees that close. The record comes first, so a
/// close without a record means that this shell can no longer report at all (see
/// [`restore_builtins`]). The redirection is made whatever `\builtin` turns out to be (a
/// read-only function gets it too; a command not found gets it in its child), so the close
/// comes even then. Open, record and close come within microseconds, so the agent wakes
/// once for all three: as separate commands (the record, then `\builtin : <>done`) they
/// woke it up to three times per command. (A redirection with no command at all would need
/// no name, but bash forks a subshell for it: a millisecond per command, and no fork at all
/// under a fork bomb. `:` alone could be a function: the fork bomb `:(){ :|:& };:` defines
/// one.) Read-write, because opening a FIFO read-write never blocks, also when nobody reads
/// it. A command may have removed its directory, or made it unsearchable: then `done`
/// cannot be opened, and the record is written without it (`|| …`), as it is when the state
/// dir had no room for the FIFOs (`done` is `None`).
fn report_status(nonce: &str, done: Option<&str>) -> String {
    let status = format!("__cli_mcp_status_{nonce}");
    let record = format!(
        "\\builtin printf '\\0%s %s %s %s\\0' {nonce} \"${status}\" \"$-\" \"${{PWD-}}\" >&3"
    );
    let report = match done {
        Some(done) => format!("{record} <>{done} || {record}"),
        None => record,
    };
    format!(
        "{status}=$?; {}{report}; \\builtin unset {status}",
        restore_builtins(nonce)
    )
}

/// Makes the names the agent's lines use mean the builtins again, whatever the previous
/// command did: a function or an alias named `builtin`, `.`, `eval`, `printf`, `unset`,
/// `enable` or `trap`, or one of those builtins disabled with `enable -n`; removes the
/// `DEBUG` and `RETURN` traps; and removes the prompts `PS0` and `PS1`, which bash expands
/// on its own around each line it reads: a command substitution in one runs before the
/// agent's next line and can read that line from bash's input. (`PROMPT_COMMAND`, the
/// other thing bash runs on its own there, is made empty and read-only when the shell
/// starts: a hook that redefined `builtin` made every later command a silent no-op.)
///
/// - Aliases: every command word the agent writes is quoted (`\builtin`), and a quoted word
///   is never alias-expanded; the user's aliases are left alone. (Reserved words such as
///   `if` or `{` can be aliases too, so the line uses none: `[[ ]]`, `||` and `;` only.)
/// - Functions: `builtin X` skips functions named X, so only functions named `builtin` and
///   `enable` must go. `unset -f` removes them, but `unset` can be a function too, and so
///   can `command`: no regular builtin is safe from a function. In POSIX mode, though,
///   *special* builtins (`unset` and `trap` are) are found before functions, and POSIX mode
///   is entered by assigning `POSIXLY_CORRECT`, an assignment, which no function or alias
///   can intercept. So `unset -f` (and `unset -v` of the prompts) runs in POSIX mode, which
///   is left again only if the agent entered it: the user's own mode is kept. The agent's
///   `POSIXLY_CORRECT` is named for it (`__cli_mcp_<nonce>`), so it is told apart from the
///   user's own; any such value is removed, also one a line cut short by an interrupt left
///   behind.
/// - `enable -n`: `enable` re-enables the builtins the agent uses (after `enable` itself
///   was freed of a function).
/// - Traps: a `DEBUG` trap runs before every simple command at the top level, the agent's
///   own included, and a `RETURN` trap whenever a sourced file (every command) returns: a
///   slow or reading one would make every later call slow, a false timeout, or eat the
///   agent's lines. Both are removed as early as a special builtin can be trusted, right
///   after POSIX mode is entered; once more after `enable`, for a `trap` that was disabled.
///   Until then the trap still runs a few times: the command that set it pays for it.
///   Before that, `trap` lists the traps that are set on the status pipe (the agent says
///   which were removed): without arguments it lists only the traps set, so in the usual
///   case it writes nothing and the agent is not woken for it (`trap -p DEBUG RETURN`, in
///   POSIX mode, wrote a line per trap, set or not, each waking the agent).
///
/// A command that goes further (a read-only function named `builtin`, `enable -n enable`, a
/// read-only `POSIXLY_CORRECT` together with a function named `unset`, fd 3 closed for good)
/// leaves the shell unable to report; the `done` FIFO tells at once, and the shell is
/// replaced.
fn restore_builtins(nonce: &str) -> String {
    let mark = format!("__cli_mcp_{nonce}");
    format!(
        "[[ -o posix ]] || POSIXLY_CORRECT={mark}; \\trap >&3; \\trap - DEBUG RETURN; \\unset -f builtin enable; \\unset -v PS0 PS1; [[ ${{POSIXLY_CORRECT-}} != __cli_mcp_* ]] || \\unset POSIXLY_CORRECT; \\enable builtin enable printf . eval unset trap; \\builtin trap - DEBUG RETURN; "
    )
}

/// The agent's end of the status pipe.
pub(super) struct StatusPipe {
    rx: pipe::Receiver,
    buf: Vec<u8>,
    /// How much of `buf` is known to hold no NUL.
    scanned: usize,
    /// EOF: the process on the other side is no longer our shell.
    pub closed: bool,
    /// The `DEBUG`/`RETURN` traps of the segment seen since the last record: they belong
    /// to the next one.
    traps: Option<String>,
}

impl StatusPipe {
    pub fn new(rx: pipe::Receiver) -> Self {
        Self {
            rx,
            buf: Vec::new(),
            scanned: 0,
            closed: false,
            traps: None,
        }
    }

    /// A record tagged with one of `nonces` among what the pipe holds now, without waiting.
    ///
    /// Reads the pipe itself (it is non-blocking) rather than through tokio's `try_read`,
    /// which answers "would block" without a read while the reactor has not yet reported
    /// the pipe readable. The caller comes here when bash closed `done`, just after it wrote
    /// the record: on a multi-threaded runtime that close can be seen before the reactor has
    /// dispatched the record's readiness, and the shell was then wrongly replaced as unable
    /// to report.
    pub fn try_record(&mut self, nonces: &[&str]) -> Option<Record> {
        let mut chunk = [0u8; 4096];
        loop {
            while let Some(rec) = self.buffered_record() {
                if nonces.contains(&rec.nonce.as_str()) {
                    return Some(rec);
                }
            }
            if self.buf.len() > STATUS_BUF_MAX {
                // The same bound as `next_record`: junk is not kept.
                let keep = 256;
                self.buf.drain(..self.buf.len() - keep);
                self.scanned = self.buf.len();
            }
            match nix::unistd::read(&self.rx, &mut chunk) {
                Ok(0) => {
                    self.closed = true;
                    return None;
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(nix::errno::Errno::EINTR) => {}
                // EAGAIN: nothing more in the pipe now.
                Err(_) => return None,
            }
        }
    }

    /// The next complete record in what was read already.
    fn buffered_record(&mut self) -> Option<Record> {
        while let Some(off) = self.buf[self.scanned..].iter().position(|b| *b == 0) {
            let end = self.scanned + off;
            let segment: Vec<u8> = self.buf.drain(..=end).collect();
            self.scanned = 0;
            let segment = &segment[..segment.len() - 1];
            if let Some(mut rec) = parse_record(segment) {
                rec.traps = self.traps.take();
                return Some(rec);
            }
            // The traps listing (usually empty) is the segment just before its record.
            self.traps = removed_traps(&String::from_utf8_lossy(segment));
        }
        self.scanned = self.buf.len();
        None
    }

    /// Reads the next record; `None` on EOF. Records are NUL-delimited on both sides so
    /// anything bash printed on the pipe before its init script ran (startup warnings, a
    /// first prompt) is a segment of its own that matches no nonce.
    pub async fn next_record(&mut self) -> Option<Record> {
        loop {
            // Only bytes not yet searched are searched, so a flood stays linear.
            if let Some(rec) = self.buffered_record() {
                return Some(rec);
            }
            if self.buf.len() > STATUS_BUF_MAX {
                // No record is this long: drop the junk (keep a tail that may start one).
                let keep = 256;
                self.buf.drain(..self.buf.len() - keep);
                self.scanned = self.buf.len();
            }
            let mut chunk = [0u8; 4096];
            match self.rx.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

/// The `DEBUG` and `RETURN` traps in a `trap` listing (every trap that is set, one
/// `trap -- '<command>' <signal>` each, a command spanning lines if it has newlines), joined
/// by newlines; `None` if neither is set.
fn removed_traps(listing: &str) -> Option<String> {
    let mut entries: Vec<String> = Vec::new();
    for line in listing.lines() {
        match entries.last_mut() {
            Some(entry) if !line.starts_with("trap -- ") => {
                entry.push('\n');
                entry.push_str(line);
            }
            _ => entries.push(line.to_owned()),
        }
    }
    entries.retain(|e| {
        e.starts_with("trap -- ")
            && !e.starts_with("trap -- - ")
            && (e.ends_with(" DEBUG") || e.ends_with(" RETURN"))
    });
    (!entries.is_empty()).then(|| entries.join("\n"))
}

/// Parses `<nonce> <status> <flags> <cwd>`; anything else (empty segments, junk) is `None`.
fn parse_record(segment: &[u8]) -> Option<Record> {
    let text = String::from_utf8_lossy(segment);
    let mut parts = text.splitn(4, ' ');
    let nonce = parts.next()?;
    if nonce.len() != 32 || !nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let status = parts.next()?.parse().ok()?;
    let flags = parts.next()?.to_owned();
    let cwd = parts.next()?.to_owned();
    Some(Record {
        nonce: nonce.to_owned(),
        status,
        flags,
        cwd,
        traps: None,
    })
}

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// 128 random bits as 32 hex digits: nonces and directory names nobody can guess.
pub(super) fn random_hex() -> String {
    let bytes: [u8; 16] = rand::random();
    bytes.iter().fold(String::with_capacity(32), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    fn record(nonce: &str, status: i32, cwd: &str) -> Record {
        Record {
            nonce: nonce.to_owned(),
            status,
            flags: "himBs".to_owned(),
            cwd: cwd.to_owned(),
            traps: None,
        }
    }

    #[test]
    fn quoting_survives_quotes() {
        assert_eq!(sh_quote("/a b/c'd"), r"'/a b/c'\''d'");
    }

    #[test]
    fn command_line_names_only_our_files() {
        let l = command_line(Path::new("/s/cmd/1"), "abc");
        assert!(
            l.starts_with(
                "\\builtin . '/s/cmd/1/cmd' </dev/null >'/s/cmd/1/out' 2>'/s/cmd/1/err' 3>&-; __cli_mcp_status_abc=$?; "
            ),
            "{l}"
        );
        let record = "\\builtin printf '\\0%s %s %s %s\\0' abc \"$__cli_mcp_status_abc\" \"$-\" \"${PWD-}\" >&3";
        assert!(
            l.ends_with(&format!(
                "{record} <>'/s/cmd/1/done' || {record}; \\builtin unset __cli_mcp_status_abc\n"
            )),
            "{l}"
        );
        // No reserved word: an alias can redefine `if` or `{`, never `[[`, `||` or `;`.
        for word in ["if", "then", "fi", "{", "}", "while", "case"] {
            assert!(!l.split([' ', ';']).any(|w| w == word), "{word} in {l}");
        }
        assert_eq!(l.lines().count(), 1, "{l}");
    }

    #[test]
    fn an_inline_command_is_quoted_whole() {
        let l = inline_command_line("echo 'a'\nb", None, "n");
        assert!(
            l.starts_with(
                "\\builtin eval 'echo '\\''a'\\''\nb' </dev/null >/dev/null 2>/dev/null 3>&-; __cli_mcp_status_n=$?; "
            ),
            "{l}"
        );
    }

    #[test]
    fn records_parse_and_junk_is_ignored() {
        let n = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            parse_record(format!("{n} 3 himBs /a b").as_bytes()),
            Some(record(n, 3, "/a b"))
        );
        assert_eq!(parse_record(b"bash-5.2# exec 3>&2"), None);
        assert_eq!(parse_record(b""), None);
        assert_eq!(parse_record(format!("{n} x himBs /").as_bytes()), None);
        assert_eq!(parse_record(format!("{n} 3").as_bytes()), None);
    }

    #[test]
    fn only_debug_and_return_traps_are_taken_from_a_listing() {
        assert_eq!(removed_traps(""), None);
        assert_eq!(
            removed_traps("trap -- 'echo x' ERR\ntrap -- '' SIGINT\n"),
            None
        );
        assert_eq!(
            removed_traps("trap -- 'a\ntrap b' DEBUG\ntrap -- 'echo x' EXIT\ntrap -- 'r' RETURN\n"),
            Some("trap -- 'a\ntrap b' DEBUG\ntrap -- 'r' RETURN".to_owned())
        );
        assert_eq!(removed_traps("trap -- - DEBUG\n"), None);
    }

    /// bash writes the record, then closes `done`; the agent looks for the record as soon as
    /// it sees `done` closed. On a multi-threaded runtime the reactor may not have told the
    /// status pipe's readiness yet at that moment; here (one thread, no yield) it never has.
    #[tokio::test]
    async fn a_record_in_the_pipe_is_found_before_the_reactor_reports_it() {
        let (tx, rx) = pipe::pipe().expect("pipe");
        let mut status = StatusPipe::new(rx);
        let nonce = "0123456789abcdef0123456789abcdef";
        assert_eq!(status.try_record(&[nonce]), None, "nothing written yet");
        let line = format!("\0{nonce} 7 himBs /w\0");
        let n = nix::unistd::write(&tx, line.as_bytes()).expect("write the record");
        assert_eq!(n, line.len());
        assert_eq!(status.try_record(&[nonce]), Some(record(nonce, 7, "/w")));
        assert!(!status.closed);
    }

    #[tokio::test]
    async fn a_flood_on_the_status_pipe_stays_bounded_and_records_still_parse() {
        let (mut tx, rx) = pipe::pipe().expect("pipe");
        let nonce = "0123456789abcdef0123456789abcdef";
        let writer = tokio::spawn(async move {
            let junk = vec![b'A'; 64 * 1024];
            for _ in 0..64 {
                tx.write_all(&junk).await.expect("write junk");
            }
            tx.write_all(
                format!("\0trap -- 'x' DEBUG\ntrap -- - RETURN\n\0{nonce} 5 himBs /w\0").as_bytes(),
            )
            .await
            .expect("write record");
        });
        let mut status = StatusPipe::new(rx);
        let rec = status.next_record().await;
        writer.await.expect("join");
        let traps = Some("trap -- 'x' DEBUG".to_owned());
        assert_eq!(
            rec,
            Some(Record {
                traps,
                ..record(nonce, 5, "/w")
            })
        );
        assert!(
            status.buf.capacity() < 4 * STATUS_BUF_MAX,
            "buffer grew to {}",
            status.buf.capacity()
        );
    }
}
