//! The relay's own answers: a connection it refuses gets a status line and a one-line reason,
//! and is closed without losing that answer.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a refused client gets to take the answer, and how much of what it still sends
/// is read meanwhile.
const LINGER: Duration = Duration::from_secs(1);
const DRAIN_BYTES: usize = 256 * 1024;

/// A status the relay answers with itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    BadRequest,
    RequestTimeout,
    HeaderFieldsTooLarge,
    BadGateway,
    ServiceUnavailable,
}

impl Status {
    pub fn code(self) -> u16 {
        match self {
            Status::BadRequest => 400,
            Status::RequestTimeout => 408,
            Status::HeaderFieldsTooLarge => 431,
            Status::BadGateway => 502,
            Status::ServiceUnavailable => 503,
        }
    }

    fn reason(self) -> &'static str {
        match self {
            Status::BadRequest => "Bad Request",
            Status::RequestTimeout => "Request Timeout",
            Status::HeaderFieldsTooLarge => "Request Header Fields Too Large",
            Status::BadGateway => "Bad Gateway",
            Status::ServiceUnavailable => "Service Unavailable",
        }
    }
}

/// The whole answer: status line, a plain-text body of one line, and `connection: close`.
pub fn render(status: Status, message: &str) -> Vec<u8> {
    // One line: a reason that carries a line end (an error's text) would end the body early.
    let body = format!(
        "cli-mcp-agent proxy relay: {}\n",
        message.replace(['\r', '\n'], " ")
    );
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        status.code(),
        status.reason(),
        body.len()
    )
    .into_bytes()
}

/// Answers `status` and closes. The client may still be sending (the rest of a head that was
/// too large, a ClientHello): closing a socket with unread bytes resets the connection, and
/// the reset can reach the client before it has read the answer. So the write side is shut
/// first and what the client sends is read and dropped until it closes too, for at most
/// [`LINGER`] and [`DRAIN_BYTES`].
pub async fn refuse(mut client: TcpStream, status: Status, message: &str) {
    let answer = render(status, message);
    let _ = tokio::time::timeout(LINGER, async {
        if client.write_all(&answer).await.is_err() || client.shutdown().await.is_err() {
            return;
        }
        let mut sink = [0u8; 8192];
        let mut drained = 0;
        while drained < DRAIN_BYTES {
            match client.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(n) => drained += n,
            }
        }
    })
    .await;
}

/// Answers `status` without waiting at all, for when not even a refusal may take a task: a
/// new socket's send buffer is empty, so the answer fits unless the client is gone.
pub fn refuse_now(client: TcpStream, status: Status, message: &str) {
    let _ = client.try_write(&render(status, message));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_one_line_of_text_with_its_length() {
        let out = String::from_utf8(render(Status::BadGateway, "no\r\nway")).expect("utf-8");
        let body = "cli-mcp-agent proxy relay: no  way\n";
        assert_eq!(
            out,
            format!(
                "HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/plain; charset=utf-8\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
        );
    }
}
