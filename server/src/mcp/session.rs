//! Which session a call runs in: the `X-Session-ID` header, the `session` argument, the MCP
//! session, or a new handle, and the checks that keep a handle to its own identity.

use cli_mcp_api::SessionId;

use crate::auth::Caller;

pub const SESSION_HEADER: &str = "x-session-id";
/// The MCP session header of the handshake-era Streamable HTTP transport.
pub const MCP_SESSION_HEADER: &str = "mcp-session-id";
/// The tool argument that carries a chat's session handle (2026-07-28 clients).
pub const SESSION_ARG: &str = "session";
/// Hex characters of the owner hash at the start of a handle.
const HANDLE_OWNER_HEX: usize = 16;
/// Random hex characters of a handle (128 bits).
const HANDLE_RANDOM_HEX: usize = 32;

/// A new chat session handle for `caller`: `c`, 16 hex of the caller's owner hash, 32 random
/// hex (a valid session id, 49 characters). The owner part lets a handle of another identity
/// be refused with a clear message before anything is looked up; the sandbox's owner check
/// is what actually protects a session (a forged prefix only reaches that check).
pub fn new_handle(caller: &Caller) -> SessionId {
    let random: [u8; HANDLE_RANDOM_HEX / 2] = rand::random();
    let text = format!("c{}{}", owner_prefix(caller), hex::encode(random));
    SessionId::parse(&text)
        .unwrap_or_else(|e| unreachable!("`c` and lowercase hex is a valid session id: {e}"))
}

/// The start of the caller's owner hash (with auth off, where there is no owner, of its name).
fn owner_prefix(caller: &Caller) -> String {
    let mut owner = match &caller.owner {
        Some(owner) => owner.clone(),
        None => crate::auth::owner_hash(&caller.name),
    };
    owner.truncate(HANDLE_OWNER_HEX);
    owner
}

/// Checks a handle a client sent back (`what` names where it came from).
pub fn check_handle(text: &str, caller: &Caller, what: &str) -> Result<SessionId, String> {
    let well_formed = text.len() == 1 + HANDLE_OWNER_HEX + HANDLE_RANDOM_HEX
        && text.starts_with('c')
        && text[1..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !well_formed {
        return Err(format!(
            "{what} {:?} is not a session handle of this server; omit it to start a new \
             session (the result then names its handle)",
            text.chars().take(80).collect::<String>()
        ));
    }
    if text[1..1 + HANDLE_OWNER_HEX] != owner_prefix(caller) {
        return Err(format!(
            "{what} {text:?} belongs to another identity; use a handle this server gave you, \
             or omit it to start a new session"
        ));
    }
    SessionId::parse(text).map_err(|e| format!("{what} {text:?}: {e}"))
}

/// Where a call's session came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionSource {
    /// `X-Session-ID`, set by the caller's configuration (an orchestrator): as before.
    Header,
    /// The `session` argument: a handle from an earlier result.
    Argument,
    /// The MCP session (`Mcp-Session-Id`, issued at initialize): one shell per chat.
    McpSession,
    /// None of them: a new handle, which the result names.
    New,
}

/// The session of a call: `X-Session-ID`, else the `session` argument, else
/// `Mcp-Session-Id`, else a new handle.
pub fn resolve_session(
    headers: &http::HeaderMap,
    argument: Option<&str>,
    caller: &Caller,
) -> Result<(SessionId, SessionSource), String> {
    if headers.contains_key(SESSION_HEADER) {
        let sid = session_from_headers(headers)?;
        if let Some(arg) = argument.filter(|a| *a != sid.as_str()) {
            return Err(format!(
                "argument `session` {arg:?} differs from this connection's X-Session-ID \
                 {sid:?}, which decides the session here; omit `session`"
            ));
        }
        return Ok((sid, SessionSource::Header));
    }
    if let Some(arg) = argument {
        return Ok((
            check_handle(arg, caller, "argument `session`")?,
            SessionSource::Argument,
        ));
    }
    let mut values = headers.get_all(MCP_SESSION_HEADER).iter();
    if let Some(value) = values.next() {
        if values.next().is_some() {
            return Err("Mcp-Session-Id is sent more than once; send exactly one".into());
        }
        let text = value
            .to_str()
            .map_err(|_| "Mcp-Session-Id is not plain ASCII text".to_owned())?;
        return Ok((
            check_handle(text, caller, "Mcp-Session-Id")?,
            SessionSource::McpSession,
        ));
    }
    Ok((new_handle(caller), SessionSource::New))
}

