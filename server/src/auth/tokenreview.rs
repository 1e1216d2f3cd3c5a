//! TokenReview + SubjectAccessReview with a short, bounded decision cache.
//!
//! A token never seen before costs one review (TokenReview, then SubjectAccessReview). So
//! that callers with junk tokens can neither flood the API server nor push real users out of
//! the cache:
//! - at most [`MAX_CONCURRENT_REVIEWS`] reviews run at once; a request over it gets 503
//!   "authentication is busy" at once, and nothing queues;
//! - concurrent first calls with one token share one review;
//! - allowed and refused decisions live in two separate least-recently-used caches, refused
//!   ones for half as long: a junk token is reviewed once per TTL, and any number of junk
//!   tokens only ever evicts other refused decisions.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::Api;
use lru::LruCache;
use sha2::{Digest, Sha256};

use cli_mcp_api::names::{InstanceName, GROUP, PLURAL};

use super::bearer::{jwt_claims, JwtClaims};
use super::coalesce::Coalesce;
use super::{Caller, Verb};
use crate::metrics::{AuthResult, Metrics, ReviewResult};

/// The subresource callers are authorised on.
pub const SUBRESOURCE: &str = "mcp";
/// How long an allow is reused by default (a refusal: half as long).
pub const DECISION_TTL: Duration = Duration::from_secs(10);
/// Most cached allowed decisions, and separately most cached refused ones.
pub const CACHE_CAPACITY: usize = 4096;
/// Most reviews in progress at once; more requests with unknown tokens get 503 at once.
pub const MAX_CONCURRENT_REVIEWS: usize = 16;
/// Longest bearer token considered (Kubernetes tokens are far shorter).
const MAX_TOKEN_LEN: usize = 16 * 1024;
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// How tokens are reviewed and decisions cached (`--token-audience`,
/// `--authorization-server`, `--resource-url`, `--auth-cache-seconds`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthOptions {
    /// Audiences a token must be bound to; empty: the API server's own.
    pub audiences: Vec<String>,
    /// Issuers (`--authorization-server`) whose JWTs the API server accepts through its
    /// JWT authenticator. Their audience is checked here (see [`Authenticator::authorize`]).
    pub oidc_issuers: Vec<String>,
    /// Audiences a token of one of `oidc_issuers` must name (`aud`): `--token-audience` and
    /// `--resource-url`.
    pub oidc_audiences: Vec<String>,
    /// How long an allow is reused; a refusal is reused half as long (at least 1 s).
    pub allowed_ttl: Duration,
    /// Most reviews in progress at once.
    pub max_reviews: usize,
    /// Entries of each of the two caches.
    pub capacity: usize,
}

impl Default for AuthOptions {
    fn default() -> Self {
        Self {
            audiences: Vec::new(),
            oidc_issuers: Vec::new(),
            oidc_audiences: Vec::new(),
            allowed_ttl: DECISION_TTL,
            max_reviews: MAX_CONCURRENT_REVIEWS,
            capacity: CACHE_CAPACITY,
        }
    }
}

