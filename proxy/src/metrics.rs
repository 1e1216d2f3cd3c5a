//! Prometheus metrics. Labels take a small fixed set of values: never a domain a sandbox chose,
//! a path, or anything from a header.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `forwarded`, `refused` or `upstream_error`.
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// A [`crate::refusal::Refusal`] reason.
    pub reason: &'static str,
}

pub struct Metrics {
    pub registry: Registry,
    /// Requests inside tunnels, by outcome.
    pub requests: Family<OutcomeLabels, Counter>,
    /// Refused connections, tunnels and requests, by reason.
    pub refusals: Family<ReasonLabels, Counter>,
    /// Client connections open (before and after CONNECT).
    pub connections: Gauge,
    /// Tunnels open (CONNECT accepted, TLS terminated or being terminated).
    pub tunnels: Gauge,
    /// Audit lines written, and those that could not be.
    pub audit_lines: Counter,
    pub audit_failures: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("cli_mcp_proxy");
        let requests = Family::<OutcomeLabels, Counter>::default();
        let refusals = Family::<ReasonLabels, Counter>::default();
        let connections = Gauge::default();
        let tunnels = Gauge::default();
        registry.register(
            "requests",
            "Requests inside tunnels, by outcome",
            requests.clone(),
        );
        registry.register(
            "refusals",
            "Refused connections, tunnels and requests, by reason",
            refusals.clone(),
        );
        registry.register(
            "connections",
            "Client connections open",
            connections.clone(),
        );
        registry.register("tunnels", "CONNECT tunnels open", tunnels.clone());
        let audit_lines = Counter::default();
        let audit_failures = Counter::default();
        registry.register("audit_lines", "Audit lines written", audit_lines.clone());
        registry.register(
            "audit_failures",
            "Audit lines that could not be written",
            audit_failures.clone(),
        );
        Self {
            registry,
            requests,
            refusals,
            connections,
            tunnels,
            audit_lines,
            audit_failures,
        }
    }
}

impl Metrics {
    pub fn refused(&self, reason: &'static str) {
        self.refusals.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub fn request(&self, outcome: &'static str) {
        self.requests
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Decrements a gauge when dropped, so every exit path of a connection or tunnel counts.
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    pub fn new(g: &Gauge) -> Self {
        g.inc();
        Self(g.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
