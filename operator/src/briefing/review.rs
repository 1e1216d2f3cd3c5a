//! Asking a Kubernetes target who its kubeconfig's identity is and what it may do, with that
//! identity's own credentials: a `SelfSubjectReview` (who), the namespaces it may list, and a
//! `SelfSubjectRulesReview` per namespace (what), summed up by [`super::rbac`].
//!
//! The operator reaches the target's API servers directly, as the credential proxy does.
//! Every request is bounded in time, and a failure never fails the instance: the briefing
//! then says the rights are unknown.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::stream::{self, StreamExt};
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::authorization::v1::{SelfSubjectRulesReview, SelfSubjectRulesReviewSpec};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};

use super::rbac::{self, Checked, Grants, Rights};
use super::{Access, ContextFacts, Kube};

/// Time for one request to a target's API server (connect, and then the answer).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for all the reviews of one context.
const CONTEXT_TIMEOUT: Duration = Duration::from_secs(15);
/// Most namespaces reviewed per identity (the first ones by name); the briefing says when
/// there are more.
pub const MAX_NAMESPACES: usize = 32;
/// Reviews in flight at once per identity.
const PARALLEL_REVIEWS: usize = 4;
/// Most contexts described; the briefing counts the rest.
pub const MAX_CONTEXTS: usize = 8;

/// The contexts of an admin kubeconfig (already validated: token users, https servers), in
/// the kubeconfig's order, the current context first, each with what its identity may do.
/// `as_caller`: the proxy impersonates each session's caller, so the kubeconfig's identity
/// is not what a session acts as and nothing is reviewed.
pub async fn review_contexts(kubeconfig: &str, as_caller: bool) -> Result<Kube, String> {
    let kc = Kubeconfig::from_yaml(kubeconfig)
        .map_err(|e| format!("reading the kubeconfig for the briefing: {e}"))?;
    let mut named: Vec<Named> = kc
        .contexts
        .iter()
        .filter_map(|c| {
            let inner = c.context.as_ref()?;
            Some(Named {
                name: c.name.clone(),
                cluster: inner.cluster.clone(),
                user: inner.user.clone(),
                namespace: inner.namespace.clone(),
            })
        })
        .collect();
    // The current context first: it is the one kubectl uses without --context.
    if let Some(current) = &kc.current_context {
        if let Some(i) = named.iter().position(|c| &c.name == current) {
            let c = named.remove(i);
            named.insert(0, c);
        }
    }
    let more = named.len().saturating_sub(MAX_CONTEXTS);
    named.truncate(MAX_CONTEXTS);
    // One review per cluster, user and namespace, all at once: the slowest context bounds
    // the reconcile, not their sum.
    let mut reviews: BTreeMap<Key, Access> = BTreeMap::new();
    if !as_caller {
        let mut first: BTreeMap<Key, &Named> = BTreeMap::new();
        for c in &named {
            first.entry(c.key()).or_insert(c);
        }
        let done = futures::future::join_all(first.into_iter().map(|(key, c)| {
            let kc = &kc;
            async move { (key, review_one(kc, &c.name, c.namespace.as_deref()).await) }
        }))
        .await;
        reviews.extend(done);
    }
    let described = named
        .into_iter()
        .map(|c| ContextFacts {
            current: kc.current_context.as_deref() == Some(c.name.as_str()),
            access: if as_caller {
                Access::AsCaller
            } else {
                reviews.get(&c.key()).cloned().unwrap_or(Access::Unknown)
            },
            name: c.name,
            cluster: c.cluster,
        })
        .collect();
    Ok(Kube::Contexts { described, more })
}

/// A context's cluster, user and namespace.
type Key = (String, Option<String>, Option<String>);

/// One context of the kubeconfig.
struct Named {
    name: String,
    cluster: String,
    user: Option<String>,
    namespace: Option<String>,
}

impl Named {
    /// What decides its review: contexts alike in these share one.
    fn key(&self) -> Key {
        (
            self.cluster.clone(),
            self.user.clone(),
            self.namespace.clone(),
        )
    }
}

