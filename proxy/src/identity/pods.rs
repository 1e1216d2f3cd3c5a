//! The instance's sandbox pods as the proxy needs them, kept current by a watch, and the
//! revocation of every tunnel of a pod that stops serving its session.
//!
//! A request is served for a pod only while the pod is a live sandbox of this instance:
//! sealed under the instance key (a pod its server or operator made, whoever else may create
//! pods in the namespace), not being deleted, and assigned to a session. The moment the watch
//! shows otherwise (`DELETE /sessions/{id}`, the idle GC, the instance going: all delete the
//! pod), every tunnel admitted for it is told, so an open `kubectl get -w` is cut and not
//! just refused its next request.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::{Api, ResourceExt};
use tokio::sync::watch;

use cli_mcp_api::names::{annotation, label};
use cli_mcp_api::pod_state::{is_deleting, is_terminal};
use cli_mcp_api::proxy::SessionCaller;
use cli_mcp_api::seal::sealed;
use cli_mcp_api::token::HmacKey;

/// What the proxy knows of one sandbox pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    pub name: String,
    pub ip: Option<IpAddr>,
    /// The session it serves; `None` for a warm pod not yet assigned.
    pub session: Option<String>,
    pub caller: Option<SessionCaller>,
    pub sealed: bool,
    pub deleting: bool,
    /// Failed or Succeeded (evicted, say): its IP may already be another pod's.
    pub terminal: bool,
}

impl PodView {
    fn of(pod: &Pod, key: &HmacKey) -> Self {
        let labels = pod.labels();
        let annotations = pod.annotations();
        Self {
            name: pod.name_any(),
            ip: pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse::<IpAddr>().ok())
                .map(|ip| ip.to_canonical()),
            session: labels.get(label::SESSION_ID).cloned(),
            caller: annotations
                .get(annotation::CALLER)
                .and_then(|a| SessionCaller::from_annotation(a)),
            sealed: sealed(pod, key),
            deleting: is_deleting(pod),
            terminal: is_terminal(pod),
        }
    }

    /// The session this pod serves now, if it serves one at all.
    pub fn serving(&self) -> Option<&str> {
        (self.sealed && !self.deleting && !self.terminal)
            .then_some(self.session.as_deref())
            .flatten()
    }
}

/// One admitted pod's revocation: the session it was admitted for, and the sender its
/// tunnels listen to.
struct Admitted {
    session: String,
    ip: IpAddr,
    caller: Option<SessionCaller>,
    revoke: watch::Sender<bool>,
}

#[derive(Default)]
struct State {
    /// By uid.
    pods: HashMap<String, PodView>,
    admitted: HashMap<String, Admitted>,
    /// The uids seen since the watch's last (re)list began.
    relisting: Option<HashSet<String>>,
    /// Whether a first list has completed.
    synced: bool,
}

impl State {
    fn upsert(&mut self, uid: String, view: PodView) {
        if let Some(a) = self.admitted.get(&uid) {
            if view.serving() != Some(a.session.as_str())
                || view.ip != Some(a.ip)
                || view.caller != a.caller
            {
                self.revoke(&uid);
            }
        }
        if let Some(seen) = &mut self.relisting {
            seen.insert(uid.clone());
        }
        self.pods.insert(uid, view);
    }

    fn remove(&mut self, uid: &str) {
        self.pods.remove(uid);
        self.revoke(uid);
    }

    fn revoke(&mut self, uid: &str) {
        if let Some(a) = self.admitted.remove(uid) {
            let _ = a.revoke.send(true);
        }
    }
}

/// The sandbox pods of one instance, shared by every connection.
#[derive(Clone)]
pub struct Pods {
    state: Arc<Mutex<State>>,
    /// Bumped after every event, for [`Pods::changed`].
    events: Arc<watch::Sender<u64>>,
}

impl Default for Pods {
    fn default() -> Self {
        Self {
            state: Arc::default(),
            events: Arc::new(watch::Sender::new(0)),
        }
    }
}

/// A pod admitted for a session: the receiver flips to `true` once it no longer serves it.
#[derive(Debug, Clone)]
pub struct Admission {
    pub view: PodView,
    pub session: String,
    pub revoked: watch::Receiver<bool>,
}

impl Pods {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the first list of the pods has completed (before it, nothing is admitted).
    pub fn synced(&self) -> bool {
        self.lock().synced
    }

