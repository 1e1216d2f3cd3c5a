//! The sandbox runtimes side by side: a column per runtime and the ratio of each to the first
//! (gVisor/runc by default), for session starts, calls, the load, a 10 MB output and an idle
//! sandbox pod's memory; the gVisor sandboxes' two targets; and where a cold start's time
//! goes under each runtime.

use std::time::Duration;

use cli_mcp_e2e::runtime::SandboxRuntime;

use crate::figures::{first_errors, stats, Stats};

use super::inside::OPS;
use super::memory::IdleMemory;
use super::phases::PHASES;
use super::{ClusterArgs, Run};

/// A cold start's median under gVisor may take this long (the target).
const GVISOR_COLD_P50: Duration = Duration::from_secs(1);
/// A `tools/call`'s median under gVisor may be this many times runc's (the target).
const GVISOR_CALL_RATIO: f64 = 2.0;

/// One cell of a row: a figure the ratio column can divide, or text.
enum Cell {
    Ms(f64),
    Us(f64),
    PerSecond(f64),
    Mib(f64),
    Text(String),
    Missing,
}

impl Cell {
    fn value(&self) -> Option<f64> {
        match self {
            Cell::Ms(v) | Cell::Us(v) | Cell::PerSecond(v) | Cell::Mib(v) => Some(*v),
            Cell::Text(_) | Cell::Missing => None,
        }
    }

    fn show(&self) -> String {
        match self {
            Cell::Ms(v) if *v >= 1000.0 => format!("{:.2} s", v / 1000.0),
            Cell::Ms(v) => format!("{v:.1} ms"),
            Cell::Us(v) => format!("{v:.1} µs"),
            Cell::PerSecond(v) => format!("{v:.0} commands/s"),
            Cell::Mib(v) => format!("{v:.1} MiB"),
            Cell::Text(t) => t.clone(),
            Cell::Missing => "–".into(),
        }
    }
}

fn title(rt: SandboxRuntime) -> &'static str {
    match rt {
        SandboxRuntime::Runc => "runc",
        SandboxRuntime::Gvisor => "gVisor",
    }
}

/// The median of `samples` in ms, `Missing` when there is none.
fn p50(samples: &[Duration]) -> Cell {
    quantile(samples, |s| s.median)
}

fn p99(samples: &[Duration]) -> Cell {
    quantile(samples, |s| s.p99)
}

fn slowest(samples: &[Duration]) -> Cell {
    samples
        .iter()
        .max()
        .map_or(Cell::Missing, |d| Cell::Ms(d.as_secs_f64() * 1000.0))
}

fn quantile(samples: &[Duration], pick: impl Fn(&Stats) -> Duration) -> Cell {
    if samples.is_empty() {
        return Cell::Missing;
    }
    Cell::Ms(pick(&stats(samples.to_vec())).as_secs_f64() * 1000.0)
}

/// The median of `values` (KiB or bytes) as MiB, `Missing` when there is none.
fn median_mib(values: &[u64], per_mib: f64) -> Cell {
    crate::figures::median(values).map_or(Cell::Missing, |v| Cell::Mib(v as f64 / per_mib))
}

/// A row of `f`'s cell for each runtime.
fn row(runs: &[Run], what: &str, f: impl Fn(&Run) -> Cell) {
    print_row(what, &runs.iter().map(f).collect::<Vec<_>>());
}

/// A `| what | a | b | b/a |` row (one ratio per runtime after the first).
fn print_row(what: &str, cells: &[Cell]) {
    let mut line = format!("| {what} |");
    for c in cells {
        line.push_str(&format!(" {} |", c.show()));
    }
    let first = cells.first().and_then(Cell::value);
    for c in cells.iter().skip(1) {
        match (first, c.value()) {
            (Some(a), Some(b)) if a > 0.0 => line.push_str(&format!(" {:.2}× |", b / a)),
            _ => line.push_str(" |"),
        }
    }
    println!("{line}");
}

fn print_header(what: &str, runs: &[Run]) {
    let names: Vec<&str> = runs.iter().map(|r| title(r.runtime)).collect();
    let mut head = format!("| {what} |");
    for n in &names {
        head.push_str(&format!(" {n} |"));
    }
    for n in names.iter().skip(1) {
        head.push_str(&format!(" {n}/{} |", names[0]));
    }
    println!("{head}");
    println!(
        "|{}",
        "---|".repeat(1 + names.len() + names.len().saturating_sub(1))
    );
}

