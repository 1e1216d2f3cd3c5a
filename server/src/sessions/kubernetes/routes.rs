//! The per-replica route cache: session → sandbox.
//!
//! The cache is only an accelerator: Kubernetes labels are the truth, and a replica that
//! lost its cache finds every session again by label. It also remembers the sandbox a
//! session had after that sandbox stopped answering (a tombstone), so that finding a
//! different one can be reported as a reset of the session's state.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use cli_mcp_api::token::Token;
use cli_mcp_api::SessionId;

use crate::metrics::Launch;
use crate::sessions::Sandbox;

/// Where a session's agent is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub pod: String,
    pub uid: String,
    pub endpoint: String,
    /// The session token this sandbox accepts (bound to its nonce).
    pub token: Token,
    /// Owner hash stamped on the pod (None: auth was off when it was made).
    pub owner: Option<String>,
    pub launch: Option<Launch>,
}

impl Route {
    /// The sandbox this route leads to, for a call (`started` when the call started it,
    /// `replaced` when the session had another sandbox before).
    pub fn sandbox(&self, started: Option<Launch>, replaced: bool) -> Sandbox {
        Sandbox {
            endpoint: self.endpoint.clone(),
            token: self.token.clone(),
            name: self.pod.clone(),
            uid: self.uid.clone(),
            started,
            replaced,
        }
    }
}

#[derive(Debug)]
enum Slot {
    Live {
        route: Route,
        used: Instant,
    },
    /// The sandbox with this uid stopped answering or disappeared.
    Gone {
        uid: String,
        at: Instant,
    },
}

impl Slot {
    fn stamp(&self) -> Instant {
        match self {
            Slot::Live { used, .. } => *used,
            Slot::Gone { at, .. } => *at,
        }
    }
}

/// Bounded map session → route. When full, tombstones go first, then the least recently
/// used routes (a forgotten route is found again by label, at the cost of one list).
#[derive(Debug)]
pub struct RouteCache {
    slots: Mutex<HashMap<SessionId, Slot>>,
    capacity: usize,
}

