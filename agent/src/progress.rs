//! How far the running command is: bytes of output so far and its last complete line, for
//! `GET /exec/progress` (the server turns them into MCP progress notifications).
//!
//! The output collectors feed every chunk they read into the [`Progress`] of the shell; the
//! HTTP layer marks which request runs ([`Progress::begin`]). What is kept is bounded: a
//! counter, the last line (at most [`PROGRESS_LINE_MAX`] bytes) and one partial line per
//! stream (as much), whatever the command prints.

use std::sync::{Arc, Mutex};

use cli_mcp_api::wire::{ExecProgress, PROGRESS_LINE_MAX};

/// Which of a command's streams a chunk came from: each has its own partial line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// The running command's progress, shared by the output collectors and the HTTP layer.
#[derive(Clone, Default)]
pub struct Progress(Arc<Mutex<State>>);

#[derive(Default)]
struct State {
    /// The request whose command runs now; `None` between commands (and for a command sent
    /// without a request id, which nobody can ask about).
    request_id: Option<String>,
    bytes: u64,
    last_line: Option<String>,
    /// The start of each stream's line that has no newline yet (at most a few bytes over
    /// [`PROGRESS_LINE_MAX`], so a cut never splits a character it keeps).
    partial: [Vec<u8>; 2],
    /// Counts [`Progress::begin`]s: a command's guard ends only its own command, not the
    /// next one that began before the guard was dropped (the shell is free for the next
    /// call as soon as the command's task lets go of it, before its HTTP handler returns).
    generation: u64,
}

/// Bytes of a partial line kept: enough for [`PROGRESS_LINE_MAX`] bytes of text after a
/// character cut at the end.
const PARTIAL_MAX: usize = PROGRESS_LINE_MAX + 4;

impl Progress {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A command starts for `request_id`: counts start again. The returned guard marks its
    /// end when dropped, whatever way the command ends.
    pub fn begin(&self, request_id: Option<String>) -> Running {
        let mut state = self.state();
        let generation = state.generation.wrapping_add(1);
        *state = State {
            request_id,
            generation,
            ..State::default()
        };
        Running {
            progress: self.clone(),
            generation,
        }
    }

    /// Output the running command wrote to `stream`.
    pub fn observe(&self, stream: Stream, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let mut state = self.state();
        state.bytes += bytes.len() as u64;
        let partial = &mut state.partial[stream as usize];
        let Some(last_nl) = bytes.iter().rposition(|&b| b == b'\n') else {
            keep_start(partial, bytes);
            return;
        };
        // The last non-blank line this chunk ends: lines wholly in the chunk from the end,
        // then the first one, which starts with the partial line of earlier chunks.
        let mut end = last_nl;
        let mut found = None;
        while let Some(prev) = bytes[..end].iter().rposition(|&b| b == b'\n') {
            if let Some(line) = clean_line(&bytes[prev + 1..end]) {
                found = Some(line);
                break;
            }
            end = prev;
        }
        if found.is_none() {
            keep_start(partial, &bytes[..end]);
            found = clean_line(partial);
        }
        partial.clear();
        keep_start(partial, &bytes[last_nl + 1..]);
        if let Some(line) = found {
            state.last_line = Some(line);
        }
    }

    /// What `GET /exec/progress` answers for `request_id`.
    pub fn snapshot(&self, request_id: &str) -> ExecProgress {
        let state = self.state();
        if state.request_id.as_deref() != Some(request_id) {
            return ExecProgress {
                running: false,
                bytes: 0,
                last_line: None,
            };
        }
        ExecProgress {
            running: true,
            bytes: state.bytes,
            last_line: state.last_line.clone(),
        }
    }
}

/// The running command, until dropped.
pub struct Running {
    progress: Progress,
    generation: u64,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut state = self.progress.state();
        if state.generation == self.generation {
            state.request_id = None;
            state.partial = Default::default();
        }
    }
}

/// Appends what fits of `more` to `line` within [`PARTIAL_MAX`] (a long line keeps its
/// start).
fn keep_start(line: &mut Vec<u8>, more: &[u8]) {
    let room = PARTIAL_MAX.saturating_sub(line.len());
    line.extend_from_slice(&more[..more.len().min(room)]);
}

/// The line as a progress message: what a terminal would show of it last (the text after
/// its last carriage return, as a progress bar redraws itself), ANSI escape sequences and
/// other control characters removed, tabs as spaces, at most [`PROGRESS_LINE_MAX`] bytes
/// of whole characters. `None` for a blank line, which says nothing about progress.
fn clean_line(raw: &[u8]) -> Option<String> {
    let shown = raw
        .split(|&b| b == b'\r')
        .rev()
        .find(|part| part.iter().any(|b| !b.is_ascii_whitespace()))?;
    let text = String::from_utf8_lossy(shown);
    let mut out = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            skip_escape(&mut chars);
            continue;
        }
        let c = if c == '\t' { ' ' } else { c };
        if c.is_control() {
            continue;
        }
        if out.len() + c.len_utf8() > PROGRESS_LINE_MAX {
            break;
        }
        out.push(c);
    }
    let out = out.trim();
    (!out.is_empty()).then(|| out.to_owned())
}

