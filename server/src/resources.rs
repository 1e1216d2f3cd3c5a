//! MCP resources of a session's sandbox: the spill files that truncated output points to,
//! and files under the workspace, read in bounded chunks.
//!
//! - `sandbox://<session>/spill/<name>`: the start of a truncated stream, as the agent kept
//!   it (`<name>` as the truncation marker gives it, e.g. `3-1a2b3c4d.stdout`);
//! - `sandbox://<session>/workspace/<path>`: a regular file beneath the sandbox's working
//!   directory (`/workspace` in a pod); `<path>` is percent-encoded where it must be.
//!
//! A read takes `?offset=N&length=M` (bytes; defaults 0 and `--max-resource-read-bytes`,
//! larger lengths are cut to it). Its contents are `text` when the chunk is valid UTF-8,
//! else `blob` (base64), and `_meta` says where the chunk is in the file:
//! `{"offset", "length", "size", "next"}` (`next` absent at the end).
//!
//! Access is the `bash` tool's: the session's sandbox must belong to the caller (the same
//! owner check, through [`SessionManager::read_file`]), and a read never starts a sandbox,
//! so a session that is gone (deleted, idle-collected, evicted) says so instead of showing a
//! fresh, empty one. The agent reads through descriptors it
//! holds and never follows a link out of the workspace (see `agent/src/files.rs`).

use base64::Engine as _;
use rmcp::model::{MetaObject, ReadResourceResult, ResourceContents, ResourceTemplate};
use rmcp::ErrorData as McpError;
use serde_json::json;

use cli_mcp_api::SessionId;

use crate::agent_client::AgentError;
use crate::auth::Caller;
use crate::sessions::{FileError, SessionError, SessionManager};

pub const SCHEME: &str = "sandbox://";

/// What a resource URI names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Spill(String),
    Workspace(String),
}

/// A parsed resource URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceUri {
    pub session: SessionId,
    pub target: Target,
    pub offset: u64,
    pub length: Option<u64>,
}

/// The URI of spill `name` of `session`.
pub fn spill_uri(session: &SessionId, name: &str) -> String {
    format!("{SCHEME}{session}/spill/{name}")
}

/// Names of the spill files the agent's truncation markers in `text` give (`…; full output
/// in <dir>/spill/<name> …]`, `…; the first N bytes are in <dir>/spill/<name>; …`), at most
/// two. A command can print a look-alike marker; its name then leads only to this session's
/// own spills, or to "no such spill".
pub fn spills_named_in(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for lead in ["bytes truncated; full output in ", " bytes are in "] {
        for (at, _) in text.match_indices(lead) {
            let path = &text[at + lead.len()..];
            let path = path
                .split(|c: char| c.is_whitespace() || c == ';')
                .next()
                .unwrap_or_default();
            let Some((_, name)) = path.rsplit_once("/spill/") else {
                continue;
            };
            let valid = !name.is_empty()
                && name.len() <= 255
                && !name.starts_with('.')
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
            if valid && !names.iter().any(|n| n == name) && names.len() < 2 {
                names.push(name.to_owned());
            }
        }
    }
    names
}

/// The resource templates every client can list.
pub fn templates(max_read: u64) -> Vec<ResourceTemplate> {
    let chunk = format!(
        "Read it in chunks: append ?offset=N&length=M (bytes; at most {max_read} per read); \
         _meta.next of a result is the offset of the next chunk."
    );
    vec![
        ResourceTemplate::new(format!("{SCHEME}{{session}}/spill/{{name}}"), "spill")
            .with_title("Full output of a truncated bash stream")
            .with_description(format!(
                "The start of a stdout or stderr stream that a bash result cut short, kept in \
                 the session's sandbox (the result names the URI). {chunk}"
            ))
            .with_mime_type("application/octet-stream"),
        ResourceTemplate::new(
            format!("{SCHEME}{{session}}/workspace/{{+path}}"),
            "workspace-file",
        )
        .with_title("A file in the session's workspace")
        .with_description(format!(
            "A regular file beneath the session's working directory (no `..`, no link out of \
             it). {chunk}"
        ))
        .with_mime_type("application/octet-stream"),
    ]
}

