//! Where a part's pods run: runtime class, node selector, tolerations, affinity, priority
//! class and image pull Secrets. `spec.sandbox`, `spec.server` and `spec.proxy` each carry
//! these six fields at their top level; they are written once here, as [`PlacementSpec`]
//! flattened into each part, with their bounds and CEL rules. A part gives its copy of the
//! schema its own CEL messages, naming `spec.<part>.<field>` so the API server's refusal says
//! what to fix, and its own descriptions ([`PlacementPart`]).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, LocalObjectReference, Toleration};
use kube::core::{Message, Rule};
use schemars::{JsonSchema, Schema};
use serde::{Deserialize, Serialize};

use crate::sandbox::Placement;

/// The runtime, scheduling and pull Secrets of one part's pods. Flattened into the part's
/// spec (`#[serde(flatten)]`): on the wire the fields sit beside the part's others, and the
/// generated schema merges them into the part's properties (no `allOf`). The descriptions
/// below are the general ones; each part replaces them with its own (see [`PlacementPart`]).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PlacementSpec {
    /// RuntimeClass of the pods (`runtimeClassName`). The RuntimeClass must exist
    /// (`kubectl get runtimeclass`), else the pods are refused. Default: the node's default
    /// runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub runtime_class_name: Option<String>,

    /// Node labels the pods must run on (`nodeSelector`). At most 32.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    pub node_selector: BTreeMap<String, String>,

    /// Taints the pods tolerate (standard pod `tolerations`). At most 32.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub tolerations: Vec<Toleration>,

    /// Node affinity and pod (anti-)affinity of the pods (standard pod `affinity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,

    /// PriorityClass of the pods (`priorityClassName`). It must exist
    /// (`kubectl get priorityclass`), else the pods are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub priority_class_name: Option<String>,

    /// Secrets (type kubernetes.io/dockerconfigjson, in the instance's namespace) the
    /// kubelet pulls the pods' image with (`imagePullSecrets`). At most 16.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    // The item schema is LocalObjectReference's with the name bounded: CEL's cost estimate
    // of an unbounded name does not fit the CRD's budget.
    #[schemars(
        length(max = 16),
        extend("items" = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}}})
    )]
    pub image_pull_secrets: Vec<LocalObjectReference>,
}

impl From<&PlacementSpec> for Placement {
    /// The pod builders' placement: the same six fields.
    fn from(p: &PlacementSpec) -> Self {
        Placement {
            runtime_class_name: p.runtime_class_name.clone(),
            node_selector: p.node_selector.clone(),
            tolerations: p.tolerations.clone(),
            affinity: p.affinity.clone(),
            priority_class_name: p.priority_class_name.clone(),
            image_pull_secrets: p.image_pull_secrets.clone(),
        }
    }
}

/// A part of the spec that carries a [`PlacementSpec`]: the path its CEL messages name, and
/// what each field's description says there. The fields and their rules are the same in
/// every part; what the pods are for, and so why one would place them, is the part's.
pub(super) struct PlacementPart {
    /// `spec.sandbox`, `spec.server` or `spec.proxy`.
    pub path: &'static str,
    pub runtime_class_name: &'static str,
    pub node_selector: &'static str,
    pub tolerations: &'static str,
    pub affinity: &'static str,
    pub priority_class_name: &'static str,
    pub image_pull_secrets: &'static str,
}

impl PlacementPart {
    /// Gives the placement properties of `schema` (the part's spec, with its
    /// [`PlacementSpec`] flattened in) this part's descriptions and CEL rules: a schema
    /// transform, run by the part's `#[schemars(transform = ...)]`. kube's derive also runs
    /// it on one-field copies of the part (for the fields with their own rules); those have
    /// no placement property, and are left as they are.
    pub(super) fn apply(&self, schema: &mut Schema) {
        let field = |name: &str| format!("{}.{name}", self.path);
        let class = field("runtimeClassName");
        let nodes = field("nodeSelector");
        let tolerations = field("tolerations");
        let priority = field("priorityClassName");
        let pull = field("imagePullSecrets");
        let properties = [
            (
                "runtimeClassName",
                self.runtime_class_name,
                vec![class_name(&class, "RuntimeClass", "runtimeclass")],
            ),
            (
                "nodeSelector",
                self.node_selector,
                vec![label_keys(&nodes), label_values(&nodes)],
            ),
            (
                "tolerations",
                self.tolerations,
                vec![
                    toleration_operator(&tolerations),
                    toleration_effect(&tolerations),
                    toleration_exists(&tolerations),
                    toleration_keyless(&tolerations),
                    toleration_seconds(&tolerations),
                ],
            ),
            ("affinity", self.affinity, vec![]),
            (
                "priorityClassName",
                self.priority_class_name,
                vec![class_name(&priority, "PriorityClass", "priorityclass")],
            ),
            (
                "imagePullSecrets",
                self.image_pull_secrets,
                vec![pull_secrets(&pull)],
            ),
        ];
        for (name, description, rules) in properties {
            let Some(property) = property_mut(schema, name) else {
                continue;
            };
            property.insert("description".into(), description.into());
            for rule in rules {
                // What `#[x_kube(validation = ...)]` does; a Rule always serializes.
                kube::core::validate(property, rule).expect("a CEL rule serializes");
            }
        }
    }
}

