//! The load phase: N sessions started at once, then each running M commands one after the
//! other, all sessions at once.

use std::time::{Duration, Instant};

use cli_mcp_e2e::journey::Mcp;

/// The load phase: its session starts, its commands that answered right, and the errors.
pub(super) struct Load {
    pub(super) start: Vec<Duration>,
    pub(super) start_errors: Vec<String>,
    pub(super) wall: Duration,
    pub(super) ok: Vec<Duration>,
    pub(super) errors: Vec<String>,
}

/// `sessions` sessions started concurrently, then each runs `commands` commands one after
/// the other, all sessions at once.
pub(super) async fn load(svc: &Mcp, sessions: usize, commands: usize) -> Load {
    let started = futures::future::join_all((0..sessions).map(|i| {
        let svc = svc.clone();
        async move {
            let t = Instant::now();
            svc.bash_ok(&format!("load-{i}"), "true")
                .await
                .map(|_| t.elapsed())
        }
    }))
    .await;
    let mut out = Load {
        start: Vec::new(),
        start_errors: Vec::new(),
        wall: Duration::ZERO,
        ok: Vec::new(),
        errors: Vec::new(),
    };
    for r in started {
        match r {
            Ok(d) => out.start.push(d),
            Err(e) => out.start_errors.push(e.to_string()),
        }
    }
    let t0 = Instant::now();
    let per_session = futures::future::join_all((0..sessions).map(|i| {
        let svc = svc.clone();
        tokio::spawn(async move {
            let sid = format!("load-{i}");
            let mut ok = Vec::with_capacity(commands);
            let mut errors = Vec::new();
            for j in 0..commands {
                let t = Instant::now();
                match svc.bash_ok(&sid, &format!("echo {i}-{j}")).await {
                    Ok(r) if r["structuredContent"]["stdout"] == format!("{i}-{j}\n") => {
                        ok.push(t.elapsed())
                    }
                    Ok(r) => errors.push(format!("{sid}: wrong output: {r}")),
                    Err(e) => errors.push(format!("{sid}: {e}")),
                }
            }
            (ok, errors)
        })
    }))
    .await;
    out.wall = t0.elapsed();
    for r in per_session {
        match r {
            Ok((ok, errors)) => {
                out.ok.extend(ok);
                out.errors.extend(errors);
            }
            Err(e) => out.errors.push(format!("client task: {e}")),
        }
    }
    for i in 0..sessions {
        let _ = svc.try_delete(&format!("load-{i}")).await;
    }
    out
}
