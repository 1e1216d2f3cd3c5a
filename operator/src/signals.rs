//! The shutdown signals: installed first thing, so a signal at any later point (even while
//! the API server is unreachable) stops the process.

use tokio::sync::watch;

/// Listens for SIGINT and SIGTERM for the whole life of the process: the receiver turns
/// true at the first one. A second one exits at once. Installed once, before anything can
/// block, because a signal that arrives while no tokio listener exists is lost — tokio's
/// handler stays installed, so the default action (exit) no longer applies either.
pub fn shutdown_signals() -> std::io::Result<watch::Receiver<bool>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let mut seen = false;
        loop {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            if seen {
                tracing::warn!("{name} again; exiting now without draining");
                std::process::exit(1);
            }
            seen = true;
            tracing::info!("{name} received; shutting down");
            let _ = tx.send(true);
        }
    });
    Ok(rx)
}

/// Resolves once `shutdown` has turned true (or its sender is gone).
pub async fn signalled(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|s| *s).await;
}
