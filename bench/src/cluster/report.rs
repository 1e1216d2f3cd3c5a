//! The cluster section's tables: the latencies of every scenario (median, p99), the load
//! phase's totals, the server's own breakdown of warm and cold starts, and the first errors.

use crate::figures::{at_most, first_errors, mib, row};

use super::admission::Burst;
use super::calls::Calls;
use super::load::Load;
use super::starts::Starts;
use super::ClusterArgs;

/// Everything the cluster section measured, in the order it was measured.
pub(super) struct Report {
    /// What the cluster's pods run (`the_cluster`'s description).
    pub(super) what: String,
    pub(super) warm_starts: Starts,
    /// The server's own breakdown of the warm starts (crate::steps), if its log had them.
    pub(super) warm_steps: Option<String>,
    pub(super) cold_starts: Starts,
    pub(super) cold_steps: Option<String>,
    pub(super) calls: Calls,
    pub(super) load: Load,
    /// The server's RSS right after the load phase.
    pub(super) rss_loaded: u64,
    pub(super) burst: Burst,
}

impl Report {
    pub(super) fn print(&self, args: &ClusterArgs) {
        self.print_start_and_call_rows();
        self.print_load_rows(args);
        self.print_admission_rows();
        self.print_load_table(args);
        self.print_steps_and_errors();
    }

    /// The latency table's header and its rows of session starts and of `tools/call`s.
    fn print_start_and_call_rows(&self) {
        let Report {
            what,
            warm_starts,
            cold_starts,
            ..
        } = self;
        let Calls {
            via_svc, via_pod, ..
        } = &self.calls;
        println!(
            "\n## cluster (local Kubernetes; operator and server as pods; {what}; through the \
         Service: loopback forward, TLS, ServiceAccount token)\n"
        );
        println!("| what | median | p99 |");
        println!("|---|---|---|");
        println!(
            "{}",
            row(
                &format!(
                    "warm start: first call of a new session (n={}, launches {:?})",
                    warm_starts.samples.len(),
                    warm_starts.launches
                ),
                &warm_starts.samples
            )
        );
        println!(
            "{}",
            row(
                &format!(
                "cold start: first call of a new session, `warmPoolSize: 0` (n={}, launches {:?})",
                cold_starts.samples.len(),
                cold_starts.launches
            ),
                &cold_starts.samples
            )
        );
        println!(
            "{}",
            row(
                &format!(
                    "`tools/call` `true`, live session, through the Service (n={})",
                    via_svc.len()
                ),
                via_svc
            )
        );
        println!(
            "{}",
            row(
                &format!(
                    "`tools/call` `true`, live session, server pod IP (n={})",
                    via_pod.len()
                ),
                via_pod
            )
        );
    }

    /// The load phase's rows of the latency table.
    fn print_load_rows(&self, args: &ClusterArgs) {
        let l = &self.load;
        println!(
            "{}",
            row(
                &format!(
                    "load: session start, {} at once (n={})",
                    args.sessions,
                    l.start.len()
                ),
                &l.start
            )
        );
        println!(
            "{}",
            row(
                &format!(
                    "load: one command, {} sessions at once (n={})",
                    args.sessions,
                    l.ok.len()
                ),
                &l.ok
            )
        );
    }

    /// The admission burst's rows of the latency table.
    fn print_admission_rows(&self) {
        let b = &self.burst;
        println!(
        "{}",
        row(
            &format!(
                "admission burst: {} new sessions at once against `maxSessions: {}`, answer of a refused one (n={})",
                2 * b.limit,
                b.limit,
                b.refused.len()
            ),
            &b.refused
        )
    );
        println!(
        "{}",
        row(
            &format!(
                "admission burst: first call of an admitted one, cold (n={}; {} errors; burst {:.1} s)",
                b.started.len(),
                b.errors.len(),
                b.wall.as_secs_f64()
            ),
            &b.started
        )
    );
        for (what, q) in ["admitted", "refused"].iter().zip(b.decided) {
            match q {
            Some(q) => println!(
                "| admission burst: the server's admission decision, {what} (n={}; histogram bucket bounds) | {} | {} |",
                q.n,
                at_most(q.median),
                at_most(q.p99)
            ),
            None => println!("| admission burst: the server's admission decision, {what} | – | – |"),
        }
        }
    }

    /// The load phase's totals, the other phases' error counts and the server's RSS.
    fn print_load_table(&self, args: &ClusterArgs) {
        let Report {
            warm_starts,
            cold_starts,
            load: l,
            rss_loaded,
            ..
        } = self;
        let Calls {
            svc_errors,
            pod_errors,
            rss_idle,
            ..
        } = &self.calls;
        let total = args.sessions * args.commands;
        println!();
        println!(
            "| load: {} sessions × {} commands | value |",
            args.sessions, args.commands
        );
        println!("|---|---|");
        println!("| commands completed / sent | {} / {total} |", l.ok.len());
        println!(
            "| throughput | {:.0} commands/s ({:.1} s wall) |",
            l.ok.len() as f64 / l.wall.as_secs_f64(),
            l.wall.as_secs_f64()
        );
        println!(
            "| errors (commands + session starts) | {} + {} |",
            l.errors.len(),
            l.start_errors.len()
        );
        println!(
        "| errors of the other phases (warm, cold, Service calls, pod-IP calls) | {}, {}, {}, {} |",
        warm_starts.errors.len(),
        cold_starts.errors.len(),
        svc_errors,
        pod_errors
    );
        println!(
            "| server RSS before the calls / after the load | {} / {} |",
            mib(*rss_idle),
            mib(*rss_loaded)
        );
    }

    /// The server's breakdown of warm and cold starts, then the first errors of each phase.
    fn print_steps_and_errors(&self) {
        let Report {
            warm_starts,
            cold_starts,
            warm_steps,
            cold_steps,
            load: l,
            burst: b,
            ..
        } = self;
        for t in [warm_steps, cold_steps].into_iter().flatten() {
            println!("\n{t}");
        }
        for errors in [
            &warm_starts.errors,
            &cold_starts.errors,
            &l.start_errors,
            &l.errors,
            &b.errors,
        ] {
            first_errors(errors);
        }
    }
}
