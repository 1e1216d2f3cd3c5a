//! The sandbox briefing of one instance ([`crate::briefing`]): the reviews of what the
//! kubeconfig's identity may do, remembered for `--briefing-refresh` and made again at once
//! when the kubeconfig changes, and the text rendered from them and the spec.

use std::time::Duration;

use sha2::{Digest, Sha256};

use cli_mcp_api::proxy::RouteIdentity;

use super::proxy::KubeconfigText;
use crate::briefing::{self, review, Facts, Kube};
use crate::children::Spec;
use crate::context::Context;

/// The briefing and when its reviews are due again.
pub(super) struct BriefingState {
    pub(super) text: Option<String>,
    pub(super) due_in: Option<Duration>,
}

/// The briefing of `spec`'s instance; `kubeconfig`: the proxy's validated kubeconfig, when it
/// is usable. Never fails: what cannot be found out is said to be unknown.
pub(super) async fn briefing(
    ctx: &Context,
    spec: &Spec,
    kubeconfig: Option<&KubeconfigText>,
) -> BriefingState {
    let uid = &spec.owner.uid;
    if !spec.briefing {
        ctx.briefings.forget(uid);
        return BriefingState {
            text: None,
            due_in: None,
        };
    }
    let (kube, due_in) = kube_facts(ctx, spec, kubeconfig).await;
    let cfg = &ctx.config;
    let image = spec.sandbox.image.as_str();
    // The record describes the operator's default image only; another image may have
    // anything on its PATH.
    let tools = cfg
        .sandbox_tools
        .as_deref()
        .filter(|_| cfg.sandbox_image.as_deref() == Some(image));
    let facts = Facts {
        image,
        tools,
        kube: &kube,
        domains: spec.proxy.allowlist.iter().map(|d| d.to_string()).collect(),
        extra_egress: !spec.extra_egress.is_empty(),
        default_timeout_secs: spec.default_timeout_secs,
        max_timeout_secs: spec.max_timeout_secs,
        output_budget: spec.output_budget,
        idle_timeout: spec.idle_timeout,
    };
    BriefingState {
        text: Some(briefing::render(&facts)),
        due_in,
    }
}

/// What the briefing says about Kubernetes: the remembered reviews while they are fresh and
/// made for this kubeconfig, else new ones.
async fn kube_facts(
    ctx: &Context,
    spec: &Spec,
    kubeconfig: Option<&KubeconfigText>,
) -> (Kube, Option<Duration>) {
    if spec.proxy.kubeconfig_secret.is_none() {
        return (Kube::NoTarget, None);
    }
    let Some(KubeconfigText(text)) = kubeconfig else {
        return (Kube::Pending, None);
    };
    let as_caller = spec.proxy.kubernetes_identity == RouteIdentity::ImpersonateCaller;
    // The whole text, not only the servers and tokens the proxy's version hashes: a renamed
    // context or a new default namespace changes the briefing too.
    let key = format!(
        "{}/{as_caller}",
        hex::encode(Sha256::digest(text.as_bytes()))
    );
    let every = ctx.config.briefing_refresh;
    let uid = &spec.owner.uid;
    if let Some((kube, due)) = ctx.briefings.fresh(uid, &key, every) {
        return (kube, Some(due));
    }
    let kube = match review::review_contexts(text, as_caller).await {
        Ok(kube) => kube,
        Err(why) => {
            tracing::warn!(namespace = %spec.namespace, instance = %spec.name, "briefing: {why}; it says Kubernetes is unknown");
            Kube::Pending
        }
    };
    ctx.briefings.store(uid, key, kube.clone());
    (kube, Some(every))
}
