//! The DNS wire format the tests speak: an A query, its reply's code and addresses, one
//! UDP exchange with a deadline.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::time::Duration;

/// DNS response codes used by the tests.
pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_REFUSED: u8 = 5;

/// A parsed DNS response to an A query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsReply {
    pub rcode: u8,
    pub addrs: Vec<Ipv4Addr>,
}

/// A DNS query (recursion desired) for the A records of `name`.
pub fn encode_query(id: u16, name: &str) -> Vec<u8> {
    let mut q = Vec::with_capacity(name.len() + 18);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name
        .trim_end_matches('.')
        .split('.')
        .filter(|l| !l.is_empty())
    {
        let bytes = &label.as_bytes()[..label.len().min(63)];
        q.push(bytes.len() as u8);
        q.extend_from_slice(bytes);
    }
    q.push(0);
    q.extend_from_slice(&[0, 1, 0, 1]);
    q
}

/// Skip a (possibly compressed) name starting at `at`; the offset after it.
fn skip_name(buf: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let len = *buf.get(at)?;
        if len & 0xC0 == 0xC0 {
            return Some(at + 2);
        }
        if len == 0 {
            return Some(at + 1);
        }
        at += 1 + usize::from(len);
    }
}

/// Parse the response to [`encode_query`] with the same `id`.
pub fn parse_reply(id: u16, buf: &[u8]) -> std::result::Result<DnsReply, String> {
    let be16 =
        |at: usize| -> Option<u16> { Some(u16::from_be_bytes([*buf.get(at)?, *buf.get(at + 1)?])) };
    let short = || format!("short DNS reply ({} bytes)", buf.len());
    if be16(0).ok_or_else(short)? != id {
        return Err("DNS reply with another id".into());
    }
    let flags = be16(2).ok_or_else(short)?;
    if flags & 0x8000 == 0 {
        return Err("not a DNS response".into());
    }
    let qd = be16(4).ok_or_else(short)?;
    let an = be16(6).ok_or_else(short)?;
    let mut at = 12;
    for _ in 0..qd {
        at = skip_name(buf, at).ok_or_else(short)? + 4;
    }
    let mut addrs = Vec::new();
    for _ in 0..an {
        at = skip_name(buf, at).ok_or_else(short)?;
        let rtype = be16(at).ok_or_else(short)?;
        let rdlen = usize::from(be16(at + 8).ok_or_else(short)?);
        let data = buf.get(at + 10..at + 10 + rdlen).ok_or_else(short)?;
        if rtype == 1 && rdlen == 4 {
            addrs.push(Ipv4Addr::new(data[0], data[1], data[2], data[3]));
        }
        at += 10 + rdlen;
    }
    Ok(DnsReply {
        rcode: (flags & 0x000F) as u8,
        addrs,
    })
}

/// Ask `server` (UDP) for the A records of `name`, waiting at most `timeout` for a reply.
pub fn query_a(server: SocketAddr, name: &str, timeout: Duration) -> std::io::Result<DnsReply> {
    let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    sock.set_read_timeout(Some(timeout))?;
    sock.connect(server)?;
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);
    let id = (std::process::id() as u16) ^ NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    sock.send(&encode_query(id, name))?;
    let mut buf = [0u8; 1500];
    let n = sock.recv(&mut buf)?;
    parse_reply(id, &buf[..n]).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_query_and_reply_round_trip() {
        let q = encode_query(0x1234, "kubernetes.default.svc.cluster.local.");
        assert_eq!(&q[..2], &[0x12, 0x34]);
        assert_eq!(q[12], 10);
        assert_eq!(&q[13..23], b"kubernetes");
        // A reply: the question echoed, one A answer with a compressed name.
        let mut r = q.clone();
        r[2] = 0x85; // response, authoritative, RD
        r[3] = 0x80; // RA, rcode 0
        r[7] = 1; // ancount
        r.extend_from_slice(&[0xC0, 12, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4, 10, 96, 0, 1]);
        assert_eq!(
            parse_reply(0x1234, &r),
            Ok(DnsReply {
                rcode: RCODE_NOERROR,
                addrs: vec![Ipv4Addr::new(10, 96, 0, 1)]
            })
        );
        let mut refused = q.clone();
        refused[2] = 0x81;
        refused[3] = 0x05;
        assert_eq!(
            parse_reply(0x1234, &refused).map(|r| r.rcode),
            Ok(RCODE_REFUSED)
        );
        assert!(parse_reply(0x9999, &r).is_err(), "other id");
        assert!(parse_reply(0x1234, &q).is_err(), "a query is not a reply");
        assert!(parse_reply(0x1234, &r[..r.len() - 3]).is_err(), "truncated");
    }
}
