//! Where a new session's start spends its time. Each step of a start (the lookup, the slot
//! creates, the claim's patch, `/assign`, …) is timed: logged at debug level as it ends, and
//! summed up in the `steps` field of the "session sandbox started" line, as
//! `name=<start>+<took>,…` in milliseconds from the start of the call, in the order the steps
//! ended (steps run side by side: two steps that overlap show it in their starts). A slow start can then be
//! read from an ordinary `info` log, and `cli-mcp-bench cluster` prints the breakdown of its
//! warm starts from it.

use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

tokio::task_local! {
    /// The steps of the start the current task runs (none outside one).
    static STEPS: Steps;
}

#[derive(Debug)]
pub struct Steps {
    t0: Instant,
    done: Mutex<Vec<Step>>,
}

#[derive(Debug)]
struct Step {
    name: &'static str,
    start: Duration,
    took: Duration,
}

impl Steps {
    fn new() -> Self {
        Self {
            t0: Instant::now(),
            done: Mutex::new(Vec::new()),
        }
    }

    /// `name=<start>+<took>` per step in the order they ended, milliseconds with one decimal,
    /// comma-separated (one token in a plain log line, without quotes).
    fn summary(&self) -> String {
        let done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        done.iter()
            .map(|s| format!("{}={:.1}+{:.1}", s.name, ms(s.start), ms(s.took)))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Runs `f`, one start, with its steps recorded (see [`summary`]).
pub async fn traced<F: Future>(f: F) -> F::Output {
    STEPS.scope(Steps::new(), f).await
}

/// The steps of the start the current task runs so far (empty outside one).
pub fn summary() -> String {
    STEPS.try_with(Steps::summary).unwrap_or_default()
}

/// Times step `name` of the start the current task runs (a no-op record outside one).
pub async fn timed<F: Future>(name: &'static str, f: F) -> F::Output {
    let start = Instant::now();
    let out = f.await;
    let took = start.elapsed();
    tracing::debug!(
        step = name,
        took_us = took.as_micros() as u64,
        "session start step"
    );
    let _ = STEPS.try_with(|s| {
        s.done.lock().unwrap_or_else(|p| p.into_inner()).push(Step {
            name,
            start: start.duration_since(s.t0),
            took,
        })
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn steps_are_recorded_in_the_order_they_end_with_their_offsets() {
        let summary = traced(async {
            timed("a", async {}).await;
            let (_, _) = tokio::join!(timed("b", async {}), timed("c", async {}));
            summary()
        })
        .await;
        let names: Vec<&str> = summary
            .split(',')
            .map(|s| s.split('=').next().unwrap_or_default())
            .collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(summary.split(',').all(|s| s.contains('+')), "{summary}");
    }

    #[tokio::test]
    async fn outside_a_start_nothing_is_recorded_and_nothing_fails() {
        assert_eq!(timed("a", async { 7 }).await, 7);
        assert_eq!(summary(), "");
    }
}
