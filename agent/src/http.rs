//! The agent's HTTP API: `POST /exec`, `POST /assign`, `GET /healthz`.
//!
//! Every error is JSON `{error, code}`. One command runs at a time: a second caller waits
//! within its own timeout for the shell, then gets 409 `busy`; only a few callers may wait
//! at once, the others get 409 `busy` at once (each waiter holds a connection). A command
//! runs in its own task so that a caller going away interrupts it cleanly instead of
//! abandoning it midway. `/healthz` touches neither the shell nor its queue, and neither do
//! `GET /exec/progress` (how far the running command is) and `GET /files/…` (a spill or a
//! workspace file read back in chunks, see [`crate::files`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use tokio::sync::{oneshot, watch, OwnedMutexGuard};

use cli_mcp_api::wire::{
    AssignRequest, AssignResponse, ErrorBody, ErrorCode, ExecProgress, ExecRequest, ExecResponse,
    HEADER_FILE_SIZE,
};

use crate::assignment::{AssignError, Assignment, AuthError};
use crate::files::{self, Chunk, FileError};
use crate::progress::Progress;
use crate::runner::{Job, RunError, Runner};
use crate::shell::{Shell, StopReason};
use crate::spill::Spills;

/// Limits applied to every `/exec`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub default_timeout: Duration,
    pub max_timeout: Duration,
    pub max_body_bytes: usize,
    /// Callers that may wait for a busy shell at once.
    pub max_waiting: usize,
}

/// How long a caller may take to send its body once its headers are accepted.
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

pub struct AgentState {
    assignment: Mutex<Assignment>,
    runner: Arc<tokio::sync::Mutex<Runner>>,
    limits: Limits,
    shutting_down: AtomicBool,
    abort_tx: watch::Sender<bool>,
    /// Callers waiting for the shell right now.
    waiting: AtomicUsize,
    /// The running command's progress (the shell's, reachable while the runner is busy).
    progress: Progress,
    spills: Spills,
    /// The shell's starting directory: the root of `GET /files/workspace`.
    workspace: std::path::PathBuf,
}

impl AgentState {
    pub fn new(assignment: Assignment, shell: Shell, limits: Limits) -> Arc<Self> {
        let (abort_tx, _) = watch::channel(false);
        let progress = shell.progress();
        let spills = shell.spills();
        let workspace = shell.options().workdir.clone();
        Arc::new(Self {
            assignment: Mutex::new(assignment),
            runner: Arc::new(tokio::sync::Mutex::new(Runner::new(shell))),
            limits,
            shutting_down: AtomicBool::new(false),
            abort_tx,
            waiting: AtomicUsize::new(0),
            progress,
            spills,
            workspace,
        })
    }

    /// Stops accepting commands (new `/exec` calls get 503).
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Interrupts the running command, if any.
    pub fn abort_running(&self) {
        self.abort_tx.send_replace(true);
    }

    /// Waits until no command runs, then returns the runner (for a final shell kill).
    pub async fn idle_runner(&self) -> OwnedMutexGuard<Runner> {
        self.runner.clone().lock_owned().await
    }

    fn refuse_if_shutting_down(&self) -> Result<(), ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::ShuttingDown,
                "the sandbox agent is shutting down; retry on a new sandbox",
            ));
        }
        Ok(())
    }

    fn assignment(&self) -> std::sync::MutexGuard<'_, Assignment> {
        self.assignment.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub fn router(state: Arc<AgentState>) -> Router {
    Router::new()
        .route("/exec", post(exec))
        .route("/exec/progress", get(exec_progress))
        .route("/files/spill", get(spill_file))
        .route("/files/workspace", get(workspace_file))
        .route("/assign", post(assign))
        .route("/healthz", get(healthz))
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                ErrorCode::NotFound,
                "no such endpoint; the agent serves POST /exec, GET /exec/progress, GET \
                 /files/spill, GET /files/workspace, POST /assign and GET /healthz",
            )
        })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                ErrorCode::BadRequest,
                "method not allowed; the agent serves POST /exec, GET /exec/progress, GET \
                 /files/spill, GET /files/workspace, POST /assign and GET /healthz",
            )
        })
        .with_state(state)
}

/// An error response: status + `{error, code}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    body: ErrorBody,
}

