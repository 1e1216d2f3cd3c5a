//! The machine's conditions a scale table names at its start and end: cores, memory, load.

/// `/proc/loadavg`'s three averages, for the conditions line.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

pub(super) fn conditions() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| mem_total(&m))
        .unwrap_or_default();
    format!("{cores} cores, {mem}, load average {}", loadavg())
}

fn mem_total(meminfo: &str) -> Option<String> {
    let kib: f64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(format!("{:.0} GiB", kib / 1024.0 / 1024.0))
}
