//! The client's request head: read within a size and a time bound, checked as HTTP/1.x, and
//! rewritten with the pod's `Proxy-Authorization`.
//!
//! The parser is strict on purpose and small: the relay only needs the lines of the head,
//! and a head it let through half-understood could hide a second `Proxy-Authorization` from
//! the scrubbing (a header folded onto the previous line, a bare CR that another parser
//! reads as a line end). Everything it keeps is copied byte for byte.

use std::fmt;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

/// Most header fields one head may carry.
const MAX_HEADERS: usize = 128;
/// The header the relay owns: every one the client sent is dropped.
const PROXY_AUTHORIZATION: &[u8] = b"proxy-authorization";

/// A head read off the client, with the bytes that followed it in the same reads.
#[derive(Debug)]
pub struct Received {
    /// The head, up to and including the empty line that ends it.
    pub head: Vec<u8>,
    /// Bytes after the head (a TLS ClientHello sent without waiting for the 200).
    pub rest: Vec<u8>,
}

/// Why no head could be taken from the client.
#[derive(Debug)]
pub enum ReadError {
    /// More than the size bound arrived without the empty line that ends a head.
    TooLarge,
    /// The head did not arrive within the time bound.
    TimedOut,
    /// The client closed (or reset) the connection before its head was complete.
    Closed,
}

/// Reads up to the end of the head, at most `max_bytes` of it, within `timeout`.
pub async fn read<R: AsyncRead + Unpin>(
    client: &mut R,
    max_bytes: usize,
    timeout: Duration,
) -> Result<Received, ReadError> {
    let mut buf = Vec::with_capacity(4096);
    let reading = async {
        let mut chunk = [0u8; 8192];
        loop {
            let n = match client.read(&mut chunk).await {
                Ok(0) | Err(_) => return Err(ReadError::Closed),
                Ok(n) => n,
            };
            // The end may straddle two reads: look again from a little before the new bytes.
            let from = buf.len().saturating_sub(2);
            buf.extend_from_slice(&chunk[..n]);
            if let Some(end) = head_end(&buf, from) {
                return if end > max_bytes {
                    Err(ReadError::TooLarge)
                } else {
                    Ok(end)
                };
            }
            if buf.len() > max_bytes {
                return Err(ReadError::TooLarge);
            }
        }
    };
    let end = tokio::time::timeout(timeout, reading)
        .await
        .map_err(|_| ReadError::TimedOut)??;
    let rest = buf.split_off(end);
    Ok(Received { head: buf, rest })
}

/// The index just past the empty line that ends a head, looking from `from` on: a line end
/// (`\n`) followed by an empty line (`\n` or `\r\n`).
fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i < buf.len() {
        if buf[i] == b'\n' {
            match (buf.get(i + 1), buf.get(i + 2)) {
                (Some(b'\n'), _) => return Some(i + 2),
                (Some(b'\r'), Some(b'\n')) => return Some(i + 3),
                _ => {}
            }
        }
        i += 1;
    }
    None
}

/// Why a head is not HTTP/1.x. The reasons never quote the head: it may hold credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadHead {
    RequestLine,
    Version,
    /// A header line (counted from 1 after the request line) that is not `name: value`.
    HeaderLine(usize),
    /// A header line that starts with a space or a tab (obsolete line folding).
    Folded(usize),
    TooManyHeaders,
}

impl fmt::Display for BadHead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadHead::RequestLine => f.write_str(
                "the request line is not `METHOD target HTTP/1.x` (is the proxy URL http://, \
                 not https://?)",
            ),
            BadHead::Version => f.write_str("the request is not HTTP/1.0 or HTTP/1.1"),
            BadHead::HeaderLine(n) => write!(f, "header line {n} is not `name: value`"),
            BadHead::Folded(n) => write!(
                f,
                "header line {n} continues the previous one (obsolete line folding)"
            ),
            BadHead::TooManyHeaders => write!(f, "the head has more than {MAX_HEADERS} headers"),
        }
    }
}

/// A head checked as HTTP/1.x: the lines to pass on, `Proxy-Authorization` left out.
#[derive(Debug)]
pub struct Checked<'a> {
    lines: Vec<&'a [u8]>,
}

/// Checks `head` (as [`read`] returned it) and picks the lines to keep: the request line
/// and every header as sent, except all `Proxy-Authorization` (in any case).
pub fn check(head: &[u8]) -> Result<Checked<'_>, BadHead> {
    let mut lines = head.split(|&b| b == b'\n').map(|line| match line {
        [body @ .., b'\r'] => body,
        line => line,
    });
    let request_line = lines.next().ok_or(BadHead::RequestLine)?;
    check_request_line(request_line)?;
    let mut kept = vec![request_line];
    let mut count = 0;
    for line in lines.take_while(|line| !line.is_empty()) {
        count += 1;
        if count > MAX_HEADERS {
            return Err(BadHead::TooManyHeaders);
        }
        let name = header_name(line, count)?;
        if !name.eq_ignore_ascii_case(PROXY_AUTHORIZATION) {
            kept.push(line);
        }
    }
    Ok(Checked { lines: kept })
}

