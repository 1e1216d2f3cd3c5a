//! Which pod a proxy token belongs to: a TokenReview naming this instance's audience, with
//! a short cache so that it stays off the hot path.
//!
//! The token is a projected ServiceAccount token bound to its pod. The review is what makes
//! it worth anything: the API server checks the signature, the expiry, that the audience is
//! this instance's proxy and that the pod it was bound to still exists with that uid. What
//! the review says is reused for at most [`ALLOWED_TTL`] (a refusal for [`REFUSED_TTL`]),
//! keyed by the token's SHA-256, never the token. At most [`MAX_REVIEWS`] run at once; a
//! connection beyond that is told to retry, so junk tokens cannot flood the API server.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;
use kube::Api;
use lru::LruCache;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

/// How long a positive review is reused. Revocation does not wait for it: every request is
/// also checked against the pod watch.
pub const ALLOWED_TTL: Duration = Duration::from_secs(5);
pub const REFUSED_TTL: Duration = Duration::from_secs(2);
pub const MAX_REVIEWS: usize = 16;
const CACHE_CAPACITY: usize = 4096;
const API_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest token considered (a projected token is about 1 KiB).
pub const MAX_TOKEN_LEN: usize = 8 * 1024;

const EXTRA_POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const EXTRA_POD_UID: &str = "authentication.kubernetes.io/pod-uid";

/// What a review found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reviewed {
    /// A valid token of `username`, bound to pod `pod_name` with uid `pod_uid`.
    Pod {
        username: String,
        pod_name: String,
        pod_uid: String,
    },
    /// A valid token for this audience that is not bound to a pod.
    Unbound { username: String },
    /// Not a valid token for this audience (the API server's error, if it gave one).
    Invalid(String),
}

/// Why no answer could be had.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReviewError {
    #[error("{MAX_REVIEWS} token reviews are already in progress; retry")]
    Busy,
    #[error("the TokenReview failed: {0}")]
    Api(String),
}

type Cache = LruCache<[u8; 32], (Reviewed, Instant)>;

pub struct Reviewer {
    api: Api<TokenReview>,
    audience: String,
    cache: Mutex<Cache>,
    running: Arc<Semaphore>,
}

impl Reviewer {
    pub fn new(client: kube::Client, audience: String) -> Self {
        Self {
            api: Api::all(client),
            audience,
            cache: Mutex::new(LruCache::new(
                NonZeroUsize::new(CACHE_CAPACITY).unwrap_or(NonZeroUsize::MIN),
            )),
            running: Arc::new(Semaphore::new(MAX_REVIEWS)),
        }
    }

    pub fn audience(&self) -> &str {
        &self.audience
    }

    /// The cached answer for `token`, or a new review.
    pub async fn review(&self, token: &str) -> Result<Reviewed, ReviewError> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(hit) = self.cached(&digest) {
            return Ok(hit);
        }
        let Ok(_permit) = self.running.clone().try_acquire_owned() else {
            return Err(ReviewError::Busy);
        };
        let reviewed = self.ask(token).await?;
        let ttl = match reviewed {
            Reviewed::Invalid(_) => REFUSED_TTL,
            _ => ALLOWED_TTL,
        };
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .put(digest, (reviewed.clone(), Instant::now() + ttl));
        Ok(reviewed)
    }

    fn cached(&self, digest: &[u8; 32]) -> Option<Reviewed> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        match cache.get(digest) {
            Some((r, until)) if *until > Instant::now() => Some(r.clone()),
            Some(_) => {
                cache.pop(digest);
                None
            }
            None => None,
        }
    }

    async fn ask(&self, token: &str) -> Result<Reviewed, ReviewError> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let answer = tokio::time::timeout(
            API_TIMEOUT,
            self.api.create(&PostParams::default(), &review),
        )
        .await
        .map_err(|_| ReviewError::Api(format!("no answer within {API_TIMEOUT:?}")))?
        .map_err(|e| ReviewError::Api(e.to_string()))?;
        Ok(read(answer, &self.audience))
    }
}

/// What a TokenReview's status says, for `audience`.
fn read(answer: TokenReview, audience: &str) -> Reviewed {
    let Some(status) = answer.status else {
        return Reviewed::Invalid("the TokenReview has no status".into());
    };
    if status.authenticated != Some(true) {
        return Reviewed::Invalid(status.error.unwrap_or_else(|| "not authenticated".into()));
    }
    // The API server answers with the audiences the token is valid for among those asked;
    // an authenticator that ignores audiences answers none, which is not good enough.
    if !status.audiences.iter().flatten().any(|a| a == audience) {
        return Reviewed::Invalid(format!("the token is not for audience {audience}"));
    }
    let Some(user) = status.user else {
        return Reviewed::Invalid("the TokenReview names no user".into());
    };
    let username = user.username.unwrap_or_default();
    let extra = |k: &str| {
        user.extra
            .as_ref()
            .and_then(|e| e.get(k))
            .and_then(|v| v.first())
            .cloned()
    };
    match (extra(EXTRA_POD_NAME), extra(EXTRA_POD_UID)) {
        (Some(pod_name), Some(pod_uid)) => Reviewed::Pod {
            username,
            pod_name,
            pod_uid,
        },
        _ => Reviewed::Unbound { username },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::{TokenReviewStatus, UserInfo};
    use std::collections::BTreeMap;

    fn answer(authenticated: bool, audiences: &[&str], pod: bool) -> TokenReview {
        let mut extra = BTreeMap::new();
        if pod {
            extra.insert(EXTRA_POD_NAME.to_owned(), vec!["p".to_owned()]);
            extra.insert(EXTRA_POD_UID.to_owned(), vec!["u".to_owned()]);
        }
        TokenReview {
            status: Some(TokenReviewStatus {
                authenticated: Some(authenticated),
                audiences: Some(audiences.iter().map(|a| (*a).to_owned()).collect()),
                user: Some(UserInfo {
                    username: Some("system:serviceaccount:ns:sa".into()),
                    extra: Some(extra),
                    ..Default::default()
                }),
                error: None,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_review_is_read_for_the_pod_and_the_audience() {
        assert_eq!(
            read(answer(true, &["aud"], true), "aud"),
            Reviewed::Pod {
                username: "system:serviceaccount:ns:sa".into(),
                pod_name: "p".into(),
                pod_uid: "u".into()
            }
        );
        assert!(matches!(
            read(answer(true, &["aud"], false), "aud"),
            Reviewed::Unbound { .. }
        ));
        assert!(matches!(
            read(answer(true, &[], true), "aud"),
            Reviewed::Invalid(_)
        ));
        assert!(matches!(
            read(answer(true, &["other"], true), "aud"),
            Reviewed::Invalid(_)
        ));
        assert!(matches!(
            read(answer(false, &["aud"], true), "aud"),
            Reviewed::Invalid(_)
        ));
    }
}
