//! The figures every section prints: a median and a p99 of timed samples, durations in
//! milliseconds, memory in MiB, and the table rows and error lines built from them.

use std::time::Duration;

use anyhow::Context;

pub(crate) struct Stats {
    pub(crate) median: Duration,
    pub(crate) p99: Duration,
}

pub(crate) fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    Stats {
        median: at(0.5),
        p99: at(0.99),
    }
}

pub(crate) fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

pub(crate) fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let (rss, _) = cli_mcp_e2e::child::rss_kib(pid).context("VmRSS missing")?;
    Ok(rss)
}

pub(crate) fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// A histogram quantile as the bucket bound it is (at most this long).
pub(crate) fn at_most(seconds: f64) -> String {
    if seconds.is_infinite() {
        "> 10 s".into()
    } else if seconds < 1e-3 {
        format!("≤ {:.1} µs", seconds * 1e6)
    } else {
        format!("≤ {:.1} ms", seconds * 1e3)
    }
}

/// A `| what | median | p99 |` row, with dashes when nothing was measured.
pub(crate) fn row(what: &str, s: &[Duration]) -> String {
    if s.is_empty() {
        return format!("| {what} | – | – |");
    }
    let Stats { median, p99 } = stats(s.to_vec());
    format!("| {what} | {} | {} |", ms(median), ms(p99))
}

/// The first five errors, each cut at 300 characters, as a list under a table.
pub(crate) fn first_errors(errors: &[String]) {
    for e in errors.iter().take(5) {
        println!("  - {}", e.chars().take(300).collect::<String>());
    }
}

/// A count over `d` as a count per minute.
pub(crate) fn per_minute(n: f64, d: Duration) -> String {
    format!("{:.1}", n * 60.0 / d.as_secs_f64().max(1e-9))
}

/// RSS as `/proc` gives it, (VmRSS, VmHWM) in KiB: the current value and the peak.
pub(crate) fn rss_cell(kib: (u64, u64)) -> String {
    format!("{} (peak {})", mib(kib.0), mib(kib.1))
}

/// The CPU time process `pid` has used (user and system), from `/proc/<pid>/stat`.
pub(crate) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command name (in parentheses, which may hold spaces): utime and stime are
    // fields 14 and 15 of the line, the 12th and 13th after it.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let ticks: Vec<f64> = after
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|t| t.parse().ok())
        .collect();
    anyhow::ensure!(ticks.len() == 2, "no CPU times in /proc/{pid}/stat");
    // The kernel's USER_HZ, 100 on every Linux this runs on.
    Ok((ticks[0] + ticks[1]) / 100.0)
}

/// The lower median of `values` (the middle one of an odd count, the lower middle of an
/// even one), or `None` when there are none.
pub(crate) fn median<T: Copy + PartialOrd>(values: &[T]) -> Option<T> {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v.get(v.len().checked_sub(1)? / 2).copied()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_median_is_the_lower_middle() {
        assert_eq!(super::median::<u64>(&[]), None);
        assert_eq!(super::median(&[3u64, 1, 2]), Some(2));
        assert_eq!(super::median(&[4.0, 1.0, 3.0, 2.0]), Some(2.0));
    }
}