/// Every side-by-side table, the targets, and the first errors of what only they show.
pub(super) fn print(runs: &[Run], args: &ClusterArgs) {
    let names: Vec<&str> = runs.iter().map(|r| title(r.runtime)).collect();
    println!(
        "\n## {} side by side (real node, one cluster, an instance per runtime, measured one \
         after the other)\n",
        names.join(" and ")
    );
    print_header("what", runs);
    row(runs, "the sandbox's kernel (`uname -r`)", |r| {
        Cell::Text(format!("`{}`", r.kernel))
    });
    row(runs, &format!("warm start p50 (n={})", args.starts), |r| {
        p50(&r.warm_starts.samples)
    });
    row(runs, "warm start p99", |r| p99(&r.warm_starts.samples));
    row(runs, &format!("cold start p50 (n={})", args.starts), |r| {
        p50(&r.cold_starts.samples)
    });
    row(runs, "cold start p99", |r| p99(&r.cold_starts.samples));
    print_call_rows(runs, args);
    print_load_rows(runs, args);
    print_big_rows(runs);
    print_memory_rows(runs);
    print_targets(runs);
    print_inside(runs);
    print_phases(runs);
    for r in runs {
        if let Some(m) = &r.memory {
            first_errors(&m.errors);
        }
        if let Some(p) = &r.cold_phases {
            first_errors(&p.errors);
        }
    }
}

/// `tools/call` of `true` on a live session, and what of it the sandbox itself takes.
fn print_call_rows(runs: &[Run], args: &ClusterArgs) {
    let n = args.calls;
    row(
        runs,
        &format!("`tools/call` `true` p50, through the Service (n={n})"),
        |r| p50(&r.calls.via_svc),
    );
    row(runs, "`tools/call` `true` p99, through the Service", |r| {
        p99(&r.calls.via_svc)
    });
    row(runs, "`tools/call` `true` p50, server pod IP", |r| {
        p50(&r.calls.via_pod)
    });
    row(runs, "`tools/call` `true` p99, server pod IP", |r| {
        p99(&r.calls.via_pod)
    });
    row(
        runs,
        "`tools/call` `true`: failed calls (Service, pod IP)",
        |r| Cell::Text(format!("{}, {}", r.calls.svc_errors, r.calls.pod_errors)),
    );
    row(
        runs,
        "`true` as the agent timed it (`duration_ms`, whole ms), p50",
        |r| p50(&r.calls.agent_ms),
    );
    row(
        runs,
        &format!("`GET /healthz` from the node to the session's agent, p50 (n={n})"),
        |r| p50(&r.calls.healthz),
    );
    row(
        runs,
        "`GET /healthz` from the node to the session's agent, p99 (failed)",
        |r| match p99(&r.calls.healthz) {
            Cell::Ms(v) => Cell::Text(format!("{v:.1} ms ({})", r.calls.healthz_errors)),
            _ => Cell::Text(format!("– ({} failed)", r.calls.healthz_errors)),
        },
    );
}

fn print_load_rows(runs: &[Run], args: &ClusterArgs) {
    let (s, c) = (args.sessions, args.commands);
    row(
        runs,
        &format!("load: {s} sessions × {c} commands, throughput"),
        |r| Cell::PerSecond(r.load.ok.len() as f64 / r.load.wall.as_secs_f64().max(1e-9)),
    );
    row(
        runs,
        "load: commands completed / sent, errors (commands + starts)",
        |r| {
            Cell::Text(format!(
                "{} / {}, {} + {}",
                r.load.ok.len(),
                s * c,
                r.load.errors.len(),
                r.load.start_errors.len()
            ))
        },
    );
    row(
        runs,
        &format!("load: session start, {s} at once, p50"),
        |r| p50(&r.load.start),
    );
    row(runs, "load: one command, p50", |r| p50(&r.load.ok));
    row(runs, "load: one command, p99", |r| p99(&r.load.ok));
}

fn print_big_rows(runs: &[Run]) {
    row(runs, "a 10 MB output: time to the result, median", |r| {
        p50(&r.big.samples)
    });
    row(runs, "a 10 MB output: time to the result, slowest", |r| {
        slowest(&r.big.samples)
    });
    row(
        runs,
        "a 10 MB output: the command itself (agent), median",
        |r| p50(&r.big.command_ms),
    );
    row(runs, "a 10 MB output: the result", |r| {
        Cell::Text(r.big.result.clone())
    });
}

