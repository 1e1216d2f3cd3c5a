//! TokenReview + SubjectAccessReview with a short, bounded decision cache.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::Api;
use sha2::{Digest, Sha256};

use cli_mcp_api::names::{InstanceName, GROUP, PLURAL};
use cli_mcp_api::token::parse_bearer;

use super::{Caller, Verb};
use crate::metrics::{AuthResult, Metrics};

/// The subresource callers are authorised on.
pub const SUBRESOURCE: &str = "mcp";
/// How long an allow or deny is reused.
pub const DECISION_TTL: Duration = Duration::from_secs(10);
/// Most cached decisions.
pub const CACHE_CAPACITY: usize = 4096;
/// Longest bearer token considered (Kubernetes tokens are far shorter).
const MAX_TOKEN_LEN: usize = 16 * 1024;
const API_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// 401
    #[error("{0}")]
    Unauthenticated(String),
    /// 403
    #[error("{0}")]
    Forbidden(String),
    /// 503: the API could not be asked.
    #[error("cannot check the caller's token right now: {0}; retry shortly")]
    Unavailable(String),
}

impl AuthError {
    pub fn status(&self) -> http::StatusCode {
        match self {
            AuthError::Unauthenticated(_) => http::StatusCode::UNAUTHORIZED,
            AuthError::Forbidden(_) => http::StatusCode::FORBIDDEN,
            AuthError::Unavailable(_) => http::StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

struct Cached {
    at: Instant,
    decision: Result<Caller, AuthError>,
}

/// A cache key: the token's SHA-256 (the token itself is never kept) and the verb.
type Key = ([u8; 32], Verb);

/// The one review in progress for a key, shared by every caller that missed the cache
/// meanwhile.
type InFlight = Arc<tokio::sync::OnceCell<Result<Caller, AuthError>>>;

pub struct Authenticator {
    client: kube::Client,
    instance: InstanceName,
    namespace: String,
    cache: Mutex<HashMap<Key, Cached>>,
    /// Reviews in progress: a burst of first calls with one token costs one TokenReview and
    /// one SubjectAccessReview, not one per call.
    in_flight: Mutex<HashMap<Key, InFlight>>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("instance", &self.instance)
            .field("namespace", &self.namespace)
            .finish()
    }
}

impl Authenticator {
    pub fn new(
        client: kube::Client,
        instance: InstanceName,
        namespace: String,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            client,
            instance,
            namespace,
            cache: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// Checks the `Authorization` header for `verb`.
    pub async fn authorize(
        &self,
        authorization: Option<&str>,
        verb: Verb,
    ) -> Result<Caller, AuthError> {
        let Some(token) = authorization.and_then(parse_bearer) else {
            self.metrics.auth(AuthResult::Unauthenticated, false);
            return Err(AuthError::Unauthenticated(
                "missing bearer token: send `Authorization: Bearer <token>` with a Kubernetes \
                 token (for example a ServiceAccount token) of an identity allowed on \
                 climcpinstances/mcp of this instance"
                    .into(),
            ));
        };
        if token.len() > MAX_TOKEN_LEN {
            self.metrics.auth(AuthResult::Unauthenticated, false);
            return Err(AuthError::Unauthenticated(format!(
                "the bearer token is {} bytes long; Kubernetes tokens are far shorter",
                token.len()
            )));
        }
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(hit) = self.cached(&key, verb) {
            self.metrics.auth(result_of(&hit), true);
            return hit;
        }
        let shared = self
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((key, verb))
            .or_default()
            .clone();
        let mut reviewed = false;
        let decision = shared
            .get_or_init(|| async {
                reviewed = true;
                let decision = self.review(token, verb).await;
                if !matches!(decision, Err(AuthError::Unavailable(_))) {
                    self.remember(key, verb, decision.clone());
                }
                decision
            })
            .await
            .clone();
        if reviewed {
            // Later misses (after the TTL, or after an outage) review afresh.
            self.in_flight
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(key, verb));
        }
        self.metrics.auth(result_of(&decision), !reviewed);
        decision
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Cached>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cached(&self, key: &[u8; 32], verb: Verb) -> Option<Result<Caller, AuthError>> {
        let cache = self.lock();
        let hit = cache.get(&(*key, verb))?;
        (hit.at.elapsed() < DECISION_TTL).then(|| hit.decision.clone())
    }

    fn remember(&self, key: [u8; 32], verb: Verb, decision: Result<Caller, AuthError>) {
        let mut cache = self.lock();
        if cache.len() >= CACHE_CAPACITY {
            cache.retain(|_, c| c.at.elapsed() < DECISION_TTL);
            if cache.len() >= CACHE_CAPACITY {
                cache.clear();
            }
        }
        cache.insert(
            (key, verb),
            Cached {
                at: Instant::now(),
                decision,
            },
        );
    }

    async fn review(&self, token: &str, verb: Verb) -> Result<Caller, AuthError> {
        let tr = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: None,
            },
            ..Default::default()
        };
        let reviewed = tokio::time::timeout(
            API_TIMEOUT,
            Api::<TokenReview>::all(self.client.clone()).create(&PostParams::default(), &tr),
        )
        .await
        .map_err(|_| AuthError::Unavailable("TokenReview timed out".into()))?
        .map_err(|e| AuthError::Unavailable(format!("TokenReview failed: {e}")))?;
        let status = reviewed.status.unwrap_or_default();
        let user = match (status.authenticated, status.user) {
            (Some(true), Some(user)) if user.username.as_deref().is_some_and(|u| !u.is_empty()) => {
                user
            }
            _ => {
                let why = status
                    .error
                    .filter(|e| !e.is_empty())
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default();
                return Err(AuthError::Unauthenticated(format!(
                    "the bearer token was not accepted by the Kubernetes API{why}; send a valid, \
                     unexpired token"
                )));
            }
        };
        let username = user.username.clone().unwrap_or_default();

        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(username.clone()),
                groups: user.groups.clone(),
                uid: user.uid.clone(),
                extra: user.extra.clone(),
                resource_attributes: Some(ResourceAttributes {
                    group: Some(GROUP.into()),
                    resource: Some(PLURAL.into()),
                    subresource: Some(SUBRESOURCE.into()),
                    name: Some(self.instance.to_string()),
                    namespace: Some(self.namespace.clone()),
                    verb: Some(verb.as_str().into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let reviewed = tokio::time::timeout(
            API_TIMEOUT,
            Api::<SubjectAccessReview>::all(self.client.clone())
                .create(&PostParams::default(), &sar),
        )
        .await
        .map_err(|_| AuthError::Unavailable("SubjectAccessReview timed out".into()))?
        .map_err(|e| AuthError::Unavailable(format!("SubjectAccessReview failed: {e}")))?;
        let status = reviewed.status.unwrap_or_default();
        if status.allowed {
            return Ok(Caller::identified(&username));
        }
        let reason = status
            .reason
            .filter(|r| !r.is_empty())
            .or(status.evaluation_error.filter(|e| !e.is_empty()))
            .map(|r| format!(" ({r})"))
            .unwrap_or_default();
        Err(AuthError::Forbidden(format!(
            "{username} may not {verb} {PLURAL}/{SUBRESOURCE} {instance:?} in namespace {ns}{reason}; \
             an admin grants it with a Role rule {{apiGroups: [{GROUP}], resources: \
             [{PLURAL}/{SUBRESOURCE}], resourceNames: [{instance}], verbs: [create, get, delete]}}",
            verb = verb.as_str(),
            instance = self.instance.as_str(),
            ns = self.namespace,
        )))
    }
}

fn result_of(d: &Result<Caller, AuthError>) -> AuthResult {
    match d {
        Ok(_) => AuthResult::Allowed,
        Err(AuthError::Forbidden(_)) => AuthResult::Denied,
        Err(AuthError::Unauthenticated(_)) => AuthResult::Unauthenticated,
        Err(AuthError::Unavailable(_)) => AuthResult::Error,
    }
}
