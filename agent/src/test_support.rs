//! Shared by the unit tests.

/// Held by every unit test that starts processes. A shell restart kills every process group
/// below the agent (so nothing that escaped the old shell outlives it); in a test binary
/// that is every test's processes, so those tests must not overlap.
pub(crate) static PROCESSES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
