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
    /// The sandbox's container stopped while the command ran (seen in the pod's status):
    /// the agent and the shell are gone with whatever the command left undone.
    #[error(
        "the sandbox stopped while the command ran: its container ended with {reason}. \
         OOMKilled means the sandbox went past its memory limit \
         (spec.sandbox.resources.limits.memory); under a sandboxed runtime such as gVisor \
         that stops the whole sandbox, not only the command. The session's shell and its \
         state are gone; the next call goes on in the restarted sandbox with a fresh shell"
    )]
    Stopped { reason: String },
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

/// How long a connection to an agent is kept for the next request. Below the agent's own
/// header-read timeout (10 s by default), after which it closes a connection that sent
/// nothing: a request written as the agent closes it breaks, and is then only retried on the
/// same sandbox (see [`AgentClient`]).
const POOL_IDLE: Duration = Duration::from_secs(5);

/// Shared client of every sandbox's agent.
///
/// Two connection policies, by what a broken connection would leave unknown:
/// - kept alive (`pooled`): `POST /exec` with a `request_id`, and reads (`/healthz`,
///   progress, files). A request written on a reused connection whose agent has since gone
///   fails *after* being sent, so it looks like an agent dying mid-command
///   ([`AgentError::may_have_run`]). That is safe here: the session layer then retries only
///   on the same sandbox, whose agent journals the request id and answers the retry from
///   its journal instead of running the command again, and never sends it to a replacement
///   sandbox. A connection whose agent closed it while idle is dropped from the pool before
///   reuse (hyper sees the close), and a request the pool hands to a connection that turns
///   out closed before a byte is written is sent again on a new one. Only a request written
///   just as the close crosses it fails, as "may have run", and that retry answers it.
/// - one connection per request (`fresh`): `POST /assign`, and `/exec` without a request id,
///   where only a fresh connection tells "nothing ran" (refused) from "it may have run".
#[derive(Debug, Clone)]
pub struct AgentClient {
    pooled: reqwest::Client,
    fresh: reqwest::Client,
    /// Cap of an `/exec` answer.
    exec_body_limit: usize,
}

impl AgentClient {
    /// `output_budget` is the per-stream budget: the cap on an `/exec` answer allows for two
    /// streams at that size even when every byte needs JSON escaping, plus the truncation
    /// markers.
    pub fn new(output_budget: usize) -> Result<Self, reqwest::Error> {
        let builder = || {
            reqwest::Client::builder()
                .no_proxy()
                .connect_timeout(CONNECT_TIMEOUT)
                .tcp_nodelay(true)
        };
        // Two idle connections per agent: a call and its progress poll run side by side.
        let pooled = builder()
            .pool_idle_timeout(POOL_IDLE)
            .pool_max_idle_per_host(2)
            .build()?;
        let fresh = builder().pool_max_idle_per_host(0).build()?;
        let per_stream = output_budget.max(cli_mcp_api::wire::DEFAULT_OUTPUT_BUDGET);
        Ok(Self {
            pooled,
            fresh,
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
        // Only a journaled request may go over a kept-alive connection (see `AgentClient`).
        let client = if req.request_id.is_some() {
            &self.pooled
        } else {
            &self.fresh
        };
        let post = Self::post(
            client,
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
            .pooled
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
        let req = self
            .pooled
            .get(&url)
            .query(query)
            .bearer_auth(token.expose());
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

    /// `GET /healthz`: whether the agent answers (what its readiness probe asks). The
    /// connection is kept for the session's first command.
    pub async fn healthy(&self, endpoint: &str) -> bool {
        let url = format!("{endpoint}/healthz");
        let req = self.pooled.get(&url);
        self.get(req, endpoint, HEALTH_TIMEOUT, SMALL_BODY_LIMIT)
            .await
            .is_ok()
    }

    /// Binds a warm pod to a session (bearer = the pod's assign token).
    pub async fn assign(
        &self,
        endpoint: &str,
        assign_token: &Token,
        req: &AssignRequest,
    ) -> Result<AssignResponse, AgentError> {
        let url = format!("{endpoint}/assign");
        Self::post(
            &self.fresh,
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
        client: &reqwest::Client,
        url: &str,
        endpoint: &str,
        bearer: &str,
        body: &B,
        timeout: Duration,
        limit: usize,
    ) -> Result<R, AgentError> {
        let send = client
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
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// What the stand-in agent does with each connection.
    #[derive(Clone, Copy)]
    enum Conn {
        /// Answers every request, keeping the connection open.
        KeepAlive,
        /// Answers one request (without `Connection: close`), then closes: an agent that
        /// went away while the connection sat idle in the pool.
        CloseAfterAnswer,
        /// Answers the first request, reads the second, then closes without an answer: an
        /// agent dying mid-command on a kept-alive connection.
        DieOnSecond,
    }

    /// A stand-in agent on loopback, speaking HTTP/1.1 by hand so that each test controls
    /// exactly when a connection closes. It counts connections and records request lines.
    struct Stub {
        endpoint: String,
        accepted: Arc<AtomicUsize>,
        requests: Arc<Mutex<Vec<String>>>,
    }

    async fn stub(mode: Conn) -> Stub {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
        let accepted = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (a, r) = (accepted.clone(), requests.clone());
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(conn, mode, r.clone()));
            }
        });
        Stub {
            endpoint,
            accepted,
            requests,
        }
    }

    async fn serve(mut conn: TcpStream, mode: Conn, requests: Arc<Mutex<Vec<String>>>) {
        let mut buf = Vec::new();
        let mut served = 0;
        loop {
            let Some((line, body)) = read_request(&mut conn, &mut buf).await else {
                return;
            };
            requests
                .lock()
                .expect("lock")
                .push(format!("{line} {body}"));
            served += 1;
            if matches!(mode, Conn::DieOnSecond) && served == 2 {
                return;
            }
            let answer = if line.starts_with("GET /healthz") {
                "ok".to_owned()
            } else {
                serde_json::json!({"stdout": "", "stderr": "", "exit_code": 0, "duration_ms": 0,
                    "timed_out": false, "truncated": false, "total_bytes": 0, "cwd": "/",
                    "shell_restarted": false})
                .to_string()
            };
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                answer.len()
            );
            if conn.write_all(response.as_bytes()).await.is_err() {
                return;
            }
            if matches!(mode, Conn::CloseAfterAnswer) {
                return;
            }
        }
    }

    /// One request's first line and body; `None` at the end of the connection.
    async fn read_request(conn: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, String)> {
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = conn.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let length: usize = head
            .lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            let n = conn.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
            buf.extend_from_slice(&chunk[..n]);
        }
        let body = String::from_utf8_lossy(&buf[head_end..head_end + length]).to_string();
        buf.drain(..head_end + length);
        Some((head.lines().next().unwrap_or_default().to_owned(), body))
    }

