//! The replica's view of the instance's warm pool (its unassigned sandbox pods), fed by a
//! watch: a warm claim picks its candidates here instead of listing the pool, one API round
//! trip less on every warm start.
//!
//! The view only picks candidates, as a LIST did: the claim is a merge patch guarded by the
//! pod's `resourceVersion` as the view has it, so a pod another replica claimed meanwhile (or
//! whose status changed) costs a 409, then a GET of the pod, never a second owner. While the
//! view cannot be trusted (before its first list, after a watch error until the watch has
//! listed again) the claim lists the pool as before.
//!
//! Which of its pods a claim may try is decided here too ([`PoolFit`]): Ready,
//! this replica's config and key, and sealed by the operator for its uid (a look-alike
//! planted under a warm pod's name has everything else).
//!
//! Only the pool is kept (its size is `warmPoolSize`, tens of pods), without
//! `managedFields`; a claimed pod leaves the view as soon as its claim patch succeeds (its
//! new `session-id` label takes it out of the watch's selector, and the watch's deletion
//! event follows).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use rand::seq::SliceRandom;
use tokio_util::sync::CancellationToken;

use cli_mcp_api::names::annotation;
use cli_mcp_api::pod_state::{is_deleting, is_ready};
use cli_mcp_api::sandbox::made_for_key;
use cli_mcp_api::seal::sealed;
use cli_mcp_api::token::HmacKey;

use crate::sessions::kubernetes::feed::{feed, WatchFed};
use crate::sessions::kubernetes::pods::{annotation_of, pod_ip};

#[derive(Debug, Default)]
struct State {
    /// Pod name → pod.
    pods: HashMap<String, Pod>,
    /// The watch's (re)list in progress.
    relist: Option<HashMap<String, Pod>>,
    /// Listed once, and no watch error since.
    synced: bool,
}

/// The replica's view of the warm pool; cheap to share.
#[derive(Debug, Clone, Default)]
pub struct WarmPool {
    state: Arc<Mutex<State>>,
}

fn trimmed(mut p: Pod) -> Pod {
    p.metadata.managed_fields = None;
    p
}

impl WarmPool {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The unassigned pods as the watch last reported them; `None` while the view cannot be
    /// trusted (list the pool instead).
    /// Only the pods `keep` accepts are cloned: a claim wants the few it could take, not a
    /// copy of the whole pool.
    pub fn pods(&self, keep: impl Fn(&Pod) -> bool) -> Option<Vec<Pod>> {
        let st = self.lock();
        st.synced
            .then(|| st.pods.values().filter(|p| keep(p)).cloned().collect())
    }

    /// Pod `name` was claimed (or found taken) by this replica: not offered again, though the
    /// watch may not have said so yet.
    pub fn taken(&self, name: &str) {
        self.lock().pods.remove(name);
    }
}

/// The unassigned pods, from the watch.
impl WatchFed<Pod> for WarmPool {
    fn relist_started(&self) {
        self.lock().relist = Some(HashMap::new());
    }

    fn relisted(&self, p: Pod) {
        if let Some(r) = self.lock().relist.as_mut() {
            r.insert(p.name_any(), trimmed(p));
        }
    }

    fn relist_done(&self) {
        let mut st = self.lock();
        if let Some(r) = st.relist.take() {
            st.pods = r;
            st.synced = true;
        }
    }

    fn applied(&self, p: Pod) {
        self.lock().pods.insert(p.name_any(), trimmed(p));
    }

    fn deleted(&self, p: Pod) {
        let mut st = self.lock();
        // A pod of the same name recreated since is kept (another uid).
        if st
            .pods
            .get(&p.name_any())
            .is_some_and(|q| q.uid() == p.uid())
        {
            st.pods.remove(&p.name_any());
        }
    }

    fn failed(&self, error: watcher::Error) {
        self.lock().synced = false;
        tracing::debug!(%error, "warm pool watch error (retrying)");
    }
}

impl WarmPool {
    /// Keeps this view from the watch of the pool (`selector`: the instance's unassigned
    /// sandbox pods).
    pub async fn watch(self, pods: Api<Pod>, selector: String, stop: CancellationToken) {
        let cfg = watcher::Config::default().labels(&selector);
        let events = watcher::watcher(pods, cfg).default_backoff();
        feed(events, &self, &stop).await;
    }
}

/// Which warm pods a claim may try: those of this replica's sandbox config (`cfg_hash`),
/// made for its key and sealed by the operator.
#[derive(Debug, Clone)]
pub struct PoolFit {
    cfg_hash: String,
    key: HmacKey,
}

impl PoolFit {
    pub fn new(cfg_hash: String, key: HmacKey) -> Self {
        Self { cfg_hash, key }
    }

    /// Whether this replica could claim warm pod `p`: what [`Self::claimable`] keeps.
    pub fn could_claim(&self, p: &Pod) -> bool {
        !is_deleting(p)
            && is_ready(p)
            && pod_ip(p).is_some()
            && annotation_of(p, annotation::SANDBOX_HASH) == Some(self.cfg_hash.as_str())
            && made_for_key(p, &self.key)
            && sealed(p, &self.key)
    }

