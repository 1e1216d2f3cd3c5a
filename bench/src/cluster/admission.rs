//! The admission burst: twice `maxSessions` new sessions at once on an instance of their own,
//! sorted by what they got (a session, or the limit error), and the server's own timing of
//! its admission decision.

use std::time::{Duration, Instant};

use anyhow::Context;
use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_e2e::journey::Env;
use serde_json::json;

use super::instance::{server_metrics, server_pod};
use crate::prom::{Quantiles, Scrape};

/// The admission burst: `2 × limit` new sessions at once against `maxSessions: limit`.
pub(super) struct Burst {
    pub(super) limit: usize,
    pub(super) refused: Vec<Duration>,
    pub(super) started: Vec<Duration>,
    pub(super) errors: Vec<String>,
    pub(super) wall: Duration,
    /// The server's own `cli_mcp_session_admission_seconds` for the burst: admission's cost
    /// without the TLS, auth, lookup and pod start around it.
    pub(super) decided: [Option<Quantiles>; 2],
    /// The server's `cli_mcp_exec_duration_seconds{outcome="error"}`: a refused tool call from
    /// its start in the server to its answer (the burst's only errors are its refusals).
    pub(super) refused_in_server: Option<Quantiles>,
    /// `2 × limit` `tools/list` calls at once before the burst, each opening the connection
    /// the burst then reuses: each one's answer, and the server's CPU time per call.
    pub(super) lists: Vec<Duration>,
    pub(super) list_cpu: Option<Duration>,
}

/// The quantiles of histogram `name{<label>="<value>"}` summed over several expositions.
fn histogram_quantiles(
    texts: &[String],
    name: &str,
    (label, value): (&str, &str),
) -> Option<Quantiles> {
    Scrape::merge(texts)
        .histogram(name, &[(label, value)])
        .quantiles()
}

/// Instance `admit` (`maxSessions: limit`, no warm pool): `2 × limit` new sessions at once,
/// each timed from its first call to that call's answer, sorted by what they got: a session,
/// or the limit error (admission's answer, nothing started).
pub(super) async fn burst(env: &Env, limit: usize) -> anyhow::Result<Burst> {
    const NAME: &str = "admit";
    env.dummy_kubeconfig(NAME).await;
    let mut cr = env.cr(NAME, 0);
    cr["spec"]["sandbox"]["maxSessions"] = json!(limit);
    // One client makes every session: the instance's bound is measured, so the per-client
    // one (half of maxSessions by default) is set past anything the burst reaches.
    cr["spec"]["server"]["maxSessionsPerClient"] = json!(10_000);
    cr["spec"]["replicas"] = json!(1);
    env.apply_cr(&cr).await;
    env.wait_ready(NAME).await;
    let svc = env.client(NAME).await;
    let server_pid = server_pod(env, NAME).await.map(|(_, pid)| pid).ok();
    // The investigating service of an alert storm has called before: its token is reviewed
    // and cached and its connections are open. The calls that open them, as many at once as
    // the burst and with no session behind them, say what a request with its TLS handshake
    // costs the server.
    let cpu = || {
        server_pid
            .and_then(|pid| u32::try_from(pid).ok())
            .and_then(|pid| crate::figures::cpu_seconds(pid).ok())
    };
    let cpu_before = cpu();
    let lists = futures::future::join_all((0..2 * limit).map(|_| async {
        let t = Instant::now();
        svc.rpc("burst-warmup", "tools/list", json!({})).await;
        t.elapsed()
    }))
    .await;
    let list_cpu = match (cpu_before, cpu()) {
        (Some(a), Some(b)) => Some(Duration::from_secs_f64(
            (b - a).max(0.0) / lists.len() as f64,
        )),
        _ => None,
    };
    let t0 = Instant::now();
    let answers = futures::future::join_all((0..2 * limit).map(|i| {
        let svc = svc.clone();
        async move {
            let t = Instant::now();
            let r = svc.try_bash(&format!("burst-{i}"), "true").await;
            (t.elapsed(), r)
        }
    }))
    .await;
    let wall = t0.elapsed();
    let texts = server_metrics(env, NAME).await;
    let decided = ["admitted", "refused"]
        .map(|r| histogram_quantiles(&texts, "cli_mcp_session_admission_seconds", ("result", r)));
    let refused_in_server = histogram_quantiles(
        &texts,
        "cli_mcp_exec_duration_seconds",
        ("outcome", "error"),
    );
    let mut out = Burst {
        limit,
        refused: Vec::new(),
        started: Vec::new(),
        errors: Vec::new(),
        wall,
        decided,
        refused_in_server,
        lists,
        list_cpu,
    };
    let full = format!("already has {limit} sessions");
    for (took, r) in answers {
        match r {
            Ok(v) if v["isError"] == false => out.started.push(took),
            Ok(v) if v["isError"] == true && v.to_string().contains(&full) => {
                out.refused.push(took)
            }
            Ok(v) => out.errors.push(v.to_string()),
            Err(e) => out.errors.push(e.to_string()),
        }
    }
    drop(svc);
    // Its sessions go with it (the operator's teardown); nothing waits for that.
    env.api::<CliMcpInstance>()
        .delete(NAME, &Default::default())
        .await
        .context("deleting instance admit")?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::figures::at_most;

    #[test]
    fn quantiles_are_the_bucket_bounds_summed_over_replicas() {
        let one = "# TYPE cli_mcp_session_admission_seconds histogram
cli_mcp_session_admission_seconds_bucket{le=\"0.000005\",result=\"refused\"} 60
cli_mcp_session_admission_seconds_bucket{le=\"0.00001\",result=\"refused\"} 99
cli_mcp_session_admission_seconds_bucket{le=\"+Inf\",result=\"refused\"} 100
cli_mcp_session_admission_seconds_bucket{le=\"0.000005\",result=\"admitted\"} 0
cli_mcp_session_admission_seconds_bucket{le=\"+Inf\",result=\"admitted\"} 3
"
        .to_string();
        let q = histogram_quantiles(
            &[one.clone(), one],
            "cli_mcp_session_admission_seconds",
            ("result", "refused"),
        )
        .expect("refused");
        assert_eq!(
            q,
            Quantiles {
                n: 200,
                median: 0.000005,
                p99: 0.00001
            }
        );
        assert_eq!(at_most(q.median), "≤ 5.0 µs");
        let a = histogram_quantiles(
            &[],
            "cli_mcp_session_admission_seconds",
            ("result", "admitted"),
        );
        assert_eq!(a, None, "no exposition, no figure");
    }
}
