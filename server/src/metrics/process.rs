//! The standard `process_*` metrics, read from `/proc` at each scrape.

/// The standard `process_*` metrics (CPU, memory, descriptors, threads, start time), read
/// from `/proc/self` at each scrape.
#[derive(Debug)]
pub(super) struct ProcessCollector;

/// The unit of the tick counts in `/proc/<pid>/stat`, fixed at 100 per second (USER_HZ) in
/// the kernel's user ABI.
const TICKS_PER_SECOND: f64 = 100.0;

#[derive(Debug, Default, PartialEq)]
struct ProcessStats {
    cpu_seconds: f64,
    start_time_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    threads: i64,
    open_fds: i64,
    max_fds: i64,
}

/// The `kB` value of `key` in `/proc/<pid>/status`, in bytes.
fn status_kib(status: &str, key: &str) -> Option<i64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<i64>()
                .ok()
        })
        .map(|kib| kib * 1024)
}

/// Parses `/proc/<pid>/stat` (fields after the command name, which may contain spaces and
/// parentheses), `/proc/<pid>/status` and the `btime` line of `/proc/stat`.
fn parse_process(stat: &str, status: &str, proc_stat: &str) -> Option<ProcessStats> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // Field 3 of stat (state) is after_comm's first; utime is field 14, so index 11.
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    let cpu_seconds = (ticks(11)? + ticks(12)?) / TICKS_PER_SECOND;
    let boot_time = proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<f64>().ok())?;
    let start_time_seconds = boot_time + ticks(19)? / TICKS_PER_SECOND;
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse::<i64>().ok())
        .unwrap_or(0);
    Some(ProcessStats {
        cpu_seconds,
        start_time_seconds,
        resident_bytes: status_kib(status, "VmRSS:").unwrap_or(0),
        virtual_bytes: status_kib(status, "VmSize:").unwrap_or(0),
        threads,
        open_fds: 0,
        max_fds: 0,
    })
}

fn read_process() -> Option<ProcessStats> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let proc_stat = std::fs::read_to_string("/proc/stat").ok()?;
    let mut p = parse_process(&stat, &status, &proc_stat)?;
    p.open_fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as i64)
        .unwrap_or(0);
    p.max_fds = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| i64::try_from(soft).unwrap_or(i64::MAX))
        .unwrap_or(0);
    Some(p)
}

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric as _;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::registry::Unit;
        // Without /proc (not Linux) there is nothing to report; the rest of /metrics stands.
        let Some(p) = read_process() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(p.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu",
            "Total user and system CPU time spent",
            Some(&Unit::Seconds),
            cpu.metric_type(),
        )?)?;
        let gauges: [(&str, &str, Option<Unit>, ConstGauge<f64>); 6] = [
            (
                "process_start_time",
                "Start time of the process since the Unix epoch",
                Some(Unit::Seconds),
                ConstGauge::new(p.start_time_seconds),
            ),
            (
                "process_resident_memory",
                "Resident memory size",
                Some(Unit::Bytes),
                ConstGauge::new(p.resident_bytes as f64),
            ),
            (
                "process_virtual_memory",
                "Virtual memory size",
                Some(Unit::Bytes),
                ConstGauge::new(p.virtual_bytes as f64),
            ),
            (
                "process_open_fds",
                "Open file descriptors",
                None,
                ConstGauge::new(p.open_fds as f64),
            ),
            (
                "process_max_fds",
                "Most open file descriptors (soft limit)",
                None,
                ConstGauge::new(p.max_fds as f64),
            ),
            (
                "process_threads",
                "OS threads of the process",
                None,
                ConstGauge::new(p.threads as f64),
            ),
        ];
        for (name, help, unit, gauge) in gauges {
            gauge.encode(encoder.encode_descriptor(
                name,
                help,
                unit.as_ref(),
                gauge.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_parse_even_with_parentheses_in_the_command_name() {
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 50 0 0 20 0 7 0 1000 123456789 2048 18446744073709551615";
        let status = "Name:\tx\nVmSize:\t  120000 kB\nVmRSS:\t    9000 kB\nThreads:\t7\n";
        let proc_stat = "cpu  1 2 3\nbtime 1700000000\nprocesses 10\n";
        let p = parse_process(stat, status, proc_stat).expect("parses");
        assert_eq!(p.cpu_seconds, 3.0);
        assert_eq!(p.start_time_seconds, 1_700_000_010.0);
        assert_eq!(p.resident_bytes, 9000 * 1024);
        assert_eq!(p.virtual_bytes, 120000 * 1024);
        assert_eq!(p.threads, 7);
        assert_eq!(parse_process("garbage", status, proc_stat), None);
    }
}