impl AuthOptions {
    fn refused_ttl(&self) -> Duration {
        (self.allowed_ttl / 2).max(Duration::from_secs(1))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// 400: the `Authorization` header is malformed (RFC 6750 `invalid_request`).
    #[error("{0}")]
    BadRequest(String),
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
            AuthError::BadRequest(_) => http::StatusCode::BAD_REQUEST,
            AuthError::Unauthenticated(_) => http::StatusCode::UNAUTHORIZED,
            AuthError::Forbidden(_) => http::StatusCode::FORBIDDEN,
            AuthError::Unavailable(_) => http::StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// A cache key: the token's SHA-256 (the token itself is never kept) and the verb.
type Key = ([u8; 32], Verb);

type Decision = Result<Caller, AuthError>;

struct Cached {
    at: Instant,
    decision: Decision,
}

/// Allowed and refused decisions, each in its own LRU with its own TTL, so refusals (junk
/// tokens) never evict an allowed caller. Answers of an unreachable API are not kept.
pub struct DecisionCache {
    allowed: LruCache<Key, Cached>,
    refused: LruCache<Key, Cached>,
    allowed_ttl: Duration,
    refused_ttl: Duration,
}

impl DecisionCache {
    pub fn new(capacity: usize, allowed_ttl: Duration, refused_ttl: Duration) -> Self {
        let cap = NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN);
        Self {
            allowed: LruCache::new(cap),
            refused: LruCache::new(cap),
            allowed_ttl,
            refused_ttl,
        }
    }

    /// The live decision for `key` (marked as recently used), if any.
    pub fn get(&mut self, key: &Key, now: Instant) -> Option<Decision> {
        for (cache, ttl) in [
            (&mut self.allowed, self.allowed_ttl),
            (&mut self.refused, self.refused_ttl),
        ] {
            match cache.get(key) {
                Some(c) if now.saturating_duration_since(c.at) < ttl => {
                    return Some(c.decision.clone())
                }
                Some(_) => {
                    cache.pop(key);
                }
                None => {}
            }
        }
        None
    }

    /// Keeps `decision`, evicting the least recently used entry of its own kind when full.
    pub fn put(&mut self, key: Key, decision: Decision, now: Instant) {
        let (mine, other) = match &decision {
            Ok(_) => (&mut self.allowed, &mut self.refused),
            Err(
                AuthError::BadRequest(_) | AuthError::Unauthenticated(_) | AuthError::Forbidden(_),
            ) => (&mut self.refused, &mut self.allowed),
            Err(AuthError::Unavailable(_)) => return,
        };
        other.pop(&key);
        mine.put(key, Cached { at: now, decision });
    }

    /// Entries (allowed, refused).
    pub fn len(&self) -> (usize, usize) {
        (self.allowed.len(), self.refused.len())
    }

    pub fn is_empty(&self) -> bool {
        self.allowed.is_empty() && self.refused.is_empty()
    }
}

pub struct Authenticator {
    client: kube::Client,
    instance: InstanceName,
    namespace: String,
    options: AuthOptions,
    cache: Mutex<DecisionCache>,
    /// Reviews in progress: a burst of first calls with one token costs one TokenReview and
    /// one SubjectAccessReview, not one per call.
    in_flight: Coalesce<Key, Decision>,
    /// Permits for reviews in progress ([`AuthOptions::max_reviews`]).
    reviews: Arc<tokio::sync::Semaphore>,
    running: AtomicI64,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("instance", &self.instance)
            .field("namespace", &self.namespace)
            .field("options", &self.options)
            .finish()
    }
}

impl Authenticator {
    pub fn new(
        client: kube::Client,
        instance: InstanceName,
        namespace: String,
        metrics: Arc<Metrics>,
        options: AuthOptions,
    ) -> Self {
        Self {
            client,
            instance,
            namespace,
            cache: Mutex::new(DecisionCache::new(
                options.capacity,
                options.allowed_ttl,
                options.refused_ttl(),
            )),
            reviews: Arc::new(tokio::sync::Semaphore::new(options.max_reviews.max(1))),
            options,
            in_flight: Coalesce::default(),
            running: AtomicI64::new(0),
            metrics,
        }
    }

