//! What the sandbox's own operations cost under a runtime, timed inside a session by bash's
//! `time` over many iterations: the kinds of work an agent's command is made of (system calls
//! on the pod's volumes, `/proc` reads, FIFOs, a process start). Under gVisor each of them is
//! served by its user-space kernel (the Sentry), files of the pod's volumes through a gofer;
//! set against runc's, they tell where a `tools/call`'s time goes inside the sandbox.

use cli_mcp_e2e::journey::{Env, Mcp};

use super::instance::no_sessions;

const SESSION: &str = "inside";

/// The operations: what the row says, the loop body, how many iterations.
pub(super) const OPS: [(&str, &str, u32); 9] = [
    ("a bash builtin (`:`): no system call", ":", 20_000),
    (
        "`: 2>/dev/null`: a device opened, two `dup2`s and a close (no volume)",
        ": 2>/dev/null",
        2_000,
    ),
    (
        "`: > f` in /tmp (a memory-backed emptyDir, the agent's state dir): open, truncate, close",
        ": > /tmp/.bench-f",
        2_000,
    ),
    (
        "`: > f` in /workspace (a disk-backed emptyDir)",
        ": > /workspace/.bench-f",
        2_000,
    ),
    (
        "`: > f` in /dev/shm (the pod's shared memory, a tmpfs the runtime provides)",
        ": > /dev/shm/.bench-f",
        2_000,
    ),
    (
        "`: <> fifo` in /tmp: a FIFO opened and closed",
        ": <> /tmp/.bench-fifo",
        2_000,
    ),
    (
        "`: <> fifo` in /dev/shm",
        ": <> /dev/shm/.bench-fifo",
        2_000,
    ),
    (
        "`read < /proc/self/stat`: a /proc file read",
        "read -r _ < /proc/self/stat",
        2_000,
    ),
    ("`/bin/true`: fork, exec and wait", "/bin/true", 200),
];

/// Microseconds per operation of [`OPS`] (same order; `None` where bash printed no time),
/// or why there are none.
pub(super) struct Inside {
    pub(super) us: Vec<Option<f64>>,
    pub(super) error: Option<String>,
}

/// The script: each loop timed by `time` (seconds, 3 decimals, one line each on stdout).
fn script() -> String {
    let mut s = String::from(
        "TIMEFORMAT=%R; for f in /tmp/.bench-fifo /dev/shm/.bench-fifo; do \
         rm -f $f; mkfifo $f; done; ",
    );
    for (_, op, n) in OPS {
        s.push_str(&format!(
            "{{ time (for ((i = 0; i < {n}; i++)); do {op}; done) ; }} 2>&1; "
        ));
    }
    s.push_str("rm -f /tmp/.bench-f* /workspace/.bench-f /dev/shm/.bench-f*");
    s
}

/// Runs [`OPS`] in a new session; then no session is left.
pub(super) async fn measured(env: &Env, svc: &Mcp) -> anyhow::Result<Inside> {
    let mut out = Inside {
        us: Vec::new(),
        error: None,
    };
    // A shell that could not report on a command is replaced and the output lost: tried
    // again, up to three times.
    for _ in 0..3 {
        match svc.bash_ok(SESSION, &script()).await {
            Ok(r) => {
                let stdout = r["structuredContent"]["stdout"].as_str().unwrap_or("");
                out.us = parse(stdout);
                out.error = None;
                break;
            }
            Err(e) => out.error = Some(e.to_string()),
        }
    }
    let _ = svc.try_delete(SESSION).await;
    no_sessions(env).await?;
    Ok(out)
}

/// µs per operation from the script's output (a number of seconds per line).
fn parse(stdout: &str) -> Vec<Option<f64>> {
    let mut lines = stdout.lines().map(|l| l.trim().parse::<f64>().ok());
    OPS.iter()
        .map(|(_, _, n)| Some(lines.next()?? * 1e6 / f64::from(*n)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_loop_is_timed_and_read_back_per_operation() {
        let s = script();
        assert!(
            s.contains("{ time (for ((i = 0; i < 200; i++)); do /bin/true; done) ; } 2>&1;"),
            "{s}"
        );
        assert!(s.starts_with("TIMEFORMAT=%R;"), "{s}");
        let us = parse("0.020\n0.010\n0.100\n0.200\n0.010\nnot a number\n0.030\n0.004\n1.000\n");
        assert_eq!(us.len(), OPS.len());
        assert_eq!(us[0], Some(1.0));
        assert_eq!(us[2], Some(50.0));
        assert_eq!(us[5], None);
        assert_eq!(us[8], Some(5000.0));
    }
}
