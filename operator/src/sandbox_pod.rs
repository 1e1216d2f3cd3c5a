//! The operator's cached view of a sandbox pod: what the warm pool, the idle GC and the pod
//! watch read, and nothing else.
//!
//! Sandbox pods are what grows with sessions: the operator caches every one of its
//! namespaces, and a full `Pod` (spec with env, volumes and probes; status with every
//! condition and container status) costs several KiB as Rust structures, 2.4 KiB of it
//! inline whatever is set. Almost all of them are assigned: the idle GC reads only their
//! labels, activity and token annotations, deletion mark, uid and resourceVersion. Only the
//! few unassigned (pool) pods need their status and assign commitment.
//!
//! So the watch deserializes pods straight into [`SandboxPod`], whose `Deserialize` reads
//! only the fields listed here and skips the rest of the JSON without keeping it:
//! - metadata: name, namespace, uid, resourceVersion, creationTimestamp,
//!   deletionTimestamp, the labels in [`KEPT_LABELS`] and the annotations in
//!   [`KEPT_ANNOTATIONS`] (the seal only for an unassigned pod);
//! - for an unassigned pod ([`SandboxPod::Unassigned`]) also: the first container's name
//!   and its `ASSIGN_SHA256` env var ([`made_for_key`]); the RuntimeClass it carries (the
//!   status reports it: [`crate::runtime_class::carried`]); the status's phase, conditions
//!   (type, status, reason, message, lastTransitionTime: how long a pod took to be Ready
//!   sizes a pool by demand) and container statuses (name, ready, restartCount,
//!   the waiting state's reason and message, whether it runs, the terminated state's exit
//!   code).
//!
//! A reader that needs another field must add it here (and to the test that pins the
//! list), or it reads `None`.
//!
//! [`made_for_key`]: cli_mcp_api::sandbox::made_for_key

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateRunning, ContainerStateTerminated,
    ContainerStateWaiting, ContainerStatus, EnvVar, Pod, PodCondition, PodSpec, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::de::{self, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use cli_mcp_api::names::{annotation, label};
use cli_mcp_api::pod_state;
use cli_mcp_api::sandbox::ENV_ASSIGN_SHA256;

/// The labels kept: which instance, that it is a sandbox, and whose session it is.
pub const KEPT_LABELS: &[&str] = &[label::INSTANCE, label::COMPONENT, label::SESSION_ID];

/// The annotations kept: the config hash (pool staleness), the token commitment and nonce
/// (stale-key sessions), the activity stamps (idle GC) and the seal (whether a pool pod is
/// warm; dropped again from an assigned pod, which nothing here checks it on).
pub const KEPT_ANNOTATIONS: &[&str] = &[
    annotation::SANDBOX_HASH,
    annotation::TOKEN_SHA256,
    annotation::SANDBOX_NONCE,
    annotation::LAST_ACTIVITY,
    annotation::CREATED_AT,
    annotation::SEAL,
];

/// A sandbox pod as the operator caches it (see the module doc for what is kept).
// The large variant is the common one (almost every cached pod is assigned, and each is
// already behind the store's Arc): boxing it would add an allocation per pod and save none.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum SandboxPod {
    /// No `session-id` label: a warm pool pod, with what the pool plan reads of its spec and
    /// status.
    Unassigned(Box<Pod>),
    /// A session's pod: its metadata alone.
    Assigned(ObjectMeta),
}

impl SandboxPod {
    /// The pod as the pool reads it; `None` for an assigned pod.
    pub fn unassigned(&self) -> Option<&Pod> {
        match self {
            SandboxPod::Unassigned(p) => Some(p),
            SandboxPod::Assigned(_) => None,
        }
    }

    pub fn is_assigned(&self) -> bool {
        matches!(self, SandboxPod::Assigned(_))
    }

    pub fn is_deleting(&self) -> bool {
        pod_state::is_deleting_meta(<Self as k8s_openapi::Metadata>::metadata(self))
    }

    /// The cached view of `pod` (the same as the watch makes from its JSON). Tests only: the
    /// operator's pods come from the watch's JSON, never from a `Pod`.
    #[cfg(test)]
    pub fn from_pod(pod: &Pod) -> Self {
        serde_json::to_value(pod)
            .and_then(serde_json::from_value)
            .expect("a Pod's JSON is a sandbox pod's")
    }
}

