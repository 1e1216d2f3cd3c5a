//! One pass over an instance's pool, as [`super::reconcile`]'s steps: the plan, the
//! recount before creating, the deletes, the creates and the pod-sandbox failures. The pass
//! owns what the steps share: the plan being carried out, the backoff it ends with, why the
//! API server refuses the pool's pods, and the first error on the way.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};

use cli_mcp_api::activity;
use cli_mcp_api::names::PoolSuffix;
use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxRole};
use cli_mcp_api::token::HmacKey;

use super::{
    admission_refusal, delete_unclaimed, instance_pods, observe, plan, sandbox_failure,
    seal_created, DeleteReason, FailingPod, Plan, PlanInputs, PoolOutcome, EXPECTATION_TTL,
    FAILED_SANDBOX_REASON, MAX_SANDBOX_EVENT_READS, SANDBOX_RECHECK,
};
use crate::api_call::is_status;
use crate::context::Context;
use crate::error::Error;
use crate::runtime_class::{self, Carried};
use crate::sandbox_pod::SandboxPod;

/// A pod just built, and the outcome of its create and of its seal.
type Created = (String, kube::Result<Pod>, Option<kube::Result<()>>);

pub(super) struct Pass<'a> {
    ctx: &'a Context,
    uid: &'a str,
    cfg: &'a SandboxConfig,
    key: Option<&'a HmacKey>,
    desired: i32,
    hash: String,
    now: Instant,
    wall: Timestamp,
    api: Api<Pod>,
    plan: Plan,
    /// Creates and deletes still pending from earlier passes.
    pending: usize,
    backoff: Option<Duration>,
    /// Why the API server refuses the pool's pods, while it does.
    refused: Option<String>,
    /// The RuntimeClass the current pods in the cache carry.
    carried: Carried,
    first_err: Option<Error>,
}

impl<'a> Pass<'a> {
    /// The plan from the cache and the expectations; no API call.
    pub(super) fn plan(
        ctx: &'a Context,
        uid: &'a str,
        cfg: &'a SandboxConfig,
        desired: i32,
        key: Option<&'a HmacKey>,
        unblocked: bool,
    ) -> Self {
        let now = Instant::now();
        let wall = Timestamp::now();
        let pods = instance_pods(&ctx.stores.pods.state(), &cfg.namespace, &cfg.instance);
        let hash = cfg.hash();
        let (the_plan, backoff, pending, refused) = ctx.pool.with(uid, |exp, backoff| {
            observe(exp, &pods, now);
            // A new config may well be accepted: try it at once.
            if backoff.refused.as_ref().is_some_and(|(h, _)| *h != hash) {
                backoff.refused = None;
                backoff.reset();
            }
            let refused = backoff.refused.as_ref().map(|(_, why)| why.clone());
            let backoff_left = backoff.remaining(now);
            let inp = PlanInputs {
                desired,
                hash: &hash,
                key,
                may_create: unblocked && key.is_some() && backoff_left.is_none(),
                now: wall,
            };
            let p = plan(&pods, exp, &inp);
            // Over only once the pool is full: one Ready pod says nothing about the pod that
            // keeps failing beside it, whose replacements must keep backing off.
            if p.ready >= desired && p.failing.is_empty() && refused.is_none() {
                backoff.reset();
            }
            let pending = exp.creates.len() + exp.deletes.len();
            (p, backoff_left, pending, refused)
        });
        let carried = runtime_class::carried(&pods, &hash);
        Pass {
            ctx,
            uid,
            cfg,
            key,
            desired,
            hash,
            now,
            wall,
            api: Api::namespaced(ctx.client.clone(), &cfg.namespace),
            plan: the_plan,
            pending,
            backoff,
            refused,
            carried,
            first_err: None,
        }
    }

