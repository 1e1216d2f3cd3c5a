//! Logging: JSON lines in a cluster (`--log-json`), human-readable otherwise.

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,kube_runtime=warn,kube_lease_manager=warn"));
    let registry = tracing_subscriber::registry().with(filter);
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(cli_mcp_api::terminal::log_colours());
    let result = if json {
        registry
            .with(layer.json().flatten_event(true).with_current_span(false))
            .try_init()
    } else {
        registry.with(layer).try_init()
    };
    // A second init (tests) keeps the first subscriber.
    let _ = result;
}
