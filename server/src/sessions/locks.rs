//! Per-session locks: one start at a time per session within a replica.

use cli_mcp_api::SessionId;

/// Serialises the slow path (lookup, claim, create) per session, so one replica never starts
/// two sandboxes for one session. Striped: memory stays fixed whatever the number of
/// sessions; two sessions sharing a stripe only wait for each other while starting.
pub struct SessionLocks {
    stripes: Vec<tokio::sync::Mutex<()>>,
}

impl std::fmt::Debug for SessionLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionLocks({})", self.stripes.len())
    }
}

impl Default for SessionLocks {
    fn default() -> Self {
        Self::new(256)
    }
}

impl SessionLocks {
    pub fn new(stripes: usize) -> Self {
        Self {
            stripes: (0..stripes.max(1))
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
        }
    }

    fn stripe(&self, sid: &SessionId) -> &tokio::sync::Mutex<()> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        sid.hash(&mut h);
        &self.stripes[(h.finish() % self.stripes.len() as u64) as usize]
    }

    pub async fn lock(&self, sid: &SessionId) -> tokio::sync::MutexGuard<'_, ()> {
        self.stripe(sid).lock().await
    }

    /// The lock if it is free right now.
    pub fn try_lock(&self, sid: &SessionId) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        self.stripe(sid).try_lock().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(s: &str) -> SessionId {
        SessionId::parse(s).expect("session id")
    }

    #[tokio::test]
    async fn locks_serialise_one_session() {
        let l = SessionLocks::new(4);
        let g = l.lock(&sid("x")).await;
        assert!(l.try_lock(&sid("x")).is_none(), "held while starting");
        drop(g);
        assert!(l.try_lock(&sid("x")).is_some());
    }
}