/// Skips the rest of an escape sequence after its ESC: a CSI (`ESC [ … final`), an OSC
/// (`ESC ] … BEL` or `ESC ] … ESC \`), or one character.
fn skip_escape(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    match chars.next() {
        Some('[') => {
            for c in chars.by_ref() {
                if ('\u{40}'..='\u{7e}').contains(&c) {
                    break;
                }
            }
        }
        Some(']') => {
            while let Some(c) = chars.next() {
                if c == '\u{7}' || (c == '\u{1b}' && chars.next_if_eq(&'\\').is_some()) {
                    break;
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fed(chunks: &[(Stream, &[u8])]) -> ExecProgress {
        let p = Progress::default();
        let _running = p.begin(Some("r".into()));
        for (stream, bytes) in chunks {
            p.observe(*stream, bytes);
        }
        p.snapshot("r")
    }

    #[test]
    fn counts_both_streams_and_keeps_the_last_complete_line() {
        let p = fed(&[
            (Stream::Stdout, b"line1\nli"),
            (Stream::Stderr, b"warn: x\n"),
            (Stream::Stdout, b"ne2\npartial"),
        ]);
        assert_eq!(
            p,
            ExecProgress {
                running: true,
                bytes: 8 + 8 + 11,
                last_line: Some("line2".into())
            }
        );
        let p = fed(&[(Stream::Stdout, b"a\nb\nc\n")]);
        assert_eq!(p.last_line.as_deref(), Some("c"));
    }

    #[test]
    fn lines_split_across_streams_do_not_mix() {
        let p = fed(&[
            (Stream::Stdout, b"out-"),
            (Stream::Stderr, b"err-"),
            (Stream::Stdout, b"end\n"),
        ]);
        assert_eq!(p.last_line.as_deref(), Some("out-end"));
    }

    #[test]
    fn a_line_is_bounded_clean_and_whole_characters() {
        let long = "é".repeat(500) + "\n";
        let p = fed(&[(Stream::Stdout, long.as_bytes())]);
        let line = p.last_line.expect("a line");
        assert!(line.len() <= PROGRESS_LINE_MAX && line.len() >= PROGRESS_LINE_MAX - 1);
        assert!(line.chars().all(|c| c == 'é'));
        // A long line in many small chunks is held within its bound too.
        let p = Progress::default();
        let _running = p.begin(Some("r".into()));
        for _ in 0..10_000 {
            p.observe(Stream::Stdout, b"xxxxxxxxxx");
        }
        assert!(p.state().partial[0].len() <= PARTIAL_MAX);
        p.observe(Stream::Stdout, b"\n");
        assert_eq!(
            p.snapshot("r").last_line.map(|l| l.len()),
            Some(PROGRESS_LINE_MAX)
        );

        let p = fed(&[(
            Stream::Stdout,
            b"\x1b[31mred\x1b[0m\tand\x07 \x1b]0;title\x07bell\x00\n",
        )]);
        assert_eq!(p.last_line.as_deref(), Some("red and bell"));
        let p = fed(&[(Stream::Stdout, b"10%\r50%\r90%\r  \n")]);
        assert_eq!(
            p.last_line.as_deref(),
            Some("90%"),
            "what the terminal shows"
        );
        let p = fed(&[(Stream::Stdout, b"\xff\xfeok\n")]);
        assert_eq!(p.last_line.as_deref(), Some("\u{fffd}\u{fffd}ok"));
    }

    #[test]
    fn blank_lines_keep_the_line_before() {
        let p = fed(&[(Stream::Stdout, b"step 1\n\n   \n\t\n")]);
        assert_eq!(p.last_line.as_deref(), Some("step 1"));
        let p = fed(&[(Stream::Stdout, b"step "), (Stream::Stdout, b"2\n\n")]);
        assert_eq!(p.last_line.as_deref(), Some("step 2"));
        let p = fed(&[(Stream::Stdout, b"one\n"), (Stream::Stdout, b"\n\n")]);
        assert_eq!(p.last_line.as_deref(), Some("one"));
    }

    #[test]
    fn the_end_of_a_command_does_not_end_the_next_one_that_already_began() {
        let p = Progress::default();
        let first = p.begin(Some("a".into()));
        // The next call takes the shell before the first call's handler has returned.
        let second = p.begin(Some("b".into()));
        p.observe(Stream::Stdout, b"working\n");
        drop(first);
        let now = p.snapshot("b");
        assert!(now.running, "the second command still runs");
        assert_eq!(now.last_line.as_deref(), Some("working"));
        assert!(!p.snapshot("a").running);
        drop(second);
        assert!(!p.snapshot("b").running);
    }

    #[test]
    fn only_the_running_request_is_answered_and_a_new_one_starts_from_zero() {
        let p = Progress::default();
        assert!(!p.snapshot("r").running, "nothing runs");
        {
            let _one = p.begin(Some("one".into()));
            p.observe(Stream::Stdout, b"x\n");
            assert!(!p.snapshot("two").running, "another request");
            assert_eq!(p.snapshot("one").bytes, 2);
        }
        assert!(!p.snapshot("one").running, "ended");
        let _two = p.begin(Some("two".into()));
        assert_eq!(
            p.snapshot("two"),
            ExecProgress {
                running: true,
                bytes: 0,
                last_line: None
            }
        );
    }
}
