//! MCP progress notifications for a running `bash` call whose request carries
//! `_meta.progressToken`: bytes of output so far and the last line, at most one a second.
//!
//! The agent tells how far a command is on `GET /exec/progress?request_id=…`; the call that
//! waits for its `POST /exec` asks that once a second and sends a `notifications/progress`
//! when the count has grown (MCP requires `progress` to increase with every notification).
//! Nothing runs for a call without a token: no poll, no notification.
//!
//! The asking happens where the agent request is made ([`crate::agent_client`]), which is
//! the one place that knows the sandbox and the request id, also for a retry on a
//! rediscovered sandbox. The reporter reaches it as a task-local ([`with_reporter`]), so the
//! session layer in between, which finds and starts sandboxes, carries no progress plumbing.
//!
//! Delivery: over Streamable HTTP rmcp answers a request with `application/json` only when
//! the first message the handler emits is its result; a notification before it turns the
//! answer into an SSE stream (`text/event-stream`) that carries the notifications and then
//! the result, in both protocol eras (rmcp 3.11, `StreamableHttpService::handle_post`,
//! `json_response`). Over stdio notifications are lines like any other message. A
//! notification is handed to rmcp before the handler returns, so none follows the result.

use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::model::{ProgressNotificationParam, ProgressToken};
use rmcp::service::Peer;
use rmcp::RoleServer;

use cli_mcp_api::wire::ExecProgress;

/// Least time between two notifications of one call, and between two polls of the agent.
pub const INTERVAL: Duration = Duration::from_secs(1);

tokio::task_local! {
    static REPORTER: Arc<Reporter>;
}

/// Where one call's progress goes: the client that asked, under its token.
pub struct Reporter {
    peer: Peer<RoleServer>,
    token: ProgressToken,
    sent: Mutex<Sent>,
}

#[derive(Default)]
struct Sent {
    /// `progress` of the last notification (they must increase).
    bytes: u64,
    at: Option<Instant>,
}

impl Reporter {
    pub fn new(peer: Peer<RoleServer>, token: ProgressToken) -> Self {
        Self {
            peer,
            token,
            sent: Mutex::new(Sent::default()),
        }
    }

    /// What to send for `now`, if anything: only more bytes than last time, and not within
    /// [`INTERVAL`] of the last notification.
    fn due(&self, now: &ExecProgress, at: Instant) -> Option<ProgressNotificationParam> {
        let mut sent = self.sent.lock().unwrap_or_else(|p| p.into_inner());
        if !now.running
            || now.bytes <= sent.bytes
            || sent.at.is_some_and(|t| at.duration_since(t) < INTERVAL)
        {
            return None;
        }
        sent.bytes = now.bytes;
        sent.at = Some(at);
        let mut param = ProgressNotificationParam::new(self.token.clone(), now.bytes as f64);
        if let Some(line) = &now.last_line {
            param = param.with_message(line.clone());
        }
        Some(param)
    }

    /// Asks `poll` once per [`INTERVAL`] and notifies the client of what is new; never ends
    /// by itself (the caller drops it when the command's answer is there).
    async fn follow<F, Fut, E>(&self, mut poll: F) -> Infallible
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<ExecProgress, E>>,
        E: std::fmt::Display,
    {
        loop {
            tokio::time::sleep(INTERVAL).await;
            let now = match poll().await {
                Ok(p) => p,
                Err(e) => {
                    // Progress is a courtesy: the command's own request decides the call.
                    tracing::debug!(error = %e, "cannot ask the agent how far the command is");
                    continue;
                }
            };
            if let Some(param) = self.due(&now, Instant::now()) {
                if let Err(e) = self.peer.notify_progress(param).await {
                    tracing::debug!(error = %e, "cannot send a progress notification");
                }
            }
        }
    }
}

/// Runs `call` with `reporter` (if any) as the progress reporter of its agent requests.
pub async fn with_reporter<T>(reporter: Option<Reporter>, call: impl Future<Output = T>) -> T {
    match reporter {
        Some(r) => REPORTER.scope(Arc::new(r), call).await,
        None => call.await,
    }
}

/// `request` (a command's `POST /exec`), with the call's reporter (if it has one) asking
/// `poll` meanwhile. Ends when `request` does; a poll or notification under way then is
/// dropped, so no notification follows the result. The reporter's record of what it sent
/// outlives `request`, so a retry on a rediscovered sandbox continues from it.
pub async fn alongside<T, F, Fut, E>(request: impl Future<Output = T>, poll: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<ExecProgress, E>>,
    E: std::fmt::Display,
{
    let Ok(reporter) = REPORTER.try_with(Arc::clone) else {
        return request.await;
    };
    tokio::select! {
        biased;
        answer = request => answer,
        never = reporter.follow(poll) => match never {},
    }
}