    /// Checks a bearer token (from [`super::bearer::token`]) for `verb`.
    ///
    /// A JWT whose `iss` is one of [`AuthOptions::oidc_issuers`] is reviewed without
    /// `spec.audiences`: the API server's JWT authenticator is audience-agnostic towards
    /// TokenReview (it checks `aud` against its own AuthenticationConfiguration, and would
    /// refuse any requested audience outside `--api-audiences`). So once the API server has
    /// accepted these bytes, and with them their signature, the `aud` claim is checked here
    /// against [`AuthOptions::oidc_audiences`]. Routing by the unverified `iss` is safe: a
    /// token claiming such an issuer is accepted only if that issuer signed it, and the API
    /// server refuses JWT issuers that equal its ServiceAccount issuer.
    pub async fn authorize(&self, token: Option<&str>, verb: Verb) -> Result<Caller, AuthError> {
        let Some(token) = token else {
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
        let (decision, reviewed) = self
            .in_flight
            .get_or_run((key, verb), || async {
                let decision = self.bounded_review(token, verb).await;
                self.lock()
                    .put((key, verb), decision.clone(), Instant::now());
                decision
            })
            .await;
        self.metrics.auth(result_of(&decision), !reviewed);
        decision
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DecisionCache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cached(&self, key: &[u8; 32], verb: Verb) -> Option<Decision> {
        self.lock().get(&(*key, verb), Instant::now())
    }

    /// A review under the concurrency bound: over it, a 503 at once (never a queue).
    async fn bounded_review(&self, token: &str, verb: Verb) -> Decision {
        let Ok(_permit) = self.reviews.clone().try_acquire_owned() else {
            self.metrics.auth_busy.inc();
            return Err(AuthError::Unavailable(format!(
                "authentication is busy ({} token reviews are in progress, the most this server \
                 runs at once)",
                self.options.max_reviews
            )));
        };
        let _running = Running::start(self);
        self.review(token, verb).await
    }

    async fn review(&self, token: &str, verb: Verb) -> Result<Caller, AuthError> {
        let oidc = jwt_claims(token).filter(|c| self.options.oidc_issuers.contains(&c.iss));
        let tr = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: (oidc.is_none() && !self.options.audiences.is_empty())
                    .then(|| self.options.audiences.clone()),
            },
            ..Default::default()
        };
        let reviewed = tokio::time::timeout(
            API_TIMEOUT,
            Api::<TokenReview>::all(self.client.clone()).create(&PostParams::default(), &tr),
        )
        .await
        .map_err(|_| AuthError::Unavailable("TokenReview timed out".into()))
        .and_then(|r| r.map_err(|e| AuthError::Unavailable(format!("TokenReview failed: {e}"))))
        .inspect_err(|_| self.metrics.token_review(ReviewResult::Error))?;
        let status = reviewed.status.unwrap_or_default();
        let user = match (status.authenticated, status.user) {
            (Some(true), Some(user)) if user.username.as_deref().is_some_and(|u| !u.is_empty()) => {
                user
            }
            _ => {
                self.metrics.token_review(ReviewResult::Unauthenticated);
                return Err(AuthError::Unauthenticated(match &oidc {
                    Some(claims) => oidc_not_accepted(status.error.as_deref(), claims),
                    None => not_accepted(status.error.as_deref(), &self.options.audiences),
                }));
            }
        };
        self.metrics.token_review(ReviewResult::Authenticated);
        match &oidc {
            Some(claims) => check_oidc_audience(&self.options.oidc_audiences, claims)?,
            None => check_audiences(&self.options.audiences, status.audiences.as_deref())?,
        }
        let username = user.username.clone().unwrap_or_default();
        let caller = caller_of(&user);

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
            return Ok(caller);
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

/// The caller an authenticated TokenReview names: its username and groups (bounded, see
/// [`Caller::with_groups`]), recorded on the pods of its sessions.
fn caller_of(user: &UserInfo) -> Caller {
    Caller::identified(user.username.as_deref().unwrap_or_default())
        .with_groups(user.groups.clone().unwrap_or_default())
}

/// Counts a review in `token_reviews_in_flight` (and its high-water mark) while it lives.
struct Running<'a>(&'a Authenticator);

impl<'a> Running<'a> {
    fn start(auth: &'a Authenticator) -> Self {
        let now = auth.running.fetch_add(1, Ordering::SeqCst) + 1;
        auth.metrics.token_reviews_in_flight.set(now);
        let max = &auth.metrics.token_reviews_in_flight_max;
        if now > max.get() {
            max.set(now);
        }
        Self(auth)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let now = self.0.running.fetch_sub(1, Ordering::SeqCst) - 1;
        self.0.metrics.token_reviews_in_flight.set(now);
    }
}

/// Why a token was not accepted, with what to do about it.
fn not_accepted(api_error: Option<&str>, audiences: &[String]) -> String {
    let api_error = api_error.filter(|e| !e.is_empty());
    let why = api_error.map(|e| format!(" ({e})")).unwrap_or_default();
    let hint = match (api_error.is_some_and(|e| e.contains("audience")), audiences) {
        (true, []) => {
            "; it is bound to an audience this server does not accept: ask for a token without \
             --audience, or start the server with --token-audience <that audience>"
                .to_owned()
        }
        (true, auds) => format!(
            "; this server accepts tokens bound to {auds:?}: get one with `kubectl create token \
             <serviceaccount> --audience {}`",
            auds[0]
        ),
        (false, _) => "; send a valid, unexpired token".to_owned(),
    };
    format!("the bearer token was not accepted by the Kubernetes API{why}{hint}")
}

/// Why the API server refused a token of a configured authorization server.
fn oidc_not_accepted(api_error: Option<&str>, claims: &JwtClaims) -> String {
    let why = api_error
        .filter(|e| !e.is_empty())
        .map(|e| format!(" ({e})"))
        .unwrap_or_default();
    format!(
        "the bearer token of {} was not accepted by the Kubernetes API{why}; get a new, \
         unexpired token for this server from the authorization server (the API server's \
         AuthenticationConfiguration must list this issuer, and the token's audience among its \
         audiences)",
        claims.iss
    )
}

/// A token of a configured authorization server must be issued for this server: its `aud`
/// names one of `wanted` (RFC 8707: the MCP resource URL, or a `--token-audience`).
fn check_oidc_audience(wanted: &[String], claims: &JwtClaims) -> Result<(), AuthError> {
    if claims.aud.iter().any(|a| wanted.contains(a)) {
        return Ok(());
    }
    Err(AuthError::Unauthenticated(format!(
        "the bearer token of {} is issued for {:?}, not for this server ({wanted:?}); ask the \
         authorization server for a token for this resource (the `resource` parameter, RFC \
         8707)",
        claims.iss, claims.aud
    )))
}

/// With `--token-audience`, the review must say the token is valid for one of them (an
/// authenticator that ignores audiences answers none: refused, fail closed).
fn check_audiences(wanted: &[String], granted: Option<&[String]>) -> Result<(), AuthError> {
    if wanted.is_empty()
        || granted
            .unwrap_or_default()
            .iter()
            .any(|g| wanted.contains(g))
    {
        return Ok(());
    }
    Err(AuthError::Unauthenticated(format!(
        "the bearer token is not bound to an audience of this server ({wanted:?}; the review \
         answered {:?}): get one with `kubectl create token <serviceaccount> --audience {}`",
        granted.unwrap_or_default(),
        wanted[0]
    )))
}

fn result_of(d: &Result<Caller, AuthError>) -> AuthResult {
    match d {
        Ok(_) => AuthResult::Allowed,
        Err(AuthError::Forbidden(_)) => AuthResult::Denied,
        Err(AuthError::BadRequest(_) | AuthError::Unauthenticated(_)) => {
            AuthResult::Unauthenticated
        }
        Err(AuthError::Unavailable(_)) => AuthResult::Error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u32, verb: Verb) -> Key {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&n.to_le_bytes());
        (k, verb)
    }

