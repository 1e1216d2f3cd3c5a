//! Admission of new sessions: everything that decides whether a session may start, and
//! holds its place while it does. [`Admission::admit`] charges the caller's rate
//! ([`rate`], when set), reserves a place under `--max-sessions` in the replica's view of
//! the sessions ([`view`], fed by the pod watch; from a LIST while that view cannot be
//! trusted), and takes the session's slots ([`slots`], [`slot_leases`]), which make the
//! bounds hold across replicas, with `--max-sessions-per-client`. What it returns, a
//! [`Reservation`], gives all of that back when dropped unused.
//!
//! The parts outside a start are here too: the slots' watch and sweep ([`slot_feed`]), the
//! `sessions_active` gauge, and freeing a session's places when `DELETE /sessions/{id}` ends
//! it.

mod rate;
mod slot_feed;
mod slot_leases;
mod slots;
mod view;

pub use slot_leases::{SlotHold, SlotLeases};
pub use view::{PodView, SessionView};

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;

use cli_mcp_api::names::{label, InstanceName};
use cli_mcp_api::SessionId;

use super::pods::pod_key;
use super::steps::timed;
use crate::auth::Caller;
use crate::cli::Limits;
use crate::metrics::{Admitted, Metrics};
use crate::sessions::{Quota, SessionError};
use rate::{Charge, NewSessionRate};
use slots::client_tag;
use view::{LimitReached, Pending, Refusal};

/// Longest a new session waits for the LIST that admission counts from while its pod watch
/// cannot be trusted (see [`SessionView`]).
const ADMISSION_LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the `sessions_active` gauge is refreshed (from the pod watch's view, or a LIST
/// while that view cannot be trusted).
const GAUGE_REFRESH: Duration = Duration::from_secs(15);

/// The replica's admission of new sessions (see the module's doc).
#[derive(Debug)]
pub struct Admission {
    /// The sessions counted under `--max-sessions`, fed by the pod watch.
    view: SessionView,
    /// The session slots, and this replica's view of them.
    leases: SlotLeases,
    /// `--new-sessions-per-minute-per-client`, when set.
    rate: Option<NewSessionRate>,
    /// The instance's pods, for a LIST while the view cannot be trusted.
    pods: Api<Pod>,
    instance: InstanceName,
    metrics: Arc<Metrics>,
}

/// A new session's admission: its rate charge, its place among the sessions being started,
/// and its slots. Everything it holds is given back when dropped, but for what the start
/// handed on ([`Reservation::written`], [`SlotHold::bind`], [`Reservation::keep_charge`]).
#[derive(Debug)]
pub struct Reservation<'a> {
    charge: Option<Charge<'a>>,
    pending: Pending,
    slots: SlotHold,
}

impl Reservation<'_> {
    /// The session's pod (its [`pod_key`]) was claimed or created: counted until the watch
    /// reports that pod.
    pub fn written(&self, pod: &str) {
        self.pending.written(pod);
    }

    /// The session's slots, to bind to its pod.
    pub fn slots(&mut self) -> &mut SlotHold {
        &mut self.slots
    }

    /// Slots still held were not bound to a pod of this session: freed now.
    pub fn free_unbound_slots(&mut self) {
        self.slots.release_all();
    }

    /// The session started: it stays charged to its caller's rate.
    pub fn keep_charge(&mut self) {
        if let Some(c) = self.charge.take() {
            c.keep();
        }
    }
}