    /// The pods of `pool` this replica can claim, in random order (concurrent claimers spread
    /// over the pool instead of all fighting for the first pod). `listed`: `pool` is what the
    /// API has, not the view, so a pool with none that fits is worth a warning.
    pub fn claimable(&self, pool: Vec<Pod>, listed: bool) -> Vec<Pod> {
        let total = pool.len();
        let mut candidates: Vec<Pod> = pool
            .into_iter()
            .filter(|p| !is_deleting(p) && is_ready(p) && pod_ip(p).is_some())
            .collect();
        let ready = candidates.len();
        candidates
            .retain(|p| annotation_of(p, annotation::SANDBOX_HASH) == Some(self.cfg_hash.as_str()));
        if listed && candidates.is_empty() && ready > 0 {
            tracing::warn!(ready, hash = %self.cfg_hash,
                "warm pods exist but none has this server's sandbox-hash; creating on demand (is the operator's sandbox config the same as --sandbox-config?)");
        }
        // A pod made for another HMAC key would refuse this replica's /assign: leave it to
        // the operator instead of claiming and then deleting it (while the key is rotated,
        // the replica being replaced would otherwise burn the new pool).
        let same_config = candidates.len();
        candidates.retain(|p| made_for_key(p, &self.key));
        if listed && candidates.is_empty() && same_config > 0 {
            tracing::warn!(warm = same_config,
                "warm pods exist but none was made for this replica's HMAC key (the key was rotated: this replica or the pool is outdated); creating on demand");
        }
        // Only a pod the operator sealed for its uid is one: anyone who may create pods can
        // plant a look-alike under a warm pod's name, with its labels, annotations and env.
        candidates.retain(|p| {
            let ok = sealed(p, &self.key);
            if !ok && listed {
                tracing::warn!(pod = %p.name_any(),
                    "warm pod has no valid seal for its uid (planted under a pool pod's name, or its seal is still on the way); not claiming it");
            }
            ok
        });
        tracing::debug!(total, ready, usable = candidates.len(), listed, "warm pool");
        candidates.shuffle(&mut rand::rng());
        candidates
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use cli_mcp_api::names::PoolSuffix;
    use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxRole};

    use crate::sessions::kubernetes::testing::{cfg, key, planted_namesake, stored_and_sealed};

    fn pod(name: &str, uid: &str) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.metadata.uid = Some(uid.into());
        p.metadata.managed_fields = Some(vec![Default::default()]);
        p
    }

    fn names(w: &WarmPool) -> Vec<String> {
        let mut n: Vec<String> = w
            .pods(|_| true)
            .expect("synced")
            .iter()
            .map(|p| p.name_any())
            .collect();
        n.sort();
        n
    }

    #[test]
    fn the_view_is_offered_only_once_listed_and_not_after_a_watch_error() {
        let w = WarmPool::default();
        assert!(w.pods(|_| true).is_none(), "never listed");
        w.relist_started();
        w.relisted(pod("a", "1"));
        assert!(w.pods(|_| true).is_none(), "list in progress");
        w.relist_done();
        assert_eq!(names(&w), ["a"]);
        assert!(
            w.pods(|_| true).expect("synced")[0]
                .metadata
                .managed_fields
                .is_none(),
            "managedFields are not kept"
        );
        w.failed(watcher::Error::NoResourceVersion);
        assert!(
            w.pods(|_| true).is_none(),
            "a watch error: list the pool instead"
        );
        w.relist_started();
        w.relisted(pod("b", "2"));
        w.relist_done();
        assert_eq!(names(&w), ["b"], "the relist replaces the view");
    }

    #[test]
    fn claimed_and_deleted_pods_leave_the_view_but_not_a_recreated_namesake() {
        let w = WarmPool::default();
        w.relist_started();
        w.relist_done();
        w.applied(pod("a", "1"));
        w.applied(pod("b", "2"));
        w.applied(pod("c", "3"));
        w.taken("a");
        w.deleted(pod("b", "2"));
        w.deleted(pod("c", "old"));
        assert_eq!(names(&w), ["c"]);
        w.applied(pod("d", "4"));
        let kept = w.pods(|p| p.name_any() == "d").expect("synced");
        assert_eq!(
            kept.len(),
            1,
            "only the pods the claim could take are copied"
        );
    }

    fn warm_pod() -> Pod {
        let suffix = PoolSuffix::from_random_bytes([4; PoolSuffix::LEN]);
        let name = cfg().instance.pool_pod(&suffix);
        let assign = key().assign_token(&name).commitment();
        let p = build_sandbox_pod(&cfg(), &SandboxRole::Pool { suffix, assign }, "t");
        stored_and_sealed(p, "uid-warm")
    }

    #[tokio::test]
    async fn a_planted_warm_namesake_is_never_claimable() {
        let b = PoolFit::new(cfg().hash(), key());
        let original = warm_pod();
        let planted = planted_namesake(&original);
        assert!(b.could_claim(&original));
        assert!(!b.could_claim(&planted), "the view's filter");
        let listed = b.claimable(vec![planted.clone()], true);
        assert!(listed.is_empty(), "a listed pool");
        let mut unsealed = original.clone();
        unsealed.annotations_mut().remove(annotation::SEAL);
        assert!(!b.could_claim(&unsealed));
        let both = b.claimable(vec![planted, original.clone(), unsealed], false);
        assert_eq!(both.len(), 1);
        assert_eq!(both[0].uid(), original.uid());
    }

    #[test]
    fn a_pod_of_another_config_or_key_is_not_claimed() {
        let original = warm_pod();
        let fit = PoolFit::new(cfg().hash(), key());
        let mut other_config = original.clone();
        other_config
            .annotations_mut()
            .insert(annotation::SANDBOX_HASH.into(), "another".into());
        assert!(!fit.could_claim(&other_config));
        assert!(fit.claimable(vec![other_config], true).is_empty());
        let rotated = PoolFit::new(cfg().hash(), HmacKey::from_bytes([9; 32]));
        assert!(!rotated.could_claim(&original), "made for the old key");
        assert!(rotated.claimable(vec![original], true).is_empty());
    }
}
