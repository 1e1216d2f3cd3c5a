//! Bounded capture of one output stream.
//!
//! Command output reaches the agent through a pipe (see `shell::streams`) and goes through
//! a [`StreamCapture`]: the agent holds at most the budget plus the tail in memory however
//! much is printed, and once a stream is over the budget it is also written to a spill file
//! (the start of the stream, within the caps of [`crate::spill`]) that the caller can
//! `grep`. What is dropped is said in the truncation marker.

use std::collections::VecDeque;
use std::path::PathBuf;

use crate::progress::{Progress, Stream};
use crate::spill::{Cut, SpillFile, Spills};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Captured {
    /// What goes into the response: everything, or head + marker + tail.
    pub bytes: Vec<u8>,
    /// Size of the full stream.
    pub total: u64,
    pub truncated: bool,
    /// The spill file holding the start of the stream, when truncated and kept.
    pub spill: Option<PathBuf>,
}

impl Captured {
    /// A stream nothing was read from.
    pub fn empty() -> Self {
        Self {
            bytes: Vec::new(),
            total: 0,
            truncated: false,
            spill: None,
        }
    }
}

/// One stream being captured: its first `budget` bytes, its last `budget - budget / 2`,
/// and a spill file once it is longer than the budget.
pub struct StreamCapture {
    budget: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    total: u64,
    spills: Spills,
    spill_name: String,
    spill: Option<Result<SpillFile, Cut>>,
    /// Told of every chunk, for `GET /exec/progress`.
    progress: Option<(Progress, Stream)>,
}

impl StreamCapture {
    /// A spill, if one is needed, is created as `spill_name` in the spill dir.
    pub fn new(budget: usize, spills: Spills, spill_name: String) -> Self {
        Self {
            budget,
            head: Vec::new(),
            tail: VecDeque::new(),
            total: 0,
            spills,
            spill_name,
            spill: None,
            progress: None,
        }
    }

    /// Reports every chunk to `progress` as output of `stream`.
    pub fn observed_by(mut self, progress: Progress, stream: Stream) -> Self {
        self.progress = Some((progress, stream));
        self
    }

    pub fn push(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        self.total += bytes.len() as u64;
        if let Some((progress, stream)) = &self.progress {
            progress.observe(*stream, bytes);
        }
        let into_head = bytes.len().min(self.budget - self.head.len());
        self.head.extend_from_slice(&bytes[..into_head]);
        self.push_tail(bytes);
        if self.total <= self.budget as u64 {
            return;
        }
        match &mut self.spill {
            Some(Ok(file)) => file.write(bytes),
            Some(Err(_)) => {}
            None => {
                // Just over the budget: the spill starts with everything so far.
                let mut created = self.spills.create(&self.spill_name);
                if let Ok(file) = created.as_mut() {
                    file.write(&self.head);
                    file.write(&bytes[into_head..]);
                }
                self.spill = Some(created);
            }
        }
    }

    fn push_tail(&mut self, bytes: &[u8]) {
        let cap = self.budget - self.budget / 2;
        if bytes.len() >= cap {
            self.tail.clear();
            self.tail.extend(&bytes[bytes.len() - cap..]);
        } else {
            let over = (self.tail.len() + bytes.len()).saturating_sub(cap);
            self.tail.drain(..over);
            self.tail.extend(bytes);
        }
    }

    /// The stream as the response carries it.
    pub fn finish(self) -> Captured {
        if self.total <= self.budget as u64 {
            return Captured {
                bytes: self.head,
                total: self.total,
                truncated: false,
                spill: None,
            };
        }
        let mut head = self.head;
        head.truncate(self.budget / 2);
        let head = trim_partial_char_end(head);
        let tail = trim_partial_char_start(Vec::from(self.tail));
        let cut = self.total - head.len() as u64 - tail.len() as u64;
        let (kept, marker) = match self.spill {
            Some(Ok(file)) if file.written > 0 => {
                let path = file.path.clone();
                let marker = match &file.cut {
                    None => format!(
                        "\n[… {cut} bytes truncated; full output in {} …]\n",
                        path.display()
                    ),
                    Some(why) => format!(
                        "\n[… {cut} bytes truncated; the first {} bytes are in {}; the {} bytes \
                         after them were not kept ({why}) …]\n",
                        file.written,
                        path.display(),
                        self.total - file.written,
                    ),
                };
                (Some(path), marker)
            }
            Some(Ok(file)) => {
                let why = file.cut.clone().unwrap_or(Cut::TotalCap(0));
                file.discard();
                (
                    None,
                    format!("\n[… {cut} bytes truncated; the output was not kept ({why}) …]\n"),
                )
            }
            Some(Err(why)) => (
                None,
                format!("\n[… {cut} bytes truncated; the output was not kept ({why}) …]\n"),
            ),
            None => (None, format!("\n[… {cut} bytes truncated …]\n")),
        };
        let mut bytes = head;
        bytes.extend_from_slice(marker.as_bytes());
        bytes.extend_from_slice(&tail);
        Captured {
            bytes,
            total: self.total,
            truncated: true,
            spill: kept,
        }
    }
}