impl Admission {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        instance: InstanceName,
        limits: &Limits,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            view: SessionView::new(limits.max_sessions),
            leases: SlotLeases::new(
                client.clone(),
                namespace,
                instance.clone(),
                limits.max_sessions,
                limits.max_sessions_per_client,
            ),
            rate: limits
                .new_sessions_per_minute_per_client
                .map(NewSessionRate::new),
            pods: Api::namespaced(client, namespace),
            instance,
            metrics,
        }
    }

    /// The sessions counted under `--max-sessions` (fed by the pod watch; the converge check
    /// reads it too).
    pub fn view(&self) -> &SessionView {
        &self.view
    }

    /// The session slots (their watch, and freeing those of a pod that goes).
    pub fn slots(&self) -> &SlotLeases {
        &self.leases
    }

    /// A new session `sid` of `caller` that the views (synced) already show over a limit:
    /// refused before any API call, so callers over a limit cost nothing. A pod or slot
    /// another replica wrote within the watches' lag is missed: that caller is refused once,
    /// and its next call finds it.
    pub fn refuse_at_once(
        &self,
        sid: &SessionId,
        caller: &Caller,
        t0: Instant,
    ) -> Result<(), SessionError> {
        let Some(quota) = self.refuses_new(sid, caller) else {
            return Ok(());
        };
        self.metrics.admission(Admitted::Refused, t0.elapsed());
        Err(SessionError::SessionLimit(quota))
    }

    fn refuses_new(&self, sid: &SessionId, caller: &Caller) -> Option<Quota> {
        refused_by_views(&self.view, sid, || self.leases.full_for(caller))
    }

    /// A new session of `caller`: charged to its rate (when set), admitted, its slots taken.
    /// Everything it holds is given back when dropped unused.
    pub async fn admit(
        &self,
        sid: &SessionId,
        caller: &Caller,
        t0: Instant,
    ) -> Result<Reservation<'_>, SessionError> {
        let charge = match &self.rate {
            None => None,
            Some(rate) => Some(rate.charge(&client_tag(caller)).map_err(|retry_after| {
                self.metrics.admission(Admitted::Refused, t0.elapsed());
                SessionError::SessionLimit(Quota::Rate {
                    per_minute: rate.per_minute(),
                    retry_after,
                })
            })?),
        };
        let (pending, slots) = self.place(sid, caller).await?;
        Ok(Reservation {
            charge,
            pending,
            slots,
        })
    }

    /// Admits one new session under `--max-sessions` (see [`SessionView`]): from the pod
    /// watch's view, or from a LIST while that view cannot be trusted; then takes its slots
    /// (see [`slots`]), which makes the bound hold across replicas, with
    /// `--max-sessions-per-client`. The place must be held until the session's pod is
    /// written ([`Reservation::written`]) or the start gave up; the slots until they are bound
    /// to that pod.
    async fn place(
        &self,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<(Pending, SlotHold), SessionError> {
        let t0 = Instant::now();
        let r = match timed("admit", self.decide(sid)).await {
            Ok(pending) => timed("slots", self.leases.take(sid, caller))
                .await
                .map(|slots| (pending, slots)),
            Err(e) => Err(e),
        };
        match &r {
            Ok(_) => self.metrics.admission(Admitted::Admitted, t0.elapsed()),
            Err(SessionError::SessionLimit { .. }) => {
                self.metrics.admission(Admitted::Refused, t0.elapsed())
            }
            Err(_) => {}
        }
        r
    }

    async fn decide(&self, sid: &SessionId) -> Result<Pending, SessionError> {
        let limit = |LimitReached { max }| SessionError::SessionLimit(Quota::Instance { max });
        match self.view.reserve(sid) {
            Ok(r) => return Ok(r),
            Err(Refusal::Limit(l)) => return Err(limit(l)),
            Err(Refusal::NotSynced) => {}
        }
        let listed = tokio::time::timeout(ADMISSION_LIST_TIMEOUT, self.live_sessions())
            .await
            .map_err(|_| {
                SessionError::Kubernetes(format!(
                    "counting the instance's sessions took over {}s; retry shortly",
                    ADMISSION_LIST_TIMEOUT.as_secs()
                ))
            })??;
        self.view.reserve_listed(sid, &listed).map_err(limit)
    }

    /// Session ids of the assigned, not-terminating pods, from a LIST; updates the gauge.
    async fn live_sessions(&self) -> Result<HashSet<SessionId>, SessionError> {
        let list = self
            .pods
            .list_metadata(&ListParams::default().labels(&self.instance.assigned_selector()))
            .await?;
        let live: HashSet<SessionId> = list
            .items
            .into_iter()
            // A metadata-only list: no Pod to ask `pod_state` about.
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| p.metadata.labels?.remove(label::SESSION_ID))
            .filter_map(|s| SessionId::parse(&s).ok())
            .collect();
        self.metrics.sessions_active.set(live.len() as i64);
        Ok(live)
    }

    /// Refreshes the `sessions_active` gauge every [`GAUGE_REFRESH`] until `stop`.
    pub async fn keep_gauge(&self, stop: CancellationToken) {
        let mut tick = tokio::time::interval(GAUGE_REFRESH);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            if let Err(e) = self.refresh_gauge().await {
                tracing::debug!(error = %e, "cannot refresh sessions_active");
            }
        }
    }

    /// Refreshes the `sessions_active` gauge: from the pod watch's view, or a LIST while that
    /// view cannot be trusted.
    async fn refresh_gauge(&self) -> Result<(), SessionError> {
        match self.view.live_sessions() {
            Some(n) => {
                self.metrics.sessions_active.set(n as i64);
                Ok(())
            }
            None => self.live_sessions().await.map(drop),
        }
    }

    /// `DELETE /sessions/{id}` deleted `pod` of session `sid`: its places are free when
    /// DELETE answers (the caller's next new session must not be refused for the session it
    /// just ended): gone from this replica's count, and its slots deleted, not left to the
    /// pod watch or the garbage collector.
    pub async fn session_ended(&self, sid: &SessionId, pod: &Pod) {
        self.view.retired(&pod_key(pod));
        if let Some(uid) = pod.uid() {
            self.leases.release_of(sid, &uid).await;
        }
    }
}

