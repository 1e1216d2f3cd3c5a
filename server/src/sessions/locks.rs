//! Per-session locks: one start at a time per session within a replica.

use cli_mcp_api::SessionId;
use tokio::sync::OwnedMutexGuard;

use crate::keyed::{Handle, Keyed};

/// Serialises the slow path (lookup, claim, create, delete) per session, so one replica never
/// starts two sandboxes for one session. One lock per session, and only while someone holds
/// or waits for it: memory follows the sessions being started, not all of them. (Striped
/// locks made unrelated sessions wait for each other through a whole cold start, up to the
/// start timeout, whenever they shared a stripe.)
#[derive(Default)]
pub struct SessionLocks {
    held: Keyed<SessionId, tokio::sync::Mutex<()>>,
}

impl std::fmt::Debug for SessionLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionLocks({} held)", self.entries())
    }
}

/// A held session lock; the session's entry goes with the last holder or waiter.
pub struct SessionGuard<'a> {
    // Fields drop in order: the lock is released (its guard holds the mutex's Arc) before the
    // entry counts who else still holds or waits for it.
    _guard: OwnedMutexGuard<()>,
    _entry: Handle<'a, SessionId, tokio::sync::Mutex<()>>,
}

impl SessionLocks {
    pub async fn lock(&self, sid: &SessionId) -> SessionGuard<'_> {
        // Dropped with a caller cancelled while waiting: it removes an entry nobody else uses.
        let entry = self.held.get(sid.clone());
        SessionGuard {
            _guard: entry.value().clone().lock_owned().await,
            _entry: entry,
        }
    }

    /// The lock if it is free right now.
    #[cfg(test)]
    pub fn try_lock(&self, sid: &SessionId) -> Option<SessionGuard<'_>> {
        let entry = self.held.get(sid.clone());
        Some(SessionGuard {
            _guard: entry.value().clone().try_lock_owned().ok()?,
            _entry: entry,
        })
    }

    /// Sessions whose lock is held or waited for.
    fn entries(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn sid(s: &str) -> SessionId {
        SessionId::parse(s).expect("session id")
    }

    #[tokio::test]
    async fn locks_serialise_one_session() {
        let l = SessionLocks::default();
        let g = l.lock(&sid("x")).await;
        assert!(l.try_lock(&sid("x")).is_none(), "held while starting");
        drop(g);
        assert!(l.try_lock(&sid("x")).is_some());
    }

    #[tokio::test]
    async fn a_session_never_waits_for_another_ones_lock() {
        let l = SessionLocks::default();
        let _starting = l.lock(&sid("slow-cold-start")).await;
        for i in 0..2000 {
            let other = sid(&format!("other-{i}"));
            assert!(l.try_lock(&other).is_some(), "{other} waited");
        }
    }

    #[tokio::test]
    async fn an_entry_lives_only_while_its_lock_is_held_or_waited_for() {
        let l = Arc::new(SessionLocks::default());
        let held = l.lock(&sid("a")).await;
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move {
                let _g = l.lock(&sid("a")).await;
            })
        };
        // The waiter is queued behind `held` (or has not run yet): the entry stays.
        tokio::task::yield_now().await;
        assert_eq!(l.entries(), 1);
        drop(held);
        waiter.await.expect("the waiter got the lock");
        assert_eq!(l.entries(), 0);
        // A waiter that gives up leaves nothing either.
        let held = l.lock(&sid("b")).await;
        let gave_up = tokio::time::timeout(std::time::Duration::from_millis(10), l.lock(&sid("b")))
            .await
            .is_err();
        assert!(gave_up);
        drop(held);
        assert_eq!(l.entries(), 0);
        for i in 0..100 {
            drop(l.try_lock(&sid(&format!("s-{i}"))));
        }
        assert_eq!(l.entries(), 0);
    }
}
