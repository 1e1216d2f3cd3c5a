//! The API server's own counts, from its `/metrics`: what the cluster wrote between two
//! scrapes, by verb and resource. Shared by the cluster and scale benches.

use anyhow::Context;
use cli_mcp_e2e::testing::TestCluster;

use crate::prom::Scrape;

/// The verbs of `apiserver_request_total` that write.
pub(crate) const WRITE_VERBS: &[&str] = &[
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

/// `GET /metrics` of the cluster's API server.
pub(crate) async fn metrics(c: &TestCluster) -> anyhow::Result<Scrape> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .context("building GET /metrics")?;
    let text = c
        .client
        .request_text(req)
        .await
        .context("GET /metrics of the API server")?;
    Ok(Scrape::parse(&text))
}

/// API writes between two scrapes, by (verb, resource[/subresource]), most first.
pub(crate) fn writes_between(a: &Scrape, b: &Scrape) -> Vec<(String, f64)> {
    let mut by: std::collections::BTreeMap<String, f64> = Default::default();
    for s in b.series("apiserver_request_total", &[]) {
        let verb = s.label("verb").unwrap_or_default();
        if !WRITE_VERBS.contains(&verb) {
            continue;
        }
        let before: f64 =
            a.0.iter()
                .find(|x| x.name == s.name && x.labels == s.labels)
                .map_or(0.0, |x| x.value);
        let d = s.value - before;
        if d <= 0.0 {
            continue;
        }
        let resource = match (s.label("resource"), s.label("subresource")) {
            (Some(r), Some(sub)) if !sub.is_empty() => format!("{r}/{sub}"),
            (Some(r), _) => r.to_owned(),
            _ => "?".into(),
        };
        *by.entry(format!("{verb} {resource}")).or_default() += d;
    }
    let mut v: Vec<_> = by.into_iter().collect();
    v.sort_by(|x, y| y.1.total_cmp(&x.1));
    v
}
