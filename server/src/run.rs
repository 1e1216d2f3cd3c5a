//! Wiring: settings → backend, auth, routers, listeners; then serve until SIGTERM/SIGINT.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use rmcp::ServiceExt as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use cli_mcp_api::signals::Signals;
use cli_mcp_api::token::HmacKey;

use crate::agent_client::AgentClient;
use crate::auth::{tls, Authenticator};
use crate::cli::{AuthMode, BackendKind, Settings, Transport};
use crate::http::{health_router, mcp_router, AppState, McpHttpOptions};
use crate::mcp::{BashServer, McpState};
use crate::metrics::Metrics;
use crate::serve::{serve, ConnLimits};
use crate::sessions::kubernetes::KubeBackend;
use crate::sessions::local::{find_agent_binary, LocalBackend};
use crate::sessions::{Backend, SessionManager};

/// Time given to open requests after the shutdown delay; delay (≤ 5 s) + drain fit in the
/// pod's 30 s termination grace period with a 5 s margin.
pub const DRAIN: Duration = Duration::from_secs(20);
/// Log message printed once the listeners are bound (tests and tools wait for it).
pub const READY_MESSAGE: &str = "cli-mcp-server ready";

/// Reads the instance HMAC key (the operator mounts Secret `cli-mcp-<n>-hmac` there).
pub fn read_hmac_key(path: &std::path::Path) -> anyhow::Result<HmacKey> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "cannot read the HMAC key file {} (--hmac-key-file); in a cluster the operator \
             mounts Secret cli-mcp-<instance>-hmac, key `key`, there",
            path.display()
        )
    })?;
    HmacKey::from_hex(&text).with_context(|| {
        format!(
            "the HMAC key file {} does not hold 64 hex characters",
            path.display()
        )
    })
}

async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| {
        format!(
            "cannot listen on {addr} ({what}); is another process using it? pick another address"
        )
    })
}

/// Runs the server until a signal (HTTP) or the end of stdin (stdio).
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let limits = settings.limits;
    let agent = AgentClient::new(limits.output_budget).context("cannot build the HTTP client")?;
    let stop = CancellationToken::new();

    let needs_kube =
        settings.backend == BackendKind::Kubernetes || settings.auth == AuthMode::Kubernetes;
    let client = if needs_kube {
        Some(kube::Client::try_default().await.context(
            "cannot configure a Kubernetes client (in-cluster service account or KUBECONFIG)",
        )?)
    } else {
        None
    };

    let mut background = Vec::new();
    let backend: Arc<dyn Backend> = match (settings.backend, &client, &settings.sandbox) {
        (BackendKind::Local, _, _) => {
            let bin =
                find_agent_binary(settings.agent_binary.as_deref()).map_err(anyhow::Error::msg)?;
            tracing::warn!(agent = %bin.display(),
                "local backend: sessions are local processes with this user's rights; nothing is isolated");
            LocalBackend::new(bin, limits, agent.clone(), metrics.clone())
                .context("cannot create a directory for local sessions")?
        }
        (BackendKind::Kubernetes, Some(client), Some(cfg)) => {
            let key = read_hmac_key(&settings.hmac_key_file)?;
            let kb = KubeBackend::new(
                client.clone(),
                cfg.clone(),
                key,
                agent.clone(),
                limits,
                metrics.clone(),
            );
            background = kb.spawn_background(stop.clone());
            kb
        }
        (BackendKind::Kubernetes, _, _) => {
            anyhow::bail!("--backend kubernetes needs --sandbox-config and a Kubernetes client")
        }
    };

    let auth = match (
        settings.auth,
        &client,
        &settings.instance,
        &settings.namespace,
    ) {
        (AuthMode::None, _, _, _) => None,
        (AuthMode::Kubernetes, Some(c), Some(i), Some(ns)) => Some(Arc::new(Authenticator::new(
            c.clone(),
            i.clone(),
            ns.clone(),
            metrics.clone(),
            settings.auth_options.clone(),
        ))),
        (AuthMode::Kubernetes, _, _, _) => {
            anyhow::bail!("--auth kubernetes needs --instance, --namespace and a Kubernetes client")
        }
    };

    let mcp = Arc::new(McpState {
        sessions: SessionManager::new(backend.clone(), agent, metrics.clone()),
        limits,
        stdio_session: settings.stdio_session.clone(),
        calls: Default::default(),
        instructions: crate::mcp::instructions(
            settings.transport == Transport::Stdio,
            settings.briefing.as_deref(),
            settings.instructions.as_deref(),
        ),
    });

    let result = match settings.transport {
        Transport::Stdio => run_stdio(mcp).await,
        // `stop` ends the backend's background tasks (the pod and slot watches, the activity
        // stamper), which in-flight calls need until the drain is over: it is cancelled only
        // once `run_http` has drained (the listeners have a token of their own).
        Transport::Http => run_http(&settings, mcp, auth, metrics).await,
    };
    stop.cancel();
    backend.shutdown().await;
    for task in background {
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
    tracing::info!("cli-mcp-server stopped");
    result
}