    fn junk() -> Decision {
        Err(AuthError::Unauthenticated("not accepted".into()))
    }

    #[test]
    fn junk_tokens_never_evict_an_allowed_caller() {
        let t0 = Instant::now();
        let mut c = DecisionCache::new(4096, Duration::from_secs(10), Duration::from_secs(5));
        let alice = key(u32::MAX, Verb::Create);
        let caller = Caller::identified("alice").with_groups(vec!["dev".into()]);
        c.put(alice, Ok(caller.clone()), t0);
        for n in 0..4200 {
            c.put(key(n, Verb::Create), junk(), t0);
        }
        assert_eq!(c.len(), (1, 4096), "refusals are bounded on their own");
        assert_eq!(c.get(&alice, t0), Some(Ok(caller)), "with its groups");
        // The most recent junk is still known (reviewed once per TTL), the oldest went first.
        assert_eq!(c.get(&key(4199, Verb::Create), t0), Some(junk()));
        assert_eq!(c.get(&key(0, Verb::Create), t0), None);
    }

    #[test]
    fn allowed_callers_are_evicted_least_recently_used_first() {
        let t0 = Instant::now();
        let mut c = DecisionCache::new(2, Duration::from_secs(10), Duration::from_secs(5));
        let (a, b, d) = (key(1, Verb::Get), key(2, Verb::Get), key(3, Verb::Get));
        c.put(a, Ok(Caller::identified("a")), t0);
        c.put(b, Ok(Caller::identified("b")), t0);
        assert!(c.get(&a, t0).is_some(), "a is now the most recently used");
        c.put(d, Ok(Caller::identified("d")), t0);
        assert!(c.get(&b, t0).is_none(), "b was the least recently used");
        assert!(c.get(&a, t0).is_some() && c.get(&d, t0).is_some());
    }

