//! Downward API: pod field paths and container resource fields, shared by env and volumes.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, ResourceFieldSelector};

use crate::quantity;

/// Facts about a pod that are not in its object (or not yet, when the status lags).
#[derive(Debug, Clone)]
pub struct PodFacts<'a> {
    pub pod: &'a Pod,
    pub pod_ip: Option<&'a str>,
    pub host_ip: &'a str,
    pub node_name: &'a str,
    /// Node allocatable cpu (cores) and memory (bytes): the default for unset limits.
    pub node_cpu: f64,
    pub node_memory: f64,
}

/// Where a field path is used: volumes allow fewer paths than env.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    Env,
    Volume,
}

/// Splits `metadata.labels['key']` into `("metadata.labels", "key")`.
fn subscript(path: &str) -> Option<(&str, &str)> {
    let (base, rest) = path.split_once("['")?;
    let key = rest.strip_suffix("']")?;
    Some((base, key))
}

/// Resolves a `fieldRef.fieldPath`.
pub fn field_value(facts: &PodFacts<'_>, path: &str, usage: Use) -> Result<String, String> {
    let meta = &facts.pod.metadata;
    let spec = facts.pod.spec.as_ref();
    if let Some((base, key)) = subscript(path) {
        let map = match base {
            "metadata.labels" => meta.labels.as_ref(),
            "metadata.annotations" => meta.annotations.as_ref(),
            _ => return Err(format!("unsupported fieldPath {path:?}")),
        };
        return Ok(map.and_then(|m| m.get(key)).cloned().unwrap_or_default());
    }
    let v = match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" if usage == Use::Volume => format_map(meta.labels.as_ref()),
        "metadata.annotations" if usage == Use::Volume => format_map(meta.annotations.as_ref()),
        "spec.nodeName" if usage == Use::Env => spec
            .and_then(|s| s.node_name.clone())
            .unwrap_or_else(|| facts.node_name.to_string()),
        "spec.serviceAccountName" if usage == Use::Env => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        "status.hostIP" | "status.hostIPs" if usage == Use::Env => facts.host_ip.to_string(),
        "status.podIP" | "status.podIPs" if usage == Use::Env => {
            facts.pod_ip.unwrap_or_default().to_string()
        }
        _ => {
            let ctx = match usage {
                Use::Env => "env",
                Use::Volume => "downwardAPI volumes",
            };
            return Err(format!("fieldPath {path:?} is not supported in {ctx}"));
        }
    };
    Ok(v)
}

/// Resolves a `resourceFieldRef` for `container` (best effort: unset limits are the node's
/// allocatable, unset requests are 0).
pub fn resource_value(
    facts: &PodFacts<'_>,
    container: &Container,
    sel: &ResourceFieldSelector,
) -> Result<String, String> {
    let res = container.resources.as_ref();
    let get = |which: &str, name: &str| -> Option<f64> {
        let m = match which {
            "limits" => res.and_then(|r| r.limits.as_ref()),
            _ => res.and_then(|r| r.requests.as_ref()),
        }?;
        quantity::parse(&m.get(name)?.0)
    };
    let (value, default_divisor) = match sel.resource.as_str() {
        "limits.cpu" => (get("limits", "cpu").unwrap_or(facts.node_cpu), 1.0),
        "requests.cpu" => (
            get("requests", "cpu")
                .or_else(|| get("limits", "cpu"))
                .unwrap_or(0.0),
            1.0,
        ),
        "limits.memory" => (get("limits", "memory").unwrap_or(facts.node_memory), 1.0),
        "requests.memory" => (
            get("requests", "memory")
                .or_else(|| get("limits", "memory"))
                .unwrap_or(0.0),
            1.0,
        ),
        "limits.ephemeral-storage" => (get("limits", "ephemeral-storage").unwrap_or(0.0), 1.0),
        "requests.ephemeral-storage" => (get("requests", "ephemeral-storage").unwrap_or(0.0), 1.0),
        other => return Err(format!("unsupported resourceFieldRef resource {other:?}")),
    };
    let divisor = match &sel.divisor {
        Some(d) => quantity::parse(&d.0)
            .ok_or_else(|| format!("invalid resourceFieldRef divisor {:?}", d.0))?,
        None => default_divisor,
    };
    quantity::divide_ceil(value, divisor)
        .map(|v| v.to_string())
        .ok_or_else(|| format!("invalid resourceFieldRef divisor {divisor}"))
}

