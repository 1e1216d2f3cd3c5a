//! The cluster section's tables: per sandbox runtime, the latencies of every scenario
//! (median, p99), the load phase's totals, the server's own breakdown of warm and cold starts
//! and the first errors; the admission burst with the first runtime; then, on the real node,
//! the runtimes side by side (`compare`).

use crate::figures::{at_most, first_errors, mib, row};

use super::admission::Burst;
use super::calls::Calls;
use super::{compare, ClusterArgs, Run};

/// Everything the cluster section measured, in the order it was measured.
pub(super) struct Report {
    /// What the cluster's pods run (`the_cluster`'s description).
    pub(super) what: String,
    /// Whether the pods ran on the real node (else the process kubelet, with no runtime).
    pub(super) real: bool,
    pub(super) runs: Vec<Run>,
    /// Measured on the first runtime's instance only: admission does not depend on it.
    pub(super) burst: Burst,
    /// Measured on the real node under runc, when asked for (`--idle`).
    pub(super) density: Option<super::density::Density>,
    /// Measured on the first runtime's node when asked for (`--arrivals`).
    pub(super) arrivals: Option<super::arrivals::Arrivals>,
}

impl Report {
    pub(super) fn print(&self, args: &ClusterArgs) {
        for (i, run) in self.runs.iter().enumerate() {
            let burst = (i == 0).then_some(&self.burst);
            self.print_start_and_call_rows(run);
            print_load_rows(run, args);
            if let Some(b) = burst {
                print_admission_rows(b);
            }
            print_load_table(run, args);
            print_steps_and_errors(run, burst);
        }
        if self.real {
            compare::print(&self.runs, args);
        }
        if let Some(d) = &self.density {
            d.print();
        }
        if let Some(a) = &self.arrivals {
            a.print();
        }
    }

    /// The latency table's header and its rows of session starts and of `tools/call`s.
    fn print_start_and_call_rows(&self, run: &Run) {
        let what = &self.what;
        let Run {
            warm_starts,
            cold_starts,
            ..
        } = run;
        let Calls {
            via_svc, via_pod, ..
        } = &run.calls;
        let runtime = if self.real {
            format!("sandboxes under {}; ", run.runtime.name())
        } else {
            String::new()
        };
        println!(
            "\n## cluster (local Kubernetes; operator and server as pods; {what}; {runtime}through \
         the Service: loopback forward, TLS, ServiceAccount token)\n"
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
        if let Some(w) = &run.warm_writes {
            print_writes_row(w, warm_starts.samples.len());
        }
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
        let big = &run.big;
        println!(
            "{}",
            row(
                &format!(
                    "a 10 MB output (one command printing 10,000,000 bytes of base64): time to \
                     the result (n={})",
                    big.samples.len()
                ),
                &big.samples
            )
        );
        println!(
            "{}",
            row(
                "a 10 MB output: the command itself (the agent's `duration_ms`)",
                &big.command_ms
            )
        );
    }
}

/// The load phase's rows of the latency table.
fn print_load_rows(run: &Run, args: &ClusterArgs) {
    let l = &run.load;
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

/// API writes per warm start (all writers: the server's claim and slots, the operator's
/// refill, the scheduler's binding, the kubelet's status), by verb and resource.
fn print_writes_row(writes: &[(String, f64)], starts: usize) {
    if starts == 0 {
        return;
    }
    let per = |n: f64| n / starts as f64;
    let total: f64 = writes.iter().map(|(_, n)| n).sum();
    let by: Vec<String> = writes
        .iter()
        .map(|(what, n)| format!("`{what}` {:.1}", per(*n)))
        .collect();
    println!(
        "| API writes per warm start, the pool's refill included (n={starts}; the API server's counts): {} | {:.1} | |",
        by.join(", "),
        per(total)
    );
}

/// The admission burst's rows of the latency table.
fn print_admission_rows(b: &Burst) {
    let cpu = b.list_cpu.map_or("–".into(), |d| {
        format!("{:.2} ms", d.as_secs_f64() * 1000.0)
    });
    println!(
        "{}",
        row(
            &format!(
                "admission burst, before it: {} `tools/list` at once, each opening its connection (a TLS handshake), answer (n={}; the server's CPU per call: {cpu})",
                b.lists.len(),
                b.lists.len()
            ),
            &b.lists
        )
    );
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
    match b.refused_in_server {
        Some(q) => println!(
            "| admission burst: a refused tool call in the server, from its start to its answer (n={}; histogram bucket bounds) | {} | {} |",
            q.n,
            at_most(q.median),
            at_most(q.p99)
        ),
        None => println!("| admission burst: a refused tool call in the server | – | – |"),
    }
}

/// The load phase's totals, the other phases' error counts and the server's RSS.
fn print_load_table(run: &Run, args: &ClusterArgs) {
    let Run {
        warm_starts,
        cold_starts,
        load: l,
        rss_loaded,
        big,
        ..
    } = run;
    let Calls {
        svc_errors,
        pod_errors,
        rss_idle,
        ..
    } = &run.calls;
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
        "| errors of the other phases (warm, cold, Service calls, pod-IP calls, 10 MB output) | {}, {}, {}, {}, {} |",
        warm_starts.errors.len(),
        cold_starts.errors.len(),
        svc_errors,
        pod_errors,
        big.errors.len()
    );
    println!("| a 10 MB output: the result | {} |", big.result);
    println!(
        "| server RSS before the calls / after the load | {} / {} |",
        mib(*rss_idle),
        mib(*rss_loaded)
    );
}

/// The server's breakdown of warm and cold starts, then the first errors of each phase.
fn print_steps_and_errors(run: &Run, burst: Option<&Burst>) {
    let Run {
        warm_starts,
        cold_starts,
        warm_steps,
        cold_steps,
        load: l,
        big,
        ..
    } = run;
    for t in [warm_steps, cold_steps].into_iter().flatten() {
        println!("\n{t}");
    }
    for errors in [
        &warm_starts.errors,
        &cold_starts.errors,
        &big.errors,
        &l.start_errors,
        &l.errors,
    ] {
        first_errors(errors);
    }
    if let Some(b) = burst {
        first_errors(&b.errors);
    }
}