    #[test]
    fn refusals_expire_sooner_and_outages_are_not_kept() {
        let t0 = Instant::now();
        let o = AuthOptions::default();
        assert_eq!(o.refused_ttl(), Duration::from_secs(5));
        let mut c = DecisionCache::new(8, o.allowed_ttl, o.refused_ttl());
        let (ok, no, down) = (
            key(1, Verb::Create),
            key(2, Verb::Create),
            key(3, Verb::Create),
        );
        c.put(ok, Ok(Caller::identified("a")), t0);
        c.put(no, Err(AuthError::Forbidden("no".into())), t0);
        c.put(down, Err(AuthError::Unavailable("down".into())), t0);
        assert!(
            c.get(&down, t0).is_none(),
            "an unreachable API is asked again"
        );
        let t6 = t0 + Duration::from_secs(6);
        assert!(c.get(&no, t6).is_none(), "a refusal lives 5 s");
        assert!(c.get(&ok, t6).is_some(), "an allow lives 10 s");
        assert!(c.get(&ok, t0 + Duration::from_secs(10)).is_none());
        assert!(c.is_empty(), "expired entries are dropped when met");
        // The verb is part of the key.
        c.put(key(9, Verb::Get), Ok(Caller::identified("a")), t0);
        assert!(c.get(&key(9, Verb::Delete), t0).is_none());
    }

    #[test]
    fn a_new_decision_replaces_the_other_kind() {
        let t0 = Instant::now();
        let mut c = DecisionCache::new(8, Duration::from_secs(10), Duration::from_secs(5));
        let k = key(1, Verb::Create);
        c.put(k, junk(), t0);
        c.put(k, Ok(Caller::identified("a")), t0);
        assert_eq!(c.len(), (1, 0));
        assert!(c.get(&k, t0).is_some_and(|d| d.is_ok()));
    }

    #[test]
    fn audiences_are_checked_only_when_asked_for() {
        let want = vec!["cli-mcp".to_owned()];
        assert!(check_audiences(&[], None).is_ok());
        assert!(check_audiences(&want, Some(&["x".into(), "cli-mcp".into()])).is_ok());
        let e = check_audiences(&want, Some(&["other".into()])).expect_err("refused");
        assert!(e.to_string().contains("--audience cli-mcp"), "{e}");
        assert!(check_audiences(&want, None).is_err(), "fail closed");
    }