/// Formats labels/annotations like the kubelet: sorted `key="value"` lines (Go `%q`
/// quoting), joined by `\n`, no trailing newline.
pub fn format_map(map: Option<&BTreeMap<String, String>>) -> String {
    map.map(|m| {
        m.iter()
            .map(|(k, v)| format!("{k}={}", go_quote(v)))
            .collect::<Vec<_>>()
            .join("\n")
    })
    .unwrap_or_default()
}

/// Go's `strconv.Quote` for the characters that occur in practice.
pub fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\u{b}' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodSpec, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod() -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("p".into()),
                namespace: Some("ns".into()),
                uid: Some("u-1".into()),
                labels: Some(BTreeMap::from([
                    ("app".to_string(), "web".to_string()),
                    ("a".to_string(), "q\"x\ny".to_string()),
                ])),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-a".into()),
                service_account_name: Some("sa".into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn facts(p: &Pod) -> PodFacts<'_> {
        PodFacts {
            pod: p,
            pod_ip: Some("10.244.0.5"),
            host_ip: "10.244.0.1",
            node_name: "node-a",
            node_cpu: 2.0,
            node_memory: 1024.0 * 1024.0 * 1024.0,
        }
    }

    #[test]
    fn env_fields() {
        let p = pod();
        let f = facts(&p);
        let v = |path| field_value(&f, path, Use::Env);
        assert_eq!(v("metadata.name").as_deref(), Ok("p"));
        assert_eq!(v("metadata.namespace").as_deref(), Ok("ns"));
        assert_eq!(v("metadata.uid").as_deref(), Ok("u-1"));
        assert_eq!(v("metadata.labels['app']").as_deref(), Ok("web"));
        assert_eq!(v("metadata.labels['missing']").as_deref(), Ok(""));
        assert_eq!(v("spec.nodeName").as_deref(), Ok("node-a"));
        assert_eq!(v("spec.serviceAccountName").as_deref(), Ok("sa"));
        assert_eq!(v("status.podIP").as_deref(), Ok("10.244.0.5"));
        assert_eq!(v("status.hostIP").as_deref(), Ok("10.244.0.1"));
        assert!(v("metadata.labels").is_err());
        assert!(v("spec.bogus").is_err());
    }

    #[test]
    fn volume_label_file_format() {
        let p = pod();
        let f = facts(&p);
        assert_eq!(
            field_value(&f, "metadata.labels", Use::Volume).as_deref(),
            Ok("a=\"q\\\"x\\ny\"\napp=\"web\"")
        );
        assert!(field_value(&f, "status.podIP", Use::Volume).is_err());
        assert_eq!(format_map(None), "");
    }

    #[test]
    fn resource_fields() {
        let p = pod();
        let f = facts(&p);
        let c = Container {
            name: "c".into(),
            resources: Some(ResourceRequirements {
                limits: Some(BTreeMap::from([(
                    "memory".to_string(),
                    Quantity("64Mi".into()),
                )])),
                requests: Some(BTreeMap::from([(
                    "cpu".to_string(),
                    Quantity("250m".into()),
                )])),
                ..Default::default()
            }),
            ..Default::default()
        };
        let sel = |r: &str, d: Option<&str>| ResourceFieldSelector {
            resource: r.into(),
            divisor: d.map(|d| Quantity(d.into())),
            container_name: None,
        };
        assert_eq!(
            resource_value(&f, &c, &sel("limits.memory", Some("1Mi"))).as_deref(),
            Ok("64")
        );
        assert_eq!(
            resource_value(&f, &c, &sel("limits.cpu", None)).as_deref(),
            Ok("2")
        );
        assert_eq!(
            resource_value(&f, &c, &sel("requests.cpu", Some("1m"))).as_deref(),
            Ok("250")
        );
        assert_eq!(
            resource_value(&f, &c, &sel("requests.cpu", None)).as_deref(),
            Ok("1")
        );
        assert!(resource_value(&f, &c, &sel("limits.gpu", None)).is_err());
    }
}
