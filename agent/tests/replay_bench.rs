//! Cost of the replay journal on the exec hot path: `true` with and without a `request_id`
//! (the server always sends one). Not a pass/fail test; run it in release:
//! `cargo test --release -p cli-mcp-agent --test replay_bench -- --ignored --nocapture`.

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::Agent;

fn quantile(samples: &mut [Duration], q: f64) -> Duration {
    samples.sort();
    samples[((samples.len() - 1) as f64 * q) as usize]
}

#[tokio::test]
#[ignore = "a measurement, not a test: run with --ignored --nocapture in release"]
async fn exec_true_with_and_without_request_id() {
    let a = Agent::start();
    let n = 1000;
    a.exec("true").await;
    // Interleaved rounds, so a burst of load from other processes hits both alike.
    let mut plain = Vec::with_capacity(n);
    let mut with_id = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        a.exec_with(json!({"command": "true"})).await;
        plain.push(t.elapsed());
        let t = Instant::now();
        a.exec_with(json!({"command": "true", "request_id": format!("bench-{i}")}))
            .await;
        with_id.push(t.elapsed());
    }
    let ms = |d: Duration| format!("{:.3} ms", d.as_secs_f64() * 1e3);
    println!("| what | median | p99 |");
    println!("|---|---|---|");
    for (what, s) in [
        ("POST /exec `true`, no request_id", &mut plain),
        ("POST /exec `true`, unique request_id", &mut with_id),
    ] {
        println!(
            "| {what} | {} | {} |",
            ms(quantile(s, 0.5)),
            ms(quantile(s, 0.99))
        );
    }
}
