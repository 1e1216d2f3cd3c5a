//! Cancelling a running `tools/call` from a later `notifications/cancelled`.
//!
//! rmcp serves `/mcp` statelessly: every POST gets its own service, and a notification POST
//! is answered 202 and dropped (`StreamableHttpService::handle_post`, the stateless branch's
//! `ClientJsonRpcMessage::Notification(_) => accepted_response()` in rmcp 3.11
//! `transport/streamable_http_server/tower.rs`), so a handshake-era client's
//! `notifications/cancelled` never reaches the call it names. The server keeps this table of
//! its running calls instead: the HTTP layer looks the named call up and cancels it, and the
//! call then stops waiting, which drops its agent request, and the agent interrupts the
//! command as Ctrl-C does.
//!
//! A call is named by who sent it (the caller's identity), the session it was sent in
//! (`X-Session-ID`, else `Mcp-Session-Id`, exactly as sent) and its JSON-RPC request id. A
//! notification without either header names no call: request ids are per client, so
//! without a session they could name another client's call. Such a client (and every
//! 2026-07-28 client, whose cancellation is closing the request) cancels by abandoning the
//! HTTP request, which rmcp turns into the call's own cancellation token.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::auth::Caller;
use crate::mcp::session::{MCP_SESSION_HEADER, SESSION_HEADER};

/// Which call a `notifications/cancelled` names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallKey {
    caller: String,
    scope: String,
    request_id: String,
}

impl CallKey {
    /// The key of request `request_id` sent by `caller` with `headers`; `None` when the
    /// request carries no session header (see the module documentation) or the id is not a
    /// JSON-RPC id (a number or a string).
    pub fn new(caller: &Caller, headers: &http::HeaderMap, request_id: &Value) -> Option<Self> {
        let request_id = match request_id {
            Value::Number(n) => format!("n:{n}"),
            Value::String(s) => format!("s:{s}"),
            _ => return None,
        };
        let scope = [(SESSION_HEADER, "x"), (MCP_SESSION_HEADER, "m")]
            .into_iter()
            .find_map(|(name, tag)| {
                let mut values = headers.get_all(name).iter();
                let value = values.next()?;
                // Sent twice: the call itself is refused, so it names nothing either.
                if values.next().is_some() {
                    return Some(None);
                }
                Some(value.to_str().ok().map(|v| format!("{tag}:{v}")))
            })??;
        Some(Self {
            caller: caller.name.clone(),
            scope,
            request_id,
        })
    }
}

type Entries = HashMap<CallKey, Vec<(u64, CancellationToken)>>;

/// The running calls that a `notifications/cancelled` can name.
#[derive(Debug, Default)]
pub struct RunningCalls {
    calls: Arc<Mutex<Entries>>,
    next: AtomicU64,
}

impl RunningCalls {
    /// Records a running call until the returned guard is dropped; `token` is cancelled when
    /// a notification names it.
    pub fn register(&self, key: CallKey, token: CancellationToken) -> Registration {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.calls)
            .entry(key.clone())
            .or_default()
            .push((id, token));
        Registration {
            calls: self.calls.clone(),
            key,
            id,
        }
    }

    /// Cancels the running calls `key` names; how many there were. Two clients of one
    /// identity that share an `X-Session-ID` may both have a call with the same id: both
    /// are cancelled, as they share one shell anyway.
    pub fn cancel(&self, key: &CallKey) -> usize {
        let calls = lock(&self.calls);
        let Some(entries) = calls.get(key) else {
            return 0;
        };
        for (_, token) in entries {
            token.cancel();
        }
        entries.len()
    }

    /// Calls registered right now.
    pub fn len(&self) -> usize {
        lock(&self.calls).values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn lock(calls: &Mutex<Entries>) -> std::sync::MutexGuard<'_, Entries> {
    calls.lock().unwrap_or_else(|p| p.into_inner())
}

/// Removes its call from [`RunningCalls`] when dropped (the call ended, or its future was
/// dropped).
#[derive(Debug)]
pub struct Registration {
    calls: Arc<Mutex<Entries>>,
    key: CallKey,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut calls = lock(&self.calls);
        if let Some(entries) = calls.get_mut(&self.key) {
            entries.retain(|(id, _)| *id != self.id);
            if entries.is_empty() {
                calls.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn headers(pairs: &[(&'static str, &'static str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (name, value) in pairs {
            h.append(*name, http::HeaderValue::from_static(value));
        }
        h
    }

    #[test]
    fn a_call_is_named_by_caller_session_and_request_id() {
        let alice = Caller::identified("alice");
        let bob = Caller::identified("bob");
        let x = headers(&[(SESSION_HEADER, "s-1")]);
        let key = CallKey::new(&alice, &x, &json!(3)).expect("key");
        assert_eq!(CallKey::new(&alice, &x, &json!(3)), Some(key.clone()));
        for other in [
            CallKey::new(&bob, &x, &json!(3)),
            CallKey::new(&alice, &headers(&[(SESSION_HEADER, "s-2")]), &json!(3)),
            CallKey::new(&alice, &x, &json!(4)),
            // A string id is another id than the number it spells.
            CallKey::new(&alice, &x, &json!("3")),
            // The same text as an MCP session id is another session.
            CallKey::new(&alice, &headers(&[(MCP_SESSION_HEADER, "s-1")]), &json!(3)),
        ] {
            assert_ne!(other, Some(key.clone()));
        }
        // X-Session-ID decides the session, as for the call itself.
        let both = headers(&[(SESSION_HEADER, "s-1"), (MCP_SESSION_HEADER, "c00")]);
        assert_eq!(CallKey::new(&alice, &both, &json!(3)), Some(key));
        // No session, a repeated header, or an id that is no JSON-RPC id: nothing is named.
        assert_eq!(CallKey::new(&alice, &headers(&[]), &json!(3)), None);
        let twice = headers(&[(SESSION_HEADER, "a"), (SESSION_HEADER, "b")]);
        assert_eq!(CallKey::new(&alice, &twice, &json!(3)), None);
        for id in [json!(null), json!([1]), json!({"id": 1}), json!(true)] {
            assert_eq!(CallKey::new(&alice, &x, &id), None, "{id}");
        }
    }

    #[test]
    fn cancel_reaches_only_running_calls_and_a_finished_call_leaves_nothing() {
        let calls = RunningCalls::default();
        let alice = Caller::identified("alice");
        let x = headers(&[(SESSION_HEADER, "s-1")]);
        let key = |id| CallKey::new(&alice, &x, &json!(id)).expect("key");
        let (one, two) = (CancellationToken::new(), CancellationToken::new());
        let reg_one = calls.register(key(1), one.clone());
        let reg_two = calls.register(key(2), two.clone());
        assert_eq!(calls.cancel(&key(9)), 0, "an unknown id cancels nothing");
        assert_eq!(calls.cancel(&key(1)), 1);
        assert!(one.is_cancelled() && !two.is_cancelled());
        drop(reg_one);
        drop(reg_two);
        assert!(calls.is_empty(), "finished calls are forgotten");
        assert_eq!(calls.cancel(&key(2)), 0);

        // The same key twice (two clients sharing a session): both are cancelled, and each
        // registration removes only its own entry.
        let (a, b) = (CancellationToken::new(), CancellationToken::new());
        let reg_a = calls.register(key(5), a.clone());
        let reg_b = calls.register(key(5), b.clone());
        drop(reg_a);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls.cancel(&key(5)), 1);
        assert!(b.is_cancelled() && !a.is_cancelled());
        drop(reg_b);
        assert!(calls.is_empty());
    }
}
