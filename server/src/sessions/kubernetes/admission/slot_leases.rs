//! The session slots in the API (see [`super::slots`] for why they exist): creating the
//! slots a new session takes, binding them to its pod once the pod is written, and deleting
//! them. [`SlotLeases`] owns the Lease API and the replica's view of the slots; a
//! [`SlotHold`] is what one start holds of them.

use std::time::Instant;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::core::PartialObjectMeta;
use kube::{Api, ResourceExt};
use serde_json::json;

use cli_mcp_api::names::{label, InstanceName};
use cli_mcp_api::SessionId;

use super::slots::{client_tag, slot_ref, slot_view, Family, SlotRef, Slots, ORPHAN_AFTER};
use crate::auth::Caller;
use crate::sessions::{Quota, SessionError};

/// The instance's slot Leases and this replica's view of them, with the bounds of their
/// families; cheap to clone.
#[derive(Debug, Clone)]
pub struct SlotLeases {
    pub(super) api: Api<Lease>,
    /// The same Leases, metadata only (their watch).
    pub(super) meta: Api<PartialObjectMeta<Lease>>,
    pub(super) slots: Slots,
    pub(super) instance: InstanceName,
    /// `--max-sessions`: the instance's slots are `0..max_sessions`.
    max_sessions: usize,
    /// `--max-sessions-per-client`, when set: each client's slots are `0..max_per_client`.
    max_per_client: Option<usize>,
}

impl SlotLeases {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        instance: InstanceName,
        max_sessions: usize,
        max_per_client: Option<usize>,
    ) -> Self {
        Self {
            api: Api::namespaced(client.clone(), namespace),
            meta: Api::namespaced(client, namespace),
            slots: Slots::new(instance.slot_prefix()),
            instance,
            max_sessions,
            max_per_client,
        }
    }

    /// The limit a new session of `caller` is over in the view of the slots (synced), if any
    /// (see [`Slots::full_for`]).
    pub fn full_for(&self, caller: &Caller) -> Option<Quota> {
        self.slots
            .full_for(caller, self.max_sessions, self.max_per_client)
    }

    /// Takes the slots a new session of `caller` needs: one of the instance's, and one of the
    /// caller's with `--max-sessions-per-client`. Refused with the limit that is full.
    pub async fn take(&self, sid: &SessionId, caller: &Caller) -> Result<SlotHold, SessionError> {
        let mut hold = SlotHold {
            held: Vec::new(),
            leases: self.clone(),
        };
        let instance = self.take_slot(sid, Family::Instance, self.max_sessions);
        match self.max_per_client {
            None => hold.held.push(instance.await?),
            Some(per_client) => {
                let client = self.take_slot(sid, Family::Client(client_tag(caller)), per_client);
                let (i, c) = tokio::join!(instance, client);
                // Whatever was taken is held, so the hold frees it if the other failed.
                let (i, c) = (i.map(|s| hold.held.push(s)), c.map(|s| hold.held.push(s)));
                i?;
                c?;
            }
        }
        Ok(hold)
    }

    /// Creates one free slot of `family` below `bound`, trying another on each 409.
    async fn take_slot(
        &self,
        sid: &SessionId,
        family: Family,
        bound: usize,
    ) -> Result<SlotRef, SessionError> {
        let refused = || {
            SessionError::SessionLimit(match &family {
                Family::Instance => Quota::Instance { max: bound },
                Family::Client(_) => Quota::Client { max: bound },
            })
        };
        loop {
            let Some(name) = self.slots.pick(&family, bound, Instant::now()) else {
                return Err(refused());
            };
            let lease = slot_lease(&name, &self.instance, sid);
            match self.api.create(&PostParams::default(), &lease).await {
                Ok(l) => {
                    let view = slot_view(&self.slots, &l.metadata);
                    let r = view.as_ref().and_then(slot_ref);
                    match (view, r) {
                        (Some(v), Some(r)) => {
                            self.slots.created(&name, Ok(v), Instant::now());
                            return Ok(r);
                        }
                        _ => {
                            self.slots.abandoned(&name);
                            return Err(SessionError::Kubernetes(format!(
                                "the API server created session slot {name} without a uid or \
                                 resourceVersion"
                            )));
                        }
                    }
                }
                Err(kube::Error::Api(s)) if s.is_already_exists() => {
                    self.slots.created(&name, Err(()), Instant::now())
                }
                Err(e) => {
                    self.slots.abandoned(&name);
                    return Err(e.into());
                }
            }
        }
    }

    /// Deletes slot `s`, exactly that object (uid precondition): gone or replaced is fine.
    pub(super) async fn delete(&self, s: &SlotRef) {
        let dp = DeleteParams::default().preconditions(Preconditions {
            uid: Some(s.uid.clone()),
            resource_version: None,
        });
        match self.api.delete(&s.name, &dp).await {
            Ok(_) => self.slots.gone(&s.name),
            Err(kube::Error::Api(e)) if e.is_not_found() || e.is_conflict() => {}
            Err(e) => tracing::warn!(slot = %s.name, error = %e,
                "cannot delete a session slot (the garbage collector or another replica frees it later)"),
        }
    }
}

