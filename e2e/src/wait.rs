//! Watch-based waits with deadlines: one object until a condition holds or it is gone, a
//! Deployment until a replica is ready, a labelled set until a predicate holds, a pod until
//! its container restarted. A leaf module: the tests (through [`crate::testing`]), the
//! instances' helpers and the add-ons' deployment wait all use it.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::RangeBounds;
use std::time::Duration;

use cli_mcp_api::pod_state::is_ready;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::wait::{await_condition, Condition};
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// Default deadline for e2e waits.
pub const TIMEOUT: Duration = Duration::from_secs(90);

/// Watch one object until `cond` holds, at most `timeout`. Returns the object (`None` if
/// the condition was met by its absence).
pub async fn wait_for<K>(
    api: Api<K>,
    name: &str,
    what: &str,
    timeout: Duration,
    cond: impl Condition<K>,
) -> Result<Option<K>>
where
    K: Clone + Debug + Send + DeserializeOwned + Resource + 'static,
{
    match tokio::time::timeout(timeout, await_condition(api, name, cond)).await {
        Ok(Ok(obj)) => Ok(obj),
        Ok(Err(source)) => Err(Error::Watch {
            what: what.to_string(),
            source,
        }),
        Err(_) => Err(Error::Timeout {
            what: what.to_string(),
            elapsed: timeout,
        }),
    }
}

/// Watch one object until it is gone, at most `timeout`.
pub async fn wait_gone<K>(api: Api<K>, name: &str, what: &str, timeout: Duration) -> Result<()>
where
    K: Clone + Debug + Send + DeserializeOwned + Resource + 'static,
{
    wait_for(api, name, what, timeout, |o: Option<&K>| o.is_none())
        .await
        .map(|_| ())
}

/// Watch a Deployment until at least one of its replicas is ready, at most `timeout`.
pub async fn wait_deployment_ready(
    api: Api<Deployment>,
    name: &str,
    timeout: Duration,
) -> Result<()> {
    wait_for(
        api,
        name,
        &format!("Deployment {name} available"),
        timeout,
        |d: Option<&Deployment>| {
            d.and_then(|d| d.status.as_ref())
                .is_some_and(|s| s.ready_replicas.unwrap_or(0) >= 1)
        },
    )
    .await
    .map(|_| ())
}

/// Watch the objects matching `label_selector` until `pred` holds for the whole set, at
/// most `timeout`. Returns the set at that moment.
pub async fn wait_for_set<K>(
    api: Api<K>,
    label_selector: &str,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&[K]) -> bool,
) -> Result<Vec<K>>
where
    K: Clone + Debug + Send + DeserializeOwned + Resource + 'static,
{
    let wait = async {
        let mut objects: BTreeMap<String, K> = BTreeMap::new();
        let mut init: BTreeMap<String, K> = BTreeMap::new();
        let mut initialised = false;
        let stream =
            watcher(api, watcher::Config::default().labels(label_selector)).default_backoff();
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            let key = |o: &K| o.uid().unwrap_or_else(|| o.name_any());
            match event {
                Ok(watcher::Event::Init) => init.clear(),
                Ok(watcher::Event::InitApply(o)) => {
                    init.insert(key(&o), o);
                }
                Ok(watcher::Event::InitDone) => {
                    objects = std::mem::take(&mut init);
                    initialised = true;
                }
                Ok(watcher::Event::Apply(o)) => {
                    objects.insert(key(&o), o);
                }
                Ok(watcher::Event::Delete(o)) => {
                    objects.remove(&key(&o));
                }
                Err(e) => {
                    tracing::debug!("watch error while waiting for {what}: {e}");
                    continue;
                }
            }
            if initialised {
                let set: Vec<K> = objects.values().cloned().collect();
                if pred(&set) {
                    return Some(set);
                }
            }
        }
        None
    };
    match tokio::time::timeout(timeout, wait).await {
        Ok(Some(set)) => Ok(set),
        Ok(None) => Err(Error::Other(format!(
            "watch ended while waiting for {what}"
        ))),
        Err(_) => Err(Error::Timeout {
            what: what.to_string(),
            elapsed: timeout,
        }),
    }
}

/// What a restarted container is waiting for in [`wait_restarted`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterRestart {
    /// Running again: the pod `Ready` and the container ready.
    Ready,
    /// Waiting to be started again: state `waiting`, reason `CrashLoopBackOff`.
    BackingOff,
}

/// Watch pod `name` until its (first) container's `restartCount` is in `restarts` (`1..`:
/// at least once; `1..=1`: exactly once) and it is as `then` says, at most [`TIMEOUT`].
/// Returns the pod then.
pub async fn wait_restarted(
    api: Api<Pod>,
    name: &str,
    restarts: impl RangeBounds<i32> + Debug,
    then: AfterRestart,
) -> Result<Pod> {
    let what = format!("pod {name}: container restarted {restarts:?} times, then {then:?}");
    let cond = |p: Option<&Pod>| {
        let Some(p) = p else { return false };
        let Some(c) = p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|cs| cs.first())
        else {
            return false;
        };
        restarts.contains(&c.restart_count)
            && match then {
                AfterRestart::Ready => is_ready(p) && c.ready,
                AfterRestart::BackingOff => {
                    c.state
                        .as_ref()
                        .and_then(|s| s.waiting.as_ref())
                        .and_then(|w| w.reason.as_deref())
                        == Some("CrashLoopBackOff")
                }
            }
    };
    wait_for(api, name, &what, TIMEOUT, cond)
        .await?
        .ok_or_else(|| Error::Other(format!("pod {name} is gone while waiting for {what}")))
}