/// The schema of property `name`, if `schema` has it.
fn property_mut<'a>(schema: &'a mut Schema, name: &str) -> Option<&'a mut Schema> {
    let property = schema
        .get_mut("properties")?
        .as_object_mut()?
        .get_mut(name)?;
    <&mut Schema>::try_from(property).ok()
}

/// A DNS-1123 subdomain, as a regular expression inside a single-quoted CEL string.
const DNS_SUBDOMAIN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";

fn rule(cel: String, message: String) -> Rule {
    Rule::new(cel).message(Message::Message(message))
}

fn class_name(field: &str, kind: &str, plural: &str) -> Rule {
    rule(
        format!("self.matches('{DNS_SUBDOMAIN}')"),
        format!(
            "{field} must be the name of a {kind}: a DNS-1123 subdomain (lowercase letters, digits, '-' and '.'); kubectl get {plural} lists them"
        ),
    )
}

fn label_keys(field: &str) -> Rule {
    rule(
        "self.all(k, size(k) <= 317 && k.matches('^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$'))".into(),
        format!(
            "{field}: each key is a node label key such as kubernetes.io/arch: an optional DNS subdomain and '/', then at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit"
        ),
    )
}

fn label_values(field: &str) -> Rule {
    rule(
        "self.all(k, self[k].matches('^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$'))".into(),
        format!(
            "{field}: each value is a label value: at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit (or empty)"
        ),
    )
}

fn toleration_operator(field: &str) -> Rule {
    rule(
        "self.all(t, !has(t.operator) || t.operator in ['Exists', 'Equal', 'Lt', 'Gt'])".into(),
        format!("{field}[].operator must be Exists, Equal (the default), Lt or Gt"),
    )
}

fn toleration_effect(field: &str) -> Rule {
    rule(
        "self.all(t, !has(t.effect) || t.effect in ['', 'NoSchedule', 'PreferNoSchedule', 'NoExecute'])".into(),
        format!("{field}[].effect must be NoSchedule, PreferNoSchedule or NoExecute (or absent for every effect)"),
    )
}

fn toleration_exists(field: &str) -> Rule {
    rule(
        "self.all(t, !has(t.operator) || t.operator != 'Exists' || !has(t.value) || t.value == '')".into(),
        format!("{field}[]: operator Exists matches every value of the key; remove value, or use operator Equal"),
    )
}

fn toleration_keyless(field: &str) -> Rule {
    rule(
        "self.all(t, (has(t.key) && t.key != '') || (has(t.operator) && t.operator == 'Exists'))".into(),
        format!("{field}[]: a toleration without key needs operator Exists (it then tolerates every taint); set key, or operator: Exists"),
    )
}

fn toleration_seconds(field: &str) -> Rule {
    rule(
        "self.all(t, !has(t.tolerationSeconds) || (has(t.effect) && t.effect == 'NoExecute'))".into(),
        format!("{field}[].tolerationSeconds applies only to effect NoExecute; set effect: NoExecute or remove tolerationSeconds"),
    )
}

fn pull_secrets(field: &str) -> Rule {
    rule(
        format!("self.all(s, s.name.matches('{DNS_SUBDOMAIN}'))"),
        format!(
            "{field}: each entry is {{name: <Secret>}}, naming a Secret of type kubernetes.io/dockerconfigjson in the instance's namespace (a DNS-1123 subdomain, not empty)"
        ),
    )
}

#[cfg(test)]
mod tests {
    use kube::CustomResourceExt;
    use serde_json::Value;

    use crate::crd::tests::cr;
    use crate::crd::CliMcpInstance;

    /// The schema of `spec.<part>` in the generated CRD.
    fn part_schema(part: &str) -> Value {
        let crd = serde_json::to_value(CliMcpInstance::crd()).expect("json");
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            [part]
            .clone()
    }

