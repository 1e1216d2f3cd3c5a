//! The simulation's tables: at each number of simulated session pods, the memory, watch
//! traffic, reconciles and warm claims; then what 1,000 more session pods cost.

use std::time::Duration;

use super::snap::Snap;
use super::traffic::watches_open;
use super::ScaleArgs;
use crate::figures::{at_most, first_errors, mib, rss_cell};
use crate::prom::Buckets;

pub(super) struct Point {
    pub(super) pods: usize,
    pub(super) create_wall: Duration,
    pub(super) ready_wall: Duration,
    pub(super) snap: Snap,
    /// Reconciles while the pods were created and marked Ready.
    pub(super) reconciles: Buckets,
    /// One reconcile at rest at this size (the CR touched).
    pub(super) one_reconcile: Buckets,
    pub(super) watch_events: f64,
    pub(super) watch_bytes: f64,
    pub(super) claims: Vec<Duration>,
    pub(super) claim_errors: Vec<String>,
}

pub(super) struct SimReport {
    pub(super) points: Vec<Point>,
    pub(super) kwok_rss: Vec<(u64, u64)>,
}

impl SimReport {
    pub(super) fn print(&self, a: &ScaleArgs, what: &str, before: &str, after: &str) {
        println!(
            "\n## scale: simulated session pods (KWOK node; {what}; {before} at the start, {after} at the end)\n"
        );
        println!("| session pods | server RSS | operator RSS | KWOK RSS | pod watch events / bytes sent while they were added (per pod) | watches open | reconciles while added: n, median, p99 | one reconcile at rest | warm claim median / p99 (n) | created / Ready after |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for (p, kwok) in self.points.iter().zip(&self.kwok_rss) {
            let added = self
                .points
                .iter()
                .take_while(|q| q.pods < p.pods)
                .last()
                .map_or(p.pods, |q| p.pods - q.pods)
                .max(1);
            let rq = p.reconciles.quantiles();
            let one = p.one_reconcile.quantiles();
            let claims = if p.claims.is_empty() {
                format!("– ({} errors)", p.claim_errors.len())
            } else {
                let s = crate::figures::stats(p.claims.clone());
                format!(
                    "{} / {} ({}{})",
                    crate::figures::ms(s.median),
                    crate::figures::ms(s.p99),
                    p.claims.len(),
                    if p.claim_errors.is_empty() {
                        String::new()
                    } else {
                        format!(", {} errors", p.claim_errors.len())
                    }
                )
            };
            println!(
                "| {} | {} | {} | {} | {:.0} / {:.1} MiB ({:.1} / {:.1} KiB) | {:.0} | {} | {} | {} | {:.1} s / {:.1} s |",
                p.pods,
                rss_cell(p.snap.server_rss),
                rss_cell(p.snap.operator_rss),
                mib(kwok.0),
                p.watch_events,
                p.watch_bytes / 1024.0 / 1024.0,
                p.watch_events / added as f64,
                p.watch_bytes / 1024.0 / added as f64,
                watches_open(&p.snap.api),
                rq.map_or("–".into(), |q| format!("{}, {}, {}", q.n, at_most(q.median), at_most(q.p99))),
                one.map_or("–".into(), |q| at_most(q.p99)),
                claims,
                p.create_wall.as_secs_f64(),
                p.ready_wall.as_secs_f64(),
            );
        }
        // The curve: what 1,000 more session pods cost, from the first to the last point.
        if let (Some(first), Some(last)) = (self.points.first(), self.points.last()) {
            let k = (last.pods - first.pods) as f64 / 1000.0;
            if k > 0.0 {
                let per = |a: u64, b: u64| (b as f64 - a as f64) / 1024.0 / k;
                println!();
                println!(
                    "| per 1,000 session pods (from {} to {}) | value |",
                    first.pods, last.pods
                );
                println!("|---|---|");
                println!(
                    "| server RSS | {:+.1} MiB |",
                    per(first.snap.server_rss.0, last.snap.server_rss.0)
                );
                println!(
                    "| operator RSS | {:+.1} MiB |",
                    per(first.snap.operator_rss.0, last.snap.operator_rss.0)
                );
            }
        }
        for p in &self.points {
            first_errors(&p.claim_errors);
        }
        let _ = a;
    }
}
