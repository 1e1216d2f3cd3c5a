//! The identity tables, in the style of the other proxy tables.

use std::time::Duration;

use crate::figures::{mib, ms, Stats};

use super::flood::Flood;
use super::latency::Latency;
use super::memory::Memory;
use super::IdentityArgs;

/// The target for a verified CONNECT with its review cached.
const WARM_TARGET: Duration = Duration::from_micros(500);

/// Median and p99; zeros when nothing was measured (every request failed).
fn stats(samples: Vec<Duration>) -> Stats {
    if samples.is_empty() {
        return Stats {
            median: Duration::ZERO,
            p99: Duration::ZERO,
        };
    }
    crate::figures::stats(samples)
}

fn added(a: Duration, b: Duration) -> String {
    format!("{:+.3} ms", (a.as_secs_f64() - b.as_secs_f64()) * 1000.0)
}

/// `| what | median | p99 | added median | added p99 |` against `base`.
fn vs(what: &str, s: &Stats, base: &Stats) -> String {
    format!(
        "| {what} | {} | {} | {} | {} |",
        ms(s.median),
        ms(s.p99),
        added(s.median, base.median),
        added(s.p99, base.p99)
    )
}

pub(crate) fn print(args: &IdentityArgs, l: &Latency, m: &Memory, f: &Flood, took: Duration) {
    connects(args, l);
    in_tunnel(args, l);
    memory(m);
    flood(args, f);
    println!("\n(the identity tables took {:.0} s)", took.as_secs_f64());
}

fn connects(args: &IdentityArgs, l: &Latency) {
    let plain = stats(l.unverified.clone());
    let warm = stats(l.warm.clone());
    let cold = stats(l.cold.clone());
    let review = stats(l.review.clone());
    println!(
        "\n## proxy: sandbox identity per CONNECT (new tunnel, TLS, one GET of a loopback \
         upstream; {} each, interleaved)\n",
        args.connects
    );
    println!("| CONNECT | median | p99 | added (median) | added (p99) |");
    println!("|---|---|---|---|---|");
    println!(
        "| unverified proxy | {} | {} | – | – |",
        ms(plain.median),
        ms(plain.p99)
    );
    println!(
        "{}",
        vs(
            "verified, TokenReview cached (one token throughout)",
            &warm,
            &plain
        )
    );
    println!(
        "{}",
        vs(
            &format!(
                "verified, a TokenReview each (a fresh token each, {})",
                l.cold.len()
            ),
            &cold,
            &plain
        )
    );
    println!(
        "| the TokenReview alone (fresh tokens, {}) | {} | {} | – | – |",
        l.review.len(),
        ms(review.median),
        ms(review.p99)
    );
    let warm_added = warm.median.saturating_sub(plain.median);
    println!(
        "\nTarget: at most {} median added with the review cached: {} ({}).",
        ms(WARM_TARGET),
        if warm_added <= WARM_TARGET {
            "met"
        } else {
            "NOT met"
        },
        added(warm.median, plain.median)
    );
}

fn in_tunnel(args: &IdentityArgs, l: &Latency) {
    let plain = stats(l.in_unverified.clone());
    let checked = stats(l.in_verified.clone());
    println!(
        "\n## proxy: requests inside an open tunnel ({} GETs each, interleaved)\n",
        args.in_tunnel
    );
    println!("| path | median | p99 |");
    println!("|---|---|---|");
    println!(
        "| unverified proxy | {} | {} |",
        ms(plain.median),
        ms(plain.p99)
    );
    println!(
        "| verified (the session's revocation checked per request) | {} | {} |",
        ms(checked.median),
        ms(checked.p99)
    );
    println!(
        "| added by the check | {} | {} |",
        added(checked.median, plain.median),
        added(checked.p99, plain.p99)
    );
}

fn memory(m: &Memory) {
    let n = m.sandboxes.max(1) as f64;
    let per = |from: u64, to: u64| format!("{:.1} KiB", (to as f64 - from as f64) / n);
    println!(
        "\n## proxy: RSS of the verifying binary with {} sandboxes\n",
        m.sandboxes
    );
    println!("| proxy RSS | |");
    println!("|---|---|");
    println!("| started, ready (pods listed) | {} |", mib(m.ready_kib));
    println!(
        "| {} more sandbox pods in its watch | {} |",
        m.sandboxes,
        mib(m.pods_kib)
    );
    println!(
        "| each with a verified tunnel holding a streaming response ({} tunnels) | {} |",
        m.tunnels,
        mib(m.streams_kib)
    );
    println!(
        "| per sandbox | {} (pod {} + tunnel and stream {}) |",
        per(m.ready_kib, m.streams_kib),
        per(m.ready_kib, m.pods_kib),
        per(m.pods_kib, m.streams_kib)
    );
}

fn flood(args: &IdentityArgs, f: &Flood) {
    let alone = stats(f.alone.clone());
    let flooded = stats(f.flooded.clone());
    println!(
        "\n## proxy: a second sandbox while the first floods ({} requests, new tunnel each)\n",
        args.flood_requests
    );
    println!("| second sandbox (127.0.0.2) | median | p99 | failed |");
    println!("|---|---|---|---|");
    println!(
        "| alone | {} | {} | {} |",
        ms(alone.median),
        ms(alone.p99),
        f.alone_failed
    );
    let rate = f.refused as f64 / f.span.as_secs_f64().max(1e-9);
    let other = if f.other > 0 {
        format!(", {} otherwise refused or failed", f.other)
    } else {
        String::new()
    };
    println!(
        "| while the first (127.0.0.1) holds {} tunnels and opens more ({} answered 429 in \
         {:.1} s, {:.0}/s{other}) | {} | {} | {} |",
        f.held,
        f.refused,
        f.span.as_secs_f64(),
        rate,
        ms(flooded.median),
        ms(flooded.p99),
        f.flooded_failed
    );
    println!(
        "| added by the flood | {} | {} | |",
        added(flooded.median, alone.median),
        added(flooded.p99, alone.p99)
    );
    println!(
        "\nThe proxy used {:.2} CPUs during the flood (the machine has {}).",
        f.proxy_cpus,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
}
