//! The proxy's life: signals first, then the listeners, then serving until SIGTERM/SIGINT,
//! after which open tunnels drain (see [`crate::Proxy::serve`]).

use anyhow::Context as _;

use cli_mcp_api::signals::Signals;

use crate::cli::Flags;
use crate::Proxy;

pub async fn run(flags: Flags) -> anyhow::Result<()> {
    // Before the listeners exist: a SIGTERM that arrives while the proxy binds must drain it,
    // not kill it mid-start (see `Signals`).
    let mut signals = Signals::install().context("cannot install the SIGTERM/SIGINT handlers")?;
    let config = flags
        .config()
        .map_err(anyhow::Error::msg)
        .context("reading the proxy's flags")?;
    let proxy = Proxy::bind(&config)
        .await
        .context("starting cli-mcp-proxy")?;
    proxy
        .serve(async move {
            let name = signals.recv().await;
            tracing::info!("{name} received; draining");
        })
        .await?;
    Ok(())
}