impl Checked<'_> {
    /// The head to send upstream: the kept lines, each ended by CRLF, then the pod's
    /// `Proxy-Authorization: Bearer <token>` and the empty line.
    pub fn with_token(&self, token: &str) -> Vec<u8> {
        let size: usize = self.lines.iter().map(|line| line.len() + 2).sum();
        let mut out = Vec::with_capacity(size + token.len() + 40);
        for line in &self.lines {
            out.extend_from_slice(line);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"Proxy-Authorization: Bearer ");
        out.extend_from_slice(token.as_bytes());
        out.extend_from_slice(b"\r\n\r\n");
        out
    }
}

/// `METHOD SP target SP HTTP/1.x`, visible ASCII only.
fn check_request_line(line: &[u8]) -> Result<(), BadHead> {
    let mut parts = line.split(|&b| b == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(BadHead::RequestLine);
    };
    if method.is_empty() || !method.iter().all(|&b| is_token(b)) {
        return Err(BadHead::RequestLine);
    }
    if target.is_empty() || !target.iter().all(|b| b.is_ascii_graphic()) {
        return Err(BadHead::RequestLine);
    }
    match version {
        [b'H', b'T', b'T', b'P', b'/', b'1', b'.', minor] if minor.is_ascii_digit() => Ok(()),
        _ if version.starts_with(b"HTTP/") => Err(BadHead::Version),
        _ => Err(BadHead::RequestLine),
    }
}

/// The name of header line `line` (number `n`), checked with its value.
fn header_name(line: &[u8], n: usize) -> Result<&[u8], BadHead> {
    if matches!(line.first(), Some(b' ' | b'\t')) {
        return Err(BadHead::Folded(n));
    }
    let colon = line
        .iter()
        .position(|&b| b == b':')
        .ok_or(BadHead::HeaderLine(n))?;
    let (name, value) = (&line[..colon], &line[colon + 1..]);
    // No space before the colon either: RFC 9112 says to refuse such a line, as proxies
    // and servers disagree about whose header it is.
    if name.is_empty() || !name.iter().all(|&b| is_token(b)) {
        return Err(BadHead::HeaderLine(n));
    }
    // Any octet but the control characters (tab aside): no bare CR, no NUL.
    if value.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f) {
        return Err(BadHead::HeaderLine(n));
    }
    Ok(name)
}

/// An HTTP `tchar`.
fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewritten(head: &str) -> Result<String, BadHead> {
        check(head.as_bytes()).map(|kept| String::from_utf8(kept.with_token("T0K")).expect("utf-8"))
    }

    #[test]
    fn the_client_proxy_authorization_goes_and_the_pods_comes_last() {
        let out = rewritten(
            "CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\nproxy-authorization: Basic x\r\n\
             PROXY-Authorization:Bearer y\r\nUser-Agent: curl/8\r\n\r\n",
        );
        assert_eq!(
            out.expect("valid"),
            "CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\nUser-Agent: curl/8\r\n\
             Proxy-Authorization: Bearer T0K\r\n\r\n"
        );
    }

    #[test]
    fn bare_line_feeds_are_taken_and_written_back_as_crlf() {
        let out = rewritten("CONNECT h:443 HTTP/1.0\nHost: h\n\n").expect("valid");
        assert_eq!(
            out,
            "CONNECT h:443 HTTP/1.0\r\nHost: h\r\nProxy-Authorization: Bearer T0K\r\n\r\n"
        );
    }

    #[test]
    fn heads_that_are_not_http_1_are_refused() {
        for (head, why) in [
            ("hello\r\n\r\n", BadHead::RequestLine),
            ("CONNECT  h:443 HTTP/1.1\r\n\r\n", BadHead::RequestLine),
            ("CONNECT h:443 HTTP/2.0\r\n\r\n", BadHead::Version),
            ("CONNECT h:443\r\n\r\n", BadHead::RequestLine),
            ("\x16\x03\x01 h HTTP/1.1\r\n\r\n", BadHead::RequestLine),
            (
                "CONNECT h:443 HTTP/1.1\r\nHost h\r\n\r\n",
                BadHead::HeaderLine(1),
            ),
            (
                "CONNECT h:443 HTTP/1.1\r\nA: b\r\nHost : h\r\n\r\n",
                BadHead::HeaderLine(2),
            ),
            (
                "CONNECT h:443 HTTP/1.1\r\nA: b\rc\r\n\r\n",
                BadHead::HeaderLine(1),
            ),
            (
                "CONNECT h:443 HTTP/1.1\r\nA: b\r\n Proxy-Authorization: x\r\n\r\n",
                BadHead::Folded(2),
            ),
        ] {
            assert_eq!(rewritten(head), Err(why), "{head:?}");
        }
        let many = format!(
            "CONNECT h:443 HTTP/1.1\r\n{}\r\n",
            "A: b\r\n".repeat(MAX_HEADERS + 1)
        );
        assert_eq!(rewritten(&many), Err(BadHead::TooManyHeaders));
    }

    #[test]
    fn the_end_of_a_head_is_found_across_reads() {
        let buf = b"CONNECT h:443 HTTP/1.1\r\nHost: h\r\n\r\nTLS";
        assert_eq!(head_end(buf, 0), Some(buf.len() - 3));
        assert_eq!(head_end(buf, buf.len() - 6), Some(buf.len() - 3));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\nX", 0), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: h\r\n", 0), None);
    }
}
