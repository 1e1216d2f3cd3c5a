//! The MCP tool handler: one tool, `bash`.
//!
//! Each HTTP request gets its own handler value (stateless Streamable HTTP); all state is in
//! [`McpState`]. The session comes from the `X-Session-ID` header (or `--session-id` on
//! stdio), the caller from the auth middleware (request extensions).
//!
//! - [`bash`]: the tool's definition, arguments and body;
//! - [`call`]: the envelope every tool call runs in (caller, session, cancel, progress,
//!   audit and metrics);
//! - [`session`]: which session a call runs in, and session handles;
//! - [`instructions`](mod@instructions): the initialize result's instructions.

use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, Implementation, ListResourceTemplatesResult,
    ListResourcesResult, ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams,
    ReadResourceResponse, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};

use cli_mcp_api::SessionId;

use crate::cancel::RunningCalls;
use crate::limits::Limits;
use crate::metrics::ErrorKind;
use crate::resources;
use crate::sessions::SessionManager;

pub mod bash;
pub mod call;
pub mod instructions;
pub mod session;

pub use self::bash::{bash_tool, parse_args, BashArgs, TOOL_NAME};
pub use self::instructions::instructions;
pub use self::session::{
    check_handle, new_handle, resolve_session, session_from_headers, SessionSource,
    MCP_SESSION_HEADER, SESSION_ARG, SESSION_HEADER,
};
pub use crate::limits::MAX_INSTRUCTIONS_BYTES;

/// Everything a tool call needs.
pub struct McpState {
    pub sessions: SessionManager,
    pub limits: Limits,
    /// The session of the stdio transport.
    pub stdio_session: Option<SessionId>,
    /// The `instructions` of the initialize result (see [`instructions()`]).
    pub instructions: String,
    /// Running calls, for `notifications/cancelled` (see [`crate::cancel`]).
    pub calls: RunningCalls,
}

#[derive(Clone)]
pub struct BashServer {
    state: Arc<McpState>,
}

impl BashServer {
    pub fn new(state: Arc<McpState>) -> Self {
        Self { state }
    }

    fn tool(&self) -> Tool {
        bash_tool(&self.state.limits)
    }
}

impl ServerHandler for BashServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .build(),
        )
        .with_server_info(
            Implementation::new("cli-mcp-server", env!("CARGO_PKG_VERSION"))
                .with_title("cli-mcp: bash in a sandbox per session"),
        )
        .with_instructions(self.state.instructions.clone())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(vec![self.tool()]))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        (name == TOOL_NAME).then(|| self.tool())
    }

    /// No fixed resources: a session's files are reached through the templates.
    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        Ok(ListResourcesResult::with_all_items(Vec::new()))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, McpError> {
        Ok(ListResourceTemplatesResult::with_all_items(
            resources::templates(self.state.limits.max_resource_read),
        ))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        let caller = call::caller_of(&context);
        let result = resources::read(
            &self.state.sessions,
            &caller,
            &request.uri,
            self.state.limits.max_resource_read,
        )
        .await;
        if let Err(e) = &result {
            tracing::info!(uri = %request.uri.chars().take(200).collect::<String>(),
                error = %e.message, "resources/read refused");
        }
        result.map(Into::into)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        if request.name != TOOL_NAME {
            self.state.sessions.metrics().error(ErrorKind::BadRequest);
            return Err(McpError::invalid_params(
                format!(
                    "unknown tool {:?}; this server has one tool: {TOOL_NAME}",
                    request.name
                ),
                None,
            ));
        }
        Ok(bash::call(&self.state, request, context).await)
    }
}
