//! The sessions as they are now, read by label: a session's sandbox for reading its files
//! (when the route cache does not know it), and a caller's sessions for `GET /sessions`.
//! Nothing is started, adopted, repaired or deleted here, so a read never brings a deleted
//! session back or disturbs a start under way on another replica.

use kube::api::ListParams;

use cli_mcp_api::names::annotation;
use cli_mcp_api::pod_state::{is_deleting, is_ready, is_terminal};
use cli_mcp_api::seal::sealed;
use cli_mcp_api::SessionId;

use super::{route_of, winner_order, Lookup};
use crate::auth::Caller;
use crate::sessions::kubernetes::pods::{annotation_of, summary_of};
use crate::sessions::{owner_allows, Sandbox, SessionError, SessionSummary};

impl Lookup {
    /// The pod the session's calls would use now, once the caller may use it; `None` when the
    /// session has no ready pod (never started, deleted, idle-collected, evicted, starting).
    pub async fn existing(
        &self,
        sid: &SessionId,
        caller: &Caller,
    ) -> Result<Option<Sandbox>, SessionError> {
        let list = self
            .pods
            .api()
            .list(&ListParams::default().labels(&self.instance.session_selector(sid)))
            .await?;
        // Only a sealed pod is the session's: a look-alike with copied labels is as good as
        // absent (the next call that starts the session removes it).
        let mut live: Vec<_> = list
            .items
            .into_iter()
            .filter(|p| !is_deleting(p) && !is_terminal(p) && sealed(p, &self.key))
            .collect();
        live.sort_by(winner_order);
        let Some(pod) = live.into_iter().next() else {
            return Ok(None);
        };
        if !owner_allows(annotation_of(&pod, annotation::OWNER), caller) {
            return Err(SessionError::Forbidden(sid.clone()));
        }
        if !is_ready(&pod) {
            return Ok(None);
        }
        // A pod of another key has no token of this server's: it is as good as gone.
        match route_of(sid, &pod, &self.key) {
            Ok(route) => Ok(Some(route.sandbox(None, false))),
            Err(_) => Ok(None),
        }
    }

    /// The sessions of `caller` (its assigned, not-terminating pods), by session id.
    pub async fn sessions(&self, caller: &Caller) -> Result<Vec<SessionSummary>, SessionError> {
        let list = self
            .pods
            .api()
            .list(&ListParams::default().labels(&self.instance.assigned_selector()))
            .await?;
        let mut out: Vec<SessionSummary> = list
            .items
            .iter()
            .filter(|p| !is_deleting(p))
            .filter(|p| owner_allows(annotation_of(p, annotation::OWNER), caller))
            .filter_map(summary_of)
            .collect();
        out.sort_by(|a, b| {
            a.session_id
                .cmp(&b.session_id)
                .then(a.sandbox.cmp(&b.sandbox))
        });
        Ok(out)
    }
}