    /// The pod `uid` if it serves a session now; its tunnels share one revocation.
    pub fn admit(&self, uid: &str) -> Result<Admission, Option<PodView>> {
        let mut state = self.lock();
        let Some(view) = state.pods.get(uid).cloned() else {
            return Err(None);
        };
        let (Some(session), Some(ip)) = (view.serving().map(str::to_owned), view.ip) else {
            return Err(Some(view));
        };
        let admitted = state
            .admitted
            .entry(uid.to_owned())
            .or_insert_with(|| Admitted {
                session: session.clone(),
                ip,
                caller: view.caller.clone(),
                revoke: watch::channel(false).0,
            });
        Ok(Admission {
            view,
            session,
            revoked: admitted.revoke.subscribe(),
        })
    }

    /// [`Pods::admit`], waiting up to `lag` for the watch to catch up. A TokenReview just
    /// said the pod exists, so a pod the watch does not show yet, or shows before its seal
    /// or its session's claim, is the watch lagging behind the API server (a session's first
    /// command comes right after the claim). A pod being deleted is refused at once.
    pub async fn admit_within(
        &self,
        uid: &str,
        lag: std::time::Duration,
    ) -> Result<Admission, Option<PodView>> {
        let mut changes = self.events.subscribe();
        let deadline = tokio::time::Instant::now() + lag;
        loop {
            match self.admit(uid) {
                Ok(a) => return Ok(a),
                Err(Some(v)) if v.deleting || v.terminal => return Err(Some(v)),
                Err(view) => {
                    let next = tokio::time::timeout_at(deadline, changes.changed()).await;
                    if !matches!(next, Ok(Ok(()))) {
                        return Err(view);
                    }
                }
            }
        }
    }

