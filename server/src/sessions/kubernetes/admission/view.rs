//! The replica's view of the instance's sessions, which admission counts against
//! `--max-sessions`: exact within one replica, without an API round trip (the session slot,
//! [`super::slots`], makes the bound hold across replicas).
//!
//! The count is the union, by session id, of three sets:
//! - `live`: the instance's assigned, not-terminating sandbox pods, as this replica's pod
//!   watch last reported them;
//! - `pending`: sessions this replica has admitted and is starting (no pod written yet);
//! - `written`: sessions whose pod this replica has just claimed or created, until its watch
//!   has reported that pod (or a fresh list was started after the write).
//!
//! Reserving is one step under one short, synchronous lock: check the count, join
//! `pending`. A session leaves `pending` only for `written` (or because it gave up), and
//! leaves `written` only once `live` holds it. So every session this replica admitted is in
//! one of the sets from the moment it was admitted until its pod is gone, and every later
//! admission counts it exactly once. Sessions started by other replicas are counted once the
//! watch reports their pods; what other replicas are starting at the same moment is what the
//! slot, taken next (one API round trip, outside any lock), accounts for.
//!
//! `DELETE /sessions/{id}` frees the session's place at once ([`SessionView::retired`]), not
//! when the watch reports the pod's deletion: the caller's next new session must not be
//! refused for the one it just ended. Events of that pod from before its deletion may still
//! be on their way (the retirement itself patches the pod first, and activity stamps patch
//! it too); they no longer count it.
//!
//! Before the watch has listed the pods once, and after a watch error until the watch is seen
//! working again, the view may be behind: admission then counts from a LIST instead
//! ([`SessionView::reserve_listed`]), still combined with `pending` and `written`, so an API
//! outage gives the caller a clear "retry shortly" and never a count made of stale data.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cli_mcp_api::SessionId;
use tokio::sync::Notify;

/// The instance already has `max` sessions.
#[derive(Debug, PartialEq, Eq)]
pub struct LimitReached {
    pub max: usize,
}

/// Why a new session was not admitted from the view.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    Limit(LimitReached),
    /// The watch-fed view cannot be trusted right now: count from a LIST instead.
    NotSynced,
}

/// One assigned sandbox pod as the watch reports it.
#[derive(Debug, Clone)]
pub struct PodView {
    /// The pod's [`pod_key`](crate::sessions::kubernetes::pods::pod_key).
    pub key: String,
    /// The session the pod serves; `None` for a pod without a valid session id label.
    pub session: Option<SessionId>,
    /// A deletion timestamp is set: no longer counted.
    pub terminating: bool,
}

#[derive(Debug, Default)]
struct View {
    /// Pod key → session, for the pods that count.
    pods: HashMap<String, SessionId>,
    /// Session → number of counted pods (a session may briefly have two).
    sessions: HashMap<SessionId, usize>,
}

impl View {
    fn insert(&mut self, key: String, sid: SessionId) {
        if let Some(old) = self.pods.insert(key, sid.clone()) {
            self.drop_session(&old);
        }
        *self.sessions.entry(sid).or_default() += 1;
    }

    fn remove(&mut self, key: &str) {
        if let Some(old) = self.pods.remove(key) {
            self.drop_session(&old);
        }
    }

    fn drop_session(&mut self, sid: &SessionId) {
        if let Some(n) = self.sessions.get_mut(sid) {
            *n -= 1;
            if *n == 0 {
                self.sessions.remove(sid);
            }
        }
    }

    fn contains(&self, sid: &SessionId) -> bool {
        self.sessions.contains_key(sid)
    }
}

/// How long a pod this replica deleted stays uncounted whatever the watch says of it alive.
/// The watch reports its deletion within moments; if that never comes (the delete failed
/// after all), the next report of it alive after this counts it again. Entries go when the
/// watch reports the pod going or gone, and any older than this when another pod is retired.
const RETIRED_FOR: Duration = Duration::from_secs(60);

/// A pod this replica claimed or created, not yet reported by its watch.
#[derive(Debug)]
struct Written {
    pod: String,
    at: Instant,
}