impl k8s_openapi::Resource for SandboxPod {
    const API_VERSION: &'static str = <Pod as k8s_openapi::Resource>::API_VERSION;
    const GROUP: &'static str = <Pod as k8s_openapi::Resource>::GROUP;
    const KIND: &'static str = <Pod as k8s_openapi::Resource>::KIND;
    const VERSION: &'static str = <Pod as k8s_openapi::Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str = <Pod as k8s_openapi::Resource>::URL_PATH_SEGMENT;
    type Scope = <Pod as k8s_openapi::Resource>::Scope;
}

impl k8s_openapi::Metadata for SandboxPod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        match self {
            SandboxPod::Unassigned(p) => &p.metadata,
            SandboxPod::Assigned(m) => m,
        }
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        match self {
            SandboxPod::Unassigned(p) => &mut p.metadata,
            SandboxPod::Assigned(m) => m,
        }
    }
}

impl<'de> Deserialize<'de> for SandboxPod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Wire::deserialize(d).map(Wire::into_sandbox_pod)
    }
}

// The JSON of a pod, reduced to what is kept. Everything else is skipped by serde.

#[derive(Deserialize, Default)]
#[serde(default)]
struct Wire {
    metadata: WireMeta,
    spec: Option<WireSpec>,
    status: Option<WireStatus>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WireMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    creation_timestamp: Option<Time>,
    deletion_timestamp: Option<Time>,
    #[serde(deserialize_with = "kept_labels")]
    labels: Option<BTreeMap<String, String>>,
    #[serde(deserialize_with = "kept_annotations")]
    annotations: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WireSpec {
    containers: Vec<WireContainer>,
    runtime_class_name: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WireContainer {
    name: String,
    #[serde(deserialize_with = "assign_env")]
    env: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WireStatus {
    phase: Option<String>,
    conditions: Option<Vec<WireCondition>>,
    container_statuses: Option<Vec<WireContainerStatus>>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WireCondition {
    #[serde(rename = "type")]
    type_: String,
    status: String,
    reason: Option<String>,
    message: Option<String>,
    last_transition_time: Option<Time>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WireContainerStatus {
    name: String,
    ready: bool,
    restart_count: i32,
    state: Option<WireState>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WireState {
    waiting: Option<WireWaiting>,
    running: Option<IgnoredAny>,
    terminated: Option<WireTerminated>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WireWaiting {
    reason: Option<String>,
    message: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WireTerminated {
    exit_code: i32,
}

impl Wire {
    fn into_sandbox_pod(self) -> SandboxPod {
        let m = self.metadata;
        let mut metadata = ObjectMeta {
            name: m.name,
            namespace: m.namespace,
            uid: m.uid,
            resource_version: m.resource_version,
            creation_timestamp: m.creation_timestamp,
            deletion_timestamp: m.deletion_timestamp,
            labels: m.labels,
            annotations: m.annotations,
            ..Default::default()
        };
        if pod_state::is_assigned_meta(&metadata) {
            // Only the pool reads seals: the many assigned pods do not keep theirs.
            if let Some(a) = metadata.annotations.as_mut() {
                a.remove(annotation::SEAL);
            }
            return SandboxPod::Assigned(metadata);
        }
        let spec = self.spec.map(|s| PodSpec {
            containers: s
                .containers
                .into_iter()
                .take(1)
                .map(|c| Container {
                    name: c.name,
                    env: c.env.map(|value| {
                        vec![EnvVar {
                            name: ENV_ASSIGN_SHA256.to_owned(),
                            value: Some(value),
                            value_from: None,
                        }]
                    }),
                    ..Default::default()
                })
                .collect(),
            runtime_class_name: s.runtime_class_name,
            ..Default::default()
        });
        let status = self.status.map(|s| PodStatus {
            phase: s.phase,
            conditions: s.conditions.map(|cs| {
                cs.into_iter()
                    .map(|c| PodCondition {
                        type_: c.type_,
                        status: c.status,
                        reason: c.reason,
                        message: c.message,
                        last_transition_time: c.last_transition_time,
                        ..Default::default()
                    })
                    .collect()
            }),
            container_statuses: s.container_statuses.map(|cs| {
                cs.into_iter()
                    .map(|c| ContainerStatus {
                        name: c.name,
                        ready: c.ready,
                        restart_count: c.restart_count,
                        state: c.state.map(|st| ContainerState {
                            waiting: st.waiting.map(|w| ContainerStateWaiting {
                                reason: w.reason,
                                message: w.message,
                            }),
                            running: st.running.map(|_| ContainerStateRunning::default()),
                            terminated: st.terminated.map(|t| ContainerStateTerminated {
                                exit_code: t.exit_code,
                                ..Default::default()
                            }),
                        }),
                        ..Default::default()
                    })
                    .collect()
            }),
            ..Default::default()
        });
        SandboxPod::Unassigned(Box::new(Pod {
            metadata,
            spec,
            status,
        }))
    }
}

/// A JSON object of strings, of which only the entries under `keep` are read; the others
/// are skipped without being allocated.
struct KeptEntries(&'static [&'static str]);

impl<'de> Visitor<'de> for KeptEntries {
    type Value = Option<BTreeMap<String, String>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map of strings or null")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = BTreeMap::new();
        while let Some(key) = map.next_key_seed(Known(self.0))? {
            match key {
                Some(k) => {
                    out.insert(k.to_owned(), map.next_value::<String>()?);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Some(out))
    }
}

/// A key, as the one of `self.0` it equals (`None`: not one of them).
struct Known(&'static [&'static str]);

impl<'de> de::DeserializeSeed<'de> for Known {
    type Value = Option<&'static str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Known {
    type Value = Option<&'static str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.0.iter().copied().find(|k| *k == v))
    }
}

fn kept_labels<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    d.deserialize_option(KeptEntries(KEPT_LABELS))
}

fn kept_annotations<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    d.deserialize_option(KeptEntries(KEPT_ANNOTATIONS))
}

/// A container's `env`, as the value of its `ASSIGN_SHA256` (`None`: no such plain value).
fn assign_env<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    struct Var {
        #[serde(deserialize_with = "assign_name")]
        name: bool,
        #[serde(default)]
        value: Option<String>,
    }
    fn assign_name<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        Ok(d.deserialize_str(Known(&[ENV_ASSIGN_SHA256]))?.is_some())
    }
    let vars = Option::<Vec<Var>>::deserialize(d)?.unwrap_or_default();
    Ok(vars.into_iter().find(|v| v.name).and_then(|v| v.value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli_mcp_api::activity::{last_activity, last_activity_meta};
    use cli_mcp_api::names::{InstanceName, PoolSuffix};
    use cli_mcp_api::pod_state::{is_ready, is_terminal, session_of, session_of_meta};
    use cli_mcp_api::sandbox::{
        build_sandbox_pod, made_for_key, session_token_of, session_token_of_meta, SandboxConfig,
        SandboxRole,
    };
    use cli_mcp_api::seal::{self, sealed};
    use cli_mcp_api::token::{HmacKey, SandboxNonce};
    use cli_mcp_api::SessionId;
    use kube::{Resource, ResourceExt};

    use crate::pool::{awaits_sandbox, failing_state, is_stale};

    fn cfg() -> SandboxConfig {
        SandboxConfig::new(InstanceName::parse("demo").expect("name"), "ns1", "img:1")
    }

    fn key() -> HmacKey {
        HmacKey::from_bytes([5; 32])
    }

    /// What the API server sends: the built pod plus what the server side adds.
    fn as_stored(mut p: Pod, status: serde_json::Value) -> Pod {
        let m = &mut p.metadata;
        m.namespace = Some("ns1".into());
        m.uid = Some("uid-1".into());
        m.resource_version = Some("42".into());
        m.creation_timestamp = Some(Time("2026-01-01T00:00:00Z".parse().expect("ts")));
        m.generation = Some(1);
        m.managed_fields = Some(vec![Default::default()]);
        m.owner_references = Some(vec![Default::default()]);
        m.annotations_mut_or_default("kubectl.kubernetes.io/note", "x");
        let seal = seal::seal_for(&p, &key()).expect("namespace, name and uid");
        p.metadata
            .annotations_mut_or_default(annotation::SEAL, &seal);
        p.spec.as_mut().expect("spec").node_name = Some("node-1".into());
        p.status = Some(serde_json::from_value(status).expect("status"));
        p
    }

    trait AnnotationsMut {
        fn annotations_mut_or_default(&mut self, k: &str, v: &str);
    }

    impl AnnotationsMut for ObjectMeta {
        fn annotations_mut_or_default(&mut self, k: &str, v: &str) {
            self.annotations
                .get_or_insert_with(Default::default)
                .insert(k.into(), v.into());
        }
    }

    fn time(s: &str) -> Time {
        Time(s.parse().expect("timestamp"))
    }

    fn running_status() -> serde_json::Value {
        serde_json::json!({
            "phase": "Running", "hostIP": "10.0.0.1", "podIP": "10.1.0.7",
            "podIPs": [{"ip": "10.1.0.7"}], "qosClass": "Burstable",
            "startTime": "2026-01-01T00:00:01Z",
            "conditions": [
                {"type": "PodScheduled", "status": "True",
                 "lastTransitionTime": "2026-01-01T00:00:01Z"},
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:03Z"}],
            "containerStatuses": [{"name": "agent", "image": "img:1", "imageID": "sha256:abc",
                "containerID": "cri://1", "ready": true, "restartCount": 2, "started": true,
                "state": {"running": {"startedAt": "2026-01-01T00:00:02Z"}},
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}]
        })
    }

    fn pool_pod() -> Pod {
        let c = cfg();
        let suffix = PoolSuffix::from_random_bytes([1; 10]);
        let assign = key()
            .assign_token(&c.instance.pool_pod(&suffix))
            .commitment();
        let p = build_sandbox_pod(
            &c,
            &SandboxRole::Pool { suffix, assign },
            "2026-01-01T00:00:00Z",
        );
        as_stored(p, running_status())
    }

    fn session_pod() -> Pod {
        let role = SandboxRole::session(
            &key(),
            SessionId::parse("s1").expect("sid"),
            SandboxNonce::from_bytes([9; 16]),
            Some("alice".into()),
        );
        let mut p = build_sandbox_pod(&cfg(), &role, "2026-01-01T00:00:00Z");
        p.metadata
            .annotations_mut_or_default(annotation::LAST_ACTIVITY, "2026-01-01T00:10:00Z");
        as_stored(p, running_status())
    }

    /// The metadata kept of `p`: exactly these fields, and of its labels and annotations
    /// only those the operator reads (an assigned pod's seal not).
    fn kept_meta(p: &Pod) -> ObjectMeta {
        let only = |m: &Option<BTreeMap<String, String>>, keys: &[&str]| {
            m.as_ref().map(|m| -> BTreeMap<String, String> {
                m.iter()
                    .filter(|(k, _)| keys.contains(&k.as_str()))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
        };
        let m = &p.metadata;
        let mut annotations = only(&m.annotations, KEPT_ANNOTATIONS);
        if pod_state::is_assigned_meta(m) {
            if let Some(a) = annotations.as_mut() {
                a.remove(annotation::SEAL);
            }
        }
        ObjectMeta {
            name: m.name.clone(),
            namespace: m.namespace.clone(),
            uid: m.uid.clone(),
            resource_version: m.resource_version.clone(),
            creation_timestamp: m.creation_timestamp.clone(),
            deletion_timestamp: m.deletion_timestamp.clone(),
            labels: only(&m.labels, KEPT_LABELS),
            annotations,
            ..Default::default()
        }
    }

    #[test]
    fn an_assigned_pod_is_cached_as_its_read_metadata_alone() {
        let full = session_pod();
        let cached = SandboxPod::from_pod(&full);
        assert_eq!(cached, SandboxPod::Assigned(kept_meta(&full)));
        let SandboxPod::Assigned(m) = &cached else {
            unreachable!()
        };
        // What is kept is what was there: every read label and annotation but the seal.
        assert_eq!(
            m.labels.as_ref().map(BTreeMap::len),
            Some(KEPT_LABELS.len())
        );
        assert!(full.annotations().contains_key(annotation::SEAL));
        assert_eq!(
            m.annotations.as_ref().map(BTreeMap::len),
            Some(KEPT_ANNOTATIONS.len() - 1)
        );
        assert!(full.labels().len() > KEPT_LABELS.len());
        assert!(m.managed_fields.is_none() && m.owner_references.is_none());
    }

    #[test]
    fn a_pool_pod_is_cached_with_the_spec_and_status_the_pool_reads() {
        let mut full = pool_pod();
        full.spec.as_mut().expect("spec").runtime_class_name = Some("gvisor".into());
        let expected = Pod {
            metadata: kept_meta(&full),
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "agent".into(),
                    env: Some(vec![EnvVar {
                        name: ENV_ASSIGN_SHA256.into(),
                        value: Some(key().assign_token(&full.name_any()).commitment().to_hex()),
                        value_from: None,
                    }]),
                    ..Default::default()
                }],
                runtime_class_name: Some("gvisor".into()),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                conditions: Some(vec![
                    PodCondition {
                        type_: "PodScheduled".into(),
                        status: "True".into(),
                        last_transition_time: Some(time("2026-01-01T00:00:01Z")),
                        ..Default::default()
                    },
                    PodCondition {
                        type_: "Ready".into(),
                        status: "True".into(),
                        last_transition_time: Some(time("2026-01-01T00:00:03Z")),
                        ..Default::default()
                    },
                ]),
                container_statuses: Some(vec![ContainerStatus {
                    name: "agent".into(),
                    ready: true,
                    restart_count: 2,
                    state: Some(ContainerState {
                        running: Some(ContainerStateRunning::default()),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        };
        assert_eq!(
            SandboxPod::from_pod(&full),
            SandboxPod::Unassigned(Box::new(expected))
        );
        let spec = full.spec.as_ref().expect("spec");
        assert!(spec.volumes.is_some() && spec.containers[0].env.as_ref().expect("env").len() > 1);
    }

    /// Every reader of a cached pod answers the same for the pod and for its cached view. A
    /// reader that starts to need a field the cache drops fails here (add it to this test
    /// when you add it to the pool or the idle GC).
    #[test]
    fn the_operators_readers_see_the_same_in_the_cached_view() {
        let k = key();
        let other = HmacKey::from_bytes([6; 32]);
        let hash = cfg().hash();
        let statuses = [
            running_status(),
            serde_json::json!({"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/1 nodes: Insufficient cpu"}]}),
            serde_json::json!({"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "PodReadyToStartContainers", "status": "False"}],
              "containerStatuses": [{"name": "agent", "image": "i", "imageID": "", "ready": false,
                "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}]}),
            serde_json::json!({"phase": "Pending", "containerStatuses": [{"name": "agent",
                "image": "i", "imageID": "", "ready": false, "restartCount": 3,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}}}]}),
            serde_json::json!({"phase": "Failed", "containerStatuses": [{"name": "agent",
                "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}),
        ];
        for status in statuses {
            let mut full = pool_pod();
            full.status = Some(serde_json::from_value(status).expect("status"));
            let cached = SandboxPod::from_pod(&full);
            let view = cached.unassigned().expect("a pool pod");
            assert_eq!(is_ready(&full), is_ready(view));
            assert_eq!(is_terminal(&full), is_terminal(view));
            assert_eq!(failing_state(&full), failing_state(view));
            assert_eq!(awaits_sandbox(&full), awaits_sandbox(view));
            for (h, key) in [(hash.as_str(), &k), ("other", &k), (hash.as_str(), &other)] {
                assert_eq!(is_stale(&full, h, Some(key)), is_stale(view, h, Some(key)));
            }
            assert!(made_for_key(view, &k) && !made_for_key(view, &other));
            assert!(sealed(view, &k) && !sealed(view, &other));
            let now = k8s_openapi::jiff::Timestamp::now();
            assert_eq!(seal::check(&full, &k, now), seal::check(view, &k, now));
            assert_eq!(
                full.metadata.creation_timestamp,
                view.metadata.creation_timestamp
            );
        }
        let full = session_pod();
        let cached = SandboxPod::from_pod(&full);
        let m = cached.meta();
        let sid = SessionId::parse("s1").expect("sid");
        assert_eq!(session_of(&full), session_of_meta(m));
        assert_eq!(last_activity(&full), last_activity_meta(m));
        for key in [&k, &other] {
            assert_eq!(
                session_token_of(&full, &sid, key).map(|t| t.commitment().to_hex()),
                session_token_of_meta(m, &sid, key).map(|t| t.commitment().to_hex())
            );
        }
        assert!(session_token_of_meta(m, &sid, &k).is_some());
        let dp = crate::api_call::delete_exactly(&cached, true);
        let pre = dp.preconditions.expect("preconditions");
        assert_eq!(
            (pre.uid, pre.resource_version),
            (full.uid(), full.resource_version())
        );
    }

    #[test]
    fn a_claim_or_a_deletion_is_seen_in_the_cached_view() {
        let mut p = pool_pod();
        p.metadata.deletion_timestamp = Some(Time("2026-01-01T00:01:00Z".parse().expect("ts")));
        assert!(SandboxPod::from_pod(&p).is_deleting());
        p.labels_mut().insert(label::SESSION_ID.into(), "s1".into());
        let claimed = SandboxPod::from_pod(&p);
        assert!(claimed.is_assigned() && claimed.unassigned().is_none());
    }
}