const MIB_OF_BYTES: f64 = 1024.0 * 1024.0;
const MIB_OF_KIB: f64 = 1024.0;

/// A row's cell from an idle runtime's memory, `Missing` where it was not measured.
fn mem(r: &Run, f: &dyn Fn(&IdleMemory) -> Cell) -> Cell {
    r.memory.as_ref().map_or(Cell::Missing, f)
}

/// The median RSS and PSS of processes (KiB) as `rss / pss` MiB.
fn rss_pss(rss: &[u64], pss: &[u64]) -> Cell {
    Cell::Text(format!(
        "{} / {}",
        median_mib(rss, MIB_OF_KIB).show(),
        median_mib(pss, MIB_OF_KIB).show()
    ))
}

/// An idle sandbox pod's memory: its pod cgroup, then what the node adds around it.
fn print_memory_rows(runs: &[Run]) {
    let first = runs.iter().find_map(|r| r.memory.as_ref());
    let file = first.map_or("memory.current", |m| m.charge_file);
    let pods = first.map_or(0, |m| m.charge.len());
    let charge = |m: &IdleMemory| median_mib(&m.charge, MIB_OF_BYTES).value();
    row(
        runs,
        &format!("idle sandbox pod: pod cgroup `{file}` (median of {pods} pods)"),
        |r| mem(r, &|m| median_mib(&m.charge, MIB_OF_BYTES)),
    );
    row(runs, "  of it: anonymous / shmem / other page cache", |r| {
        mem(r, &|m| {
            Cell::Text(
                [&m.anon, &m.shmem, &m.file]
                    .map(|v| median_mib(v, MIB_OF_BYTES).show())
                    .join(" / "),
            )
        })
    });
    row(
        runs,
        "idle sandbox pod: gVisor's Sentry (with its stubs) and gofers, RSS",
        |r| mem(r, &|m| median_mib(&m.sandbox_rss, MIB_OF_KIB)),
    );
    row(
        runs,
        "  their PSS (the pages they share split between them)",
        |r| mem(r, &|m| median_mib(&m.sandbox_pss, MIB_OF_KIB)),
    );
    // Missing when either part was not measured, never a part alone.
    let plus = |m: &IdleMemory, kib: &[u64]| match (charge(m), median_mib(kib, MIB_OF_KIB).value())
    {
        (Some(c), Some(o)) => Cell::Mib(c + o),
        _ => Cell::Missing,
    };
    print_runtime_process_rows(runs);
    row(
        runs,
        "idle sandbox pod: what the node holds for it (pod cgroup + PSS of the runtime's \
         processes outside it)",
        |r| mem(r, &|m| plus(m, &m.outside_pss)),
    );
    print_cpu_and_request_rows(runs);
}

/// What an idle pod uses of a CPU, and whether the default requests cover an idle pod's
/// cgroup (what the scheduler places pods by).
fn print_cpu_and_request_rows(runs: &[Run]) {
    let window = super::memory::CPU_WINDOW.as_secs();
    let millicores = |v: &[f64]| {
        let max = v.iter().copied().reduce(f64::max);
        match (crate::figures::median(v), max) {
            (Some(p50), Some(max)) => Cell::Text(format!("{p50:.2}m / {max:.2}m")),
            _ => Cell::Missing,
        }
    };
    row(
        runs,
        &format!("idle sandbox pod: CPU used over {window} s idle, median / max"),
        |r| mem(r, &|m| millicores(&m.cpu_millicores)),
    );
    let (cpu, memory) = cli_mcp_api::crd::DEFAULT_SANDBOX_REQUESTS;
    let request = cli_mcp_api::sandbox::limits::quantity_bytes(
        &k8s_openapi::apimachinery::pkg::api::resource::Quantity(memory.into()),
    )
    .unwrap_or(0) as f64;
    row(
        runs,
        &format!("  the default requests ({cpu}, {memory}) cover the median pod cgroup"),
        |r| {
            mem(r, &|m| {
                let need = median_mib(&m.charge, MIB_OF_BYTES)
                    .value()
                    .unwrap_or(f64::MAX);
                let have = request / MIB_OF_BYTES;
                Cell::Text(if need <= have {
                    format!("yes ({need:.1} of {have:.0} MiB)")
                } else {
                    format!("**no** ({need:.1} MiB, {have:.0} requested)")
                })
            })
        },
    );
}

