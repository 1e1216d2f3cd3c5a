//! Readiness of a replica as seen from the API's answers to readiness probes.

use std::time::{Duration, Instant};

/// Readiness as seen from the API's answers to readiness probes.
///
/// Not ready until the API has answered once (the replica can do nothing without it). After
/// that a replica serves existing sessions from its route cache and cached auth decisions,
/// so an outage shorter than [`API_OUTAGE_GRACE`] keeps it ready: otherwise an API blip takes
/// every replica out of the Service at once, for nothing. New sessions meanwhile get a clear
/// "retry shortly" error. A longer outage (this replica's own path to the API broken, say)
/// makes it unready, so callers go to replicas that can still start sessions.
#[derive(Debug, Default)]
pub struct ApiHealth {
    reached: bool,
    down_since: Option<Instant>,
}

/// How long readiness survives an API outage once the API has answered.
pub const API_OUTAGE_GRACE: Duration = Duration::from_secs(120);

impl ApiHealth {
    pub fn observe(&mut self, probe: Result<(), String>, now: Instant) -> Result<(), String> {
        match probe {
            Ok(()) => {
                self.reached = true;
                self.down_since = None;
                Ok(())
            }
            Err(e) if !self.reached => Err(e),
            Err(e) => {
                let since = *self.down_since.get_or_insert(now);
                let down = now.saturating_duration_since(since);
                if down < API_OUTAGE_GRACE {
                    Ok(())
                } else {
                    Err(format!("{e} (for {}s)", down.as_secs()))
                }
            }
        }
    }
}

/// One readiness probe of the API: its version endpoint, bounded.
pub(super) async fn probe(client: &kube::Client) -> Result<(), String> {
    match tokio::time::timeout(Duration::from_secs(3), client.apiserver_version()).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("the Kubernetes API is not reachable: {e}")),
        Err(_) => Err("the Kubernetes API did not answer within 3s".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_survives_a_short_api_outage_but_not_a_long_one() {
        let t0 = Instant::now();
        let down = || Err::<(), String>("the Kubernetes API is not reachable: refused".into());
        let mut h = ApiHealth::default();
        assert!(h.observe(down(), t0).is_err(), "never reached: not ready");
        assert!(h.observe(Ok(()), t0).is_ok());
        assert!(h.observe(down(), t0).is_ok(), "a blip keeps it ready");
        let later = t0 + API_OUTAGE_GRACE - Duration::from_secs(1);
        assert!(h.observe(down(), later).is_ok());
        let e = h
            .observe(down(), t0 + API_OUTAGE_GRACE)
            .expect_err("a long outage makes it unready");
        assert!(e.contains("not reachable") && e.contains("for 120s"), "{e}");
        assert!(
            h.observe(Ok(()), t0 + API_OUTAGE_GRACE).is_ok(),
            "recovers at once"
        );
        assert!(
            h.observe(down(), t0 + API_OUTAGE_GRACE * 2).is_ok(),
            "a new outage starts a new grace"
        );
    }
}
