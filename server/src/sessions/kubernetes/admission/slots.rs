//! Session slots: the cluster-wide, exact part of admission.
//!
//! Admission within a replica ([`super::view`]) cannot see the sessions other replicas
//! are starting at the same moment, so N replicas could each admit up to `--max-sessions`. A
//! new session therefore also takes one of `--max-sessions` **slots**: Leases named
//! `cli-mcp-<n>-slot-<k>`, `k` in `0..max`, created with a plain POST. The API server
//! creates a name once, so a slot has one holder, and a `409 AlreadyExists` means taken: the
//! caller tries another `k`. With `--max-sessions-per-client` it also takes one of the
//! client's slots, `cli-mcp-<n>-slot-c<client>-<k>` (`client` = 16 hex of its owner hash),
//! `k` in `0..max_per_client`; the two creates go out together.
//!
//! Which `k` to try comes from this replica's watch of the slots (plus the 409s it got
//! lately and the creates it has in flight), in random order, so replicas spread over the
//! free slots instead of all fighting for the first. The view only picks candidates: the
//! create decides, so a stale view can cost a 409, never an extra session.
//!
//! Lifetime: a slot is created without an owner, and once the session's pod is written
//! (claimed or created) it is patched (guarded by its `resourceVersion`) to be owned by that
//! pod. Then it goes with the pod:
//! - every replica deletes the slots of a pod its pod watch sees being deleted (a deleted
//!   session is a free place at once, as the pod count says), and `DELETE /sessions/{id}`
//!   deletes them itself;
//! - Kubernetes' garbage collector deletes it once the pod is gone, whatever happened to the
//!   replicas.
//!
//! A slot whose start gave up is deleted by its replica. A slot left without an owner (its
//! replica crashed between the slot and the pod) is deleted by any replica once it is older
//! than [`ORPHAN_AFTER`]; so is a second slot of one family owned by the same pod.
//!
//! This module is the replica's view of the slots, which decides nothing by itself;
//! [`super::slot_leases`] creates, binds and deletes the Leases, and [`super::slot_feed`]
//! keeps the view from their watch and frees slots outside a start.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use rand::seq::IndexedRandom;

use crate::auth::Caller;
use crate::sessions::Quota;

/// A slot with no owner older than this is an orphan (its replica crashed, or lost the API,
/// between the slot and the session's pod): deleted by any replica. The owner is set right
/// after the pod is claimed or created, a few API calls after the slot; but in a burst
/// those calls queue: in 300 new sessions at once with the CPUs busy, a start cycling
/// through contended warm pods reached its pod 41 s after its slot, and at 30 s another
/// replica had swept the live start's slot. As long as the default `--start-timeout`, so
/// that a start that is still within its own deadline keeps its place; a crashed replica's
/// place stays taken that long.
pub(super) const ORPHAN_AFTER: Duration = Duration::from_secs(120);

/// A 409 on a slot counts it as taken for this long, unless the watch reports it first.
const CONFLICT_MEMORY: Duration = Duration::from_secs(10);
/// How long a slot this replica deleted is kept out of its view whatever older events of it
/// the watch still delivers: longer than any watch lag, short enough to stay small.
const TOMBSTONE_MEMORY: Duration = Duration::from_secs(120);

/// How often each replica looks for orphan and duplicate slots in its view.
pub(super) const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// Which limit a slot counts against.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Family {
    /// `--max-sessions`.
    Instance,
    /// `--max-sessions-per-client` of one client (16 hex of its owner hash).
    Client(String),
}

/// The client part of a per-client slot's name: 16 hex of the owner hash, `anonymous`
/// without auth.
pub fn client_tag(caller: &Caller) -> String {
    caller
        .owner
        .as_deref()
        .map(|o| o.chars().take(16).collect())
        .unwrap_or_else(|| "anonymous".into())
}

/// One slot as the watch reports it.
#[derive(Debug, Clone)]
pub struct SlotView {
    pub name: String,
    pub family: Family,
    pub index: usize,
    /// uid of the pod that owns it (none yet while its session starts).
    pub owner: Option<String>,
    pub created: Option<k8s_openapi::jiff::Timestamp>,
    pub uid: Option<String>,
    pub resource_version: Option<String>,
}

/// A slot this replica created: what it needs to bind or delete exactly that object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotRef {
    pub name: String,
    pub uid: String,
    pub resource_version: String,
}

#[derive(Debug, Default)]
struct Families {
    slots: HashMap<String, SlotView>,
    taken: HashMap<Family, HashSet<usize>>,
}