    /// The cache can lag far behind the API (a watch relisting after an apiserver restart),
    /// and an expectation is dropped after EXPECTATION_TTL: creating from the cache alone
    /// then creates pods that already exist. Before creating, a (consistent) list of the
    /// instance's unassigned sandboxes decides how many are really missing. A failed list
    /// only holds back the creates: the deletes still run.
    pub(super) async fn recount_before_creating(&mut self) {
        if self.plan.create == 0 {
            return;
        }
        let listed: Api<SandboxPod> = Api::namespaced(self.ctx.client.clone(), &self.cfg.namespace);
        let selector = self.cfg.instance.unassigned_selector();
        match listed.list(&ListParams::default().labels(&selector)).await {
            Ok(list) => {
                let live: Vec<Arc<SandboxPod>> = list.items.into_iter().map(Arc::new).collect();
                let (now, wall, desired, key) = (self.now, self.wall, self.desired, self.key);
                let hash = &self.hash;
                self.plan.create = self.ctx.pool.with(self.uid, |exp, _| {
                    observe(exp, &live, now);
                    let inp = PlanInputs {
                        desired,
                        hash,
                        key,
                        may_create: true,
                        now: wall,
                    };
                    plan(&live, exp, &inp).create
                });
            }
            Err(e) => {
                self.plan.create = 0;
                let what = format!("listing the unassigned sandboxes ({selector})");
                self.first_err = Some(Error::pool(what)(e));
            }
        }
    }

    /// The plan's deletes (see `delete_unclaimed`); a dead pod's delete backs off the next
    /// creates.
    pub(super) async fn delete(&mut self) {
        for (pod, reason) in &self.plan.delete {
            // An unsealed pod is judged on the cache's copy: one sealed since is kept.
            let spare_sealed = self.key.filter(|_| *reason == DeleteReason::Unsealed);
            match delete_unclaimed(&self.api, pod, spare_sealed).await {
                Ok(Some(uid_deleted)) => {
                    self.ctx.metrics.api_write("Pod", "delete");
                    self.ctx.metrics.pool_deleted(reason.as_str());
                    if *reason == DeleteReason::Unsealed {
                        tracing::warn!(pod = %pod.name_any(), namespace = %self.cfg.namespace,
                            "deleted a pool pod without a valid seal (planted under a pool pod's name by someone who may create pods, or left unsealed by an operator that stopped); replacing it");
                    }
                    let backoff = &mut self.backoff;
                    self.ctx.pool.with(self.uid, |exp, b| {
                        exp.deletes.insert(uid_deleted, Instant::now());
                        if *reason == DeleteReason::Dead {
                            *backoff = Some(b.fail(Instant::now()));
                        }
                    });
                }
                Ok(None) => {}
                Err(e) => {
                    self.first_err.get_or_insert(e);
                }
            }
        }
    }

    /// The plan's creates, recorded as expectations before they are sent, each sealed as
    /// soon as it exists.
    pub(super) async fn create(&mut self) {
        let Some(key) = self.key.filter(|_| self.plan.create > 0) else {
            return;
        };
        let pods: Vec<Pod> = (0..self.plan.create)
            .map(|_| {
                let suffix = PoolSuffix::from_random_bytes(rand::random());
                let name = self.cfg.instance.pool_pod(&suffix);
                let assign = key.assign_token(&name).commitment();
                let role = SandboxRole::Pool { suffix, assign };
                build_sandbox_pod(self.cfg, &role, &activity::stamp_now())
            })
            .collect();
        self.ctx.pool.with(self.uid, |exp, _| {
            for p in &pods {
                exp.creates.insert(p.name_any(), Instant::now());
            }
        });
        let results: Vec<Created> = stream::iter(pods)
            .map(|p| {
                let api = self.api.clone();
                async move {
                    let name = p.name_any();
                    let created = api.create(&PostParams::default(), &p).await;
                    let sealed = match &created {
                        Ok(c) => Some(seal_created(&api, c, key).await),
                        Err(_) => None,
                    };
                    (name, created, sealed)
                }
            })
            .buffer_unordered(8)
            .collect()
            .await;
        self.created(results);
    }