fn bad_uri(uri: &str, why: &str) -> McpError {
    McpError::invalid_params(
        format!(
            "{why} in resource URI {:?}; use sandbox://<session>/spill/<name> or \
             sandbox://<session>/workspace/<path>, optionally with ?offset=N&length=M",
            uri.chars().take(200).collect::<String>()
        ),
        None,
    )
}

/// Parses `uri` (see the module documentation).
pub fn parse(uri: &str) -> Result<ResourceUri, McpError> {
    let rest = uri
        .strip_prefix(SCHEME)
        .ok_or_else(|| bad_uri(uri, "not a sandbox:// URI"))?;
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    if rest.contains('#') {
        return Err(bad_uri(uri, "a fragment"));
    }
    let (session, path) = rest
        .split_once('/')
        .ok_or_else(|| bad_uri(uri, "no path after the session"))?;
    let session = SessionId::parse(session).map_err(|e| {
        bad_uri(
            uri,
            &format!("session {session:?} is not a session id ({e})"),
        )
    })?;
    let target = if let Some(name) = path.strip_prefix("spill/") {
        Target::Spill(decode(name).ok_or_else(|| bad_uri(uri, "bad percent-encoding"))?)
    } else if let Some(file) = path.strip_prefix("workspace/") {
        Target::Workspace(decode(file).ok_or_else(|| bad_uri(uri, "bad percent-encoding"))?)
    } else {
        return Err(bad_uri(uri, "neither spill/ nor workspace/"));
    };
    let (mut offset, mut length) = (0, None);
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let number = || {
            value.parse::<u64>().map_err(|_| {
                bad_uri(
                    uri,
                    &format!("{key}={value:?} is not a whole number of bytes"),
                )
            })
        };
        match key {
            "offset" => offset = number()?,
            "length" => length = Some(number()?),
            _ => return Err(bad_uri(uri, &format!("unknown parameter {key:?}"))),
        }
    }
    Ok(ResourceUri {
        session,
        target,
        offset,
        length,
    })
}

/// Percent-decoding of a URI path (into UTF-8).
fn decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Reads the chunk `uri` names, for `caller`, within `max_read` bytes.
pub async fn read(
    sessions: &SessionManager,
    caller: &Caller,
    uri: &str,
    max_read: u64,
) -> Result<ReadResourceResult, McpError> {
    let parsed = parse(uri)?;
    let sid = &parsed.session;
    let length = parsed.length.unwrap_or(max_read).min(max_read);
    let (kind, key, value) = match &parsed.target {
        Target::Spill(name) => ("spill", "name", name.clone()),
        Target::Workspace(path) => ("workspace", "path", path.clone()),
    };
    let query = [
        (key, value),
        ("offset", parsed.offset.to_string()),
        ("length", length.to_string()),
    ];
    let (bytes, size) = sessions
        .read_file(sid, caller, kind, &query)
        .await
        .map_err(|e| file_error(sid, e))?;
    let got = bytes.len() as u64;
    let end = parsed.offset.saturating_add(got);
    let mut meta = json!({"offset": parsed.offset, "length": got, "size": size});
    if end < size {
        meta["next"] = json!(end);
    }
    let meta = match meta {
        serde_json::Value::Object(m) => Some(MetaObject(m)),
        _ => None,
    };
    let contents = match String::from_utf8(bytes) {
        Ok(text) => ResourceContents::TextResourceContents {
            uri: uri.to_owned(),
            mime_type: Some("text/plain".into()),
            text,
            meta,
        },
        Err(e) => ResourceContents::BlobResourceContents {
            uri: uri.to_owned(),
            mime_type: Some("application/octet-stream".into()),
            blob: base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
            meta,
        },
    };
    Ok(ReadResourceResult::new(vec![contents]))
}

fn gone(sid: &SessionId) -> McpError {
    McpError::resource_not_found(
        format!(
            "session {sid} has no sandbox now (it was deleted, idle-collected or evicted, or \
             never started): its spill files and workspace are gone with it"
        ),
        None,
    )
}

