//! A command's stdout and stderr: FIFOs in its directory, which bash opens for the command
//! (`>out 2>err`) and the agent reads while it runs.
//!
//! Output never lands on disk unasked: the agent keeps the head and tail in memory and
//! writes a spill file only within the spill caps, so `yes` cannot fill the pod's `/tmp`.
//! A FIFO holds no data blocks, so a command still gets its output back when the state dir
//! is full. And the agent knows when nobody writes any more (EOF): processes that outlive
//! their call (background jobs) keep the FIFO open, and what they print afterwards is read
//! and discarded instead of growing an unlinked file that `du` cannot see.
//!
//! The agent holds a write end of its own until the command has ended, so a read before
//! bash has opened the FIFO does not see an early EOF. After the command's status record,
//! everything its foreground processes wrote is in the pipe: the rest is drained without
//! waiting, and a FIFO still open elsewhere goes on to be drained in the background.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::output::{Captured, StreamCapture};
use crate::progress::{self, Progress};
use crate::spill::Spills;
use crate::state_files::open_at;

/// Bytes read from a stream at a time.
const CHUNK: usize = 64 * 1024;
/// Most bytes drained from a stream once its command has ended: more than a pipe holds
/// (1 MiB at most for an unprivileged process), so what is beyond it comes from a process
/// that is still writing, which the command's own output must not wait for.
const DRAIN_MAX: usize = 2 * 1024 * 1024;
/// Streams of earlier commands drained at once. Each costs the agent a descriptor; past this,
/// the oldest is closed, and its writers get EPIPE (or SIGPIPE) on their next write.
pub(super) const LINGERING_MAX: usize = 64;

/// The running command's two streams. Collected in the task that waits for the command
/// (polled alongside that wait), not in one of their own: handing them over to another task
/// and back cost two cross-thread wake-ups per command.
pub(super) struct Streams {
    out: Stream,
    err: Stream,
    /// `dir/done`, open for reading: bash opens and closes it once past the command's line
    /// (see `framing::report_status`). Taken by the task that waits for the command.
    pub done: Option<pipe::Receiver>,
}

pub(super) struct Collected {
    out: Captured,
    err: Captured,
    /// Streams that some process still holds open once the command has ended.
    lingering: Vec<pipe::Receiver>,
}

/// Opens `out`, `err` and `done` in the command's directory `dir` for reading: made as
/// FIFOs first when `fresh`; otherwise the FIFOs an earlier command used, which must have
/// no writer left (a process that still holds one open would write into this command's
/// output, or close `done` in the middle of it), nor, for `out` and `err`, another reader
/// (it would take part of this command's output). `spill_stem` names the spill files
/// (`<stem>.stdout`, `<stem>.stderr`).
pub(super) fn open(
    dir: BorrowedFd<'_>,
    budget: usize,
    spills: &Spills,
    spill_stem: &str,
    fresh: bool,
    progress: &Progress,
) -> io::Result<Streams> {
    let out = Stream::open(
        dir,
        "out",
        StreamCapture::new(budget, spills.clone(), format!("{spill_stem}.stdout"))
            .observed_by(progress.clone(), progress::Stream::Stdout),
        fresh,
    )?;
    let err = Stream::open(
        dir,
        "err",
        StreamCapture::new(budget, spills.clone(), format!("{spill_stem}.stderr"))
            .observed_by(progress.clone(), progress::Stream::Stderr),
        fresh,
    )?;
    let done = done_fifo(dir, "done", fresh)?;
    Ok(Streams {
        out,
        err,
        done: Some(done),
    })
}

