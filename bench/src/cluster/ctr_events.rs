//! containerd's own account of the real node's pods: `ctr events` recorded while cold starts
//! run (each container record's creation, its task's creation and start, stamped by
//! containerd with the host's wall clock, which the bench's `SystemTime` reads too), and the
//! containers of a pod (its sandbox and its app containers) by the CRI's pod-uid label.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

/// The CRI plugin's containerd namespace.
const K8S_NS: &str = "k8s.io";

/// One event of a container: when, its topic (`/containers/create`, `/tasks/create`,
/// `/tasks/start`, …) and the container's id.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Event {
    pub(super) at: SystemTime,
    pub(super) topic: String,
    pub(super) id: String,
}

/// A running `ctr events`, and the task collecting its lines.
pub(super) struct Recorder {
    child: Child,
    lines: JoinHandle<Vec<Event>>,
}

impl Recorder {
    /// Subscribes to the events of the containerd at `socket`.
    pub(super) async fn start(socket: &Path) -> anyhow::Result<Recorder> {
        let mut child = Command::new("ctr")
            .arg("--address")
            .arg(socket)
            .arg("events")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting `ctr events`")?;
        let stdout = child.stdout.take().context("`ctr events` has no stdout")?;
        let lines = tokio::spawn(async move {
            let mut out = Vec::new();
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                out.extend(parse(&l));
            }
            out
        });
        // The subscription is made after the process starts; what comes before it is lost.
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(Recorder { child, lines })
    }

    /// Ends the subscription; the events of containers it saw.
    pub(super) async fn stop(mut self) -> Vec<Event> {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
        self.lines.await.unwrap_or_default()
    }
}

/// An event line of `ctr events` (containerd 1.6: Go's `time.Time` as its `String()` gives
/// it, the namespace, the topic, the event as JSON), if it is one of a container in the
/// CRI's namespace.
fn parse(line: &str) -> Option<Event> {
    let mut w = line.splitn(6, ' ');
    let (date, time, offset, _zone) = (w.next()?, w.next()?, w.next()?, w.next()?);
    if w.next()? != K8S_NS {
        return None;
    }
    let (topic, json) = w.next()?.split_once(' ')?;
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let id = v["container_id"].as_str().or(v["id"].as_str())?;
    Some(Event {
        at: wall_clock(date, time, offset)?,
        topic: topic.to_owned(),
        id: id.to_owned(),
    })
}

/// `2026-12-07 03:00:00.123456789 +0000` as a point in time (the fraction may be shorter or
/// absent: Go drops its trailing zeros).
fn wall_clock(date: &str, time: &str, offset: &str) -> Option<SystemTime> {
    let mut d = date.splitn(3, '-').map(str::parse::<i64>);
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.splitn(3, ':').map(str::parse::<i64>);
    let (h, min, s) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let nanos: u32 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<9}").get(..9)?.parse().ok()?
    };
    let sign = match offset.as_bytes().first()? {
        b'+' => 1,
        b'-' => -1,
        _ => return None,
    };
    let off = offset.get(1..)?;
    let off_s = sign
        * (off.get(..2)?.parse::<i64>().ok()? * 3600 + off.get(2..4)?.parse::<i64>().ok()? * 60);
    let secs = days_from_civil(y, m, day) * 86_400 + h * 3600 + min * 60 + s - off_s;
    let secs = u64::try_from(secs).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::new(secs, nanos))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The ids of pod `uid`'s containers in the containerd at `socket`: its sandbox's and its
/// app containers'.
pub(super) async fn pod_containers(socket: &Path, uid: &str) -> anyhow::Result<Vec<String>> {
    let out = Command::new("ctr")
        .arg("--address")
        .arg(socket)
        .args(["--namespace", K8S_NS, "containers", "ls", "--quiet"])
        .arg(format!("labels.\"io.kubernetes.pod.uid\"=={uid}"))
        .output()
        .await
        .context("running `ctr containers ls`")?;
    anyhow::ensure!(
        out.status.success(),
        "ctr containers ls: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_line_is_read_with_containerds_timestamp() {
        let l = r#"2026-12-07 03:00:01.5 +0000 UTC k8s.io /tasks/start {"container_id":"abc","pid":42}"#;
        let e = parse(l).expect("an event");
        assert_eq!(e.topic, "/tasks/start");
        assert_eq!(e.id, "abc");
        let since =
            e.at.duration_since(SystemTime::UNIX_EPOCH)
                .expect("after 1970");
        assert_eq!(since, Duration::new(1_796_612_401, 500_000_000));
        let create = r#"2026-12-07 04:00:01.000000123 +0100 CET k8s.io /containers/create {"id":"def","image":"x","runtime":{"name":"io.containerd.runsc.v1"}}"#;
        let e = parse(create).expect("an event");
        assert_eq!(e.id, "def");
        let since =
            e.at.duration_since(SystemTime::UNIX_EPOCH)
                .expect("after 1970");
        assert_eq!(since, Duration::new(1_796_612_401, 123));
        assert_eq!(
            parse(&l.replace("k8s.io", "moby")),
            None,
            "another namespace"
        );
        assert_eq!(
            parse("2026-12-07 03:00:01 +0000 UTC k8s.io /snapshot/prepare {\"key\":\"k\"}"),
            None
        );
    }

    #[test]
    fn civil_days_are_counted_from_1970() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2026, 12, 7), 20_794);
    }
}
