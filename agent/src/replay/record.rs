//! The journal's two files per slot, `<slot>.json` (the request) and `<slot>.response`,
//! encoded and parsed strictly: the shell user can write them, so whatever does not parse,
//! does not match its request, or holds more output than a live answer can is not believed.

use std::os::fd::BorrowedFd;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use cli_mcp_api::wire::{Encoding, ExecResponse};

use crate::state_files::read_capped_at;

/// Format version written in every file; others are ignored.
const VERSION: u32 = 1;

/// Largest request file read (ours are about 250 bytes; a page is what is written whole).
const REQUEST_CAP: u64 = 4096;

/// Most bytes a live response adds to a stream on top of the output budget: the truncation
/// marker (with the spill path) and the agent's notes. Far more than they take.
pub(super) const STREAM_SLACK: usize = 16 * 1024;

/// Largest response file read: two streams at the output budget, each possibly base64 or
/// JSON-escaped (up to 6 bytes per byte for control characters), plus room for the rest.
pub(super) fn response_cap(output_budget: usize) -> u64 {
    (output_budget as u64)
        .saturating_mul(12)
        .saturating_add(64 * 1024)
}

/// True when each stream of `resp` is no longer than a live response can make it (the
/// output budget plus markers and notes). A longer one was not written by this agent with
/// this budget (a forged record, or one from an agent with a larger budget): replaying it
/// would bypass truncation.
pub(super) fn within_output_budget(resp: &ExecResponse, output_budget: usize) -> bool {
    let max = output_budget.saturating_add(STREAM_SLACK);
    let raw_len = |text: &str, enc: Encoding| match enc {
        Encoding::Utf8 => text.len(),
        // Decoded base64 is 3 bytes per 4 characters.
        Encoding::Base64 => text.len() / 4 * 3,
    };
    raw_len(&resp.stdout, resp.stdout_encoding) <= max
        && raw_len(&resp.stderr, resp.stderr_encoding) <= max
}

/// `<slot>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RequestFile {
    v: u32,
    pub seq: u64,
    pub request_sha256: String,
    pub command_sha256: String,
    started_unix_ms: u64,
}

impl RequestFile {
    pub fn new(seq: u64, request_sha256: String, command_sha256: String) -> Self {
        Self {
            v: VERSION,
            seq,
            request_sha256,
            command_sha256,
            started_unix_ms: unix_ms(SystemTime::now()),
        }
    }

    pub fn started(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.started_unix_ms)
    }

    /// The request in the file `name` in `dir`; `Ok(None)`: no file. `Err`: a file this
    /// agent did not write (the reason is for the log).
    pub fn read(dir: BorrowedFd<'_>, name: &str) -> Result<Option<Self>, String> {
        let Some(bytes) = read_capped_at(dir, name, REQUEST_CAP)? else {
            return Ok(None);
        };
        let request: Self = first_json_value(&bytes)?;
        if request.v != VERSION
            || !is_sha256_hex(&request.request_sha256)
            || !is_sha256_hex(&request.command_sha256)
        {
            return Err("not a request record of this version".into());
        }
        Ok(Some(request))
    }
}

/// First line of `<slot>.response`; the response JSON follows.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResponseHeader {
    v: u32,
    seq: u64,
    request_sha256: String,
    len: u64,
    sha256: String,
}

/// The bytes of `<slot>.response` for `request`: a header line that holds the length and
/// checksum of the response JSON that follows, so a cut write is detected.
pub(super) fn encode_response(request: &RequestFile, response: &ExecResponse) -> Option<Vec<u8>> {
    let body = match serde_json::to_vec(response) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "cannot encode a replay response");
            return None;
        }
    };
    let header = ResponseHeader {
        v: VERSION,
        seq: request.seq,
        request_sha256: request.request_sha256.clone(),
        len: body.len() as u64,
        sha256: hex::encode(Sha256::digest(&body)),
    };
    let mut bytes = serde_json::to_vec(&header).ok()?;
    bytes.push(b'\n');
    bytes.extend_from_slice(&body);
    Some(bytes)
}

/// The response recorded for `request`, if its file is whole and belongs to it.
pub(super) fn read_response(
    dir: BorrowedFd<'_>,
    name: &str,
    cap: u64,
    request: &RequestFile,
) -> Result<Option<ExecResponse>, String> {
    let Some(bytes) = read_capped_at(dir, name, cap)? else {
        return Ok(None);
    };
    let Some(nl) = bytes.iter().position(|b| *b == b'\n') else {
        return Err("no header line".into());
    };
    let header: ResponseHeader =
        serde_json::from_slice(&bytes[..nl]).map_err(|e| format!("not a response header: {e}"))?;
    if header.v != VERSION
        || header.seq != request.seq
        || header.request_sha256 != request.request_sha256
    {
        // An older request's response left in the slot: not this one's.
        return Ok(None);
    }
    let body = usize::try_from(header.len)
        .ok()
        .and_then(|len| bytes.get(nl + 1..)?.get(..len))
        .ok_or("shorter than its header says (a cut write)")?;
    if hex::encode(Sha256::digest(body)) != header.sha256 {
        return Err("its checksum does not match (a cut write)".into());
    }
    serde_json::from_slice(body)
        .map(Some)
        .map_err(|e| format!("not a response: {e}"))
}

/// The first JSON value in `bytes`; what follows is ignored (the tail of a longer earlier
/// version, when the process died between the write and the cut).
fn first_json_value<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    match serde_json::Deserializer::from_slice(bytes)
        .into_iter::<T>()
        .next()
    {
        Some(Ok(v)) => Ok(v),
        Some(Err(e)) => Err(format!("not a replay record: {e}")),
        None => Err("empty".into()),
    }
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
