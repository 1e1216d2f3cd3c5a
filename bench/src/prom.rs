//! The Prometheus text exposition as the bench reads it: sums of counters and gauges over the
//! series whose labels match, histograms as cumulative buckets, and the difference of two
//! scrapes (what happened between them).

/// One sample line: metric name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn matches(&self, filter: &[(&str, &str)]) -> bool {
        filter.iter().all(|(k, v)| self.label(k) == Some(v))
    }
}

/// The samples of one or more scrapes (comments and malformed lines are skipped).
#[derive(Debug, Clone, Default)]
pub struct Scrape(pub Vec<Sample>);

/// `name{a="x",b="y"} value [timestamp]`; `None` for comments and lines it cannot read.
fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, rest) = match line.find(['{', ' ']) {
        Some(i) => line.split_at(i),
        None => return None,
    };
    let mut labels = Vec::new();
    let rest = if let Some(mut r) = rest.strip_prefix('{') {
        loop {
            r = r.trim_start_matches([',', ' ']);
            if let Some(after) = r.strip_prefix('}') {
                break after;
            }
            let (key, after) = r.split_once("=\"")?;
            // The value ends at the first quote not escaped by a backslash.
            let mut value = String::new();
            let mut chars = after.char_indices();
            let end = loop {
                let (i, c) = chars.next()?;
                match c {
                    '\\' => {
                        let (_, e) = chars.next()?;
                        value.push(match e {
                            'n' => '\n',
                            other => other,
                        });
                    }
                    '"' => break i,
                    c => value.push(c),
                }
            };
            labels.push((key.trim().to_owned(), value));
            r = &after[end + 1..];
        }
    } else {
        rest
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

impl Scrape {
    pub fn parse(text: &str) -> Scrape {
        Scrape(text.lines().filter_map(parse_line).collect())
    }

    /// Several scrapes as one (e.g. every replica's): sums and histograms add up.
    pub fn merge(texts: &[String]) -> Scrape {
        Scrape(
            texts
                .iter()
                .flat_map(|t| t.lines().filter_map(parse_line))
                .collect(),
        )
    }

    /// The sum of every `name` series whose labels include `filter`.
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.0
            .iter()
            .filter(|s| s.name == name && s.matches(filter))
            .map(|s| s.value)
            .sum()
    }

    /// The series of `name` matching `filter`, each with its value.
    pub fn series<'a>(
        &'a self,
        name: &'a str,
        filter: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.0
            .iter()
            .filter(move |s| s.name == name && s.matches(filter))
    }

    /// Histogram `name`'s cumulative buckets over the series matching `filter`, summed.
    pub fn histogram(&self, name: &str, filter: &[(&str, &str)]) -> Buckets {
        let bucket = format!("{name}_bucket");
        let mut out: Vec<(f64, f64)> = Vec::new();
        for s in self.series(&bucket, filter) {
            let Some(le) = s.label("le").and_then(|v| match v {
                "+Inf" => Some(f64::INFINITY),
                v => v.parse().ok(),
            }) else {
                continue;
            };
            match out.iter_mut().find(|(b, _)| *b == le) {
                Some((_, c)) => *c += s.value,
                None => out.push((le, s.value)),
            }
        }
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        Buckets(out)
    }
}

/// Cumulative histogram buckets: (upper bound, observations at or below it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Buckets(pub Vec<(f64, f64)>);

/// Median and p99 read off a histogram: the upper bound of the bucket each falls in (so
/// "at most").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantiles {
    pub n: u64,
    pub median: f64,
    pub p99: f64,
}

impl Buckets {
    /// What was observed after `earlier` (a scrape of the same process before this one).
    pub fn since(&self, earlier: &Buckets) -> Buckets {
        Buckets(
            self.0
                .iter()
                .map(|(le, c)| {
                    let before = earlier
                        .0
                        .iter()
                        .find(|(b, _)| b == le)
                        .map_or(0.0, |(_, c)| *c);
                    (*le, (c - before).max(0.0))
                })
                .collect(),
        )
    }

    pub fn count(&self) -> u64 {
        self.0.last().map_or(0, |(_, c)| *c as u64)
    }

    /// `None` without observations.
    pub fn quantiles(&self) -> Option<Quantiles> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        // Buckets are cumulative: the first whose count reaches the rank holds the quantile.
        let at = |q: f64| {
            let rank = (q * n as f64).ceil().max(1.0);
            self.0
                .iter()
                .find(|(_, c)| *c >= rank)
                .map_or(f64::INFINITY, |(le, _)| *le)
        };
        Some(Quantiles {
            n,
            median: at(0.5),
            p99: at(0.99),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const APISERVER: &str = r#"# HELP apiserver_request_total [STABLE] Counter of apiserver requests
# TYPE apiserver_request_total counter
apiserver_request_total{code="201",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="POST",version="v1"} 12
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="status",verb="PATCH",version="v1"} 30
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="PATCH",version="v1"} 5
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="namespace",subresource="",verb="WATCH",version="v1"} 3
weird{msg="a \"quoted\", comma"} 1e3
op_seconds_bucket{le="0.001"} 1
op_seconds_bucket{le="0.002"} 4
op_seconds_bucket{le="+Inf"} 5
"#;

    #[test]
    fn sums_filter_on_labels_and_read_escaped_values() {
        let s = Scrape::parse(APISERVER);
        assert_eq!(
            s.sum("apiserver_request_total", &[("resource", "pods")]),
            47.0
        );
        assert_eq!(
            s.sum(
                "apiserver_request_total",
                &[("resource", "pods"), ("subresource", "")]
            ),
            17.0
        );
        assert_eq!(
            s.sum("apiserver_longrunning_requests", &[("verb", "WATCH")]),
            3.0
        );
        assert_eq!(s.sum("weird", &[("msg", "a \"quoted\", comma")]), 1000.0);
        assert_eq!(s.sum("absent", &[]), 0.0);
        assert_eq!(Scrape::parse("garbage{ 12\n{}\n").0, vec![]);
    }

    #[test]
    fn histogram_differences_give_what_happened_between_scrapes() {
        let before = Scrape::parse(APISERVER).histogram("op_seconds", &[]);
        let after = Scrape::parse(
            "op_seconds_bucket{le=\"0.001\"} 1\nop_seconds_bucket{le=\"0.002\"} 4\nop_seconds_bucket{le=\"+Inf\"} 105\n",
        )
        .histogram("op_seconds", &[]);
        let q = after.since(&before).quantiles().expect("100 new");
        assert_eq!(q.n, 100);
        assert!(q.median.is_infinite() && q.p99.is_infinite());
        let q = before.quantiles().expect("5");
        assert_eq!((q.n, q.median, q.p99), (5, 0.002, f64::INFINITY));
        assert_eq!(before.since(&before).quantiles(), None);
    }
}