/// The MCP error of a read that failed: a forbidden session is a bad request, a sandbox
/// that is gone is a resource that is not found.
fn file_error(sid: &SessionId, e: FileError) -> McpError {
    match e {
        FileError::Gone => gone(sid),
        FileError::Session(e @ SessionError::Forbidden(_)) => {
            McpError::invalid_params(e.to_string(), None)
        }
        FileError::Session(e) => McpError::internal_error(e.to_string(), None),
        FileError::Agent(e) => agent_error(sid, e),
    }
}

fn agent_error(sid: &SessionId, e: AgentError) -> McpError {
    match &e {
        AgentError::Status {
            status, message, ..
        } if status.as_u16() == 404 => McpError::resource_not_found(message.clone(), None),
        AgentError::Status {
            status, message, ..
        } if status.as_u16() == 400 => McpError::invalid_params(message.clone(), None),
        // The pod behind the route went away (a new pod answers 401 to this session's old
        // token), or nothing listens any more.
        AgentError::Status { status, .. } if status.as_u16() == 401 || status.as_u16() == 503 => {
            gone(sid)
        }
        AgentError::Connect { .. } => gone(sid),
        _ => McpError::internal_error(
            format!("reading from the session's sandbox failed: {e}"),
            None,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_and_bad_ones_say_what_is_wrong() {
        let u = parse("sandbox://s-1/spill/3-ab.stdout?offset=10&length=5").expect("valid");
        assert_eq!(
            (u.session.as_str(), u.target, u.offset, u.length),
            ("s-1", Target::Spill("3-ab.stdout".into()), 10, Some(5))
        );
        let u = parse("sandbox://s-1/workspace/src/a%20b.rs").expect("valid");
        assert_eq!(u.target, Target::Workspace("src/a b.rs".into()));
        assert_eq!((u.offset, u.length), (0, None));
        for (uri, needle) in [
            ("file:///etc/passwd", "not a sandbox://"),
            ("sandbox://s-1", "no path"),
            ("sandbox://Bad_Id/spill/x", "not a session id"),
            ("sandbox://s-1/etc/passwd", "neither spill/ nor workspace/"),
            ("sandbox://s-1/spill/x?offset=-1", "not a whole number"),
            ("sandbox://s-1/spill/x?length=1e9", "not a whole number"),
            ("sandbox://s-1/spill/x?mode=raw", "unknown parameter"),
            ("sandbox://s-1/workspace/%zz", "percent-encoding"),
            ("sandbox://s-1/workspace/%ff", "percent-encoding"),
        ] {
            let e = parse(uri).expect_err(uri);
            assert!(e.message.contains(needle), "{uri}: {}", e.message);
        }
    }

    #[test]
    fn spill_names_come_from_the_agents_markers() {
        let text = "head\n[… 900 bytes truncated; full output in /tmp/cli-mcp-agent/spill/3-ab12.stdout …]\ntail";
        assert_eq!(spills_named_in(text), ["3-ab12.stdout"]);
        let text = "[… 9 bytes truncated; the first 30 bytes are in /tmp/s/spill/4-cd.stderr; the 70 bytes after them were not kept (…) …]";
        assert_eq!(spills_named_in(text), ["4-cd.stderr"]);
        for none in [
            "no marker at all",
            "[… 9 bytes truncated; the output was not kept (disk full) …]",
            "[… 9 bytes truncated; full output in /tmp/x/spill/../../etc/passwd …]",
        ] {
            assert!(spills_named_in(none).is_empty(), "{none}");
        }
    }

    #[test]
    fn templates_name_both_kinds_and_the_chunk_limit() {
        let t = templates(1024);
        let uris: Vec<_> = t.iter().map(|t| t.uri_template.as_str()).collect();
        assert_eq!(
            uris,
            [
                "sandbox://{session}/spill/{name}",
                "sandbox://{session}/workspace/{+path}"
            ]
        );
        assert!(t[0]
            .description
            .as_deref()
            .unwrap_or_default()
            .contains("1024"));
    }
}
