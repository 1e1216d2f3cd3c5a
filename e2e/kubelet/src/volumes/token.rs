//! Service-account tokens of projected volumes, from the TokenRequest API, kept until
//! they are due for renewal.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ServiceAccount, ServiceAccountTokenProjection};
use kube::api::PostParams;
use kube::Api;

use super::SyncCtx;

const DEFAULT_TOKEN_SECONDS: i64 = 3600;

struct CachedToken {
    token: String,
    refresh_at: Instant,
}

/// A pod's tokens, by volume and path in it.
#[derive(Default)]
pub(super) struct Tokens(BTreeMap<(String, String), CachedToken>);

impl Tokens {
    /// Earliest time a cached token should be renewed.
    pub fn next_refresh(&self) -> Option<Instant> {
        self.0.values().map(|t| t.refresh_at).min()
    }

    /// The token for `t` in `volume`: the cached one until it is due for renewal, then a
    /// new one.
    pub async fn get(
        &mut self,
        ctx: &SyncCtx<'_>,
        volume: &str,
        t: &ServiceAccountTokenProjection,
    ) -> Result<String, String> {
        let key = (volume.to_string(), t.path.clone());
        if let Some(c) = self.0.get(&key) {
            if Instant::now() < c.refresh_at {
                return Ok(c.token.clone());
            }
        }
        let (token, refresh_at) = request(ctx, t).await?;
        self.0.insert(
            key,
            CachedToken {
                token: token.clone(),
                refresh_at,
            },
        );
        Ok(token)
    }
}

/// A new token for the pod's service account, bound to the pod, and when to renew it.
async fn request(
    ctx: &SyncCtx<'_>,
    t: &ServiceAccountTokenProjection,
) -> Result<(String, Instant), String> {
    let pod = ctx.facts.pod;
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let sa = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_else(|| "default".into());
    let seconds = t.expiration_seconds.unwrap_or(DEFAULT_TOKEN_SECONDS);
    let audiences: Vec<String> = t
        .audience
        .iter()
        .filter(|a| !a.is_empty())
        .cloned()
        .collect();
    let req = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: (!audiences.is_empty()).then_some(audiences),
            expiration_seconds: Some(seconds),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: pod.metadata.name.clone(),
                uid: pod.metadata.uid.clone(),
            }),
            attestations: None,
        }),
        ..Default::default()
    };
    let api: Api<ServiceAccount> = Api::namespaced(ctx.client.clone(), ns);
    let resp = api
        .create_token_request(&sa, &PostParams::default(), &req)
        .await
        .map_err(|e| format!("TokenRequest for serviceaccount {ns}/{sa}: {e}"))?;
    let status = resp.status.unwrap_or_default();
    let token = status
        .token
        .ok_or_else(|| format!("TokenRequest for serviceaccount {ns}/{sa} returned no token"))?;
    // Renew at 80% of the lifetime the API actually granted.
    let granted = status
        .expiration_timestamp
        .map(|t| {
            t.0.duration_since(k8s_openapi::jiff::Timestamp::now())
                .as_secs()
        })
        .unwrap_or(seconds)
        .max(60) as u64;
    let refresh_at = Instant::now() + Duration::from_secs(granted * 8 / 10);
    Ok((token, refresh_at))
}