    #[test]
    fn oidc_tokens_must_name_this_server() {
        let claims = |aud: &[&str]| JwtClaims {
            iss: "https://idp".into(),
            aud: aud.iter().map(|a| a.to_string()).collect(),
        };
        let want = vec!["https://mcp.example/mcp".to_owned(), "cli-mcp".to_owned()];
        assert!(check_oidc_audience(&want, &claims(&["x", "cli-mcp"])).is_ok());
        let e = check_oidc_audience(&want, &claims(&["kubectl"])).expect_err("other audience");
        assert!(e.to_string().contains("issued for [\"kubectl\"]"), "{e}");
        assert!(check_oidc_audience(&want, &claims(&[])).is_err(), "no aud");
        assert!(
            check_oidc_audience(&[], &claims(&["x"])).is_err(),
            "fail closed"
        );
    }

    #[test]
    fn an_audience_refusal_says_which_flag_fixes_it() {
        let api = "token audiences [\"cli-mcp\"] is invalid for the target audiences";
        assert!(not_accepted(Some(api), &[]).contains("--token-audience"));
        assert!(not_accepted(Some(api), &["mine".into()]).contains("--audience mine"));
        let plain = not_accepted(None, &[]);
        assert!(plain.ends_with("send a valid, unexpired token"), "{plain}");
    }

    #[test]
    fn an_authenticated_review_names_the_callers_groups() {
        // A TokenReview status as the API server answers it for a ServiceAccount token.
        let reviewed: TokenReview = serde_json::from_value(serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {},
            "status": {
                "authenticated": true,
                "user": {
                    "username": "system:serviceaccount:ns:alice",
                    "uid": "u-1",
                    "groups": ["system:serviceaccounts", "system:serviceaccounts:ns",
                               "system:authenticated"]
                }
            }
        }))
        .expect("a TokenReview");
        let user = reviewed.status.and_then(|s| s.user).expect("user");
        let c = caller_of(&user);
        assert_eq!(c.name, "system:serviceaccount:ns:alice");
        assert_eq!(
            c.groups,
            [
                "system:serviceaccounts",
                "system:serviceaccounts:ns",
                "system:authenticated"
            ]
        );
        assert_eq!(c.owner, Caller::identified(&c.name).owner);
        // No groups in the review: none on the caller.
        let bare = UserInfo {
            username: Some("bob".into()),
            ..Default::default()
        };
        assert!(caller_of(&bare).groups.is_empty());
    }

    #[test]
    fn memory_of_full_caches() {
        // Printed for docs/server.md: both caches full, refusals with a realistic message.
        let t0 = Instant::now();
        let mut c = DecisionCache::new(CACHE_CAPACITY, DECISION_TTL, DECISION_TTL / 2);
        let msg = not_accepted(Some("[invalid bearer token, square/go-jose: error in cryptographic primitive, token lookup failed]"), &[]);
        // A ServiceAccount's groups.
        let groups: Vec<String> = [
            "system:serviceaccounts",
            "system:serviceaccounts:team-a",
            "system:authenticated",
        ]
        .map(String::from)
        .to_vec();
        for n in 0..CACHE_CAPACITY as u32 {
            c.put(
                key(n, Verb::Create),
                Err(AuthError::Unauthenticated(msg.clone())),
                t0,
            );
            c.put(
                key(n + 1_000_000, Verb::Create),
                Ok(
                    Caller::identified("system:serviceaccount:team-a:agent-1234")
                        .with_groups(groups.clone()),
                ),
                t0,
            );
        }
        let entry = std::mem::size_of::<(Key, Cached)>() + 3 * std::mem::size_of::<usize>();
        let refused = CACHE_CAPACITY * (entry + msg.len());
        let group_bytes: usize = groups
            .iter()
            .map(|g| std::mem::size_of::<String>() + g.len())
            .sum();
        let allowed = CACHE_CAPACITY * (entry + 2 * 64 + 40 + group_bytes);
        eprintln!(
            "decision cache at its bound: ~{} KiB refused + ~{} KiB allowed",
            refused / 1024,
            allowed / 1024
        );
        assert_eq!(c.len(), (CACHE_CAPACITY, CACHE_CAPACITY));
    }
}