    /// What the creates' outcomes mean for the backoff, the refusal and the error.
    fn created(&mut self, results: Vec<Created>) {
        let (ctx, uid) = (self.ctx, self.uid);
        let mut newly_refused = None;
        let mut create_failed = None;
        for (name, r, sealed) in results {
            match r {
                Ok(_) => {
                    ctx.metrics.api_write("Pod", "create");
                    ctx.metrics.pool_created.inc();
                    ctx.pool.with(uid, |_, b| b.refused = None);
                    self.refused = None;
                    match sealed {
                        Some(Ok(())) => ctx.metrics.api_write("Pod", "patch"),
                        Some(Err(e)) => {
                            tracing::warn!(pod = %name, error = %e,
                                "cannot seal a pool pod just created; it is never claimed, and is replaced once the seal's grace is over");
                            self.first_err
                                .get_or_insert(Error::pool("sealing a pool pod")(e));
                        }
                        None => {}
                    }
                }
                Err(e) => {
                    ctx.pool.with(uid, |exp, _| exp.creates.remove(&name));
                    if let Some(why) = admission_refusal(&e) {
                        newly_refused = Some(why);
                    } else if !is_status(&e, 409) {
                        create_failed.get_or_insert((name, e));
                    }
                }
            }
        }
        // A failing webhook, a 429 or a 5xx: the next creates wait for the pool's backoff
        // (2 s, doubling), not just for the next reconcile, which would send them all again.
        if create_failed.is_some() && newly_refused.is_none() {
            let backoff = &mut self.backoff;
            ctx.pool
                .with(uid, |_, b| *backoff = Some(b.fail(Instant::now())));
        }
        // The log names the pod; the error, which becomes the status's message, does not: a
        // new random name on every attempt would rewrite the status each time.
        if let Some((name, e)) = create_failed {
            tracing::debug!(pod = %name, error = %e, "cannot create a pool pod");
            self.first_err
                .get_or_insert(Error::pool("creating a pool pod")(e));
        }
        // Retrying a refused pod unchanged is refused again: back off, and say why.
        if let Some(why) = newly_refused {
            let (backoff, hash) = (&mut self.backoff, &self.hash);
            ctx.pool.with(uid, |_, b| {
                b.refused = Some((hash.clone(), why.clone()));
                *backoff = Some(b.fail(Instant::now()));
            });
            self.refused = Some(why);
        }
    }

    /// The pods (not being deleted) that wait for their pod sandbox, and for the first few,
    /// the kubelet's reason from their Events as a failing pod. Returns how many wait.
    pub(super) async fn read_sandbox_failures(&mut self) -> usize {
        let deleted: HashSet<Option<String>> =
            self.plan.delete.iter().map(|(p, _)| p.uid()).collect();
        let awaiting: Vec<Arc<SandboxPod>> = self
            .plan
            .awaiting_sandbox
            .iter()
            .filter(|p| !deleted.contains(&p.uid()))
            .cloned()
            .collect();
        for p in awaiting.iter().take(MAX_SANDBOX_EVENT_READS) {
            if let Some(message) = sandbox_failure(self.ctx, &self.cfg.namespace, p).await {
                self.plan.failing.push(FailingPod {
                    name: p.name_any(),
                    reason: FAILED_SANDBOX_REASON.to_owned(),
                    message,
                });
            }
        }
        awaiting.len()
    }

    /// The pool's outcome for the status, and the pass's first error.
    pub(super) fn outcome(
        self,
        blocked: Option<String>,
        awaiting: usize,
    ) -> (PoolOutcome, Option<Error>) {
        let p = &self.plan;
        let busy = self.pending > 0 || !p.delete.is_empty() || p.create > 0;
        let requeue = match (busy, self.backoff) {
            // A failed API call: the reconcile fails (and is retried) after the status is
            // written.
            _ if self.first_err.is_some() => None,
            (_, Some(b)) => Some(b),
            // Expectations resolve through pod events; this only guards against a lost event.
            (true, None) => Some(EXPECTATION_TTL),
            (false, None) if awaiting > 0 => Some(SANDBOX_RECHECK),
            (false, None) => None,
        };
        // A pod within the seal's grace is looked at again when the grace ends: nothing else
        // wakes the pool for a plant that is never sealed.
        let requeue = match (requeue, p.seal_recheck) {
            _ if self.first_err.is_some() => None,
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let outcome = PoolOutcome {
            desired: self.desired,
            ready: self.plan.ready,
            failing: self.plan.failing,
            stale: self.plan.stale,
            blocked: blocked.or_else(|| {
                self.refused.map(|why| {
                    format!("the API server refuses the pool pods: {why}; fix spec.sandbox")
                })
            }),
            backoff: self.backoff,
            requeue,
            api_error: self.first_err.as_ref().map(ToString::to_string),
            carried: self.carried,
            sessions_last_minute: None,
        };
        (outcome, self.first_err)
    }
}
