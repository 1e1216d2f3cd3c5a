//! `--new-sessions-per-minute-per-client`: a token bucket per caller identity, on each
//! replica.
//!
//! A bucket holds up to `per_minute` new sessions and refills at `per_minute` a minute, so a
//! client may start a burst of `per_minute`, then one every `60/per_minute` seconds. It is
//! kept in memory by each replica: with N replicas a client that reaches all of them may
//! start up to N times the rate. An exact count across replicas would cost an API write per
//! new session and a time-windowed object per client; `maxSessions` and
//! `maxSessionsPerClient` (exact, through slots) bound what a client can hold, and the rate
//! only paces how fast it churns through them.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Past this many buckets, full ones (a client idle for a minute) are dropped: a full bucket
/// is the same as none.
const PRUNE_ABOVE: usize = 1024;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

#[derive(Debug)]
pub struct NewSessionRate {
    per_minute: u32,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl NewSessionRate {
    pub fn new(per_minute: u32) -> Self {
        Self {
            per_minute: per_minute.max(1),
            buckets: Mutex::default(),
        }
    }

    pub fn per_minute(&self) -> u32 {
        self.per_minute
    }

    fn cap(&self) -> f64 {
        f64::from(self.per_minute)
    }

    fn refilled(&self, b: Bucket, now: Instant) -> f64 {
        let per_sec = self.cap() / 60.0;
        (b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * per_sec).min(self.cap())
    }

    /// Takes one new session for `who`, or says how long until one is allowed.
    pub fn take(&self, who: &str, now: Instant) -> Result<(), Duration> {
        let mut m = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() > PRUNE_ABOVE {
            m.retain(|_, b| self.refilled(*b, now) < self.cap());
        }
        let tokens = m.get(who).map_or(self.cap(), |b| self.refilled(*b, now));
        if tokens < 1.0 {
            let per_sec = self.cap() / 60.0;
            return Err(Duration::from_secs_f64((1.0 - tokens) / per_sec));
        }
        m.insert(
            who.to_owned(),
            Bucket {
                tokens: tokens - 1.0,
                at: now,
            },
        );
        Ok(())
    }

    /// Gives back what [`NewSessionRate::take`] took: the session was refused by another
    /// limit, or could not start.
    pub fn give_back(&self, who: &str, now: Instant) {
        let mut m = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = m.get_mut(who) {
            b.tokens = (self.refilled(*b, now) + 1.0).min(self.cap());
            b.at = now;
        }
    }
}

/// One new session taken from a client's bucket; given back when dropped unless kept.
#[derive(Debug)]
pub struct Charge<'a> {
    rate: &'a NewSessionRate,
    who: String,
    kept: bool,
}

impl Charge<'_> {
    /// The session started: it stays counted.
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Charge<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.rate.give_back(&self.who, Instant::now());
        }
    }
}

impl NewSessionRate {
    /// [`NewSessionRate::take`] as a [`Charge`].
    pub fn charge(&self, who: &str) -> Result<Charge<'_>, Duration> {
        self.take(who, Instant::now())?;
        Ok(Charge {
            rate: self,
            who: who.to_owned(),
            kept: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_the_rate_then_one_per_interval() {
        let r = NewSessionRate::new(3);
        let t = Instant::now();
        for _ in 0..3 {
            r.take("a", t).expect("within the burst");
        }
        let wait = r.take("a", t).expect_err("the fourth in the same instant");
        assert!(
            (19.9..=20.1).contains(&wait.as_secs_f64()),
            "one token every 20 s: {wait:?}"
        );
        r.take("b", t).expect("another client has its own bucket");
        let wait = r
            .take("a", t + Duration::from_secs(10))
            .expect_err("half a token");
        assert!((9.9..=10.1).contains(&wait.as_secs_f64()), "{wait:?}");
        r.take("a", t + Duration::from_secs(20))
            .expect("a token after 20 s");
    }

    #[test]
    fn a_given_back_session_can_be_started_again() {
        let r = NewSessionRate::new(1);
        let t = Instant::now();
        r.take("a", t).expect("first");
        assert!(r.take("a", t).is_err());
        r.give_back("a", t);
        r.take("a", t).expect("given back");
    }

    #[test]
    fn buckets_of_idle_clients_are_dropped() {
        let r = NewSessionRate::new(1);
        let t = Instant::now();
        for i in 0..=PRUNE_ABOVE {
            r.take(&format!("c{i}"), t).expect("first of each");
        }
        r.take("late", t + Duration::from_secs(61)).expect("first");
        let n = r.buckets.lock().expect("lock").len();
        assert_eq!(n, 1, "every bucket but the new one had refilled");
    }
}
