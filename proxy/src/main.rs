//! `cli-mcp-proxy`: flags, logging, then [`cli_mcp_proxy::run::run`].

use clap::Parser as _;

use cli_mcp_api::logs::{self, LogFormat};
use cli_mcp_proxy::cli::Flags;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    logs::init(LogFormat::from_json_flag(flags.log_json), "info");
    cli_mcp_proxy::run::run(flags).await
}
