//! Warm and cold session starts: new sessions one after the other, each timed from its first
//! call to that call's answer.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cli_mcp_e2e::journey::{Env, Mcp};

use super::instance::no_sessions;
use super::SERVER_CONTAINER;

/// Starts of one kind: how long each took, the launches the server reported, the errors.
pub(super) struct Starts {
    pub(super) samples: Vec<Duration>,
    pub(super) launches: BTreeMap<String, usize>,
    pub(super) errors: Vec<String>,
}

/// `n` starts of sessions `<launch>-<i>` (`launch` is `warm` or `cold`, as the pool is),
/// and the server's own breakdown of them from its log; then no session is left.
pub(super) async fn measured(
    env: &Env,
    svc: &Mcp,
    launch: &str,
    n: usize,
) -> anyhow::Result<(Starts, Option<String>)> {
    let starts = starts(svc, launch, n).await;
    // Read before the later phases' starts crowd the log.
    let server_log = env.c.pod_logs(&env.ns.name, SERVER_CONTAINER, usize::MAX);
    let steps = crate::steps::table(&server_log, launch);
    no_sessions(env).await?;
    Ok((starts, steps))
}

/// `n` new sessions one after the other, each timed from its first call to that call's
/// answer; then they are deleted.
async fn starts(svc: &Mcp, prefix: &str, n: usize) -> Starts {
    let mut out = Starts {
        samples: Vec::new(),
        launches: Default::default(),
        errors: Vec::new(),
    };
    for i in 0..n {
        let sid = format!("{prefix}-{i}");
        let t = Instant::now();
        match svc.bash_ok(&sid, "true").await {
            Ok(r) => {
                out.samples.push(t.elapsed());
                let launch = r["structuredContent"]["new_sandbox"]
                    .as_str()
                    .unwrap_or("none")
                    .to_owned();
                *out.launches.entry(launch).or_default() += 1;
            }
            Err(e) => out.errors.push(e.to_string()),
        }
    }
    for i in 0..n {
        // Best effort: the next phase waits until no session is left anyway.
        let _ = svc.try_delete(&format!("{prefix}-{i}")).await;
    }
    out
}
