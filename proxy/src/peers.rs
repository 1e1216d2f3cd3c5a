//! Connections per client address: one sandbox pod may hold at most
//! `--max-connections-per-client` of the proxy's connections, so that a sandbox flooding the
//! proxy (thousands of idle or slow connections) leaves room for every other sandbox. The
//! address is only a key for fairness here, never a proof of who is calling
//! ([`crate::identity`] is that).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

pub struct PeerSlots {
    limit: usize,
    held: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's slot; given back when dropped.
pub struct PeerSlot {
    slots: Arc<PeerSlots>,
    ip: IpAddr,
}

impl PeerSlots {
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            held: Mutex::new(HashMap::new()),
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// A slot for `ip`, or `None` when it holds the limit already.
    pub fn try_take(self: &Arc<Self>, ip: IpAddr) -> Option<PeerSlot> {
        let ip = ip.to_canonical();
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let n = held.entry(ip).or_insert(0);
        if *n >= self.limit {
            return None;
        }
        *n += 1;
        Some(PeerSlot {
            slots: self.clone(),
            ip,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut held = self
            .slots
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_address_holds_at_most_the_limit_and_gets_slots_back() {
        let slots = Arc::new(PeerSlots::new(2));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let one = slots.try_take(a).expect("first");
        let _two = slots.try_take(a).expect("second");
        assert!(slots.try_take(a).is_none(), "a third from the same pod");
        assert!(slots.try_take(b).is_some(), "another pod is not affected");
        drop(one);
        assert!(slots.try_take(a).is_some(), "a slot comes back when closed");
        // An IPv4-mapped IPv6 address is the same client.
        let mapped: IpAddr = "::ffff:10.0.0.2".parse().unwrap();
        let _b1 = slots.try_take(b).expect("b");
        let _b2 = slots.try_take(mapped).expect("b mapped");
        assert!(slots.try_take(b).is_none());
    }
}
