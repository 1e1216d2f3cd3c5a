//! Restart and retry back-off (the kubelet's CrashLoopBackOff / ImagePullBackOff timing).

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    /// A run at least this long resets the back-off.
    reset_after: Duration,
    current: Option<Duration>,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max: max.max(initial),
            reset_after: max.max(initial) * 2,
            current: None,
        }
    }

    /// Delay before restarting a container that ran for `ran_for`: the first restart is
    /// immediate, then `initial`, doubling up to `max`.
    pub fn after_exit(&mut self, ran_for: Duration) -> Duration {
        if ran_for >= self.reset_after {
            self.current = None;
        }
        match self.current {
            None => {
                self.current = Some(self.initial);
                Duration::ZERO
            }
            Some(d) => {
                self.current = Some((d * 2).min(self.max));
                d
            }
        }
    }

    /// Delay before the next retry of a failed operation: `initial`, doubling up to `max`.
    pub fn after_failure(&mut self) -> Duration {
        let d = self.current.unwrap_or(self.initial);
        self.current = Some((d * 2).min(self.max));
        d
    }

    pub fn reset(&mut self) {
        self.current = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn crash_loop_sequence() {
        let mut b = Backoff::new(10 * S, 40 * S);
        let seq: Vec<u64> = (0..5).map(|_| b.after_exit(S).as_secs()).collect();
        assert_eq!(seq, vec![0, 10, 20, 40, 40]);
        assert_eq!(b.after_exit(100 * S), Duration::ZERO);
        assert_eq!(b.after_exit(S), 10 * S);
    }

    #[test]
    fn failure_sequence_and_reset() {
        let mut b = Backoff::new(2 * S, 5 * S);
        let seq: Vec<u64> = (0..4).map(|_| b.after_failure().as_secs()).collect();
        assert_eq!(seq, vec![2, 4, 5, 5]);
        b.reset();
        assert_eq!(b.after_failure(), 2 * S);
    }
}