/// The session id of a request, or a message that says exactly what is wrong.
pub fn session_from_headers(headers: &http::HeaderMap) -> Result<SessionId, String> {
    let mut values = headers.get_all(SESSION_HEADER).iter();
    let Some(value) = values.next() else {
        return Err(
            "missing X-Session-ID header: every call needs a session id, a DNS-1123 \
             label such as `my-session-1` (lowercase letters, digits and '-', at most 63 \
             characters), sent as the HTTP header X-Session-ID; calls with the same id share \
             one shell"
                .into(),
        );
    };
    if values.next().is_some() {
        return Err("X-Session-ID is sent more than once; send exactly one".into());
    }
    let text = value.to_str().map_err(|_| {
        "X-Session-ID is not plain ASCII text; use a DNS-1123 label such as `my-session-1`"
    })?;
    SessionId::parse(text).map_err(|e| format!("invalid X-Session-ID {text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_header_errors_say_what_is_wrong() {
        let mut h = http::HeaderMap::new();
        assert!(session_from_headers(&h)
            .expect_err("missing")
            .contains("missing X-Session-ID"));
        h.insert(SESSION_HEADER, http::HeaderValue::from_static("Bad_ID"));
        let e = session_from_headers(&h).expect_err("invalid");
        assert!(
            e.contains("invalid X-Session-ID \"Bad_ID\"") && e.contains("'B'"),
            "{e}"
        );
        h.append(SESSION_HEADER, http::HeaderValue::from_static("ok"));
        assert!(session_from_headers(&h)
            .expect_err("twice")
            .contains("more than once"));
        let mut h = http::HeaderMap::new();
        h.insert(SESSION_HEADER, http::HeaderValue::from_static("s-1"));
        assert_eq!(
            session_from_headers(&h).map(|s| s.to_string()),
            Ok("s-1".into())
        );
    }

    #[test]
    fn sessions_come_from_the_header_the_argument_the_mcp_session_or_anew() {
        let alice = Caller::identified("alice");
        let bob = Caller::identified("bob");
        let none = http::HeaderMap::new();
        let (first, source) = resolve_session(&none, None, &alice).expect("new");
        assert_eq!(source, SessionSource::New);
        let (other, _) = resolve_session(&none, None, &alice).expect("new");
        assert_ne!(first, other, "every call without a session starts its own");
        assert_eq!(first.as_str().len(), 49);

        let (again, source) = resolve_session(&none, Some(first.as_str()), &alice).expect("handle");
        assert_eq!(
            (again.clone(), source),
            (first.clone(), SessionSource::Argument)
        );
        let e = resolve_session(&none, Some(first.as_str()), &bob).expect_err("not bob's");
        assert!(e.contains("belongs to another identity"), "{e}");
        // One sentence: a line continuation lost in the source shows as a run of spaces.
        assert!(!e.contains("  "), "{e:?}");
        for forged in [
            "my-session",
            "c1234",
            &format!("{}x", &first.as_str()[..48]),
        ] {
            let e = resolve_session(&none, Some(forged), &alice).expect_err("forged");
            assert!(
                e.contains("is not a session handle of this server") && !e.contains("  "),
                "{forged}: {e:?}"
            );
        }

        let mut mcp = http::HeaderMap::new();
        mcp.insert(
            MCP_SESSION_HEADER,
            http::HeaderValue::from_str(first.as_str()).expect("header"),
        );
        assert_eq!(
            resolve_session(&mcp, None, &alice),
            Ok((first.clone(), SessionSource::McpSession))
        );
        assert!(resolve_session(&mcp, None, &bob)
            .expect_err("not bob's")
            .contains("Mcp-Session-Id"));
        mcp.append(MCP_SESSION_HEADER, http::HeaderValue::from_static("c0"));
        assert!(resolve_session(&mcp, None, &alice)
            .expect_err("twice")
            .contains("more than once"));

        // The orchestrator's header decides, whatever else is sent.
        let mut h = mcp.clone();
        h.insert(SESSION_HEADER, http::HeaderValue::from_static("orch-1"));
        assert_eq!(
            resolve_session(&h, None, &bob).map(|(s, src)| (s.to_string(), src)),
            Ok(("orch-1".to_owned(), SessionSource::Header))
        );
        assert!(resolve_session(&h, Some("orch-1"), &bob).is_ok());
        let e = resolve_session(&h, Some(first.as_str()), &alice).expect_err("differs");
        assert!(
            e.contains("differs from this connection's X-Session-ID") && !e.contains("  "),
            "{e:?}"
        );
        // Auth off: handles are still checked, against the anonymous name.
        let anon = Caller::anonymous();
        let (h1, _) = resolve_session(&none, None, &anon).expect("new");
        assert!(resolve_session(&none, Some(h1.as_str()), &anon).is_ok());
    }
}