impl ApiError {
    fn new(status: StatusCode, code: ErrorCode, msg: impl Into<String>) -> Self {
        Self {
            status,
            body: ErrorBody {
                error: msg.into(),
                code,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut res = (self.status, Json(self.body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            res.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        res
    }
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        match e {
            AuthError::NotAssigned => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::NotAssigned,
                e.to_string(),
            ),
            AuthError::MissingBearer | AuthError::WrongToken => Self::new(
                StatusCode::UNAUTHORIZED,
                ErrorCode::Unauthorized,
                e.to_string(),
            ),
        }
    }
}

/// Reads and parses a body — only ever called after the caller was authenticated, so an
/// anonymous client cannot make the agent buffer anything. Bounded in size and in time.
async fn parse_body<T: DeserializeOwned>(body: Body, limit: usize) -> Result<T, ApiError> {
    let bytes: Bytes = match tokio::time::timeout(
        BODY_READ_TIMEOUT,
        axum::body::to_bytes(body, limit),
    )
    .await
    {
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                ErrorCode::BadRequest,
                "the request body did not arrive within 10 s",
            ))
        }
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
                || e.to_string().contains("length limit");
            return Err(if too_large {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, ErrorCode::PayloadTooLarge, "request body is over the agent's limit; send a shorter command or raise --max-body-bytes")
            } else {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::BadRequest,
                    format!("cannot read the request body: {e}"),
                )
            });
        }
        Ok(Ok(b)) => b,
    };
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::BadRequest,
            format!("invalid JSON body: {e}"),
        )
    })
}

fn authorization(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
}

async fn healthz(State(state): State<Arc<AgentState>>) -> Json<serde_json::Value> {
    let assigned = state.assignment().is_assigned();
    Json(serde_json::json!({"status": "ok", "assigned": assigned}))
}

async fn assign(
    State(state): State<Arc<AgentState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<AssignResponse>, ApiError> {
    // Authenticate before reading the body: only the holder of a token may make us buffer.
    state
        .assignment()
        .authenticate_assign(authorization(&headers))?;
    let req: AssignRequest = parse_body(body, state.limits.max_body_bytes).await?;
    let session_id = state.assignment().assign(authorization(&headers), &req)?;
    tracing::info!(session = %session_id, "assigned");
    Ok(Json(AssignResponse { session_id }))
}

impl From<AssignError> for ApiError {
    fn from(e: AssignError) -> Self {
        match e {
            AssignError::Auth(e) => e.into(),
            AssignError::AlreadyAssigned => Self::new(
                StatusCode::CONFLICT,
                ErrorCode::AlreadyAssigned,
                e.to_string(),
            ),
            AssignError::BadCommitment => Self::new(
                StatusCode::BAD_REQUEST,
                ErrorCode::BadRequest,
                e.to_string(),
            ),
        }
    }
}

async fn exec(
    State(state): State<Arc<AgentState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<ExecResponse>, ApiError> {
    state.assignment().authorize_exec(authorization(&headers))?;
    state.refuse_if_shutting_down()?;
    let req: ExecRequest = parse_body(body, state.limits.max_body_bytes).await?;
    let timeout = resolve_timeout(req.timeout_ms, &state.limits)?;
    if req.command.is_empty() {
        return Err(bad_request("command is empty"));
    }
    if req.command.contains('\0') {
        return Err(bad_request(
            "command contains a NUL byte, which bash cannot run",
        ));
    }

    let runner = wait_for_shell(&state, timeout).await?;
    // A caller that waited for the lock may have waited through SIGTERM.
    state.refuse_if_shutting_down()?;
    let _running = state.progress.begin(req.request_id.clone());
    let job = Job {
        command: req.command,
        request_id: req.request_id,
        timeout,
    };

    // The command runs in its own task: if this handler is dropped (the client went away),
    // `cancel_tx` drops with it and the task interrupts the command and cleans up.
    let (cancel_tx, cancel_rx) = oneshot::channel::<()>();
    let mut abort_rx = state.abort_tx.subscribe();
    let abort = async move {
        tokio::select! {
            _ = cancel_rx => StopReason::CallerGone,
            gone = async { abort_rx.wait_for(|v| *v).await.is_err() } => {
                // The state (and its sender) went away: nothing will ever abort.
                if gone { std::future::pending::<()>().await }
                StopReason::Shutdown
            }
        }
    };
    let task = tokio::spawn(async move {
        let mut runner = runner;
        runner.run_once(&job, abort).await
    });
    let joined = task.await;
    drop(cancel_tx);
    match joined {
        Ok(Ok(resp)) => Ok(Json(resp)),
        Ok(Err(e @ RunError::RequestIdReused)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::BadRequest,
            e.to_string(),
        )),
        Ok(Err(RunError::Shell(e))) => {
            tracing::error!(error = %e, "exec failed");
            Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorCode::Internal,
                e.to_string(),
            ))
        }
        Err(e) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            format!("the command task failed: {e}"),
        )),
    }
}

