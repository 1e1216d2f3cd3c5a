//! Sustained arrivals: new sessions at a steady rate for a while against a warm pool sized
//! by demand (`spec.sandbox.warmPool`), as an alert storm's investigations arrive. Each
//! session runs `true` (its first answer is what is timed) and stays, as an investigation
//! does, until the arrivals end; so every session holds a pod, and the node must start one
//! pod per arrival. What is printed: how many were served warm, their first answers, the
//! sizes the operator chose on the way (its `WarmPoolResized` Events), and how many sandbox
//! pods a second the node got Ready meanwhile (what bounds the rate it can serve warm).

use std::time::{Duration, Instant};

use anyhow::Context;
use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_e2e::journey::Env;
use k8s_openapi::api::events::v1::Event;
use kube::api::ListParams;
use serde_json::json;
use tokio::task::JoinSet;

use crate::figures::{ms, stats};

const NAME: &str = "arrive";
/// The pool's bounds: `min` covers the first seconds, before the demand is seen, of
/// `MIN_SECONDS` of arrivals; `MAX` stays under what the node runs beside the sessions.
const MIN_SECONDS: u32 = 2;
const MAX: u32 = 150;
/// Pods the real node runs besides the control plane's and the server's (`maxPods` 250).
const NODE_PODS: u32 = 240;

/// What one arrival got.
struct Arrival {
    first_answer: Duration,
    /// `new_sandbox` of the answer: `warm` or `cold`.
    launch: String,
}

pub(super) struct Arrivals {
    rate: u32,
    secs: u32,
    min: u32,
    answered: Vec<Arrival>,
    errors: Vec<String>,
    /// The targets of the operator's `WarmPoolResized` Events (from, to), oldest first.
    resizes: Vec<(i32, i32)>,
    /// The pool's `max`: what the node has room for beside the sessions.
    max: u32,
    /// Sandbox pods of the instance that became Ready while the arrivals went on, per second.
    node_start_rate: Option<f64>,
    /// The host's CPU time busy (all processes: control plane, node, server, bench) and the
    /// time available, over the arrivals, in CPU-seconds.
    host_cpu: Option<(f64, f64)>,
    /// status.warmPool at the end of the arrivals: desired, and the last minute's sessions.
    last_status: Option<(i32, Option<i32>)>,
}

/// `rate` new sessions a second for `secs` seconds on instance `arrive` (runtime: the node's
/// default).
pub(super) async fn measure(env: &Env, rate: u32, secs: u32) -> anyhow::Result<Arrivals> {
    let sessions = rate * secs;
    let min = (rate * MIN_SECONDS).clamp(1, MAX);
    let max = MAX.min(NODE_PODS.saturating_sub(sessions));
    if max < min {
        anyhow::bail!(
            "--arrivals {rate} for {secs} s: {sessions} sessions and a pool of at least {min} do not fit the real node's {NODE_PODS} pods; lower --arrivals or --arrivals-secs"
        );
    }
    env.dummy_kubeconfig(NAME).await;
    let mut cr = env.cr(NAME, 0);
    if let Some(sandbox) = cr["spec"]["sandbox"].as_object_mut() {
        sandbox.remove("warmPoolSize");
    }
    cr["spec"]["sandbox"]["warmPool"] = json!({"min": min, "max": max, "scaleDownDelay": "5m"});
    cr["spec"]["sandbox"]["maxSessions"] = json!(10_000);
    cr["spec"]["server"]["maxSessionsPerClient"] = json!(10_000);
    cr["spec"]["server"]["newSessionsPerMinutePerClient"] = json!(10_000);
    cr["spec"]["replicas"] = json!(1);
    env.apply_cr(&cr).await;
    env.wait_ready(NAME).await;
    super::converge_pool(env, NAME, i32::try_from(min)?).await?;
    let svc = env.client(NAME).await;
    let began = k8s_openapi::jiff::Timestamp::now();
    let cpu_before = host_cpu();
    let mut tasks = JoinSet::new();
    let apart = Duration::from_secs(1) / rate.max(1);
    let mut tick = tokio::time::interval(apart);
    for i in 0..rate * secs {
        tick.tick().await;
        let svc = svc.clone();
        tasks.spawn(async move {
            let sid = format!("arrival-{i}");
            let t = Instant::now();
            let r = svc.bash_ok(&sid, "true").await;
            let first_answer = t.elapsed();
            r.map(|v| Arrival {
                first_answer,
                launch: v["structuredContent"]["new_sandbox"]
                    .as_str()
                    .unwrap_or("none")
                    .to_owned(),
            })
            .map_err(|e| e.to_string())
        });
    }
    let mut out = Arrivals {
        rate,
        secs,
        min,
        answered: Vec::new(),
        errors: Vec::new(),
        resizes: Vec::new(),
        max,
        node_start_rate: None,
        host_cpu: None,
        last_status: None,
    };
    while let Some(joined) = tasks.join_next().await {
        match joined.context("an arrival's task")? {
            Ok(a) => out.answered.push(a),
            Err(e) => out.errors.push(e),
        }
    }
    let instances = env.api::<CliMcpInstance>();
    out.last_status = instances
        .get(NAME)
        .await
        .ok()
        .and_then(|o| o.status)
        .map(|s| (s.warm_pool.desired, s.warm_pool.sessions_last_minute));
    out.resizes = resizes(env).await;
    let ended = k8s_openapi::jiff::Timestamp::now();
    out.node_start_rate = started_per_second(env, began, ended).await;
    out.host_cpu = cpu_before
        .zip(host_cpu())
        .map(|((b0, t0), (b1, t1))| (b1 - b0, t1 - t0));
    drop(svc);
    instances
        .delete(NAME, &Default::default())
        .await
        .context("deleting instance arrive")?;
    super::no_pods_of(env, NAME).await?;
    Ok(out)
}