/// Drops an incomplete UTF-8 sequence at the end of `head`, so a cut through a multi-byte
/// character does not turn valid text into "binary" output.
fn trim_partial_char_end(mut head: Vec<u8>) -> Vec<u8> {
    if let Err(e) = std::str::from_utf8(&head) {
        if e.error_len().is_none() {
            head.truncate(e.valid_up_to());
        }
    }
    head
}

/// Skips continuation bytes (at most 3) at the start of `tail`.
fn trim_partial_char_start(tail: Vec<u8>) -> Vec<u8> {
    let skip = tail
        .iter()
        .take(3)
        .take_while(|b| (0x80..0xC0).contains(*b))
        .count();
    if skip > 0 && std::str::from_utf8(&tail[skip..]).is_ok() {
        tail[skip..].to_vec()
    } else {
        tail
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spill::SpillLimits;

    fn spills(dir: &std::path::Path, max_file: u64) -> Spills {
        Spills::open(
            crate::state_files::HeldDir::open(dir, None).expect("spill dir"),
            SpillLimits {
                max_file,
                max_total: 1 << 20,
            },
        )
    }

    fn capture(dir: &std::path::Path, budget: usize, chunks: &[&[u8]]) -> Captured {
        let mut c = StreamCapture::new(budget, spills(dir, 1 << 20), "s".into());
        for chunk in chunks {
            c.push(chunk);
        }
        c.finish()
    }

    #[test]
    fn small_output_is_whole_and_not_spilled() {
        let d = tempfile::tempdir().expect("tempdir");
        let c = capture(d.path(), 10, &[b"hel", b"lo"]);
        assert_eq!(
            (c.bytes.as_slice(), c.truncated, c.total),
            (&b"hello"[..], false, 5)
        );
        assert!(!d.path().join("s").exists());
    }

    #[test]
    fn large_output_keeps_head_and_tail_and_spills() {
        let d = tempfile::tempdir().expect("tempdir");
        let data: Vec<u8> = (0..1000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let chunks: Vec<&[u8]> = data.chunks(7).collect();
        let c = capture(d.path(), 100, &chunks);
        assert!(c.truncated);
        assert_eq!(c.total, 1000);
        assert!(c.bytes.starts_with(&data[..50]));
        assert!(c.bytes.ends_with(&data[950..]));
        let text = String::from_utf8(c.bytes).expect("utf8");
        assert!(
            text.contains("[… 900 bytes truncated; full output in "),
            "{text}"
        );
        assert_eq!(std::fs::read(d.path().join("s")).expect("spill kept"), data);
    }

    #[test]
    fn a_stream_just_over_the_budget_has_a_tail_from_the_head() {
        let d = tempfile::tempdir().expect("tempdir");
        let c = capture(d.path(), 10, &[b"0123456789ab"]);
        let text = String::from_utf8(c.bytes).expect("utf8");
        assert!(text.starts_with("01234\n[… 2 bytes truncated"), "{text}");
        assert!(text.ends_with(" …]\n789ab"), "{text}");
    }

    #[test]
    fn past_the_spill_cap_the_marker_says_what_was_dropped() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut c = StreamCapture::new(10, spills(d.path(), 30), "s".into());
        for _ in 0..10 {
            c.push(&[b'x'; 10]);
        }
        let c = c.finish();
        let text = String::from_utf8(c.bytes).expect("utf8");
        assert!(
            text.contains("the first 30 bytes are in ")
                && text.contains(
                    "the 70 bytes after them were not kept (a spill keeps at most 30 bytes"
                ),
            "{text}"
        );
        assert_eq!(std::fs::read(d.path().join("s")).expect("spill").len(), 30);
    }

    #[test]
    fn cuts_never_split_a_character() {
        let d = tempfile::tempdir().expect("tempdir");
        let data = "é".repeat(500); // 2 bytes each
        let c = capture(d.path(), 101, &[data.as_bytes()]);
        assert!(String::from_utf8(c.bytes).is_ok());
    }
}
