//! The limits every call is held to: set by flags (see [`crate::cli`]), read by the tool
//! handler and the backends. A module of its own so that neither the flags nor the handler
//! has to import the other for them.

use std::time::Duration;

use cli_mcp_api::wire::DEFAULT_OUTPUT_BUDGET;

/// Limits applied to every call.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_sessions: usize,
    /// Most sessions of one caller identity (`None`: no such limit).
    pub max_sessions_per_client: Option<usize>,
    /// Most new sessions of one caller identity per minute, per replica (`None`: no limit).
    pub new_sessions_per_minute_per_client: Option<u32>,
    pub default_timeout: Duration,
    pub max_timeout: Duration,
    pub output_budget: usize,
    pub max_body_bytes: usize,
    /// Longest command accepted (bytes); leaves room for JSON escaping under the agent's
    /// 1 MiB body limit.
    pub max_command_bytes: usize,
    pub start_timeout: Duration,
    /// Most bytes of one `resources/read`.
    pub max_resource_read: u64,
    /// Shortest time between two `last-activity` writes of one sandbox.
    pub activity_stamp_gap: Duration,
}

/// Default of `--max-resource-read-bytes`.
pub const DEFAULT_RESOURCE_READ: u64 = 1024 * 1024;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_sessions: 100,
            max_sessions_per_client: None,
            new_sessions_per_minute_per_client: None,
            default_timeout: Duration::from_secs(60),
            max_timeout: Duration::from_secs(300),
            output_budget: DEFAULT_OUTPUT_BUDGET,
            max_body_bytes: 1024 * 1024,
            max_command_bytes: MAX_COMMAND_BYTES,
            start_timeout: Duration::from_secs(120),
            max_resource_read: DEFAULT_RESOURCE_READ,
            activity_stamp_gap: cli_mcp_api::activity::STAMP_GAP_MIN,
        }
    }
}

/// Longest command: half of the agent's default 1 MiB body limit, so JSON escaping of any
/// text fits.
pub const MAX_COMMAND_BYTES: usize = 512 * 1024;

/// Largest `--instructions` text (bytes).
pub const MAX_INSTRUCTIONS_BYTES: usize = 16 * 1024;
