//! A map of key → shared value whose entry lives only while someone uses it.
//!
//! Both the in-flight token reviews ([`crate::auth`]) and the per-session start locks
//! ([`crate::sessions`]) hand concurrent callers of one key the same value, and must not keep
//! an entry for every key ever seen: anyone could grow the map with junk tokens or session
//! ids. A caller holds a [`Handle`]; the entry goes with the last handle, also when its caller
//! was cancelled mid-wait (an HTTP/2 stream reset or a closed connection drops the request's
//! future), or earlier, when a holder [`Handle::retire`]s it.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

pub struct Keyed<K, T> {
    entries: Mutex<HashMap<K, Arc<T>>>,
}

impl<K, T> Default for Keyed<K, T> {
    fn default() -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Hash + Eq + Clone, T: Default> Keyed<K, T> {
    /// A hold on `key`'s value, made now if nobody holds one.
    pub fn get(&self, key: K) -> Handle<'_, K, T> {
        let value = self.map().entry(key.clone()).or_default().clone();
        Handle {
            owner: self,
            key,
            value,
        }
    }
}

impl<K, T> Keyed<K, T> {
    /// Keys held now.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `key`'s value, without holding it (tests watch who waits on a value through this).
    #[cfg(test)]
    pub fn peek(&self, key: &K) -> Option<Arc<T>>
    where
        K: Hash + Eq,
    {
        self.map().get(key).cloned()
    }

    // A panic elsewhere while the map was locked leaves it consistent (every change is one
    // insert or remove), so a poisoned lock is used as is.
    fn map(&self) -> MutexGuard<'_, HashMap<K, Arc<T>>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A caller's hold on its key's value. Dropped, it removes the entry if nobody else holds
/// the value.
pub struct Handle<'a, K: Hash + Eq, T> {
    owner: &'a Keyed<K, T>,
    key: K,
    value: Arc<T>,
}

impl<K: Hash + Eq, T> Handle<'_, K, T> {
    pub fn value(&self) -> &Arc<T> {
        &self.value
    }

    /// Removes the entry now, however many hold it: the next caller of the key gets a fresh
    /// value while the current holders keep theirs.
    pub fn retire(&self) {
        self.remove_if(|_| true);
    }

    /// Removes the entry if it is still this handle's (a retired one may have been replaced
    /// by a newer value, which is not ours to remove) and `now` says so.
    fn remove_if(&self, now: impl FnOnce(usize) -> bool) {
        let mut map = self.owner.map();
        let ours = map
            .get(&self.key)
            .is_some_and(|v| Arc::ptr_eq(v, &self.value));
        if ours && now(Arc::strong_count(&self.value)) {
            map.remove(&self.key);
        }
    }
}

impl<K: Hash + Eq, T> Drop for Handle<'_, K, T> {
    fn drop(&mut self) {
        // Two holders, the map and this handle: nobody else uses the value. Counted under the
        // map's lock, so no new holder can appear meanwhile; one that clones the value out of
        // a handle (a lock's owned guard) counts as a holder until it lets go.
        self.remove_if(|holders| holders <= 2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_lives_while_it_is_held() {
        let k: Keyed<String, ()> = Keyed::default();
        let a = k.get("x".into());
        let b = k.get("x".into());
        assert!(Arc::ptr_eq(a.value(), b.value()), "one value per key");
        assert_eq!(k.len(), 1);
        drop(a);
        assert_eq!(k.len(), 1, "b still holds it");
        drop(b);
        assert!(k.is_empty());
        for i in 0..100 {
            drop(k.get(format!("s-{i}")));
        }
        assert!(k.is_empty());
    }

    #[test]
    fn a_clone_of_the_value_keeps_the_entry_until_it_goes() {
        let k: Keyed<u8, ()> = Keyed::default();
        let a = k.get(1);
        let other = k.get(1);
        let clone = a.value().clone();
        drop(a);
        drop(other);
        // Three holders were counted at the second drop: map, `other` and `clone`.
        assert_eq!(k.len(), 1);
        drop(clone);
        drop(k.get(1));
        assert!(k.is_empty());
    }

    #[test]
    fn a_retired_entry_makes_way_for_a_fresh_value_that_its_holders_leave_alone() {
        let k: Keyed<u8, ()> = Keyed::default();
        let old = k.get(1);
        let old_too = k.get(1);
        old.retire();
        assert!(k.is_empty());
        let new = k.get(1);
        assert!(!Arc::ptr_eq(old.value(), new.value()));
        drop(old);
        drop(old_too);
        assert_eq!(k.len(), 1, "the old holders removed the new entry");
        drop(new);
        assert!(k.is_empty());
    }
}