/// How many sandbox pods of the instance became Ready between `from` and `to`, per second
/// (their Ready condition's `lastTransitionTime`, whole seconds).
async fn started_per_second(
    env: &Env,
    from: k8s_openapi::jiff::Timestamp,
    to: k8s_openapi::jiff::Timestamp,
) -> Option<f64> {
    let pods = env
        .list::<k8s_openapi::api::core::v1::Pod>(&cli_mcp_e2e::journey::sandbox_selector(NAME))
        .await;
    let ready = pods
        .iter()
        .filter_map(|p| p.status.as_ref()?.conditions.as_ref())
        .filter_map(|cs| cs.iter().find(|c| c.type_ == "Ready" && c.status == "True"))
        .filter_map(|c| c.last_transition_time.as_ref())
        .filter(|t| t.0 >= from && t.0 <= to)
        .count();
    let secs = to.duration_since(from).as_secs_f64();
    (secs > 0.0).then(|| ready as f64 / secs)
}

/// The host's CPU time so far, busy and in all, in CPU-seconds (`/proc/stat`'s first line;
/// idle and iowait are not busy).
fn host_cpu() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<f64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let all: f64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    // USER_HZ is 100 on Linux.
    Some(((all - idle) / 100.0, all / 100.0))
}

/// The (from, to) of every `WarmPoolResized` Event of the namespace, oldest first.
async fn resizes(env: &Env) -> Vec<(i32, i32)> {
    let Ok(list) = env.api::<Event>().list(&ListParams::default()).await else {
        return Vec::new();
    };
    let mut events: Vec<Event> = list
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("WarmPoolResized"))
        .collect();
    events.sort_by_key(|e| e.metadata.creation_timestamp.clone().map(|t| t.0));
    events
        .iter()
        .filter_map(|e| target_step(e.note.as_deref()?))
        .collect()
}

/// The sizes an Event's note `warm pool target A -> B (...)` names.
fn target_step(note: &str) -> Option<(i32, i32)> {
    let rest = note.strip_prefix("warm pool target ")?;
    let (from, rest) = rest.split_once(" -> ")?;
    Some((
        from.parse().ok()?,
        rest.split_whitespace().next()?.parse().ok()?,
    ))
}

impl Arrivals {
    pub(super) fn print(&self) {
        let sent = self.rate * self.secs;
        let warm: Vec<Duration> = self
            .answered
            .iter()
            .filter(|a| a.launch == "warm")
            .map(|a| a.first_answer)
            .collect();
        let all: Vec<Duration> = self.answered.iter().map(|a| a.first_answer).collect();
        println!();
        println!(
            "| sustained arrivals: {} new sessions/s for {} s, `warmPool: {{min: {}, max: {}}}`, each running `true` and kept | value |",
            self.rate, self.secs, self.min, self.max
        );
        println!("|---|---|");
        println!(
            "| answered / sent (errors) | {} / {sent} ({}) |",
            self.answered.len(),
            self.errors.len()
        );
        let pct = 100.0 * warm.len() as f64 / f64::from(sent.max(1));
        println!("| served warm | {} ({pct:.1} %) |", warm.len());
        if !all.is_empty() {
            let s = stats(all);
            println!(
                "| first answer, all: median / p99 | {} / {} |",
                ms(s.median),
                ms(s.p99)
            );
        }
        if !warm.is_empty() {
            let s = stats(warm);
            println!(
                "| first answer, warm: median / p99 | {} / {} |",
                ms(s.median),
                ms(s.p99)
            );
        }
        let steps: Vec<String> = self.resizes.iter().map(|(_, to)| to.to_string()).collect();
        println!(
            "| pool targets the operator chose (Events), from {} | {} |",
            self.min,
            if steps.is_empty() {
                "none".into()
            } else {
                steps.join(" → ")
            }
        );
        if let Some(r) = self.node_start_rate {
            println!("| sandbox pods the node got Ready meanwhile, per second | {r:.1} |");
        }
        if let Some((busy, all)) = self.host_cpu {
            let per_pod = self
                .node_start_rate
                .filter(|r| *r > 0.0)
                .map(|r| busy / (r * all / num_cpus()));
            println!(
                "| the host's CPU meanwhile: busy / available (per pod made Ready) | {busy:.0} / {all:.0} CPU-s ({}) |",
                per_pod.map_or("–".into(), |c| format!("{c:.2} CPU-s"))
            );
        }
        if let Some((desired, last_minute)) = self.last_status {
            println!(
                "| status at the end: warmPool.desired, sessionsLastMinute | {desired}, {} |",
                last_minute.map_or("–".into(), |n| n.to_string())
            );
        }
        crate::figures::first_errors(&self.errors);
    }
}

/// The host's CPUs (what `/proc/stat`'s first line sums over).
fn num_cpus() -> f64 {
    std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_events_note_gives_its_sizes() {
        assert_eq!(
            target_step("warm pool target 20 -> 64 (bounds 20..150): 300 new sessions"),
            Some((20, 64))
        );
        assert_eq!(target_step("something else"), None);
    }
}