impl RouteCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            slots: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live route of `sid`.
    pub fn get(&self, sid: &SessionId) -> Option<Route> {
        let mut slots = self.lock();
        match slots.get_mut(sid) {
            Some(Slot::Live { route, used }) => {
                *used = Instant::now();
                Some(route.clone())
            }
            _ => None,
        }
    }

    /// Uid of the sandbox this replica last knew for `sid` (live or gone).
    pub fn previous_uid(&self, sid: &SessionId) -> Option<String> {
        match self.lock().get(sid) {
            Some(Slot::Live { route, .. }) => Some(route.uid.clone()),
            Some(Slot::Gone { uid, .. }) => Some(uid.clone()),
            None => None,
        }
    }

    pub fn insert(&self, sid: SessionId, route: Route) {
        let mut slots = self.lock();
        if slots.len() >= self.capacity && !slots.contains_key(&sid) {
            Self::evict(&mut slots, self.capacity);
        }
        slots.insert(
            sid,
            Slot::Live {
                route,
                used: Instant::now(),
            },
        );
    }

    /// Turns the route of `sid` into a tombstone if it still points at `uid`; true when it
    /// did.
    pub fn invalidate(&self, sid: &SessionId, uid: &str) -> bool {
        let mut slots = self.lock();
        if let Some(slot) = slots.get_mut(sid) {
            if matches!(slot, Slot::Live { route, .. } if route.uid == uid) {
                *slot = Slot::Gone {
                    uid: uid.to_owned(),
                    at: Instant::now(),
                };
                return true;
            }
        }
        false
    }

    /// The pod `uid` of `sid` is going away (seen by the pod watch): its live route becomes a
    /// tombstone, and a session this replica never served gets one too, so whichever replica
    /// serves the session next reports the reset — unless the pod was `retired` (ended on
    /// purpose or never held state: nothing to report). A live route to another (newer) pod
    /// is kept. True when a live route was dropped.
    pub fn tombstone(&self, sid: &SessionId, uid: &str, retired: bool) -> bool {
        let mut slots = self.lock();
        match slots.get(sid) {
            Some(Slot::Live { route, .. }) if route.uid != uid => false,
            Some(Slot::Live { .. }) => {
                slots.insert(
                    sid.clone(),
                    Slot::Gone {
                        uid: uid.to_owned(),
                        at: Instant::now(),
                    },
                );
                true
            }
            Some(Slot::Gone { .. }) => false,
            None if retired => false,
            None => {
                if slots.len() >= self.capacity {
                    Self::evict(&mut slots, self.capacity);
                }
                slots.insert(
                    sid.clone(),
                    Slot::Gone {
                        uid: uid.to_owned(),
                        at: Instant::now(),
                    },
                );
                false
            }
        }
    }

    /// Forgets `sid` entirely (the session was deleted on purpose).
    pub fn remove(&self, sid: &SessionId) {
        self.lock().remove(sid);
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    fn evict(slots: &mut HashMap<SessionId, Slot>, capacity: usize) {
        slots.retain(|_, s| matches!(s, Slot::Live { .. }));
        if slots.len() < capacity {
            return;
        }
        // Drop the least recently used eighth in one pass, so eviction is amortised.
        let mut stamps: Vec<(Instant, SessionId)> =
            slots.iter().map(|(k, s)| (s.stamp(), k.clone())).collect();
        stamps.sort();
        let drop = (capacity / 8).max(1);
        for (_, k) in stamps.into_iter().take(drop) {
            slots.remove(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(s: &str) -> SessionId {
        SessionId::parse(s).expect("valid")
    }

    fn route(uid: &str) -> Route {
        Route {
            pod: format!("pod-{uid}"),
            uid: uid.into(),
            endpoint: "http://10.0.0.1:8090".into(),
            token: cli_mcp_api::token::HmacKey::from_bytes([1; 32]).session_token(
                &sid("s"),
                &cli_mcp_api::token::SandboxNonce::from_bytes([2; 16]),
            ),
            owner: None,
            launch: None,
        }
    }

    #[test]
    fn invalidation_leaves_a_tombstone_for_reset_detection() {
        let c = RouteCache::new(10);
        c.insert(sid("a"), route("u1"));
        assert_eq!(c.get(&sid("a")).map(|r| r.uid), Some("u1".into()));
        c.invalidate(&sid("a"), "other");
        assert!(
            c.get(&sid("a")).is_some(),
            "a stale uid does not invalidate"
        );
        c.invalidate(&sid("a"), "u1");
        assert!(c.get(&sid("a")).is_none());
        assert_eq!(c.previous_uid(&sid("a")), Some("u1".into()));
        c.remove(&sid("a"));
        assert_eq!(c.previous_uid(&sid("a")), None);
    }

    #[test]
    fn a_pod_going_away_leaves_a_tombstone_even_for_an_unknown_session() {
        let c = RouteCache::new(10);
        assert!(!c.tombstone(&sid("elsewhere"), "u1", false));
        assert_eq!(c.previous_uid(&sid("elsewhere")), Some("u1".into()));
        // A retired pod (session ended on purpose, a duplicate, never started) held no
        // state to report.
        assert!(!c.tombstone(&sid("ended"), "u9", true));
        assert_eq!(c.previous_uid(&sid("ended")), None);
        assert!(c.get(&sid("elsewhere")).is_none());
        c.insert(sid("a"), route("u2"));
        assert!(
            !c.tombstone(&sid("a"), "old", false),
            "a newer pod's route is kept"
        );
        assert!(c.get(&sid("a")).is_some());
        // A live route to a retired pod still becomes a tombstone: this replica may have
        // run commands in it (a duplicate that lost).
        assert!(c.tombstone(&sid("a"), "u2", true));
        assert_eq!(c.previous_uid(&sid("a")), Some("u2".into()));
    }

    #[test]
    fn capacity_is_bounded() {
        let c = RouteCache::new(16);
        for i in 0..1000 {
            c.insert(sid(&format!("s{i}")), route(&i.to_string()));
            assert!(c.len() <= 16);
        }
        // The most recent one survives.
        assert!(c.get(&sid("s999")).is_some());
    }
}
