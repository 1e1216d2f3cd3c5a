//! The CEL rules of the placement fields `spec.sandbox`, `spec.server` and `spec.proxy`
//! share, each naming the field it guards so the API server's refusal says what to fix.

use kube::core::{Message, Rule};

/// A DNS-1123 subdomain, as a regular expression inside a single-quoted CEL string.
const DNS_SUBDOMAIN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";

fn rule(cel: String, message: String) -> Rule {
    Rule::new(cel).message(Message::Message(message))
}

pub fn class_name(field: &str, kind: &str, plural: &str) -> Rule {
    rule(
        format!("self.matches('{DNS_SUBDOMAIN}')"),
        format!(
            "{field} must be the name of a {kind}: a DNS-1123 subdomain (lowercase letters, digits, '-' and '.'); kubectl get {plural} lists them"
        ),
    )
}

pub fn label_keys(field: &str) -> Rule {
    rule(
        "self.all(k, size(k) <= 317 && k.matches('^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$'))".into(),
        format!(
            "{field}: each key is a node label key such as kubernetes.io/arch: an optional DNS subdomain and '/', then at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit"
        ),
    )
}

pub fn label_values(field: &str) -> Rule {
    rule(
        "self.all(k, self[k].matches('^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$'))".into(),
        format!(
            "{field}: each value is a label value: at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit (or empty)"
        ),
    )
}

pub fn toleration_operator(field: &str) -> Rule {
    rule(
        "self.all(t, !has(t.operator) || t.operator in ['Exists', 'Equal', 'Lt', 'Gt'])".into(),
        format!("{field}[].operator must be Exists, Equal (the default), Lt or Gt"),
    )
}

pub fn toleration_effect(field: &str) -> Rule {
    rule(
        "self.all(t, !has(t.effect) || t.effect in ['', 'NoSchedule', 'PreferNoSchedule', 'NoExecute'])".into(),
        format!("{field}[].effect must be NoSchedule, PreferNoSchedule or NoExecute (or absent for every effect)"),
    )
}

pub fn toleration_exists(field: &str) -> Rule {
    rule(
        "self.all(t, !has(t.operator) || t.operator != 'Exists' || !has(t.value) || t.value == '')".into(),
        format!("{field}[]: operator Exists matches every value of the key; remove value, or use operator Equal"),
    )
}

pub fn toleration_keyless(field: &str) -> Rule {
    rule(
        "self.all(t, (has(t.key) && t.key != '') || (has(t.operator) && t.operator == 'Exists'))".into(),
        format!("{field}[]: a toleration without key needs operator Exists (it then tolerates every taint); set key, or operator: Exists"),
    )
}

pub fn toleration_seconds(field: &str) -> Rule {
    rule(
        "self.all(t, !has(t.tolerationSeconds) || (has(t.effect) && t.effect == 'NoExecute'))".into(),
        format!("{field}[].tolerationSeconds applies only to effect NoExecute; set effect: NoExecute or remove tolerationSeconds"),
    )
}

pub fn pull_secrets(field: &str) -> Rule {
    rule(
        format!("self.all(s, s.name.matches('{DNS_SUBDOMAIN}'))"),
        format!(
            "{field}: each entry is {{name: <Secret>}}, naming a Secret of type kubernetes.io/dockerconfigjson in the instance's namespace (a DNS-1123 subdomain, not empty)"
        ),
    )
}
