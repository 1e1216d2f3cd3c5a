//! The live phase's tables: RSS at each point, the API server's traffic per window, and the
//! latency of idle starts, active commands and warm claims under load.

use std::time::Duration;

use super::snap::Snap;
use super::traffic::{
    all_requests, delta, operator_writes, server_writes, watches_open, writes_between,
};
use super::ScaleArgs;
use crate::figures::{at_most, first_errors, mib, per_minute, row, rss_cell};

/// Two snapshots a window apart, and the sessions there were during it.
pub(super) struct Window {
    pub(super) from: Snap,
    pub(super) to: Snap,
    pub(super) sessions: usize,
}

impl Window {
    pub(super) fn secs(&self) -> Duration {
        self.to.at.duration_since(self.from.at)
    }
}

/// Everything the live phase measured.
pub(super) struct LiveReport {
    pub(super) rss_empty: ((u64, u64), (u64, u64)),
    pub(super) started: Vec<Duration>,
    pub(super) start_errors: Vec<String>,
    pub(super) start_wall: Duration,
    pub(super) idle: Window,
    pub(super) active: Window,
    pub(super) commands: Vec<Duration>,
    pub(super) command_errors: Vec<String>,
    pub(super) claims: Vec<Duration>,
    pub(super) claim_launches: std::collections::BTreeMap<String, usize>,
    pub(super) claim_errors: Vec<String>,
    pub(super) rss_active_max: (u64, u64),
}

impl LiveReport {
    pub(super) fn print(&self, a: &ScaleArgs, what: &str, before: &str, after: &str) {
        self.print_rss(a, what, before, after);
        self.print_api_traffic();
        self.print_latencies(a);
    }

    /// The section's heading and the RSS table: empty, idle, active (highest), after.
    fn print_rss(&self, a: &ScaleArgs, what: &str, before: &str, after: &str) {
        println!(
            "\n## scale: {} idle + {} active sessions ({what}; {before} at the start, {after} at the end)\n",
            a.idle, a.active
        );
        println!(
            "| RSS (VmRSS, and VmHWM: the highest since the process started) | server | operator |"
        );
        println!("|---|---|---|");
        println!(
            "| instance ready, 0 sessions, pool of {} | {} | {} |",
            a.pool,
            rss_cell(self.rss_empty.0),
            rss_cell(self.rss_empty.1)
        );
        println!(
            "| {} idle sessions (end of the idle window) | {} | {} |",
            self.idle.sessions,
            rss_cell(self.idle.to.server_rss),
            rss_cell(self.idle.to.operator_rss)
        );
        println!(
            "| active window: highest VmRSS read (every 2 s) | {} | {} |",
            mib(self.rss_active_max.0),
            mib(self.rss_active_max.1)
        );
        println!(
            "| end of the active window | {} | {} |",
            rss_cell(self.active.to.server_rss),
            rss_cell(self.active.to.operator_rss)
        );
    }

    /// The API server's traffic in the idle and the active window, side by side.
    fn print_api_traffic(&self) {
        println!();
        println!("| API server, per window | idle ({} sessions, {:.0} s) | active ({} sessions, {:.0} s) |",
            self.idle.sessions, self.idle.secs().as_secs_f64(), self.active.sessions, self.active.secs().as_secs_f64());
        println!("|---|---|---|");
        let both = |f: &dyn Fn(&Window) -> String| (f(&self.idle), f(&self.active));
        let (i, x) = both(&|w| per_minute(server_writes(&w.from, &w.to), w.secs()));
        println!("| server writes per minute (pod writes less the operator's) | {i} | {x} |");
        let (i, x) = both(&|w| per_minute(operator_writes(&w.from, &w.to, &[]), w.secs()));
        println!("| operator writes per minute (its own counter) | {i} | {x} |");
        let (i, x) = both(&|w| {
            per_minute(
                delta(
                    &w.from.api,
                    &w.to.api,
                    "apiserver_request_total",
                    &[("resource", "pods"), ("subresource", "status")],
                ),
                w.secs(),
            )
        });
        println!("| kubelet pod status writes per minute | {i} | {x} |");
        let (i, x) = both(&|w| {
            let n = all_requests(&w.from, &w.to);
            format!(
                "{:.1} (per session {:.4})",
                n / w.secs().as_secs_f64(),
                n / w.secs().as_secs_f64() / w.sessions.max(1) as f64
            )
        });
        println!("| API server requests per second, all clients | {i} | {x} |");
        let (i, x) = both(&|w| format!("{:.0}", watches_open(&w.to.api)));
        println!("| watches open at the end | {i} | {x} |");
        for (name, w) in [("idle", &self.idle), ("active", &self.active)] {
            let top: Vec<String> = writes_between(&w.from, &w.to)
                .into_iter()
                .take(8)
                .map(|(k, n)| format!("{k} {}", per_minute(n, w.secs())))
                .collect();
            println!(
                "| writes per minute by verb and resource, {name} | {} | |",
                top.join(", ")
            );
        }
    }

    /// The latencies of idle starts, active commands and warm claims (ours and the
    /// server's own histogram), then the first errors of each.
    fn print_latencies(&self, a: &ScaleArgs) {
        println!();
        println!("| what | median | p99 |");
        println!("|---|---|---|");
        println!(
            "{}",
            row(
                &format!(
                    "start of an idle session, {} at a time (n={}, {} errors, {:.0} s in all)",
                    a.concurrency,
                    self.started.len(),
                    self.start_errors.len(),
                    self.start_wall.as_secs_f64()
                ),
                &self.started
            )
        );
        println!(
            "{}",
            row(
                &format!(
                    "active session: one command ({} sessions, one every {} ms; n={}, {} errors)",
                    a.active,
                    a.interval_ms,
                    self.commands.len(),
                    self.command_errors.len()
                ),
                &self.commands
            )
        );
        println!(
            "{}",
            row(
                &format!(
                    "**warm claim under load**: first call of a new session (n={}, launches {:?}, {} errors)",
                    self.claims.len(),
                    self.claim_launches,
                    self.claim_errors.len()
                ),
                &self.claims
            )
        );
        let q = self
            .active
            .to
            .server
            .histogram("cli_mcp_session_start_seconds", &[("launch", "warm")])
            .since(
                &self
                    .active
                    .from
                    .server
                    .histogram("cli_mcp_session_start_seconds", &[("launch", "warm")]),
            )
            .quantiles();
        if let Some(q) = q {
            println!(
                "| warm claim, the server's `cli_mcp_session_start_seconds{{launch=\"warm\"}}` in the window (n={}; bucket bounds) | {} | {} |",
                q.n,
                at_most(q.median),
                at_most(q.p99)
            );
        }
        for e in [&self.start_errors, &self.command_errors, &self.claim_errors] {
            first_errors(e);
        }
    }
}
