//! One look at everything a scale phase measures: the API server's, the operator's and the
//! server's metrics, and the RSS of the server and the operator.

use std::time::{Duration, Instant};

use cli_mcp_api::names::InstanceName;
use cli_mcp_e2e::journey::Env;
use cli_mcp_e2e::testing::TestCluster;

use super::{INSTANCE, OPERATOR_SELECTOR};
use crate::cluster::pod_process;
use crate::prom::Scrape;

/// The server's and the operator's pod: IP and host pid.
pub(super) struct Procs {
    pub(super) server: (String, i32),
    pub(super) operator: (String, i32),
}

impl Procs {
    pub(super) async fn find(env: &Env) -> anyhow::Result<Procs> {
        Ok(Procs {
            server: pod_process(env, &InstanceName::parse(INSTANCE)?.server_selector()).await?,
            operator: pod_process(env, OPERATOR_SELECTOR).await?,
        })
    }
}

/// One look at everything: the API server's, operator's and server's metrics, and the RSS
/// (current, peak) of the server and the operator.
pub(super) struct Snap {
    pub(super) at: Instant,
    pub(super) api: Scrape,
    pub(super) operator: Scrape,
    pub(super) server: Scrape,
    pub(super) server_rss: (u64, u64),
    pub(super) operator_rss: (u64, u64),
}

pub(super) async fn metrics_of(ip: &str) -> Scrape {
    let Ok(http) = cli_mcp_e2e::http::client(None)
        .timeout(Duration::from_secs(10))
        .build()
    else {
        return Scrape::default();
    };
    match cli_mcp_e2e::http::get(&http, &format!("http://{ip}:8081/metrics")).await {
        Some((200, body)) => Scrape::parse(&body),
        _ => Scrape::default(),
    }
}

pub(super) fn rss(pid: i32) -> (u64, u64) {
    u32::try_from(pid)
        .ok()
        .and_then(cli_mcp_e2e::child::rss_kib)
        .unwrap_or((0, 0))
}

pub(super) async fn snap(c: &TestCluster, p: &Procs) -> anyhow::Result<Snap> {
    Ok(Snap {
        at: Instant::now(),
        api: crate::apiserver::metrics(c).await?,
        operator: metrics_of(&p.operator.0).await,
        server: metrics_of(&p.server.0).await,
        server_rss: rss(p.server.1),
        operator_rss: rss(p.operator.1),
    })
}
