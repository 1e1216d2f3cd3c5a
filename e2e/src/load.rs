//! A bounded CPU load for tests that must hold on a busy machine: one spinning thread per
//! CPU, stopped when the guard is dropped or at its deadline, whichever comes first, so a
//! failed or hung test never leaves the machine loaded.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Keeps every CPU busy while it lives (at most `limit`).
pub struct CpuLoad {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<u64>>,
}

impl CpuLoad {
    /// Starts one spinner per available CPU; each stops after `limit` at the latest.
    pub fn start(limit: Duration) -> CpuLoad {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..cpus)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || spin(&stop, Instant::now() + limit))
            })
            .collect();
        CpuLoad { stop, threads }
    }
}

/// Busy work the optimiser cannot remove; returns the iterations done.
fn spin(stop: &AtomicBool, deadline: Instant) -> u64 {
    let mut n: u64 = 0;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    while !stop.load(Ordering::Relaxed) && (!n.is_multiple_of(4096) || Instant::now() < deadline) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        n = n.wrapping_add(1);
    }
    std::hint::black_box(x);
    n
}

impl Drop for CpuLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_stops_at_its_deadline_without_being_dropped() {
        let t0 = Instant::now();
        let mut load = CpuLoad::start(Duration::from_millis(50));
        for t in load.threads.drain(..) {
            assert!(t.join().expect("spinner") > 0, "it did spin");
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
}
