//! Warm and cold session starts: new sessions one after the other, each timed from its first
//! call to that call's answer.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use cli_mcp_e2e::journey::{Env, Mcp};

use super::instance::no_sessions;
use super::SERVER_CONTAINER;

/// Starts of one kind: how long each took, the launches the server reported, the errors.
pub(super) struct Starts {
    pub(super) samples: Vec<Duration>,
    /// For each sample (same order): its session and when its call was sent (wall clock, to
    /// set it against containerd's timestamps).
    pub(super) sent: Vec<(String, SystemTime)>,
    pub(super) launches: BTreeMap<String, usize>,
    pub(super) errors: Vec<String>,
    /// The server's log after these starts (its "session sandbox started" lines).
    pub(super) server_log: String,
}

/// `n` starts of sessions `<launch>-<i>` (`launch` is `warm` or `cold`, as the pool is),
/// and the server's own breakdown of them from its log. The sessions stay: [`end`] them.
pub(super) async fn measured(
    env: &Env,
    svc: &Mcp,
    launch: &str,
    n: usize,
) -> (Starts, Option<String>) {
    let mut starts = starts(svc, launch, n).await;
    // Read before the later phases' starts crowd the log.
    starts.server_log = env.c.pod_logs(&env.ns.name, SERVER_CONTAINER, usize::MAX);
    let steps = crate::steps::table(&starts.server_log, launch);
    (starts, steps)
}

/// Deletes the sessions [`measured`] started, and waits until their pods are gone.
pub(super) async fn end(env: &Env, svc: &Mcp, prefix: &str, n: usize) -> anyhow::Result<()> {
    for i in 0..n {
        // Best effort: what follows waits until no session is left anyway.
        let _ = svc.try_delete(&format!("{prefix}-{i}")).await;
    }
    no_sessions(env).await
}

/// `n` new sessions one after the other, each timed from its first call to that call's
/// answer.
async fn starts(svc: &Mcp, prefix: &str, n: usize) -> Starts {
    let mut out = Starts {
        samples: Vec::new(),
        sent: Vec::new(),
        launches: Default::default(),
        errors: Vec::new(),
        server_log: String::new(),
    };
    for i in 0..n {
        let sid = format!("{prefix}-{i}");
        let sent = SystemTime::now();
        let t = Instant::now();
        match svc.bash_ok(&sid, "true").await {
            Ok(r) => {
                out.samples.push(t.elapsed());
                out.sent.push((sid, sent));
                let launch = r["structuredContent"]["new_sandbox"]
                    .as_str()
                    .unwrap_or("none")
                    .to_owned();
                *out.launches.entry(launch).or_default() += 1;
            }
            Err(e) => out.errors.push(e.to_string()),
        }
    }
    out
}