async fn run_stdio(mcp: Arc<McpState>) -> anyhow::Result<()> {
    let service = BashServer::new(mcp)
        .serve(rmcp::transport::stdio())
        .await
        .context("cannot start MCP on stdio")?;
    tracing::info!("{READY_MESSAGE}");
    service
        .waiting()
        .await
        .context("MCP stdio session failed")?;
    Ok(())
}

async fn run_http(
    settings: &Settings,
    mcp: Arc<McpState>,
    auth: Option<Arc<Authenticator>>,
    metrics: Arc<Metrics>,
) -> anyhow::Result<()> {
    let stop = CancellationToken::new();
    // Before anything can announce this server: a SIGTERM that arrived before tokio's
    // handler existed would kill the process outright, without its lame-duck phase.
    let mut signals = Signals::install().context("cannot install the SIGTERM/SIGINT handlers")?;
    let tls = match &settings.tls {
        Some(files) => Some(tls::server_config(&files.cert, &files.key)?),
        None => None,
    };
    let mut state = AppState::new(mcp, auth, metrics);
    if let Some(resource) = &settings.protected_resource {
        state = state.with_protected_resource(resource.clone());
    }
    let state = Arc::new(state);
    let listener = bind(settings.listen, "--listen").await?;
    let health = bind(settings.health_listen, "--health-listen").await?;
    let listen = listener.local_addr().context("listener has no address")?;
    let health_addr = health.local_addr().context("listener has no address")?;
    if settings.auth == AuthMode::None && !listen.ip().is_loopback() {
        tracing::warn!(%listen, "--auth none on a non-loopback address: anyone who reaches it gets a shell");
    }
    let app = mcp_router(
        state.clone(),
        McpHttpOptions {
            loopback_hosts_only: listen.ip().is_loopback(),
            origins: crate::origin::OriginPolicy {
                allowed: settings.allowed_origins.clone(),
                loopback: listen.ip().is_loopback(),
            },
            // Not `stop`: in-flight calls must finish during the drain.
            cancel: CancellationToken::new(),
        },
    );
    let main = tokio::spawn(serve(
        listener,
        app,
        tls.clone(),
        stop.clone(),
        DRAIN,
        ConnLimits::default(),
    ));
    let health_task = tokio::spawn(serve(
        health,
        health_router(state.clone()),
        None,
        stop.clone(),
        Duration::from_secs(1),
        ConnLimits::default(),
    ));
    tracing::info!(
        listen = %listen,
        health_listen = %health_addr,
        tls = tls.is_some(),
        backend = ?settings.backend,
        auth = ?settings.auth,
        "{READY_MESSAGE}"
    );
    signals.recv().await;
    // Lame duck: the endpoint goes out of the Service (readiness fails) while this replica
    // still accepts, and keep-alive clients are told to reconnect (elsewhere).
    let delay = settings.shutdown_delay;
    state
        .draining
        .store(true, std::sync::atomic::Ordering::Relaxed);
    tracing::info!(?delay, "shutting down: /readyz fails and connections close after each response; still serving for the shutdown delay");
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = signals.recv() => tracing::info!("second signal: skipping the rest of the shutdown delay"),
    }
    tracing::info!("shutting down: no new requests; open ones get {DRAIN:?}");
    stop.cancel();
    let _ = main.await;
    let _ = health_task.await;
    Ok(())
}