    #[test]
    fn each_part_names_its_own_placement_fields_in_the_crd() {
        for part in ["sandbox", "server", "proxy"] {
            let schema = part_schema(part);
            // Flattened into the part's properties: still a structural schema.
            for key in ["allOf", "anyOf", "oneOf", "$ref"] {
                assert!(schema.get(key).is_none(), "spec.{part} has {key}");
            }
            let props = &schema["properties"];
            for (field, rules) in [
                ("runtimeClassName", 1),
                ("nodeSelector", 2),
                ("tolerations", 5),
                ("affinity", 0),
                ("priorityClassName", 1),
                ("imagePullSecrets", 1),
            ] {
                let p = &props[field];
                let description = p["description"].as_str().unwrap_or_default();
                assert!(
                    description.contains(&format!("`{field}`")),
                    "spec.{part}.{field}: {description:?}"
                );
                let messages: Vec<_> = p["x-kubernetes-validations"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|r| r["message"].as_str())
                    .collect();
                assert_eq!(messages.len(), rules, "spec.{part}.{field}: {messages:?}");
                for m in messages {
                    assert!(
                        m.starts_with(&format!("spec.{part}.{field}")),
                        "spec.{part}.{field}: {m:?}"
                    );
                }
            }
        }
        // What each part's pods are for stays in its descriptions.
        assert!(
            part_schema("proxy")["properties"]["affinity"]["description"]
                .as_str()
                .is_some_and(|d| d.contains("the replicas prefer different nodes"))
        );
        assert!(
            part_schema("sandbox")["properties"]["runtimeClassName"]["description"]
                .as_str()
                .is_some_and(|d| d.starts_with("RuntimeClass of sandbox pods"))
        );
    }

    #[test]
    fn placement_fields_stay_where_they_were_on_the_wire() {
        let placement = serde_json::json!({
            "runtimeClassName": "gvisor",
            "nodeSelector": {"pool": "a"},
            "tolerations": [{"operator": "Exists"}],
            "affinity": {"nodeAffinity": {}},
            "priorityClassName": "high",
            "imagePullSecrets": [{"name": "regcred"}]
        });
        let mut proxy = placement.clone();
        proxy["targets"] = serde_json::json!([{"type": "kubernetes"}]);
        let o = cr(serde_json::json!({
            "sandbox": placement.clone(), "server": placement.clone(), "proxy": proxy
        }));
        let spec = serde_json::to_value(&o.spec).expect("json");
        for part in ["sandbox", "server", "proxy"] {
            for (k, v) in placement.as_object().expect("object") {
                assert_eq!(&spec[part][k], v, "spec.{part}.{k}");
            }
            assert!(
                spec[part].get("placement").is_none(),
                "no spec.{part}.placement"
            );
        }
        // Unset, the fields are left out as before.
        let plain = serde_json::to_value(&cr(serde_json::json!({})).spec).expect("json");
        assert!(plain["sandbox"].get("tolerations").is_none());
        assert!(plain["server"].get("runtimeClassName").is_none());
    }

    #[test]
    fn each_part_gets_its_own_placement() {
        let o = cr(serde_json::json!({
            "sandbox": {"runtimeClassName": "gvisor", "nodeSelector": {"pool": "sandboxes"},
                        "imagePullSecrets": [{"name": "sandbox-pull"}]},
            "server": {"priorityClassName": "critical", "tolerations": [{"operator": "Exists"}]}
        }));
        let cfg = o.sandbox_config(Some("i")).expect("config");
        assert_eq!(cfg.placement, o.spec.sandbox.placement());
        assert_eq!(cfg.placement.runtime_class_name.as_deref(), Some("gvisor"));
        assert_eq!(cfg.placement.node_selector["pool"], "sandboxes");
        assert_eq!(cfg.placement.image_pull_secrets[0].name, "sandbox-pull");
        assert_eq!(
            cfg.placement.priority_class_name, None,
            "the server's PriorityClass is not the sandboxes'"
        );
        assert!(cfg.placement.tolerations.is_empty());
        let server = o.spec.server.placement();
        assert_eq!(server.priority_class_name.as_deref(), Some("critical"));
        assert_eq!(server.tolerations.len(), 1);
        assert_eq!(server.runtime_class_name, None);

        let proxied = cr(serde_json::json!({"proxy": {
            "targets": [{"type": "kubernetes"}],
            "runtimeClassName": "kata", "tolerations": [{"operator": "Exists"}]
        }}));
        let plan = proxied.proxy_plan().expect("plan");
        assert_eq!(plan.placement.runtime_class_name.as_deref(), Some("kata"));
        assert_eq!(plan.placement.tolerations.len(), 1);
        assert!(
            proxied
                .sandbox_config(Some("i"))
                .expect("config")
                .placement
                .is_empty(),
            "the proxy's placement is not the sandboxes'"
        );

        let plain = cr(serde_json::json!({}));
        assert!(plain
            .sandbox_config(Some("i"))
            .expect("config")
            .placement
            .is_empty());
        assert!(plain.spec.server.placement().is_empty());
    }
}
