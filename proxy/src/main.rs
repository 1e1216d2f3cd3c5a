use anyhow::Context;
use clap::Parser;

use cli_mcp_proxy::cli::Flags;
use cli_mcp_proxy::Proxy;

fn init_logs(json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(cli_mcp_api::terminal::log_colours());
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.compact().init();
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    init_logs(flags.log_json);
    let config = flags.config().map_err(anyhow::Error::msg)?;
    let proxy = Proxy::bind(&config)
        .await
        .context("starting cli-mcp-proxy")?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    proxy
        .serve(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            tracing::info!("signal received; draining");
        })
        .await?;
    Ok(())
}