/// A FIFO the agent only reads, with no writer of its own: its end of file is bash's close.
/// Always a new FIFO, also in a reused directory: its end of file must mean that a writer
/// opened it for this command and closed it. Linux signals that only for writers that came
/// after this reader's open, but gVisor's kernel does for any FIFO that ever had a writer,
/// so a reused `done` read as closed at once there, before bash had reported, and every
/// such command looked unreported (its shell was replaced).
fn done_fifo(dir: BorrowedFd<'_>, name: &str, fresh: bool) -> io::Result<pipe::Receiver> {
    if !fresh {
        match crate::state_files::remove_file_at(dir, name) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    let reader = open_reader(dir, name, true)?;
    pipe::Receiver::from_file_unchecked(reader)
}

/// A FIFO's read end; an existing FIFO must have no writer and hold no bytes (a read of a
/// FIFO with neither returns 0 at once).
fn open_reader(dir: BorrowedFd<'_>, name: &str, fresh: bool) -> io::Result<std::fs::File> {
    if fresh {
        make_fifo(dir, name)?;
    }
    let reader = open_at(dir, name, OFlag::O_RDONLY | OFlag::O_NONBLOCK, 0)?;
    if !fresh {
        match nix::unistd::read(&reader, &mut [0u8; 1]) {
            Ok(0) => {}
            _ => return Err(io::Error::other("another process holds the FIFO open")),
        }
    }
    Ok(reader)
}

/// An existing output FIFO must have no reader either, before the agent opens its own: a
/// process that kept one open (a command's background job with its own output sent
/// elsewhere, so no writer) would take part of what a later command prints into it. A
/// non-blocking open for writing fails with `ENXIO` exactly when nobody reads. Best effort:
/// it sees who reads now, not a process that opens the path later (any command can find
/// its FIFOs' paths); that one only confuses its own session.
fn no_other_reader(dir: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    match open_at(dir, name, OFlag::O_WRONLY | OFlag::O_NONBLOCK, 0) {
        Err(e) if e.raw_os_error() == Some(nix::libc::ENXIO) => Ok(()),
        Ok(_) => Err(io::Error::other("another process reads the FIFO")),
        Err(e) => Err(e),
    }
}

fn make_fifo(dir: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    nix::unistd::mkfifoat(dir, name, Mode::S_IRUSR | Mode::S_IWUSR).map_err(io::Error::from)
}

impl Streams {
    /// Reads both streams until `finished` (the command has ended, or will never run),
    /// then takes what is left in the pipes.
    pub(super) async fn collect(self, finished: oneshot::Receiver<()>) -> Collected {
        collect(self.out, self.err, finished).await
    }
}

impl Collected {
    /// Both streams reached their end: no process holds them any more, and nobody but the
    /// agent reads them.
    pub(super) fn all_closed(&self) -> bool {
        self.lingering.is_empty()
    }

    /// The captured streams; any stream still open elsewhere goes to `lingering`.
    pub(super) fn into_captures(self, lingering: &mut Lingering) -> (Captured, Captured) {
        for rx in self.lingering {
            lingering.drain(rx);
        }
        (self.out, self.err)
    }
}

struct Stream {
    rx: pipe::Receiver,
    /// Ours, so that the FIFO has a writer before bash opens it; dropped at the end.
    _writer: Option<OwnedFd>,
    capture: StreamCapture,
    eof: bool,
}

impl Stream {
    fn open(
        dir: BorrowedFd<'_>,
        name: &str,
        capture: StreamCapture,
        fresh: bool,
    ) -> io::Result<Self> {
        if !fresh {
            no_other_reader(dir, name)?;
        }
        let reader = open_reader(dir, name, fresh)?;
        // With a reader open, a non-blocking open for writing succeeds at once.
        let writer = open_at(dir, name, OFlag::O_WRONLY | OFlag::O_NONBLOCK, 0)?;
        // Unchecked: the checked variant costs an fstat and two fcntls per stream on every
        // command. We made the FIFO and opened it O_RDONLY|O_NONBLOCK|O_NOFOLLOW; should a
        // command have swapped something else in first, epoll refuses it (EPERM for files and
        // directories) and the command is refused before it runs.
        Ok(Self {
            rx: pipe::Receiver::from_file_unchecked(reader)?,
            _writer: Some(OwnedFd::from(writer)),
            capture,
            eof: false,
        })
    }

    /// Reads what the pipe holds, now that it is readable (`buf` is allocated on first use,
    /// so a command without output costs no buffer).
    fn take_ready(&mut self, buf: &mut Vec<u8>) {
        if buf.is_empty() {
            buf.resize(CHUNK, 0);
        }
        loop {
            match self.rx.try_read(buf) {
                Ok(0) => self.eof = true,
                Ok(n) => {
                    self.capture.push(&buf[..n]);
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read command output");
                    self.eof = true;
                }
            }
            return;
        }
    }

    /// Reads what is in the pipe now, without waiting: after the command ended, that is all
    /// its foreground processes wrote. Raw reads, so no stale readiness hides data. False:
    /// another process still holds the FIFO open.
    fn drain(&mut self, buf: &mut Vec<u8>) -> bool {
        if buf.is_empty() {
            // Most commands end with an empty pipe: one read of a small buffer tells.
            buf.resize(4096, 0);
        }
        let mut drained = 0;
        while !self.eof {
            if drained >= DRAIN_MAX {
                return false;
            }
            match nix::unistd::read(&self.rx, buf) {
                Ok(0) => self.eof = true,
                Ok(n) => {
                    self.capture.push(&buf[..n]);
                    drained += n;
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(nix::errno::Errno::EAGAIN) => return false,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read command output");
                    self.eof = true;
                }
            }
        }
        true
    }
}

async fn collect(
    mut out: Stream,
    mut err: Stream,
    mut finished: oneshot::Receiver<()>,
) -> Collected {
    // One buffer for both streams, allocated once output arrives.
    let mut buf = Vec::new();
    // Watched from the start: a timer to watch only commands that run longer cost more
    // wake-ups (arming it wakes the thread that waits for I/O) than the FIFOs' own (bash
    // opening and closing them wakes the reactor, without data).
    loop {
        tokio::select! {
            // Also when the sender is gone: the command never reached bash.
            _ = &mut finished => break,
            ready = out.rx.readable(), if !out.eof => match ready {
                Ok(()) => out.take_ready(&mut buf),
                Err(_) => out.eof = true,
            },
            ready = err.rx.readable(), if !err.eof => match ready {
                Ok(()) => err.take_ready(&mut buf),
                Err(_) => err.eof = true,
            },
        }
    }
    out._writer = None;
    err._writer = None;
    let mut lingering = Vec::new();
    let mut finish = |mut stream: Stream, buf: &mut Vec<u8>| {
        if !stream.drain(buf) {
            lingering.push(stream.rx);
        }
        stream.capture.finish()
    };
    let out = finish(out, &mut buf);
    let err = finish(err, &mut buf);
    Collected {
        out,
        err,
        lingering,
    }
}

/// Streams of earlier commands that some process (a background job) still writes:
/// drained and discarded until their last writer closes them, at most `LINGERING_MAX`.
#[derive(Default)]
pub(super) struct Lingering {
    tasks: VecDeque<JoinHandle<()>>,
}

impl Lingering {
    fn drain(&mut self, mut rx: pipe::Receiver) {
        self.tasks.retain(|t| !t.is_finished());
        while self.tasks.len() >= LINGERING_MAX {
            if let Some(oldest) = self.tasks.pop_front() {
                oldest.abort();
            }
        }
        self.tasks.push_back(tokio::spawn(async move {
            let mut buf = vec![0u8; CHUNK];
            let mut discarded: u64 = 0;
            loop {
                match rx.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => discarded += n as u64,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            tracing::debug!(discarded, "output of a finished command's background job");
        }));
    }
}