/// Who the identity of context `name` is and what it may do, or why that is unknown.
async fn review_one(kc: &Kubeconfig, name: &str, namespace: Option<&str>) -> Access {
    let work = async {
        let client = client_for(kc, name).await?;
        let who = whoami(&client).await;
        let rights = rights(&client, namespace.unwrap_or("default")).await?;
        Ok::<_, String>((who, rights))
    };
    match tokio::time::timeout(CONTEXT_TIMEOUT, work).await {
        Ok(Ok((identity, rights))) => Access::Reviewed { identity, rights },
        Ok(Err(why)) => {
            tracing::warn!(context = %name, "briefing: reviewing what the context's identity may do failed: {why}; the briefing says it is unknown");
            Access::Unknown
        }
        Err(_) => {
            tracing::warn!(context = %name, "briefing: the review took longer than {}s; the briefing says it is unknown", CONTEXT_TIMEOUT.as_secs());
            Access::Unknown
        }
    }
}

/// A client with the context's own credentials.
async fn client_for(kc: &Kubeconfig, name: &str) -> Result<Client, String> {
    let options = KubeConfigOptions {
        context: Some(name.to_owned()),
        ..Default::default()
    };
    let mut config = kube::Config::from_custom_kubeconfig(kc.clone(), &options)
        .await
        .map_err(|e| format!("context {name}: {e}"))?;
    config.connect_timeout = Some(REQUEST_TIMEOUT);
    config.read_timeout = Some(REQUEST_TIMEOUT);
    config.write_timeout = Some(REQUEST_TIMEOUT);
    config.reset_reader_on_write = true;
    Client::try_from(config).map_err(|e| format!("context {name}: building a client: {e}"))
}

/// The username the API server knows the identity by; `None` when it will not say (an API
/// server before 1.28, or the review refused).
async fn whoami(client: &Client) -> Option<String> {
    let api: Api<SelfSubjectReview> = Api::all(client.clone());
    let review = SelfSubjectReview::default();
    match api.create(&PostParams::default(), &review).await {
        Ok(r) => r.status?.user_info?.username,
        Err(e) => {
            tracing::debug!("briefing: SelfSubjectReview failed: {e}");
            None
        }
    }
}

/// The namespaces to review: every one the identity may list (the first [`MAX_NAMESPACES`]
/// by name), else only `home` (the context's namespace, or `default`).
async fn namespaces(client: &Client, home: &str) -> (Checked, Vec<String>) {
    let api: Api<Namespace> = Api::all(client.clone());
    match api.list_metadata(&ListParams::default()).await {
        Ok(list) => {
            let mut names: Vec<String> = list
                .items
                .into_iter()
                .filter_map(|n| n.metadata.name)
                .collect();
            names.sort();
            let total = names.len();
            names.truncate(MAX_NAMESPACES);
            if names.is_empty() {
                return (Checked::Only(home.to_owned()), vec![home.to_owned()]);
            }
            let reviewed = names.len();
            (Checked::Listed { reviewed, total }, names)
        }
        Err(_) => (Checked::Only(home.to_owned()), vec![home.to_owned()]),
    }
}

/// What one namespace's rules review found: its grants, and whether the authorizer could not
/// tell all.
type Reviewed = Result<(Grants, bool), String>;

/// The rules review of one namespace.
async fn rules_in(client: &Client, namespace: &str) -> Reviewed {
    let api: Api<SelfSubjectRulesReview> = Api::all(client.clone());
    let review = SelfSubjectRulesReview {
        spec: SelfSubjectRulesReviewSpec {
            namespace: Some(namespace.to_owned()),
        },
        ..Default::default()
    };
    let done = api
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| format!("SelfSubjectRulesReview in namespace {namespace}: {e}"))?;
    let status = done.status.unwrap_or_default();
    let incomplete = status.incomplete || status.evaluation_error.is_some();
    Ok((rbac::grants(&status.resource_rules), incomplete))
}

/// What the identity may do in the namespaces it can see, collapsed.
async fn rights(client: &Client, home: &str) -> Result<Rights, String> {
    let (checked, names) = namespaces(client, home).await;
    let results: Vec<(String, Reviewed)> = stream::iter(names)
        .map(|ns| async move {
            let r = rules_in(client, &ns).await;
            (ns, r)
        })
        .buffer_unordered(PARALLEL_REVIEWS)
        .collect()
        .await;
    let mut per_namespace = BTreeMap::new();
    let mut incomplete = false;
    for (ns, r) in results {
        let (grants, partial) = r?;
        incomplete |= partial;
        per_namespace.insert(ns, grants);
    }
    Ok(rbac::collapse(checked, per_namespace, incomplete))
}