    /// Applies one watch event.
    pub fn apply(&self, event: Event<Pod>, key: &HmacKey) {
        self.apply_locked(event, key);
        self.events.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn apply_locked(&self, event: Event<Pod>, key: &HmacKey) {
        let mut state = self.lock();
        match event {
            Event::Apply(pod) | Event::InitApply(pod) => {
                if let Some(uid) = pod.uid() {
                    state.upsert(uid, PodView::of(&pod, key));
                }
            }
            Event::Delete(pod) => {
                if let Some(uid) = pod.uid() {
                    state.remove(&uid);
                }
            }
            Event::Init => state.relisting = Some(HashSet::new()),
            Event::InitDone => {
                // A pod deleted while the watch was down has no Delete event: what the new
                // list did not show is gone.
                if let Some(seen) = state.relisting.take() {
                    let gone: Vec<String> = state
                        .pods
                        .keys()
                        .filter(|uid| !seen.contains(*uid))
                        .cloned()
                        .collect();
                    for uid in gone {
                        state.remove(&uid);
                    }
                }
                state.synced = true;
            }
        }
    }

    /// Keeps the view current until the task is dropped. Errors of the watch (the API server
    /// away, a 410) are retried with backoff by the watcher; meanwhile the last view holds.
    pub async fn watch(self, api: Api<Pod>, instance: String, key: HmacKey) {
        let selector = format!(
            "{}={instance},{}={}",
            label::INSTANCE,
            label::COMPONENT,
            label::COMPONENT_SANDBOX
        );
        let config = watcher::Config::default().labels(&selector);
        let stream = kube::runtime::WatchStreamExt::default_backoff(watcher::watcher(api, config));
        futures::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(event) => self.apply(event, &key),
                Err(e) => tracing::warn!(error = %e, "watching the sandbox pods failed; retrying"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli_mcp_api::seal::seal;
    use k8s_openapi::api::core::v1::PodStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use std::collections::BTreeMap;

    fn key() -> HmacKey {
        HmacKey::from_bytes([7; 32])
    }

    fn pod(uid: &str, session: Option<&str>, sealed_by: &HmacKey) -> Pod {
        let mut labels = BTreeMap::new();
        if let Some(s) = session {
            labels.insert(label::SESSION_ID.to_owned(), s.to_owned());
        }
        let annotations = BTreeMap::from([(
            annotation::SEAL.to_owned(),
            seal(sealed_by, "ns", &format!("p-{uid}"), uid),
        )]);
        Pod {
            metadata: ObjectMeta {
                name: Some(format!("p-{uid}")),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                labels: Some(labels),
                annotations: Some(annotations),
                ..Default::default()
            },
            status: Some(PodStatus {
                pod_ip: Some("10.0.0.5".into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn synced(pods: &[Pod]) -> Pods {
        let p = Pods::default();
        p.apply(Event::Init, &key());
        for pod in pods {
            p.apply(Event::InitApply(pod.clone()), &key());
        }
        p.apply(Event::InitDone, &key());
        p
    }

    #[test]
    fn only_a_sealed_assigned_live_pod_is_admitted() {
        let other = HmacKey::from_bytes([8; 32]);
        let p = synced(&[
            pod("a", Some("s1"), &key()),
            pod("warm", None, &key()),
            pod("plant", Some("s2"), &other),
        ]);
        let a = p.admit("a").expect("admitted");
        assert_eq!(a.session, "s1");
        assert_eq!(a.view.ip, Some("10.0.0.5".parse().unwrap()));
        assert!(p.admit("warm").is_err(), "a warm pod serves no session");
        assert!(p.admit("plant").is_err(), "sealed under another key");
        assert!(matches!(p.admit("nobody"), Err(None)));
    }

    #[test]
    fn deletion_revokes_every_tunnel_of_the_pod() {
        let p = synced(&[pod("a", Some("s1"), &key())]);
        let first = p.admit("a").expect("admitted");
        let second = p.admit("a").expect("admitted");
        let mut going = pod("a", Some("s1"), &key());
        going.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        p.apply(Event::Apply(going), &key());
        assert!(*first.revoked.borrow() && *second.revoked.borrow());
        assert!(
            p.admit("a").is_err(),
            "a pod being deleted is not admitted again"
        );
    }

    #[test]
    fn a_pod_gone_while_the_watch_was_down_is_revoked_by_the_relist() {
        let p = synced(&[pod("a", Some("s1"), &key()), pod("b", Some("s2"), &key())]);
        let a = p.admit("a").expect("admitted");
        let b = p.admit("b").expect("admitted");
        p.apply(Event::Init, &key());
        p.apply(Event::InitApply(pod("b", Some("s2"), &key())), &key());
        p.apply(Event::InitDone, &key());
        assert!(*a.revoked.borrow());
        assert!(!*b.revoked.borrow());
    }

    #[tokio::test]
    async fn a_connect_waits_for_a_watch_that_lags_behind_the_claim() {
        let p = synced(&[pod("a", None, &key())]);
        let waiting = {
            let p = p.clone();
            tokio::spawn(async move {
                p.admit_within("a", std::time::Duration::from_secs(30))
                    .await
            })
        };
        // Let the waiter see the warm pod and start waiting.
        tokio::task::yield_now().await;
        p.apply(Event::Apply(pod("a", Some("s1"), &key())), &key());
        let admitted = waiting.await.expect("join").expect("admitted once claimed");
        assert_eq!(admitted.session, "s1");
        // Deletion is never waited on; an unknown pod is refused when the time is up.
        let mut going = pod("a", Some("s1"), &key());
        going.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        p.apply(Event::Apply(going), &key());
        let at_once = p.admit_within("a", std::time::Duration::from_secs(30));
        assert!(
            tokio::time::timeout(std::time::Duration::from_secs(5), at_once)
                .await
                .expect("a pod being deleted is refused at once")
                .is_err()
        );
        let gone = p
            .admit_within("nobody", std::time::Duration::from_millis(10))
            .await;
        assert!(matches!(gone, Err(None)));
    }

    #[test]
    fn a_terminal_pod_serves_nothing_and_its_tunnels_are_cut() {
        // An evicted pod keeps its object, seal, session and IP, but the IP may be another
        // pod's by now.
        let p = synced(&[pod("a", Some("s1"), &key())]);
        let a = p.admit("a").expect("admitted");
        let mut evicted = pod("a", Some("s1"), &key());
        if let Some(s) = evicted.status.as_mut() {
            s.phase = Some("Failed".into());
        }
        p.apply(Event::Apply(evicted), &key());
        assert!(*a.revoked.borrow());
        assert!(p.admit("a").is_err());
    }

    #[test]
    fn a_changed_caller_cuts_the_tunnels_admitted_for_the_old_one() {
        let p = synced(&[pod("a", Some("s1"), &key())]);
        let a = p.admit("a").expect("admitted");
        let mut other = pod("a", Some("s1"), &key());
        other
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(
                annotation::CALLER.to_owned(),
                r#"{"user":"mallory","groups":[]}"#.to_owned(),
            );
        p.apply(Event::Apply(other), &key());
        assert!(*a.revoked.borrow());
    }

    #[test]
    fn a_pod_reassigned_or_unlabelled_is_revoked() {
        let p = synced(&[pod("a", Some("s1"), &key())]);
        let a = p.admit("a").expect("admitted");
        p.apply(Event::Apply(pod("a", Some("s1"), &key())), &key());
        assert!(!*a.revoked.borrow(), "an unchanged pod keeps its tunnels");
        p.apply(Event::Apply(pod("a", None, &key())), &key());
        assert!(*a.revoked.borrow());
    }
}
