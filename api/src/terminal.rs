//! Whether log lines get colour: only for a person at a terminal. `kubectl logs` and log
//! collectors read a pipe, where escape codes are noise; `NO_COLOR` (any non-empty value)
//! turns colour off everywhere. Every binary's log setup asks here, so they agree.

use std::io::IsTerminal as _;

pub fn log_colours() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
