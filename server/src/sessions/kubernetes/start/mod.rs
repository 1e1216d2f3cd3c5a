//! Starting a session's sandbox: claim a warm pool pod ([`claim`]: guarded patch, then
//! `/assign`), else create the session's own pod ([`create`]: deterministic name, so
//! concurrent creators adopt one pod), wait for it to be Ready, and converge with other
//! replicas that did the same. [`warm`] is the replica's view of the warm pool, where claims
//! find their candidates.
//!
//! [`Starter`] owns what only a start needs (the warm pool, the sandbox config); what it
//! shares with the rest of the backend comes in as [`Shared`]: the pods, the lookup (a pod
//! another replica gave the session is adopted), the agent wait, and the view of the
//! sessions (the converge check).

mod claim;
mod create;
mod warm;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;

use cli_mcp_api::pod_state::is_deleting;
use cli_mcp_api::sandbox::SandboxConfig;
use cli_mcp_api::token::HmacKey;
use cli_mcp_api::SessionId;

use super::admission::{Reservation, SessionView};
use super::agent_wait::AgentWait;
use super::lookup::Lookup;
use super::pods::{pod_key, SandboxPods};
use super::steps::timed;
use crate::auth::Caller;
use crate::metrics::{Launch, Metrics};
use crate::sessions::SessionError;
use warm::{PoolFit, WarmPool};

/// How long the converge check waits for the pod watch to report the pod just written before
/// it asks the API with a LIST instead (the watch usually reports it within milliseconds).
const CONVERGE_VIEW_WAIT: Duration = Duration::from_millis(500);

/// What a start shares with the rest of the backend.
pub struct Shared {
    pub pods: SandboxPods,
    /// Adopting a pod another replica gave the session, and resolving duplicates.
    pub lookup: Arc<Lookup>,
    pub agent_wait: AgentWait,
    /// The sessions' view, for the converge check.
    pub view: SessionView,
    pub metrics: Arc<Metrics>,
}

/// Starts sessions' sandboxes (see the module's doc).
#[derive(Debug)]
pub struct Starter {
    pods: SandboxPods,
    lookup: Arc<Lookup>,
    agent_wait: AgentWait,
    view: SessionView,
    metrics: Arc<Metrics>,
    /// The warm pool, fed by its watch: where claims find their candidates.
    pool: WarmPool,
    /// Which warm pods this replica may claim.
    fit: PoolFit,
    cfg: SandboxConfig,
    key: HmacKey,
    /// The instance's Deployments: the credential proxy's, which a cold start checks.
    deployments: Api<Deployment>,
    /// `--start-timeout`.
    start_timeout: Duration,
}

impl Starter {
    pub fn new(
        client: kube::Client,
        cfg: SandboxConfig,
        key: HmacKey,
        start_timeout: Duration,
        shared: Shared,
    ) -> Self {
        let Shared {
            pods,
            lookup,
            agent_wait,
            view,
            metrics,
        } = shared;
        Self {
            pods,
            lookup,
            agent_wait,
            view,
            metrics,
            pool: WarmPool::default(),
            fit: PoolFit::new(cfg.hash(), key.clone()),
            deployments: Api::namespaced(client, &cfg.namespace),
            cfg,
            key,
            start_timeout,
        }
    }

    /// Keeps this replica's view of the warm pool (see [`WarmPool`]).
    pub fn watch_pool(&self, stop: CancellationToken) -> impl Future<Output = ()> + 'static {
        let selector = self.cfg.instance.unassigned_selector();
        self.pool
            .clone()
            .watch(self.pods.api().clone(), selector, stop)
    }

    /// Claims a warm pod, else creates one; returns it Ready, converged with other replicas
    /// that started the session at the same time (see [`Self::converge`]). The reservation
    /// is handed on as soon as the pod is written, and the slots become owned by the pod. A
    /// pod another replica created for the session first is adopted without them (they are
    /// freed: that replica's slots are the session's).
    pub async fn start(
        &self,
        sid: &SessionId,
        caller: &Caller,
        reservation: &mut Reservation<'_>,
    ) -> Result<(Pod, Launch), SessionError> {
        if let Some(p) = Box::pin(self.claim_warm(sid, caller, reservation)).await? {
            return Ok((p, Launch::Warm));
        }
        let ready = Box::pin(self.start_cold(sid, caller, reservation)).await?;
        let pod = Box::pin(timed("converge", self.converge(sid, ready, caller))).await?;
        Ok((pod, Launch::Cold))
    }

    /// After a create: if another replica gave the session a second pod at the same time,
    /// every replica keeps the same one.
    async fn converge(
        &self,
        sid: &SessionId,
        ours: Pod,
        caller: &Caller,
    ) -> Result<Pod, SessionError> {
        match self.other_winner(sid, &ours).await? {
            None => Ok(ours),
            Some(winner) => self.lookup.adopt(winner, sid, caller).await,
        }
    }

    /// The converge check, once `ours` is written: the session's pods as of a moment after
    /// the write, so of two replicas that wrote a pod each, at least the later one sees both;
    /// with two or more, the losers are retired and the winner is returned unless it is
    /// `ours`. Every replica picks the same winner. The pod watch's view answers as soon as it
    /// has reported `ours` (see [`super::admission::SessionView::pods_after_write`]); a LIST,
    /// which sees every pod written before it began, when the view cannot tell or shows a
    /// second pod.
    async fn other_winner(&self, sid: &SessionId, ours: &Pod) -> Result<Option<Pod>, SessionError> {
        let in_view = self
            .view
            .pods_after_write(sid, &pod_key(ours), CONVERGE_VIEW_WAIT)
            .await;
        if in_view == Some(1) {
            return Ok(None);
        }
        let list = self
            .pods
            .api()
            .list(&ListParams::default().labels(&self.cfg.instance.session_selector(sid)))
            .await?;
        let live: Vec<Pod> = list.items.into_iter().filter(|p| !is_deleting(p)).collect();
        if live.len() <= 1 {
            return Ok(None);
        }
        Ok(self
            .lookup
            .resolve_duplicates(live, sid)
            .await
            .filter(|winner| winner.uid() != ours.uid()))
    }
}
