//! HTTP from tests and benches: clients (optionally trusting one CA), a plain GET, and
//! sums of samples in Prometheus text (`/metrics`).

use std::time::Duration;

/// The timeout of a [`client`]: longer than any command a test runs.
pub const TIMEOUT: Duration = Duration::from_secs(120);

/// A client builder with no proxy and a [`TIMEOUT`]; with `ca_pem`, that CA as a root (an
/// instance's CA, a test's self-signed one). Callers add the rest (`resolve`, pooling,
/// another timeout).
pub fn client(ca_pem: Option<&str>) -> reqwest::ClientBuilder {
    let b = reqwest::Client::builder().no_proxy().timeout(TIMEOUT);
    match ca_pem {
        Some(pem) => b.add_root_certificate(
            reqwest::Certificate::from_pem(pem.as_bytes()).expect("a CA certificate in PEM"),
        ),
        None => b,
    }
}

/// GET `url`: the status and the body, or `None` without a whole answer.
pub async fn get(http: &reqwest::Client, url: &str) -> Option<(u16, String)> {
    let r = http.get(url).send().await.ok()?;
    let status = r.status().as_u16();
    Some((status, r.text().await.ok()?))
}

/// The sum of the samples of `series` in Prometheus text: a bare metric name takes every
/// label set of that metric, `name{labels}` exactly that one. `None` when no sample matches.
pub fn metric_sum(text: &str, series: &str) -> Option<f64> {
    let labelled = series.contains('{');
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(key, _)| {
            if labelled {
                *key == series
            } else {
                key.split(['{', ' ']).next() == Some(series)
            }
        })
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .fold(None, |sum, v| Some(sum.unwrap_or(0.0) + v))
}

#[cfg(test)]
mod tests {
    use super::metric_sum;

    #[test]
    fn sums_a_metric_or_one_series() {
        let text = "# HELP x_total X.\n# TYPE x_total counter\n\
                    x_total{kind=\"a\"} 2\nx_total{kind=\"b\"} 3\nx_total_more 7\ny 1.5\n";
        assert_eq!(metric_sum(text, "x_total"), Some(5.0));
        assert_eq!(metric_sum(text, "x_total{kind=\"b\"}"), Some(3.0));
        assert_eq!(metric_sum(text, "y"), Some(1.5));
        assert_eq!(metric_sum(text, "z"), None);
        assert_eq!(metric_sum(text, "x_total{kind=\"c\"}"), None);
    }
}
