//! HTTP client of the sandbox agent (`POST /exec`, `POST /assign`), with every response body
//! read under a byte cap so a misbehaving sandbox cannot exhaust the server's memory.

use std::time::Duration;

use reqwest::StatusCode;
use serde::de::DeserializeOwned;
use serde::Serialize;

use cli_mcp_api::token::Token;
use cli_mcp_api::wire::{
    AssignRequest, AssignResponse, ErrorBody, ErrorCode, ExecProgress, ExecRequest, ExecResponse,
    FILE_READ_MAX, HEADER_FILE_SIZE,
};

/// Extra time over a command's own timeout before the server gives up on the agent: the
/// agent needs a moment after a timeout to kill the command and collect its output.
const EXEC_GRACE: Duration = Duration::from_secs(15);
const ASSIGN_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Cap of error bodies and `/assign` answers.
const SMALL_BODY_LIMIT: usize = 64 * 1024;
/// One `GET /healthz` of a starting agent: on a pod network it answers in well under this.
const HEALTH_TIMEOUT: Duration = Duration::from_millis(500);
/// One `GET /exec/progress`: asked once a second, so an answer later than that is useless.
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(1);
/// One `GET /files/…`: at most [`FILE_READ_MAX`] bytes from the sandbox's own disk.
const FILE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// No connection could be made (nothing listening, pod gone, network unreachable).
    #[error("cannot connect to the sandbox agent at {endpoint}: {detail}")]
    Connect { endpoint: String, detail: String },
    /// The connection failed after the request may have been sent.
    #[error("the connection to the sandbox agent at {endpoint} failed: {detail}")]
    Transport { endpoint: String, detail: String },
    /// The agent did not answer within the command timeout plus a grace period.
    #[error("the sandbox agent at {endpoint} did not answer within {after:?}")]
    Timeout { endpoint: String, after: Duration },
    /// The agent answered with an error status.
    #[error("the sandbox agent answered {status}: {message}")]
    Status {
        status: StatusCode,
        code: Option<ErrorCode>,
        message: String,
    },
    #[error("the sandbox agent's answer is over {limit} bytes; lower the agent's output budget")]
    TooLarge { limit: usize },
    #[error("the sandbox agent's answer is not valid: {0}")]
    BadBody(String),
}

impl AgentError {
    /// A failure that a different (rediscovered) sandbox may not have: transport errors, and
    /// 401/503 (the pod was replaced and no longer knows this session's token, or is not
    /// assigned, or is shutting down).
    pub fn is_rediscoverable(&self) -> bool {
        match self {
            AgentError::Connect { .. } | AgentError::Transport { .. } => true,
            AgentError::Status { status, .. } => {
                *status == StatusCode::UNAUTHORIZED || *status == StatusCode::SERVICE_UNAVAILABLE
            }
            _ => false,
        }
    }

    /// True when the request reached the agent and the connection broke before its answer:
    /// the command may have run (and may still be running there).
    pub fn may_have_run(&self) -> bool {
        matches!(self, AgentError::Transport { .. })
    }

    /// True when the request certainly did not reach the agent (safe to send again).
    pub fn not_sent(&self) -> bool {
        matches!(self, AgentError::Connect { .. })
    }

    pub fn is_busy(&self) -> bool {
        matches!(
            self,
            AgentError::Status {
                code: Some(ErrorCode::Busy),
                ..
            }
        )
    }
}

/// Shared client: one connection pool for every sandbox.
#[derive(Debug, Clone)]
pub struct AgentClient {
    http: reqwest::Client,
    /// Cap of an `/exec` answer.
    exec_body_limit: usize,
}