/// The limit a new session `sid` is over in the views alone: the sessions' (synced, `sid`
/// unknown to it and over `--max-sessions`), else the slots' (`slots_full`, asked only for a
/// session the view does not know).
fn refused_by_views(
    view: &SessionView,
    sid: &SessionId,
    slots_full: impl FnOnce() -> Option<Quota>,
) -> Option<Quota> {
    if let Some(LimitReached { max }) = view.refuses_new(sid) {
        return Some(Quota::Instance { max });
    }
    if !view.unknown(sid) {
        return None;
    }
    slots_full()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(s: &str) -> SessionId {
        SessionId::parse(s).expect("session id")
    }

    /// A view whose watch has listed one pod of each of `sessions`.
    fn synced(max: usize, sessions: &[&str]) -> SessionView {
        let v = SessionView::new(max);
        v.relist_started(Instant::now());
        for s in sessions {
            v.relisted(PodView {
                key: format!("uid-{s}"),
                session: Some(sid(s)),
                terminating: false,
            });
        }
        v.relist_done();
        v
    }

    const CLIENT_FULL: Option<Quota> = Some(Quota::Client { max: 1 });

    #[test]
    fn a_full_view_of_the_sessions_refuses_before_the_slots_are_asked() {
        let v = synced(1, &["x"]);
        let refused = refused_by_views(&v, &sid("y"), || panic!("the slots are not asked"));
        assert!(matches!(refused, Some(Quota::Instance { max: 1 })));
    }

    #[test]
    fn full_slots_refuse_only_a_session_the_view_does_not_know() {
        let v = synced(5, &["x"]);
        assert!(matches!(
            refused_by_views(&v, &sid("y"), || CLIENT_FULL),
            Some(Quota::Client { max: 1 })
        ));
        assert!(
            refused_by_views(&v, &sid("x"), || CLIENT_FULL).is_none(),
            "x has a pod: looked up, not refused"
        );
        assert!(refused_by_views(&v, &sid("y"), || None).is_none(), "room");
    }

    #[test]
    fn a_view_that_cannot_be_trusted_refuses_nothing_at_once() {
        let v = SessionView::new(1);
        assert!(refused_by_views(&v, &sid("y"), || CLIENT_FULL).is_none());
    }
}