#[derive(Debug, Default)]
struct State {
    view: View,
    /// The watch's relist in progress: the new view being built, and when the relist began.
    relist: Option<(View, Instant)>,
    /// A list has completed at least once (a view built from events alone could miss pods).
    listed_once: bool,
    /// The view can be trusted: listed once, and no watch error since the last event.
    synced: bool,
    pending: HashSet<SessionId>,
    written: HashMap<SessionId, Written>,
    /// Pods this replica deleted (key → when) whose deletion the watch has not reported yet.
    retired: HashMap<String, Instant>,
}

impl State {
    /// Sessions counted against the limit other than `sid`, given the sessions of a `base`
    /// (the view, or a LIST).
    fn count_without(
        &self,
        sid: &SessionId,
        base_len: usize,
        in_base: impl Fn(&SessionId) -> bool,
    ) -> usize {
        let other = |s: &&SessionId| *s != sid && !in_base(s);
        let pending = self.pending.iter().filter(other).count();
        let written = self
            .written
            .keys()
            .filter(other)
            .filter(|s| !self.pending.contains(*s))
            .count();
        base_len - usize::from(in_base(sid)) + pending + written
    }

    /// The watch reported pod `key` (alive or not): a write of it no longer needs counting
    /// apart.
    fn seen(&mut self, key: &str) {
        self.written.retain(|_, w| w.pod != key);
    }

    /// An event after a watch error shows the watch delivering again from where it stopped
    /// (a watch that had to start over lists again first).
    fn resumed(&mut self) {
        if self.relist.is_none() && self.listed_once {
            self.synced = true;
        }
    }

    /// Whether a report of pod `key` alive is older than this replica's delete of it.
    fn stale(&self, key: &str, now: Instant) -> bool {
        self.retired
            .get(key)
            .is_some_and(|at| now.duration_since(*at) < RETIRED_FOR)
    }
}

/// The replica's view of the sessions admission counts; cheap to share (`Arc` inside).
#[derive(Debug, Clone)]
pub struct SessionView {
    state: Arc<Mutex<State>>,
    /// Woken after every change of the view (see [`SessionView::pods_after_write`]).
    changed: Arc<Notify>,
    max: usize,
}

