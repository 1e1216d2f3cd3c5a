//! The exposition formats of `/metrics`, and which one a scraper asked for.

/// The exposition formats of `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text: the default.
    OpenMetrics,
    /// The Prometheus text format 0.0.4, for scrapers that ask for `text/plain`.
    PrometheusText,
}

impl Format {
    /// Picks the format from an `Accept` header: Prometheus text when the client rates
    /// `text/plain` above OpenMetrics (`*/*` and `application/*` count for OpenMetrics),
    /// else OpenMetrics. A Prometheus server offers both with OpenMetrics first, and gets
    /// OpenMetrics; one set to `scrape_protocols: [PrometheusText0.0.4]` gets the text format.
    pub fn negotiate(accept: Option<&str>) -> Self {
        let (mut openmetrics, mut text) = (0.0_f64, 0.0_f64);
        for range in accept.unwrap_or("").split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.strip_prefix("q="))
                .find_map(|q| q.trim().parse::<f64>().ok())
                .unwrap_or(1.0);
            match media.as_str() {
                "application/openmetrics-text" | "application/*" | "*/*" => {
                    openmetrics = openmetrics.max(q)
                }
                "text/plain" | "text/*" => text = text.max(q),
                _ => {}
            }
        }
        if text > openmetrics {
            Self::PrometheusText
        } else {
            Self::OpenMetrics
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Self::PrometheusText => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{ErrorKind, Metrics};

    #[test]
    fn the_format_follows_the_scrapers_accept_header() {
        use Format::*;
        for (accept, want) in [
            (None, OpenMetrics),
            (Some("*/*"), OpenMetrics),
            (Some("text/plain"), PrometheusText),
            (Some("text/plain;version=0.0.4"), PrometheusText),
            (Some("application/openmetrics-text;version=1.0.0"), OpenMetrics),
            // What Prometheus 3 sends by default.
            (Some("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"), OpenMetrics),
            (Some("text/plain;version=0.0.4;q=0.9,*/*;q=0.1"), PrometheusText),
            (Some("application/json"), OpenMetrics),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
        let m = Metrics::new();
        m.error(ErrorKind::Busy);
        let text = m.encode_as(PrometheusText);
        assert!(
            text.contains("# TYPE cli_mcp_errors_total counter"),
            "{text}"
        );
        assert!(
            text.contains("cli_mcp_errors_total{kind=\"busy\"} 1"),
            "{text}"
        );
        assert!(text.contains("cli_mcp_build_info{version="), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
        assert!(m.encode().ends_with("# EOF\n"));
    }
}
