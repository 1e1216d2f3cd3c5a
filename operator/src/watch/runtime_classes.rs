//! The cluster's RuntimeClasses (cluster-scoped, read only): the cache the reconcile checks
//! the classes an instance names against ([`crate::runtime_class`]), whether that cache is
//! usable, and a trigger that wakes every instance naming a class when the class is
//! created, changed or deleted — so an instance waiting for its class goes on by itself.

use futures::{future, StreamExt};
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;

use cli_mcp_api::crd::CliMcpInstance;

use super::{hold_init, status_code, Ctl};
use crate::runtime_class::names_class;

/// Adds the RuntimeClass watch to `c`: its store, and whether the store holds the cluster's
/// classes (`Some(true)` once listed, `Some(false)` while the list is refused, `None`
/// before the first answer).
pub(super) fn watch_runtime_classes(
    c: Ctl,
    client: &Client,
    instances: &Store<CliMcpInstance>,
) -> (Ctl, Store<RuntimeClass>, watch::Receiver<Option<bool>>) {
    let (reader, writer) = reflector::store();
    let (listed_tx, listed) = watch::channel(None);
    let mut state = Listed::default();
    // A refused list must not count as an answer, or the backoff would reset and the watch
    // list again every second (see `hold_init`).
    let stream = hold_init(watcher(
        Api::<RuntimeClass>::all(client.clone()),
        watcher::Config::default(),
    ))
    .default_backoff()
    // The flag is set after the store took the list in, so a reconcile never reads an
    // empty store as "listed".
    .reflect(writer)
    .filter_map(move |ev| {
        if let Some(now) = state.observe(&ev) {
            listed_tx.send_replace(Some(now));
            if now {
                tracing::info!("watching RuntimeClasses");
            } else {
                tracing::warn!(
                    "the operator may not list RuntimeClasses (grant get, list and watch on \
                     runtimeclasses.node.k8s.io, as the packaged RBAC does); until then a \
                     runtimeClassName naming a missing class is reported only by the API \
                     server's refusal of the pods"
                );
            }
        }
        // Refused is said once above, not once per retry in the controller's log.
        future::ready((!refused(&ev)).then_some(ev))
    })
    .touched_objects();
    let instances = instances.clone();
    let c = c.watches_stream(stream, move |rc: RuntimeClass| {
        let class = rc.name_any();
        instances
            .state()
            .into_iter()
            .filter(|cr| names_class(cr, &class))
            .map(|cr| ObjectRef::from_obj(cr.as_ref()))
            .collect::<Vec<_>>()
    });
    (c, reader, listed)
}

type WatchEvent = Result<watcher::Event<RuntimeClass>, watcher::Error>;

/// The API refused the list or watch (RBAC).
fn refused(ev: &WatchEvent) -> bool {
    matches!(ev, Err(e) if status_code(e) == Some(403))
}

/// Whether the cache holds the cluster's classes, as the watch's events say.
#[derive(Default)]
struct Listed(Option<bool>);

impl Listed {
    /// The new state when `ev` changes it: listed once a list is complete, not listed while
    /// the API refuses. Other errors (an outage) leave the cache as it was: still the last
    /// list, which the watch brings up to date once it reconnects.
    fn observe(&mut self, ev: &WatchEvent) -> Option<bool> {
        let now = match ev {
            Ok(watcher::Event::InitDone) => true,
            _ if refused(ev) => false,
            _ => return None,
        };
        (self.0 != Some(now)).then(|| {
            self.0 = Some(now);
            now
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16) -> WatchEvent {
        Err(watcher::Error::InitialListFailed(kube::Error::Api(
            kube::core::Status::failure("x", "y")
                .with_code(code)
                .boxed(),
        )))
    }

    #[test]
    fn listed_once_a_list_completes_and_not_while_refused_said_once_each() {
        let mut l = Listed::default();
        assert_eq!(l.observe(&api_error(403)), Some(false));
        assert_eq!(l.observe(&api_error(403)), None, "said once");
        assert!(refused(&api_error(403)) && !refused(&api_error(500)));
        assert_eq!(l.observe(&Ok(watcher::Event::Init)), None);
        assert_eq!(l.observe(&Ok(watcher::Event::InitDone)), Some(true));
        // An outage keeps the last list.
        assert_eq!(l.observe(&api_error(500)), None);
        assert_eq!(l.observe(&Ok(watcher::Event::InitDone)), None);
        // RBAC taken away: the cache is no longer trusted.
        assert_eq!(l.observe(&api_error(403)), Some(false));
    }
}