/// The Lease of slot `name`, held by session `sid` (no owner yet).
fn slot_lease(name: &str, instance: &InstanceName, sid: &SessionId) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(
                [
                    (label::INSTANCE.into(), instance.to_string()),
                    (label::COMPONENT.into(), label::COMPONENT_SLOT.into()),
                    (label::APP_PART_OF.into(), label::PART_OF.into()),
                    (label::SESSION_ID.into(), sid.to_string()),
                ]
                .into(),
            ),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(sid.to_string()),
            ..Default::default()
        }),
    }
}

/// The slots one new session holds until its pod owns them; deleted when dropped unbound
/// (the start gave up, failed, or adopted a pod another replica made).
#[derive(Debug)]
pub struct SlotHold {
    held: Vec<SlotRef>,
    leases: SlotLeases,
}

impl SlotHold {
    /// Deletes the slots still held, in a task of their own (never blocks).
    pub fn release_all(&mut self) {
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return;
        }
        let leases = self.leases.clone();
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            for s in held {
                leases.delete(&s).await;
            }
        });
    }

    /// The session's pod is written: its slots become owned by it (each patch guarded by the
    /// slot's `resourceVersion`, so a slot that was taken away as an orphan and created again
    /// by another session is never taken over). A slot lost that way fails the start. Returns
    /// the slots now bound (no longer held).
    pub async fn bind(&mut self, pod: &Pod) -> Result<Vec<SlotRef>, SessionError> {
        let (Some(uid), name) = (pod.uid(), pod.name_any()) else {
            return Err(SessionError::Sandbox(format!(
                "pod {} has no uid to own its session slot",
                pod.name_any()
            )));
        };
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name,
            uid,
            ..Default::default()
        };
        let binds = self.held.iter().map(|s| {
            let patch = json!({"metadata": {
                "resourceVersion": s.resource_version,
                "ownerReferences": [owner],
            }});
            let api = self.leases.api.clone();
            async move {
                api.patch(&s.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
            }
        });
        let results = futures::future::join_all(binds).await;
        let mut lost = None;
        for (s, r) in self.held.iter().zip(results) {
            match r {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.is_not_found() || e.is_conflict() => {
                    lost = Some(s.name.clone())
                }
                Err(e) => return Err(e.into()),
            }
        }
        if let Some(name) = lost {
            return Err(SessionError::Sandbox(format!(
                "its session slot {name} was taken back as abandoned while the sandbox was \
                 started (the start took over {}s); retry the call",
                ORPHAN_AFTER.as_secs()
            )));
        }
        // Owned by the pod now: they go with it.
        Ok(std::mem::take(&mut self.held))
    }

    /// Deletes slots this start bound to a pod it then retired (exactly those objects: uid
    /// precondition), so that it can take new ones without waiting for the pod's deletion to
    /// free them.
    pub async fn give_back(&self, bound: Vec<SlotRef>) {
        for s in bound {
            self.leases.delete(&s).await;
        }
    }

    /// Takes new slots for the session's next candidate pod, in place of those given back.
    pub async fn retake(&mut self, sid: &SessionId, caller: &Caller) -> Result<(), SessionError> {
        *self = self.leases.take(sid, caller).await?;
        Ok(())
    }
}

impl Drop for SlotHold {
    fn drop(&mut self) {
        self.release_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_lease_is_labelled_for_the_instance_and_held_by_its_session() {
        let instance = InstanceName::parse("demo").expect("name");
        let sid = SessionId::parse("s1").expect("sid");
        let l = slot_lease("cli-mcp-demo-slot-3", &instance, &sid);
        assert_eq!(l.metadata.name.as_deref(), Some("cli-mcp-demo-slot-3"));
        let labels = l.metadata.labels.expect("labels");
        assert_eq!(labels[label::INSTANCE], "demo");
        assert_eq!(labels[label::COMPONENT], label::COMPONENT_SLOT);
        assert_eq!(labels[label::SESSION_ID], "s1");
        assert!(
            l.metadata.owner_references.is_none(),
            "bound once the pod is written"
        );
        let holder = l.spec.and_then(|s| s.holder_identity);
        assert_eq!(holder.as_deref(), Some("s1"));
    }
}
