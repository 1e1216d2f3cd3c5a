//! Prometheus metrics of the operator (served on `/metrics`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

pub struct Metrics {
    registry: Registry,
    /// Reconciles by result (`ok`, or an error label).
    pub reconciles: Family<Labels, Counter>,
    pub reconcile_duration: Histogram,
    /// API writes by kind and verb: the steady-state figure (should stay flat).
    pub writes: Family<Labels, Counter>,
    /// Pool pods created / deleted (by reason).
    pub pool_created: Counter,
    pub pool_deleted: Family<Labels, Counter>,
    /// Assigned sandboxes collected (idle, stale key).
    pub sessions_collected: Family<Labels, Counter>,
    pub leader: Gauge,
    ready: AtomicBool,
    count: std::sync::atomic::AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("cli_mcp_operator");
        let reconciles = Family::<Labels, Counter>::default();
        registry.register("reconciles", "Reconciles by result", reconciles.clone());
        let reconcile_duration = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "reconcile_duration_seconds",
            "Duration of one reconcile",
            reconcile_duration.clone(),
        );
        let writes = Family::<Labels, Counter>::default();
        registry.register(
            "api_writes",
            "Write requests sent to the Kubernetes API, by kind and verb",
            writes.clone(),
        );
        let pool_created = Counter::default();
        registry.register(
            "pool_pods_created",
            "Warm pool pods created",
            pool_created.clone(),
        );
        let pool_deleted = Family::<Labels, Counter>::default();
        registry.register(
            "pool_pods_deleted",
            "Warm pool pods deleted, by reason",
            pool_deleted.clone(),
        );
        let sessions_collected = Family::<Labels, Counter>::default();
        registry.register(
            "sessions_collected",
            "Assigned sandboxes deleted by the operator, by reason",
            sessions_collected.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this process holds the leader lease",
            leader.clone(),
        );
        Self {
            registry,
            reconciles,
            reconcile_duration,
            writes,
            pool_created,
            pool_deleted,
            sessions_collected,
            leader,
            ready: AtomicBool::new(false),
            count: std::sync::atomic::AtomicU64::new(0),
        }
    }

    pub fn reconciled(&self, result: &str, took: Duration) {
        self.reconciles
            .get_or_create(&vec![("result".to_owned(), result.to_owned())])
            .inc();
        self.reconcile_duration.observe(took.as_secs_f64());
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn api_write(&self, kind: &str, verb: &str) {
        self.writes
            .get_or_create(&vec![
                ("kind".to_owned(), kind.to_owned()),
                ("verb".to_owned(), verb.to_owned()),
            ])
            .inc();
    }

    pub fn pool_deleted(&self, reason: &str) {
        self.pool_deleted
            .get_or_create(&vec![("reason".to_owned(), reason.to_owned())])
            .inc();
    }

    pub fn session_collected(&self, reason: &str) {
        self.sessions_collected
            .get_or_create(&vec![("reason".to_owned(), reason.to_owned())])
            .inc();
    }

    /// Total reconciles so far (all results).
    pub fn reconcile_count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_encode() {
        let m = Metrics::new();
        m.reconciled("ok", Duration::from_millis(3));
        m.api_write("Pod", "create");
        let text = m.encode();
        assert!(
            text.contains("cli_mcp_operator_reconciles_total{result=\"ok\"} 1"),
            "{text}"
        );
        assert!(text.contains("cli_mcp_operator_api_writes_total{kind=\"Pod\",verb=\"create\"} 1"));
        assert_eq!(m.reconcile_count(), 1);
    }
}