impl SessionView {
    pub fn new(max: usize) -> Self {
        Self {
            state: Arc::new(Mutex::new(State::default())),
            changed: Arc::new(Notify::new()),
            max,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits `sid`, counting from the watch-fed view.
    pub fn reserve(&self, sid: &SessionId) -> Result<Pending, Refusal> {
        let mut st = self.lock();
        if !st.synced {
            return Err(Refusal::NotSynced);
        }
        let view = &st.view;
        let n = st.count_without(sid, view.sessions.len(), |s| view.contains(s));
        self.admit(&mut st, sid, n).map_err(Refusal::Limit)
    }

    /// Whether a new session `sid` would be refused right now, judged from a synced view in
    /// which `sid` has no pod: the caller can be told at once, without looking the session
    /// up in the API. `None` when only a lookup can tell (not synced, `sid` known, room).
    pub fn refuses_new(&self, sid: &SessionId) -> Option<LimitReached> {
        let st = self.lock();
        if !st.synced || st.view.contains(sid) || st.pending.contains(sid) {
            return None;
        }
        let view = &st.view;
        let n = st.count_without(sid, view.sessions.len(), |s| view.contains(s));
        (n >= self.max).then_some(LimitReached { max: self.max })
    }

    /// Whether the view (synced) has neither a pod nor a start of `sid`: a new session.
    pub fn unknown(&self, sid: &SessionId) -> bool {
        let st = self.lock();
        st.synced && !st.view.contains(sid) && !st.pending.contains(sid)
    }

    /// Whether no pod of `sid` has been seen or written by this replica: the view (synced)
    /// has none, and this replica is neither starting one nor has just written one its watch
    /// has not reported yet. Such a session is new but for a pod another replica wrote within
    /// the watch's lag, which the converge check after this replica's own write catches.
    pub fn unseen(&self, sid: &SessionId) -> bool {
        let st = self.lock();
        st.synced
            && !st.view.contains(sid)
            && !st.pending.contains(sid)
            && !st.written.contains_key(sid)
    }

    /// Admits `sid`, counting `listed` (the session ids of the assigned, not-terminating pods
    /// from a LIST that began after this call did) instead of the view.
    pub fn reserve_listed(
        &self,
        sid: &SessionId,
        listed: &HashSet<SessionId>,
    ) -> Result<Pending, LimitReached> {
        let mut st = self.lock();
        let n = st.count_without(sid, listed.len(), |s| listed.contains(s));
        self.admit(&mut st, sid, n)
    }

    fn admit(
        &self,
        st: &mut State,
        sid: &SessionId,
        counted: usize,
    ) -> Result<Pending, LimitReached> {
        if counted >= self.max {
            return Err(LimitReached { max: self.max });
        }
        st.pending.insert(sid.clone());
        Ok(Pending {
            view: self.clone(),
            sid: sid.clone(),
        })
    }

    /// How many pods `sid` has, once this replica's write of its pod `key` is in the view;
    /// `None` when the view cannot tell within `wait` (not synced, a relist in progress, the
    /// pod not reported or gone): then only a LIST can.
    ///
    /// The converge check needs every pod of the session written before `key` was. A watch
    /// delivers events in the order the API server stored them, so once the watch reported
    /// `key`, it reported every earlier write too: of two replicas that each wrote a pod for
    /// one session, the later one sees both here, as it would in a LIST that began after its
    /// write — and without the LIST's round trip.
    pub async fn pods_after_write(
        &self,
        sid: &SessionId,
        key: &str,
        wait: Duration,
    ) -> Option<usize> {
        let answer = async {
            loop {
                // Registered before the check, so a change right after it still wakes us.
                let changed = self.changed.notified();
                {
                    let st = self.lock();
                    if !st.synced || st.relist.is_some() {
                        return None;
                    }
                    match st.view.pods.get(key) {
                        Some(s) if s == sid => return st.view.sessions.get(sid).copied(),
                        // Counted under another session: not ours to judge.
                        Some(_) => return None,
                        None => {}
                    }
                }
                changed.await;
            }
        };
        tokio::time::timeout(wait, answer).await.ok().flatten()
    }

    /// Sessions the view counts now (for the `sessions_active` gauge), when it is synced.
    pub fn live_sessions(&self) -> Option<usize> {
        let st = self.lock();
        st.synced.then(|| st.view.sessions.len())
    }

    /// The watch starts a (re)list.
    pub fn relist_started(&self, now: Instant) {
        self.lock().relist = Some((View::default(), now));
        self.changed.notify_waiters();
    }

    /// One pod of the (re)list.
    pub fn relisted(&self, pod: PodView) {
        let mut st = self.lock();
        if pod.terminating {
            st.retired.remove(&pod.key);
        }
        if st.stale(&pod.key, Instant::now()) {
            return;
        }
        if let (Some((view, _)), Some(sid), false) =
            (st.relist.as_mut(), pod.session, pod.terminating)
        {
            view.insert(pod.key, sid);
        }
    }

    /// The (re)list is complete and replaces the view. Every pod this replica wrote before
    /// the list began is in it, or is gone.
    pub fn relist_done(&self) {
        let mut st = self.lock();
        let Some((view, began)) = st.relist.take() else {
            return;
        };
        st.view = view;
        let State { view, written, .. } = &mut *st;
        written.retain(|_, w| w.at >= began && !view.pods.contains_key(&w.pod));
        st.listed_once = true;
        st.synced = true;
        drop(st);
        self.changed.notify_waiters();
    }

    /// A pod was added or changed.
    pub fn applied(&self, pod: PodView) {
        let mut st = self.lock();
        st.seen(&pod.key);
        match (pod.session, pod.terminating) {
            (Some(_), false) if st.stale(&pod.key, Instant::now()) => {}
            (Some(sid), false) => st.view.insert(pod.key, sid),
            _ => {
                st.retired.remove(&pod.key);
                st.view.remove(&pod.key);
            }
        }
        st.resumed();
        drop(st);
        self.changed.notify_waiters();
    }

    /// A pod was deleted.
    pub fn deleted(&self, pod: PodView) {
        let mut st = self.lock();
        st.seen(&pod.key);
        st.retired.remove(&pod.key);
        st.view.remove(&pod.key);
        st.resumed();
        drop(st);
        self.changed.notify_waiters();
    }

    /// This replica deleted pod `key` (`DELETE /sessions/{id}`): its place is free now, and
    /// reports of it alive that the watch still delivers are older than the delete.
    pub fn retired(&self, key: &str) {
        let mut st = self.lock();
        let now = Instant::now();
        st.retired
            .retain(|_, at| now.duration_since(*at) < RETIRED_FOR);
        st.retired.insert(key.to_owned(), now);
        st.seen(key);
        st.view.remove(key);
        // A relist that listed it before the delete must not bring it back either.
        if let Some((relist, _)) = st.relist.as_mut() {
            relist.remove(key);
        }
        drop(st);
        self.changed.notify_waiters();
    }

    /// The watch failed: until it is seen working again, admission counts from a LIST.
    pub fn watch_failed(&self) {
        self.lock().synced = false;
        self.changed.notify_waiters();
    }
}

/// A place among the sessions being started, given back when dropped (also when the call is
/// dropped) unless [`Pending::written`] handed it on.
#[derive(Debug)]
pub struct Pending {
    view: SessionView,
    sid: SessionId,
}

impl Pending {
    /// The session's pod `pod` (its uid) was claimed or created: counted until the watch
    /// reports that pod.
    pub fn written(&self, pod: &str) {
        let mut st = self.view.lock();
        st.pending.remove(&self.sid);
        if !st.view.pods.contains_key(pod) {
            let w = Written {
                pod: pod.to_owned(),
                at: Instant::now(),
            };
            st.written.insert(self.sid.clone(), w);
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.view.lock().pending.remove(&self.sid);
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    fn sid(s: &str) -> SessionId {
        SessionId::parse(s).expect("session id")
    }

    fn pod(key: &str, session: &str) -> PodView {
        PodView {
            key: key.into(),
            session: Some(sid(session)),
            terminating: false,
        }
    }

    /// An admission whose watch has listed `pods`.
    fn synced(max: usize, pods: &[(&str, &str)]) -> SessionView {
        let a = SessionView::new(max);
        a.relist_started(Instant::now());
        for (key, session) in pods {
            a.relisted(pod(key, session));
        }
        a.relist_done();
        a
    }

    fn limit<E>(r: Result<Pending, E>) -> E {
        r.expect_err("refused")
    }

    const FULL: Refusal = Refusal::Limit(LimitReached { max: 2 });

    #[test]
    fn nothing_is_admitted_from_a_view_that_was_never_listed() {
        let a = SessionView::new(10);
        assert_eq!(limit(a.reserve(&sid("a"))), Refusal::NotSynced);
        a.applied(pod("p1", "x"));
        assert_eq!(
            limit(a.reserve(&sid("a"))),
            Refusal::NotSynced,
            "events alone do not make a complete view"
        );
    }

    #[test]
    fn the_view_counts_sessions_not_pods() {
        let a = synced(2, &[("p1", "x"), ("p2", "x")]);
        let r = a.reserve(&sid("a")).expect("x counts once");
        assert_eq!(limit(a.reserve(&sid("b"))), FULL);
        drop(r);
        assert!(
            a.reserve(&sid("b")).is_ok(),
            "a given-up reservation frees its place"
        );
    }

    #[test]
    fn concurrent_reservations_never_exceed_the_limit() {
        let a = synced(3, &[("p1", "x")]);
        let held: Vec<_> = ["a", "b", "c", "d"]
            .iter()
            .filter_map(|s| a.reserve(&sid(s)).ok())
            .collect();
        assert_eq!(held.len(), 2, "x plus two new sessions");
    }

    #[test]
    fn a_written_pod_stays_counted_until_the_watch_reports_it_and_then_once() {
        let a = synced(2, &[]);
        let r = a.reserve(&sid("a")).expect("first");
        r.written("uid-a");
        drop(r);
        let r = a.reserve(&sid("b")).expect("second");
        r.written("uid-b");
        drop(r);
        assert_eq!(
            limit(a.reserve(&sid("c"))),
            FULL,
            "written, not yet watched"
        );
        a.applied(pod("uid-a", "a"));
        a.applied(pod("uid-b", "b"));
        assert_eq!(limit(a.reserve(&sid("c"))), FULL);
        a.deleted(pod("uid-a", "a"));
        assert!(
            a.reserve(&sid("c")).is_ok(),
            "a deleted session frees its place"
        );
    }

    /// `DELETE /sessions/{id}` frees the place at once; the watch then still delivers the
    /// pod's retirement patch (alive, from before the delete): it must not count the pod
    /// again, and the new session of the caller is admitted. Its deletion, when the watch
    /// reports it, ends the matter.
    #[test]
    fn a_deleted_session_stays_uncounted_when_older_events_of_its_pod_arrive() {
        let a = synced(2, &[("uid-a", "a"), ("uid-x", "x")]);
        assert_eq!(limit(a.reserve(&sid("b"))), FULL);
        a.retired("uid-a");
        a.applied(pod("uid-a", "a"));
        let r = a.reserve(&sid("b")).expect("the place a's DELETE freed");
        r.written("uid-b");
        drop(r);
        a.applied(pod("uid-b", "b"));
        let mut gone = pod("uid-a", "a");
        gone.terminating = true;
        a.applied(gone);
        a.deleted(pod("uid-a", "a"));
        assert!(a.lock().retired.is_empty(), "forgotten once seen going");
        assert_eq!(limit(a.reserve(&sid("c"))), FULL, "b counts");
    }

    /// A delete that did not happen after all: the pod counts again once the watch keeps
    /// reporting it alive past [`RETIRED_FOR`].
    #[test]
    fn a_retired_pod_the_watch_still_reports_alive_counts_again_after_a_while() {
        let a = synced(2, &[("uid-a", "a"), ("uid-x", "x")]);
        a.retired("uid-a");
        // As if retired RETIRED_FOR ago (a machine up for less than that has no such instant).
        let Some(long_ago) = Instant::now().checked_sub(RETIRED_FOR) else {
            return;
        };
        a.lock().retired.insert("uid-a".into(), long_ago);
        a.applied(pod("uid-a", "a"));
        assert_eq!(limit(a.reserve(&sid("b"))), FULL);
    }

    /// The watch started over and listed the pod alive just before `DELETE` retired it: the
    /// relist, once done, must not count it again.
    #[test]
    fn a_relist_that_listed_a_pod_before_its_delete_does_not_count_it() {
        let a = synced(2, &[("uid-a", "a"), ("uid-x", "x")]);
        a.relist_started(Instant::now());
        a.relisted(pod("uid-a", "a"));
        a.relisted(pod("uid-x", "x"));
        a.retired("uid-a");
        a.relist_done();
        assert!(a.reserve(&sid("b")).is_ok(), "a's place is free");
    }

    #[test]
    fn a_pod_the_watch_reported_before_its_write_returned_is_not_counted_twice_nor_leaked() {
        let a = synced(2, &[]);
        let r = a.reserve(&sid("a")).expect("first");
        a.applied(pod("uid-a", "a"));
        r.written("uid-a");
        drop(r);
        let held = a.reserve(&sid("b")).expect("a counts once");
        drop(held);
        a.deleted(pod("uid-a", "a"));
        let r1 = a.reserve(&sid("b")).expect("the place of a is free");
        let r2 = a.reserve(&sid("c")).expect("both places are free");
        drop((r1, r2));
    }

    #[test]
    fn the_old_pod_of_a_session_going_does_not_uncount_its_new_pod() {
        let a = synced(1, &[("old", "a")]);
        a.applied(PodView {
            terminating: true,
            ..pod("old", "a")
        });
        let r = a.reserve(&sid("a")).expect("a again");
        r.written("new");
        drop(r);
        a.deleted(pod("old", "a"));
        assert_eq!(
            limit(a.reserve(&sid("b"))),
            Refusal::Limit(LimitReached { max: 1 }),
            "the new pod of a still counts"
        );
    }

    #[test]
    fn terminating_pods_do_not_count() {
        let a = synced(1, &[("p1", "x")]);
        assert_eq!(
            limit(a.reserve(&sid("a"))),
            Refusal::Limit(LimitReached { max: 1 })
        );
        a.applied(PodView {
            terminating: true,
            ..pod("p1", "x")
        });
        assert!(a.reserve(&sid("a")).is_ok());
    }

    #[test]
    fn a_full_synced_view_refuses_unknown_sessions_without_a_lookup() {
        let a = synced(1, &[("p1", "x")]);
        assert_eq!(a.refuses_new(&sid("y")), Some(LimitReached { max: 1 }));
        assert_eq!(a.refuses_new(&sid("x")), None, "x has a pod: look it up");
        a.watch_failed();
        assert_eq!(
            a.refuses_new(&sid("y")),
            None,
            "a stale view decides nothing"
        );
        let b = synced(2, &[("p1", "x")]);
        assert_eq!(b.refuses_new(&sid("y")), None, "room: look it up");
    }

    #[test]
    fn the_session_being_started_does_not_count_against_itself() {
        let a = synced(1, &[("p1", "a")]);
        assert!(
            a.reserve(&sid("a")).is_ok(),
            "a replaces its own pod, the count does not grow"
        );
    }

    #[test]
    fn after_a_watch_error_admission_counts_from_a_list_until_the_watch_delivers_again() {
        let a = synced(2, &[("p1", "x")]);
        a.watch_failed();
        assert_eq!(limit(a.reserve(&sid("a"))), Refusal::NotSynced);
        let listed: HashSet<_> = [sid("x"), sid("y")].into();
        assert_eq!(
            limit(a.reserve_listed(&sid("a"), &listed)),
            LimitReached { max: 2 },
            "the list is what counts, not the stale view"
        );
        let listed: HashSet<_> = HashSet::new();
        let r = a.reserve_listed(&sid("a"), &listed).expect("room");
        r.written("uid-a");
        drop(r);
        assert_eq!(
            limit(a.reserve_listed(&sid("b"), &[sid("x")].into())),
            LimitReached { max: 2 },
            "x from the list, a written by this replica"
        );
        a.applied(pod("p2", "y"));
        assert!(
            a.reserve(&sid("b")).is_err(),
            "the watch delivers again: x, y in the view, a written"
        );
    }

    #[test]
    fn a_relist_replaces_the_view_and_forgets_writes_it_covers() {
        let a = synced(2, &[("p1", "x")]);
        let r = a.reserve(&sid("a")).expect("room");
        r.written("uid-a");
        drop(r);
        a.watch_failed();
        // The pod of a was deleted while the watch was down; the relist does not have it.
        a.relist_started(Instant::now());
        a.relisted(pod("p1", "x"));
        assert_eq!(
            limit(a.reserve(&sid("b"))),
            Refusal::NotSynced,
            "not during the relist"
        );
        a.relist_done();
        let r = a
            .reserve(&sid("b"))
            .expect("a's write is covered by the list");
        drop(r);
        assert_eq!(a.live_sessions(), Some(1));
    }

    #[test]
    fn a_write_after_the_relist_began_survives_it() {
        let a = synced(1, &[]);
        a.watch_failed();
        a.relist_started(Instant::now());
        let r = a.reserve_listed(&sid("a"), &HashSet::new()).expect("room");
        r.written("uid-a");
        drop(r);
        a.relist_done();
        assert_eq!(
            limit(a.reserve(&sid("b"))),
            Refusal::Limit(LimitReached { max: 1 })
        );
    }

    const WAIT: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn a_write_is_judged_once_the_watch_reports_it_with_every_earlier_pod() {
        let a = synced(10, &[]);
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.pods_after_write(&sid("s"), "ours", WAIT).await }
        });
        // Another replica's pod of the session came first, then ours.
        a.applied(pod("theirs", "s"));
        a.applied(pod("ours", "s"));
        assert_eq!(waiting.await.expect("joined"), Some(2));
        // Alone, and already reported before the check began.
        let b = synced(10, &[("only", "t")]);
        assert_eq!(b.pods_after_write(&sid("t"), "only", WAIT).await, Some(1));
    }

    #[tokio::test]
    async fn a_view_that_cannot_tell_sends_the_check_to_a_list() {
        // Never listed.
        let a = SessionView::new(10);
        assert_eq!(a.pods_after_write(&sid("s"), "ours", WAIT).await, None);
        // The watch fails while we wait.
        let a = synced(10, &[]);
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.pods_after_write(&sid("s"), "ours", WAIT).await }
        });
        a.applied(pod("other", "x"));
        a.watch_failed();
        assert_eq!(waiting.await.expect("joined"), None);
        // A relist begins while we wait.
        let a = synced(10, &[]);
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.pods_after_write(&sid("s"), "ours", WAIT).await }
        });
        a.relist_started(Instant::now());
        assert_eq!(waiting.await.expect("joined"), None);
        // The pod is never reported: the wait ends.
        let a = synced(10, &[]);
        assert_eq!(
            a.pods_after_write(&sid("s"), "ours", Duration::from_millis(1))
                .await,
            None
        );
    }
}