impl Families {
    fn insert(&mut self, s: SlotView) {
        self.remove(&s.name);
        self.taken
            .entry(s.family.clone())
            .or_default()
            .insert(s.index);
        self.slots.insert(s.name.clone(), s);
    }

    fn remove(&mut self, name: &str) {
        if let Some(old) = self.slots.remove(name) {
            if let Some(set) = self.taken.get_mut(&old.family) {
                set.remove(&old.index);
                if set.is_empty() {
                    self.taken.remove(&old.family);
                }
            }
        }
    }

    fn taken(&self, family: &Family, index: usize) -> bool {
        self.taken.get(family).is_some_and(|s| s.contains(&index))
    }
}

#[derive(Debug, Default)]
struct State {
    view: Families,
    relist: Option<Families>,
    /// The view has been listed once and no watch error came since.
    synced: bool,
    /// Slots a create of this replica found taken (409), and when.
    conflicts: HashMap<String, Instant>,
    /// Slots this replica is creating right now.
    in_flight: HashSet<String>,
    /// uids of the slots this replica deleted, and when: an older event of one (its bind,
    /// delivered late by a lagging watch) must not put it back in the view, where it would
    /// refuse a new session its DELETE freed the place for.
    tombstones: HashMap<String, Instant>,
}

impl State {
    fn buried(&self, s: &SlotView) -> bool {
        s.uid
            .as_ref()
            .is_some_and(|u| self.tombstones.contains_key(u))
    }
}

/// The replica's view of the instance's slots; cheap to share.
#[derive(Debug, Clone)]
pub struct Slots {
    state: Arc<Mutex<State>>,
    prefix: String,
}