/// The runtime's processes of an idle pod: where they sit, and those outside the pod cgroup.
fn print_runtime_process_rows(runs: &[Run]) {
    row(
        runs,
        "  runsc processes over all pods by subcommand (of them outside their pod cgroup)",
        |r| {
            mem(r, &|m| {
                let roles: Vec<String> = m
                    .runsc_roles
                    .iter()
                    .map(|(role, (n, out))| format!("{role} {n} ({out})"))
                    .collect();
                Cell::Text(if roles.is_empty() {
                    "none".into()
                } else {
                    roles.join(", ")
                })
            })
        },
    );
    row(
        runs,
        "  runsc's other processes of the pod (outside the pod cgroup), RSS / PSS",
        |r| mem(r, &|m| rss_pss(&m.helper_rss, &m.helper_pss)),
    );
    row(
        runs,
        "  the pod's containerd shim (outside the pod cgroup), RSS / PSS",
        |r| mem(r, &|m| rss_pss(&m.shim_rss, &m.shim_pss)),
    );
}

/// The gVisor sandboxes' targets: a cold start's median ≤ 1 s, a call's ≤ 2× runc's.
fn print_targets(runs: &[Run]) {
    let by = |rt| runs.iter().find(|r| r.runtime == rt);
    let Some(g) = by(SandboxRuntime::Gvisor) else {
        return;
    };
    let met = |ok: bool| if ok { "met" } else { "**not met**" };
    println!();
    if let Some(cold) = p50(&g.cold_starts.samples).value() {
        println!(
            "- target: cold start p50 under gVisor ≤ {:.1} s: {:.2} s, {}",
            GVISOR_COLD_P50.as_secs_f64(),
            cold / 1000.0,
            met(cold <= GVISOR_COLD_P50.as_secs_f64() * 1000.0)
        );
    }
    let call_p50 = |r: &Run| p50(&r.calls.via_svc).value();
    if let (Some(gc), Some(rc)) = (call_p50(g), by(SandboxRuntime::Runc).and_then(call_p50)) {
        println!(
            "- target: `tools/call` p50 under gVisor ≤ {GVISOR_CALL_RATIO:.0}× runc: {gc:.2} ms \
             against {rc:.2} ms, {:.2}×, {}",
            gc / rc,
            met(gc / rc <= GVISOR_CALL_RATIO)
        );
    }
}

/// What the sandbox's own operations cost, a column per runtime.
fn print_inside(runs: &[Run]) {
    if runs.iter().all(|r| r.inside.is_none()) {
        return;
    }
    println!();
    print_header(
        "inside the sandbox: one operation (bash's `time` over a loop, µs each)",
        runs,
    );
    for (i, (what, _, n)) in OPS.iter().enumerate() {
        let cells: Vec<Cell> = runs
            .iter()
            .map(|r| {
                match r
                    .inside
                    .as_ref()
                    .and_then(|x| x.us.get(i).copied().flatten())
                {
                    Some(us) => Cell::Us(us),
                    None => Cell::Missing,
                }
            })
            .collect();
        print_row(&format!("{what} (×{n})"), &cells);
    }
    for r in runs {
        if let Some(e) = r.inside.as_ref().and_then(|x| x.error.as_ref()) {
            first_errors(std::slice::from_ref(e));
        }
    }
}

/// Where a cold start's time goes, median per phase, a column per runtime.
fn print_phases(runs: &[Run]) {
    if runs.iter().all(|r| r.cold_phases.is_none()) {
        return;
    }
    let complete: Vec<String> = runs
        .iter()
        .map(|r| r.cold_phases.as_ref().map_or(0, |p| p.complete).to_string())
        .collect();
    println!();
    print_header(
        &format!(
            "where a cold start's time goes (median ms per phase; complete starts: {})",
            complete.join(", ")
        ),
        runs,
    );
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len().wrapping_sub(1) / 2).copied()
    };
    let phase = |r: &Run, i: usize| r.cold_phases.as_ref().and_then(|p| median(p.ms.get(&i)?));
    for (i, name) in PHASES.iter().enumerate() {
        let cells: Vec<Cell> = runs
            .iter()
            .map(|r| phase(r, i).map_or(Cell::Missing, Cell::Ms))
            .collect();
        print_row(&format!("{}. {name}", i + 1), &cells);
    }
    let sums: Vec<Cell> = runs
        .iter()
        .map(|r| {
            (0..PHASES.len())
                .map(|i| phase(r, i))
                .sum::<Option<f64>>()
                .map_or(Cell::Missing, Cell::Ms)
        })
        .collect();
    print_row("sum of the medians", &sums);
}