/// The shell, once this caller's turn comes: within the call's own timeout, and only if few
/// enough callers wait already (each holds a connection and a task while it waits).
async fn wait_for_shell(
    state: &Arc<AgentState>,
    timeout: Duration,
) -> Result<OwnedMutexGuard<Runner>, ApiError> {
    if let Ok(runner) = state.runner.clone().try_lock_owned() {
        return Ok(runner);
    }
    let max = state.limits.max_waiting;
    let waiting = state.waiting.fetch_add(1, Ordering::SeqCst);
    let _turn = Waiting(&state.waiting);
    if waiting >= max {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::Busy,
            format!(
                "another command is still running in this session and {waiting} other callers \
                 are already waiting for the shell (at most {max}); retry when it has finished"
            ),
        ));
    }
    match tokio::time::timeout(timeout, state.runner.clone().lock_owned()).await {
        Ok(runner) => Ok(runner),
        Err(_) => Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::Busy,
            "another command is still running in this session; waited for the shell for this \
             call's whole timeout. Retry when it has finished",
        )),
    }
}

/// One caller counted in `AgentState::waiting` until dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn bad_request(msg: &str) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, ErrorCode::BadRequest, msg)
}

fn resolve_timeout(ms: Option<u64>, limits: &Limits) -> Result<Duration, ApiError> {
    match ms {
        None => Ok(limits.default_timeout),
        Some(0) => Err(bad_request("timeout_ms must be at least 1")),
        Some(ms) if Duration::from_millis(ms) > limits.max_timeout => Err(bad_request(&format!(
            "timeout_ms {ms} is over the maximum of {}",
            limits.max_timeout.as_millis()
        ))),
        Some(ms) => Ok(Duration::from_millis(ms)),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProgressQuery {
    request_id: String,
}

/// How far the command of `request_id` is; `running: false` when it is not the one running.
async fn exec_progress(
    State(state): State<Arc<AgentState>>,
    headers: HeaderMap,
    query: Result<Query<ProgressQuery>, QueryRejection>,
) -> Result<Json<ExecProgress>, ApiError> {
    state.assignment().authorize_exec(authorization(&headers))?;
    let Query(q) = query.map_err(|e| {
        bad_request(&format!(
            "{}; GET /exec/progress takes ?request_id=<the request_id of the POST /exec>",
            e.body_text()
        ))
    })?;
    Ok(Json(state.progress.snapshot(&q.request_id)))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpillQuery {
    name: String,
    #[serde(default)]
    offset: u64,
    length: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkspaceQuery {
    path: String,
    #[serde(default)]
    offset: u64,
    length: Option<u64>,
}

/// Bytes of the spill `name` (`?name=…&offset=…&length=…`).
async fn spill_file(
    State(state): State<Arc<AgentState>>,
    headers: HeaderMap,
    query: Result<Query<SpillQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    state.assignment().authorize_exec(authorization(&headers))?;
    let Query(q) = query.map_err(|e| {
        bad_request(&format!(
            "{}; GET /files/spill takes ?name=<spill name>[&offset=N][&length=N]",
            e.body_text()
        ))
    })?;
    let spills = state.spills.clone();
    let length = q.length.unwrap_or(files::FILE_READ_MAX);
    read_file(move || files::read_spill(&spills, &q.name, q.offset, length)).await
}

/// Bytes of a file beneath the workspace (`?path=…&offset=…&length=…`).
async fn workspace_file(
    State(state): State<Arc<AgentState>>,
    headers: HeaderMap,
    query: Result<Query<WorkspaceQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    state.assignment().authorize_exec(authorization(&headers))?;
    let Query(q) = query.map_err(|e| {
        bad_request(&format!(
            "{}; GET /files/workspace takes ?path=<path in the workspace>[&offset=N][&length=N]",
            e.body_text()
        ))
    })?;
    let root = state.workspace.clone();
    let length = q.length.unwrap_or(files::FILE_READ_MAX);
    read_file(move || files::read_workspace(&root, &q.path, q.offset, length)).await
}

/// Runs a file read off the async threads; the chunk as `application/octet-stream` with the
/// file's size in `x-file-size`.
async fn read_file(
    read: impl FnOnce() -> Result<Chunk, FileError> + Send + 'static,
) -> Result<Response, ApiError> {
    let chunk = tokio::task::spawn_blocking(read)
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorCode::Internal,
                format!("the read task failed: {e}"),
            )
        })?
        .map_err(|e| match e {
            FileError::Refused(m) => {
                ApiError::new(StatusCode::BAD_REQUEST, ErrorCode::BadRequest, m)
            }
            FileError::NotFound(m) => {
                ApiError::new(StatusCode::NOT_FOUND, ErrorCode::NoSuchFile, m)
            }
            FileError::Io(m) => {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, ErrorCode::Internal, m)
            }
        })?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (
                header::HeaderName::from_static(HEADER_FILE_SIZE),
                chunk.size.to_string(),
            ),
        ],
        chunk.bytes,
    )
        .into_response())
}