impl Slots {
    pub fn new(prefix: String) -> Self {
        Self {
            state: Arc::default(),
            prefix,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn name(&self, family: &Family, index: usize) -> String {
        match family {
            Family::Instance => format!("{}{index}", self.prefix),
            Family::Client(c) => format!("{}c{c}-{index}", self.prefix),
        }
    }

    /// The family and index a slot name stands for; `None` for a name this server does not
    /// make.
    pub fn parse(&self, name: &str) -> Option<(Family, usize)> {
        let rest = name.strip_prefix(&self.prefix)?;
        let index = |s: &str| {
            (!s.is_empty() && s.len() <= 5 && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse().ok())
                .flatten()
        };
        match rest.strip_prefix('c') {
            None => Some((Family::Instance, index(rest)?)),
            Some(r) => {
                let (client, k) = r.rsplit_once('-')?;
                let ok = !client.is_empty()
                    && client.len() <= 16
                    && client.bytes().all(|b| b.is_ascii_alphanumeric());
                ok.then_some(())?;
                Some((Family::Client(client.to_owned()), index(k)?))
            }
        }
    }

    /// A free slot of `family` below `bound` to try, in random order, marked in flight; `None`
    /// when the view, the recent 409s and the creates in flight account for every one.
    pub fn pick(&self, family: &Family, bound: usize, now: Instant) -> Option<String> {
        let mut st = self.lock();
        st.conflicts
            .retain(|_, at| now.duration_since(*at) < CONFLICT_MEMORY);
        let free: Vec<usize> = (0..bound)
            .filter(|&k| !st.view.taken(family, k))
            .filter(|&k| {
                let n = self.name(family, k);
                !st.conflicts.contains_key(&n) && !st.in_flight.contains(&n)
            })
            .collect();
        let k = *free.choose(&mut rand::rng())?;
        let name = self.name(family, k);
        st.in_flight.insert(name.clone());
        Some(name)
    }

    /// The create of `name` returned: `Ok(view)` it is ours, `Err(())` it was taken.
    pub fn created(&self, name: &str, outcome: Result<SlotView, ()>, now: Instant) {
        let mut st = self.lock();
        st.in_flight.remove(name);
        match outcome {
            Ok(view) => st.view.insert(view),
            Err(()) => {
                st.conflicts.insert(name.to_owned(), now);
            }
        }
    }

    /// The create of `name` failed for another reason than a conflict.
    pub fn abandoned(&self, name: &str) {
        self.lock().in_flight.remove(name);
    }

    /// Whether the view (synced) shows every slot of `family` below `bound` taken: a new
    /// session of it can be refused without an API call.
    pub fn full(&self, family: &Family, bound: usize) -> bool {
        let st = self.lock();
        st.synced
            && st
                .view
                .taken
                .get(family)
                .is_some_and(|s| s.iter().filter(|&&k| k < bound).count() >= bound)
    }

    /// The limit a new session of `caller` is over if the view (synced) shows every slot it
    /// would need taken: one of the `max` of the instance, one of the `per_client` of its
    /// client when set. It can then be refused without an API call.
    pub fn full_for(
        &self,
        caller: &Caller,
        max: usize,
        per_client: Option<usize>,
    ) -> Option<Quota> {
        if self.full(&Family::Instance, max) {
            return Some(Quota::Instance { max });
        }
        let per_client = per_client?;
        self.full(&Family::Client(client_tag(caller)), per_client)
            .then_some(Quota::Client { max: per_client })
    }

    /// Slots owned by pod `uid`, as the view has them.
    pub fn owned_by(&self, uid: &str) -> Vec<SlotRef> {
        let st = self.lock();
        st.view
            .slots
            .values()
            .filter(|s| s.owner.as_deref() == Some(uid))
            .filter_map(slot_ref)
            .collect()
    }

    /// Slots to delete: orphans older than [`ORPHAN_AFTER`], and every slot of a family but
    /// the lowest that one pod owns.
    pub fn sweepable(&self, now: k8s_openapi::jiff::Timestamp) -> Vec<SlotRef> {
        let st = self.lock();
        if !st.synced {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut by_owner: HashMap<(&str, &Family), Vec<&SlotView>> = HashMap::new();
        for s in st.view.slots.values() {
            match &s.owner {
                Some(o) => by_owner.entry((o, &s.family)).or_default().push(s),
                None => {
                    let old = s.created.is_some_and(|c| {
                        now.duration_since(c).unsigned_abs() >= ORPHAN_AFTER && c <= now
                    });
                    if old {
                        out.extend(slot_ref(s));
                    }
                }
            }
        }
        for mut same in by_owner.into_values().filter(|v| v.len() > 1) {
            same.sort_by_key(|s| s.index);
            out.extend(same[1..].iter().filter_map(|s| slot_ref(s)));
        }
        out
    }

    /// This replica deleted `name` (or found it gone). A 409 remembered for it is forgotten
    /// too: the slot is free now, and without that a session started right after
    /// `DELETE /sessions/{id}` was refused when a refused start had met that slot's 409
    /// within [`CONFLICT_MEMORY`] and the watch had not yet reported the delete.
    pub fn gone(&self, name: &str) {
        let mut st = self.lock();
        st.conflicts.remove(name);
        let now = Instant::now();
        st.tombstones
            .retain(|_, at| now.duration_since(*at) < TOMBSTONE_MEMORY);
        if let Some(uid) = st.view.slots.get(name).and_then(|s| s.uid.clone()) {
            st.tombstones.insert(uid, now);
        }
        st.view.remove(name);
        if let Some(r) = st.relist.as_mut() {
            r.remove(name);
        }
    }

    pub fn relist_started(&self) {
        self.lock().relist = Some(Families::default());
    }

    pub fn relisted(&self, s: SlotView) {
        let mut st = self.lock();
        if st.buried(&s) {
            return;
        }
        if let Some(r) = st.relist.as_mut() {
            r.insert(s);
        }
    }

    pub fn relist_done(&self) {
        let mut st = self.lock();
        if let Some(r) = st.relist.take() {
            st.view = r;
            st.synced = true;
        }
    }

    pub fn applied(&self, s: SlotView) {
        let mut st = self.lock();
        st.conflicts.remove(&s.name);
        if !st.buried(&s) {
            st.view.insert(s);
        }
    }

    pub fn deleted(&self, name: &str) {
        let mut st = self.lock();
        st.conflicts.remove(name);
        st.view.remove(name);
    }

    pub fn watch_failed(&self) {
        self.lock().synced = false;
    }

    /// Slots the view counts in `family` (for tests and the log).
    #[cfg(test)]
    fn count(&self, family: &Family) -> usize {
        self.lock().view.taken.get(family).map_or(0, HashSet::len)
    }
}

pub(super) fn slot_ref(s: &SlotView) -> Option<SlotRef> {
    Some(SlotRef {
        name: s.name.clone(),
        uid: s.uid.clone()?,
        resource_version: s.resource_version.clone()?,
    })
}

/// What the view needs of a slot object.
pub(super) fn slot_view(slots: &Slots, meta: &ObjectMeta) -> Option<SlotView> {
    let name = meta.name.clone()?;
    let (family, index) = slots.parse(&name)?;
    let owner = meta
        .owner_references
        .as_ref()
        .and_then(|o| o.iter().find(|r| r.kind == "Pod"))
        .map(|r| r.uid.clone());
    Some(SlotView {
        name,
        family,
        index,
        owner,
        created: meta.creation_timestamp.as_ref().map(|t| t.0),
        uid: meta.uid.clone(),
        resource_version: meta.resource_version.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots() -> Slots {
        Slots::new("cli-mcp-demo-slot-".into())
    }

    fn view(s: &Slots, family: Family, index: usize, owner: Option<&str>) -> SlotView {
        SlotView {
            name: s.name(&family, index),
            family,
            index,
            owner: owner.map(str::to_owned),
            created: Some(k8s_openapi::jiff::Timestamp::now()),
            uid: Some(format!("uid-{index}")),
            resource_version: Some("1".into()),
        }
    }

    fn synced(s: &Slots, views: Vec<SlotView>) {
        s.relist_started();
        for v in views {
            s.relisted(v);
        }
        s.relist_done();
    }

    #[test]
    fn names_round_trip_and_foreign_names_are_not_slots() {
        let s = slots();
        let c = Family::Client("0123456789abcdef".into());
        assert_eq!(s.name(&Family::Instance, 7), "cli-mcp-demo-slot-7");
        assert_eq!(s.name(&c, 3), "cli-mcp-demo-slot-c0123456789abcdef-3");
        assert_eq!(s.parse("cli-mcp-demo-slot-7"), Some((Family::Instance, 7)));
        assert_eq!(
            s.parse("cli-mcp-demo-slot-c0123456789abcdef-3"),
            Some((c, 3))
        );
        for bad in [
            "cli-mcp-demo-slot-",
            "cli-mcp-demo-slot-x",
            "cli-mcp-demo-slot-123456",
            "cli-mcp-demo-slot-c-1",
            "cli-mcp-demo-slot-cabc",
            "cli-mcp-other-slot-1",
            "leader-election",
        ] {
            assert_eq!(s.parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn picks_only_free_slots_and_never_one_already_in_flight() {
        let s = slots();
        synced(&s, vec![view(&s, Family::Instance, 0, Some("p0"))]);
        let now = Instant::now();
        let a = s.pick(&Family::Instance, 3, now).expect("a free slot");
        let b = s
            .pick(&Family::Instance, 3, now)
            .expect("the other free slot");
        assert_ne!(a, b);
        assert!(![&a, &b].contains(&&s.name(&Family::Instance, 0)));
        assert_eq!(
            s.pick(&Family::Instance, 3, now),
            None,
            "all taken or in flight"
        );
        // A 409 on a: remembered as taken for a while; b given up: free again.
        s.created(&a, Err(()), now);
        s.abandoned(&b);
        assert_eq!(s.pick(&Family::Instance, 3, now), Some(b.clone()));
        s.abandoned(&b);
        assert!(
            s.pick(&Family::Instance, 3, now + CONFLICT_MEMORY)
                .is_some_and(|n| n == a || n == b),
            "the 409 is forgotten after a while"
        );
    }

    /// DELETE frees a session's slots at once; the watch, lagging under load, then delivers
    /// an older event of one of them (its bind). Before tombstones that event put the slot
    /// back, and the client's next new session was refused over a limit it no longer had.
    #[test]
    fn a_late_event_of_a_slot_this_replica_deleted_does_not_bring_it_back() {
        let s = slots();
        let c = Family::Client("abc".into());
        let (a1, a2) = (
            view(&s, c.clone(), 0, Some("p1")),
            view(&s, c.clone(), 1, Some("p2")),
        );
        synced(&s, vec![a1.clone(), a2]);
        assert!(s.full(&c, 2));
        s.gone(&a1.name);
        assert!(!s.full(&c, 2), "freed at once");
        s.applied(a1.clone());
        assert!(
            !s.full(&c, 2),
            "a late event of the deleted slot is ignored"
        );
        s.relist_started();
        s.relisted(a1.clone());
        s.relist_done();
        assert!(
            !s.full(&c, 2),
            "and so is a relist that saw it before the delete"
        );
        // A new slot under the same name (another session's) is a new object: counted.
        let again = SlotView {
            uid: Some("uid-new".into()),
            ..a1
        };
        s.applied(again);
        assert_eq!(s.count(&c), 1);
    }

    /// A refused start met every slot's 409; then this replica deletes one (`DELETE
    /// /sessions/{id}`): the next start must try it at once, not wait for the watch to report
    /// the delete or for the 409 to be forgotten.
    #[test]
    fn a_slot_this_replica_deleted_is_free_at_once_despite_an_earlier_409() {
        let s = slots();
        let taken: Vec<SlotView> = (0..3)
            .map(|k| view(&s, Family::Instance, k, Some("p")))
            .collect();
        synced(&s, taken);
        let now = Instant::now();
        // Another replica's view: it lags, so it tries a slot and gets a 409.
        let name = s.name(&Family::Instance, 1);
        s.lock().view.remove(&name);
        assert_eq!(s.pick(&Family::Instance, 3, now), Some(name.clone()));
        s.created(&name, Err(()), now);
        assert_eq!(s.pick(&Family::Instance, 3, now), None, "all taken");
        s.gone(&name);
        assert_eq!(s.pick(&Family::Instance, 3, now), Some(name));
    }

    #[test]
    fn full_counts_the_family_below_the_bound_and_only_from_a_synced_view() {
        let s = slots();
        let c = Family::Client("abc".into());
        assert!(!s.full(&Family::Instance, 1), "not synced: ask the API");
        synced(
            &s,
            vec![
                view(&s, Family::Instance, 0, Some("p0")),
                view(&s, Family::Instance, 5, Some("p5")),
                view(&s, c.clone(), 0, Some("p0")),
            ],
        );
        assert!(s.full(&Family::Instance, 1));
        assert!(!s.full(&Family::Instance, 2), "slot 5 is above the bound");
        assert!(s.full(&c, 1));
        assert!(!s.full(&Family::Client("other".into()), 1));
        s.deleted(&s.name(&Family::Instance, 0));
        assert!(!s.full(&Family::Instance, 1), "a deleted slot is free");
        assert_eq!(s.count(&Family::Instance), 1);
    }

    #[test]
    fn a_new_session_is_refused_with_the_family_that_is_full() {
        let s = slots();
        let caller = Caller::anonymous();
        let mine = Family::Client(client_tag(&caller));
        assert_eq!(s.full_for(&caller, 1, Some(1)), None, "not synced");
        synced(&s, vec![view(&s, mine.clone(), 0, Some("p0"))]);
        assert_eq!(s.full_for(&caller, 2, None), None, "no per-client limit");
        assert_eq!(
            s.full_for(&caller, 2, Some(1)),
            Some(Quota::Client { max: 1 })
        );
        s.applied(view(&s, Family::Instance, 0, Some("p0")));
        assert_eq!(
            s.full_for(&caller, 1, Some(1)),
            Some(Quota::Instance { max: 1 }),
            "the instance's limit first"
        );
    }

    #[test]
    fn orphans_are_swept_only_when_old_and_duplicates_keep_the_lowest() {
        let s = slots();
        let mut orphan = view(&s, Family::Instance, 1, None);
        let mut young = view(&s, Family::Instance, 2, None);
        let now = k8s_openapi::jiff::Timestamp::now();
        orphan.created = Some(now - k8s_openapi::jiff::SignedDuration::from_secs(121));
        // A live start in a burst reached its pod 41 s after its slot: it keeps the slot.
        young.created = Some(now - k8s_openapi::jiff::SignedDuration::from_secs(41));
        synced(
            &s,
            vec![
                orphan,
                young,
                view(&s, Family::Instance, 3, Some("p")),
                view(&s, Family::Instance, 4, Some("p")),
                view(&s, Family::Client("c".into()), 0, Some("p")),
            ],
        );
        let mut swept: Vec<String> = s.sweepable(now).into_iter().map(|r| r.name).collect();
        swept.sort();
        assert_eq!(swept, ["cli-mcp-demo-slot-1", "cli-mcp-demo-slot-4"]);
        s.watch_failed();
        assert!(s.sweepable(now).is_empty(), "nothing from a stale view");
    }

    #[test]
    fn a_pods_slots_are_found_by_its_uid() {
        let s = slots();
        synced(
            &s,
            vec![
                view(&s, Family::Instance, 0, Some("p")),
                view(&s, Family::Client("c".into()), 1, Some("p")),
                view(&s, Family::Instance, 1, Some("q")),
            ],
        );
        let mut names: Vec<_> = s.owned_by("p").into_iter().map(|r| r.name).collect();
        names.sort();
        assert_eq!(names, ["cli-mcp-demo-slot-0", "cli-mcp-demo-slot-cc-1"]);
    }
}
