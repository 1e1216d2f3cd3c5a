//! The server's own breakdown of its session starts: each "session sandbox started" line of
//! its log carries `took_ms` and `steps=name=<start>+<took>,…` (milliseconds from the start
//! of the call; see the server's `sessions/kubernetes/steps.rs`). This turns the lines of one
//! launch kind into a table: per step, in how many starts it ran, when it began and how long
//! it took (medians, and the slowest).

use std::collections::BTreeMap;

/// One start as its log line tells it.
#[derive(Debug, Clone, PartialEq)]
pub struct Start {
    /// The session it started (`session=`), to join it with what the bench saw of it.
    pub session: Option<String>,
    pub launch: String,
    pub took_ms: f64,
    /// `(step, start ms, took ms)` in the order the steps ended.
    pub steps: Vec<(String, f64, f64)>,
}

/// The start a log line reports, if it is a "session sandbox started" line with steps: a
/// plain line (the server's default) or a JSON one (`--log-json`, as the operator runs it),
/// as the process kubelet keeps it or behind the CRI's `<time> <stream> <tag> ` prefix (the
/// real node's container logs).
pub fn parse_line(line: &str) -> Option<Start> {
    let line = cri_payload(line);
    if line.trim_start().starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        if v["message"] != "session sandbox started" {
            return None;
        }
        let took_ms = match &v["took_ms"] {
            serde_json::Value::String(s) => s.parse().ok()?,
            n => n.as_f64()?,
        };
        let session = v["session"].as_str().map(str::to_owned);
        return start(
            session,
            v["launch"].as_str()?,
            took_ms,
            v["steps"].as_str()?,
        );
    }
    let rest = &line[line.find("session sandbox started")?..];
    let field = |name: &str| -> Option<&str> {
        let at = rest.find(&format!(" {name}="))? + name.len() + 2;
        let v = &rest[at..];
        Some(match v.strip_prefix('"') {
            Some(q) => &q[..q.find('"')?],
            None => v.split(' ').next().unwrap_or_default(),
        })
    };
    start(
        field("session").map(str::to_owned),
        field("launch")?,
        field("took_ms")?.parse().ok()?,
        field("steps")?,
    )
}

/// A CRI log line's payload (`2026-12-07T03:25:57.45Z stderr F <payload>`), or the line.
fn cri_payload(line: &str) -> &str {
    let mut w = line.splitn(4, ' ');
    match (w.next(), w.next(), w.next(), w.next()) {
        (Some(_), Some("stdout" | "stderr"), Some("F" | "P"), Some(payload)) => payload,
        _ => line,
    }
}

fn start(session: Option<String>, launch: &str, took_ms: f64, steps: &str) -> Option<Start> {
    let steps = steps
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            let (name, times) = s.split_once('=')?;
            let (start, took) = times.split_once('+')?;
            Some((name.to_owned(), start.parse().ok()?, took.parse().ok()?))
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Start {
        session,
        launch: launch.to_owned(),
        took_ms,
        steps,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The table of the starts of `launch` in `log` (markdown), or `None` when it has none.
pub fn table(log: &str, launch: &str) -> Option<String> {
    let starts: Vec<Start> = log
        .lines()
        .filter_map(parse_line)
        .filter(|s| s.launch == launch)
        .collect();
    if starts.is_empty() {
        return None;
    }
    let mut by_step: BTreeMap<&str, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for s in &starts {
        for (name, start, took) in &s.steps {
            let e = by_step.entry(name.as_str()).or_default();
            e.0.push(*start);
            e.1.push(*took);
        }
    }
    let mut rows: Vec<(f64, String)> = by_step
        .into_iter()
        .map(|(name, (starts_at, took))| {
            let n = took.len();
            let max = took.iter().copied().fold(0.0, f64::max);
            let at = median(starts_at);
            let row = format!(
                "| {name} | {n} | {at:.1} ms | {:.1} ms | {max:.1} ms |",
                median(took)
            );
            (at, row)
        })
        .collect();
    rows.sort_by(|a, b| a.0.total_cmp(&b.0));
    let took: Vec<f64> = starts.iter().map(|s| s.took_ms).collect();
    let max = took.iter().copied().fold(0.0, f64::max);
    let mut out = format!(
        "| server's steps of a {launch} start (n={}; took_ms median {:.0}, max {max:.0}) | ran in | starts at (median) | takes (median) | slowest |\n|---|---|---|---|---|\n",
        starts.len(),
        median(took),
    );
    for (_, r) in rows {
        out.push_str(&r);
        out.push('\n');
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str = "2026-12-02T10:00:00.000000Z  INFO cli_mcp_server::sessions::kubernetes: \
        session sandbox started session=warm-0 pod=cli-mcp-bench-p-x launch=\"warm\" took_ms=12 \
        steps=lookup=0.0+2.1,slots=0.1+3.0,claim=3.2+2.5";

    #[test]
    fn a_start_line_is_parsed_and_other_lines_are_not() {
        assert_eq!(
            parse_line(LINE),
            Some(Start {
                session: Some("warm-0".into()),
                launch: "warm".into(),
                took_ms: 12.0,
                steps: vec![
                    ("lookup".into(), 0.0, 2.1),
                    ("slots".into(), 0.1, 3.0),
                    ("claim".into(), 3.2, 2.5)
                ],
            })
        );
        let json = r#"{"timestamp":"2026-12-02T16:38:52.235802Z","level":"INFO","message":"session sandbox started","session":"warm-0","launch":"warm","took_ms":12,"steps":"lookup=0.0+2.1,slots=0.1+3.0,claim=3.2+2.5","target":"cli_mcp_server::sessions::kubernetes"}"#;
        assert_eq!(
            parse_line(json),
            parse_line(LINE),
            "the server's --log-json line"
        );
        assert_eq!(
            parse_line(&format!("2026-12-02T16:38:52.235900000Z stderr F {json}")),
            parse_line(LINE),
            "the same in the real node's CRI log format"
        );
        assert_eq!(
            parse_line(r#"{"message":"assigned","launch":"warm"}"#),
            None
        );
        assert_eq!(parse_line("INFO assigned session=x"), None);
        assert_eq!(
            parse_line("session sandbox started launch=warm took_ms=3"),
            None,
            "a server without steps"
        );
    }

    #[test]
    fn the_table_orders_steps_by_when_they_start() {
        let t = table(&format!("{LINE}\n{LINE}\nnoise"), "warm").expect("a table");
        let steps: Vec<&str> = t
            .lines()
            .skip(2)
            .map(|l| l.split(" | ").next().unwrap_or_default())
            .collect();
        assert_eq!(steps, ["| lookup", "| slots", "| claim"]);
        assert!(t.contains("n=2"), "{t}");
        assert!(table(LINE, "cold").is_none());
    }
}