    fn token() -> Token {
        cli_mcp_api::token::HmacKey::from_bytes([7; 32]).assign_token("p")
    }

    fn exec_req(request_id: Option<&str>) -> ExecRequest {
        ExecRequest {
            command: "true".into(),
            timeout_ms: Some(1000),
            request_id: request_id.map(str::to_owned),
        }
    }

    const T: Duration = Duration::from_secs(1);

    #[tokio::test]
    async fn journaled_commands_and_reads_reuse_one_connection() {
        let agent = stub(Conn::KeepAlive).await;
        let client = AgentClient::new(0).expect("client");
        assert!(client.healthy(&agent.endpoint).await);
        for i in 0..5 {
            let id = format!("r{i}");
            client
                .exec(&agent.endpoint, &token(), &exec_req(Some(&id)), T)
                .await
                .expect("exec");
        }
        assert_eq!(agent.requests.lock().expect("lock").len(), 6);
        assert_eq!(
            agent.accepted.load(Ordering::SeqCst),
            1,
            "the health check and five journaled commands share one connection"
        );
    }

    #[tokio::test]
    async fn unjournaled_commands_and_assign_take_a_connection_each() {
        let agent = stub(Conn::KeepAlive).await;
        let client = AgentClient::new(0).expect("client");
        for _ in 0..3 {
            client
                .exec(&agent.endpoint, &token(), &exec_req(None), T)
                .await
                .expect("exec");
        }
        assert_eq!(agent.accepted.load(Ordering::SeqCst), 3);
    }

    /// An agent that closed a pooled connection while it was idle (it exited, or its
    /// header-read timeout passed): the next command goes on a new connection, and the
    /// agent reads each command exactly once. Many rounds, because the close and the next
    /// request race: this stub closes right after its answer, so now and then (under load)
    /// the next request is written before the close has arrived. That one fails as "may
    /// have run", never read by the agent, and the session layer's retry on the same
    /// sandbox with the same request id (done here as it does) gets the answer; it must
    /// stay the exception.
    #[tokio::test]
    async fn a_connection_the_agent_closed_while_idle_is_not_a_broken_command() {
        let agent = stub(Conn::CloseAfterAnswer).await;
        let client = AgentClient::new(0).expect("client");
        let mut crossed = 0;
        for i in 0..200 {
            let id = format!("r{i}");
            let req = exec_req(Some(&id));
            if let Err(e) = client.exec(&agent.endpoint, &token(), &req, T).await {
                assert!(e.may_have_run(), "round {i}: {e}");
                crossed += 1;
                client
                    .exec(&agent.endpoint, &token(), &req, T)
                    .await
                    .unwrap_or_else(|e| panic!("round {i}, the retry: {e}"));
            }
        }
        let requests = agent.requests.lock().expect("lock");
        assert_eq!(requests.len(), 200, "each command read exactly once");
        // A crossed request went on the closed connection; its retry took a new one.
        assert_eq!(agent.accepted.load(Ordering::SeqCst), 200);
        assert!(
            crossed <= 20,
            "{crossed} of 200 requests went on a connection the agent had closed"
        );
    }

    #[tokio::test]
    async fn an_agent_dying_after_reading_a_pooled_request_may_have_run_it() {
        let agent = stub(Conn::DieOnSecond).await;
        let client = AgentClient::new(0).expect("client");
        client
            .exec(&agent.endpoint, &token(), &exec_req(Some("a")), T)
            .await
            .expect("first");
        let e = client
            .exec(&agent.endpoint, &token(), &exec_req(Some("b")), T)
            .await
            .expect_err("no answer");
        assert!(e.may_have_run(), "{e}");
        assert!(!e.not_sent(), "{e}");
        assert_eq!(
            agent.accepted.load(Ordering::SeqCst),
            1,
            "sent on the kept connection"
        );
        assert_eq!(
            agent.requests.lock().expect("lock").len(),
            2,
            "and not sent again"
        );
    }

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