impl AgentClient {
    /// `output_budget` is the per-stream budget: the cap on an `/exec` answer allows for two
    /// streams at that size even when every byte needs JSON escaping, plus the truncation
    /// markers.
    pub fn new(output_budget: usize) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            // A connection per request: on a pooled connection whose agent died while it
            // was idle, the next request fails *after* being written, which looks exactly
            // like an agent dying mid-command. Only a fresh connection tells "nothing ran"
            // (refused) from "it may have run" (broken after sending), and the server must
            // never send a command that may have run to a replacement sandbox.
            .pool_max_idle_per_host(0)
            .build()?;
        let per_stream = output_budget.max(cli_mcp_api::wire::DEFAULT_OUTPUT_BUDGET);
        Ok(Self {
            http,
            exec_body_limit: 2 * 6 * per_stream + 64 * 1024,
        })
    }

    /// Runs one command. `timeout` is the command's own timeout (sent to the agent).
    pub async fn exec(
        &self,
        endpoint: &str,
        token: &Token,
        req: &ExecRequest,
        timeout: Duration,
    ) -> Result<ExecResponse, AgentError> {
        let url = format!("{endpoint}/exec");
        let post = self.post(
            &url,
            endpoint,
            token.expose(),
            req,
            timeout + EXEC_GRACE,
            self.exec_body_limit,
        );
        // A call whose client asked for progress also asks the agent how far it is.
        match req.request_id.as_deref() {
            Some(id) => {
                crate::progress::alongside(post, || self.progress(endpoint, token, id)).await
            }
            None => post.await,
        }
    }

    /// `GET /exec/progress`: how far the command of `request_id` is.
    pub async fn progress(
        &self,
        endpoint: &str,
        token: &Token,
        request_id: &str,
    ) -> Result<ExecProgress, AgentError> {
        let url = format!("{endpoint}/exec/progress");
        let req = self
            .http
            .get(&url)
            .query(&[("request_id", request_id)])
            .bearer_auth(token.expose());
        let (_, bytes) = self
            .get(req, endpoint, PROGRESS_TIMEOUT, SMALL_BODY_LIMIT)
            .await?;
        serde_json::from_slice(&bytes).map_err(|e| AgentError::BadBody(e.to_string()))
    }

    /// `GET /files/<kind>` (`spill` or `workspace`) with `query`: a chunk of a file and the
    /// file's size.
    pub async fn file(
        &self,
        endpoint: &str,
        token: &Token,
        kind: &str,
        query: &[(&str, String)],
    ) -> Result<(Vec<u8>, u64), AgentError> {
        let url = format!("{endpoint}/files/{kind}");
        let req = self.http.get(&url).query(query).bearer_auth(token.expose());
        let limit = usize::try_from(FILE_READ_MAX).unwrap_or(usize::MAX);
        let (headers, bytes) = self.get(req, endpoint, FILE_TIMEOUT, limit).await?;
        let size = headers
            .get(HEADER_FILE_SIZE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| AgentError::BadBody(format!("no {HEADER_FILE_SIZE} header")))?;
        Ok((bytes, size))
    }

    async fn get(
        &self,
        req: reqwest::RequestBuilder,
        endpoint: &str,
        timeout: Duration,
        limit: usize,
    ) -> Result<(reqwest::header::HeaderMap, Vec<u8>), AgentError> {
        let resp = req
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| classify(e, endpoint, timeout))?;
        let headers = resp.headers().clone();
        let bytes = read_body(resp, endpoint, timeout, limit).await?;
        Ok((headers, bytes))
    }

    /// `GET /healthz`: whether the agent answers (what its readiness probe asks).
    pub async fn healthy(&self, endpoint: &str) -> bool {
        let url = format!("{endpoint}/healthz");
        matches!(
            self.http.get(&url).timeout(HEALTH_TIMEOUT).send().await,
            Ok(r) if r.status().is_success()
        )
    }

    /// Binds a warm pod to a session (bearer = the pod's assign token).
    pub async fn assign(
        &self,
        endpoint: &str,
        assign_token: &Token,
        req: &AssignRequest,
    ) -> Result<AssignResponse, AgentError> {
        let url = format!("{endpoint}/assign");
        self.post(
            &url,
            endpoint,
            assign_token.expose(),
            req,
            ASSIGN_TIMEOUT,
            SMALL_BODY_LIMIT,
        )
        .await
    }

    async fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        url: &str,
        endpoint: &str,
        bearer: &str,
        body: &B,
        timeout: Duration,
        limit: usize,
    ) -> Result<R, AgentError> {
        let send = self
            .http
            .post(url)
            .bearer_auth(bearer)
            .json(body)
            .timeout(timeout)
            .send();
        let resp = send.await.map_err(|e| classify(e, endpoint, timeout))?;
        let bytes = read_body(resp, endpoint, timeout, limit).await?;
        serde_json::from_slice(&bytes).map_err(|e| AgentError::BadBody(e.to_string()))
    }
}

/// A successful answer's body within `limit` bytes; an error answer (within
/// `SMALL_BODY_LIMIT`) as [`AgentError::Status`].
async fn read_body(
    mut resp: reqwest::Response,
    endpoint: &str,
    timeout: Duration,
    limit: usize,
) -> Result<Vec<u8>, AgentError> {
    let status = resp.status();
    let body_limit = if status.is_success() {
        limit
    } else {
        SMALL_BODY_LIMIT
    };
    if resp.content_length().is_some_and(|n| n > body_limit as u64) {
        return Err(AgentError::TooLarge { limit: body_limit });
    }
    let mut bytes =
        Vec::with_capacity(resp.content_length().unwrap_or(1024).min(body_limit as u64) as usize);
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                if bytes.len() + chunk.len() > body_limit {
                    return Err(AgentError::TooLarge { limit: body_limit });
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(None) => break,
            Err(e) => return Err(classify(e, endpoint, timeout)),
        }
    }
    if !status.is_success() {
        let (code, message) = match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(b) => (Some(b.code), b.error),
            Err(_) => (None, String::from_utf8_lossy(&bytes).trim().to_owned()),
        };
        return Err(AgentError::Status {
            status,
            code,
            message,
        });
    }
    Ok(bytes)
}

fn classify(e: reqwest::Error, endpoint: &str, timeout: Duration) -> AgentError {
    let endpoint = endpoint.to_owned();
    if e.is_connect() {
        AgentError::Connect {
            endpoint,
            detail: error_chain(&e),
        }
    } else if e.is_timeout() {
        AgentError::Timeout {
            endpoint,
            after: timeout,
        }
    } else {
        AgentError::Transport {
            endpoint,
            detail: error_chain(&e),
        }
    }
}

/// The error and its sources on one line (reqwest's top-level message alone is vague).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rediscoverable_failures() {
        let status = |s: StatusCode, code| AgentError::Status {
            status: s,
            code,
            message: String::new(),
        };
        assert!(AgentError::Connect {
            endpoint: "e".into(),
            detail: "refused".into()
        }
        .is_rediscoverable());
        assert!(
            status(StatusCode::UNAUTHORIZED, Some(ErrorCode::Unauthorized)).is_rediscoverable()
        );
        assert!(status(
            StatusCode::SERVICE_UNAVAILABLE,
            Some(ErrorCode::NotAssigned)
        )
        .is_rediscoverable());
        assert!(!status(StatusCode::CONFLICT, Some(ErrorCode::Busy)).is_rediscoverable());
        assert!(status(StatusCode::CONFLICT, Some(ErrorCode::Busy)).is_busy());
        assert!(!status(StatusCode::BAD_REQUEST, Some(ErrorCode::BadRequest)).is_rediscoverable());
    }
}
