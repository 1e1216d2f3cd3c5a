//! Container environment: runtime defaults, service variables, `envFrom`, `env` (with
//! `$(VAR)` expansion) and the expansion of `command`/`args`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, Container, Secret};

use crate::downward::{self, PodFacts, Use};

/// ConfigMaps and Secrets fetched for one container start; `None` = not found.
#[derive(Debug, Default, Clone)]
pub struct Objects {
    pub config_maps: BTreeMap<String, Option<ConfigMap>>,
    pub secrets: BTreeMap<String, Option<Secret>>,
}

impl Objects {
    /// String value of a ConfigMap key (`data` first, then `binaryData`).
    fn config_map_key(&self, name: &str, key: &str) -> Lookup {
        match self.config_maps.get(name) {
            Some(Some(cm)) => config_map_entries(cm)
                .remove(key)
                .map(Lookup::Found)
                .unwrap_or(Lookup::NoKey),
            _ => Lookup::NoObject,
        }
    }

    fn secret_key(&self, name: &str, key: &str) -> Lookup {
        match self.secrets.get(name) {
            Some(Some(s)) => secret_entries(s)
                .remove(key)
                .map(Lookup::Found)
                .unwrap_or(Lookup::NoKey),
            _ => Lookup::NoObject,
        }
    }
}

enum Lookup {
    Found(String),
    NoKey,
    NoObject,
}

pub fn config_map_entries(cm: &ConfigMap) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = cm.data.clone().unwrap_or_default();
    for (k, v) in cm.binary_data.iter().flatten() {
        out.entry(k.clone())
            .or_insert_with(|| String::from_utf8_lossy(&v.0).into_owned());
    }
    out
}

pub fn secret_entries(s: &Secret) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = s
        .data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), String::from_utf8_lossy(&v.0).into_owned()))
        .collect();
    for (k, v) in s.string_data.iter().flatten() {
        out.insert(k.clone(), v.clone());
    }
    out
}

/// Names of the ConfigMaps and Secrets a container's env refers to.
pub fn referenced_objects(c: &Container) -> (Vec<String>, Vec<String>) {
    let mut cms = Vec::new();
    let mut secrets = Vec::new();
    for ef in c.env_from.iter().flatten() {
        if let Some(r) = &ef.config_map_ref {
            cms.push(r.name.clone());
        }
        if let Some(r) = &ef.secret_ref {
            secrets.push(r.name.clone());
        }
    }
    for e in c.env.iter().flatten() {
        let Some(vf) = &e.value_from else { continue };
        if let Some(r) = &vf.config_map_key_ref {
            cms.push(r.name.clone());
        }
        if let Some(r) = &vf.secret_key_ref {
            secrets.push(r.name.clone());
        }
    }
    cms.sort();
    cms.dedup();
    secrets.sort();
    secrets.dedup();
    (cms, secrets)
}

/// An ordered environment where a later `set` of the same name replaces the value in place.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct EnvList(pub Vec<(String, String)>);

impl EnvList {
    pub fn set(&mut self, k: impl Into<String>, v: impl Into<String>) {
        let (k, v) = (k.into(), v.into());
        match self.0.iter_mut().find(|(name, _)| *name == k) {
            Some(slot) => slot.1 = v,
            None => self.0.push((k, v)),
        }
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(name, _)| name == k)
            .map(|(_, v)| v.as_str())
    }
}

/// Inputs that are the same for every container of the kubelet.
#[derive(Debug, Clone)]
pub struct ServiceEnv {
    pub apiserver_host: String,
    pub apiserver_port: u16,
}

impl ServiceEnv {
    /// The variables a `kubernetes` Service would inject.
    pub fn vars(&self) -> Vec<(String, String)> {
        let (h, p) = (&self.apiserver_host, self.apiserver_port);
        let addr = format!("tcp://{h}:{p}");
        vec![
            ("KUBERNETES_SERVICE_HOST".into(), h.clone()),
            ("KUBERNETES_SERVICE_PORT".into(), p.to_string()),
            ("KUBERNETES_SERVICE_PORT_HTTPS".into(), p.to_string()),
            ("KUBERNETES_PORT".into(), addr.clone()),
            (format!("KUBERNETES_PORT_{p}_TCP"), addr),
            (format!("KUBERNETES_PORT_{p}_TCP_PROTO"), "tcp".into()),
            (format!("KUBERNETES_PORT_{p}_TCP_PORT"), p.to_string()),
            (format!("KUBERNETES_PORT_{p}_TCP_ADDR"), h.clone()),
        ]
    }
}

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Builds the container's environment. Errors are `CreateContainerConfigError` messages.
pub fn resolve(
    facts: &PodFacts<'_>,
    container: &Container,
    objects: &Objects,
    service: &ServiceEnv,
    uid: u32,
) -> Result<EnvList, String> {
    let mut env = EnvList::default();
    env.set("PATH", DEFAULT_PATH);
    env.set(
        "HOSTNAME",
        facts.pod.metadata.name.clone().unwrap_or_default(),
    );
    env.set("HOME", if uid == 0 { "/root" } else { "/" });
    for (k, v) in service.vars() {
        env.set(k, v);
    }
    let ns = facts.pod.metadata.namespace.as_deref().unwrap_or("default");

    for ef in container.env_from.iter().flatten() {
        let prefix = ef.prefix.clone().unwrap_or_default();
        if let Some(r) = &ef.config_map_ref {
            match objects.config_maps.get(&r.name) {
                Some(Some(cm)) => {
                    for (k, v) in config_map_entries(cm) {
                        env.set(format!("{prefix}{k}"), v);
                    }
                }
                _ if r.optional == Some(true) => {}
                _ => return Err(format!("configmap \"{}\" not found", r.name)),
            }
        }
        if let Some(r) = &ef.secret_ref {
            match objects.secrets.get(&r.name) {
                Some(Some(s)) => {
                    for (k, v) in secret_entries(s) {
                        env.set(format!("{prefix}{k}"), v);
                    }
                }
                _ if r.optional == Some(true) => {}
                _ => return Err(format!("secret \"{}\" not found", r.name)),
            }
        }
    }

    for e in container.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (_, Some(vf)) => {
                if let Some(f) = &vf.field_ref {
                    downward::field_value(facts, &f.field_path, Use::Env)
                        .map_err(|m| format!("env {}: {m}", e.name))?
                } else if let Some(r) = &vf.resource_field_ref {
                    downward::resource_value(facts, container, r)
                        .map_err(|m| format!("env {}: {m}", e.name))?
                } else if let Some(r) = &vf.config_map_key_ref {
                    match objects.config_map_key(&r.name, &r.key) {
                        Lookup::Found(v) => v,
                        _ if r.optional == Some(true) => continue,
                        Lookup::NoKey => {
                            return Err(format!(
                                "couldn't find key {} in ConfigMap {ns}/{}",
                                r.key, r.name
                            ))
                        }
                        Lookup::NoObject => {
                            return Err(format!("configmap \"{}\" not found", r.name))
                        }
                    }
                } else if let Some(r) = &vf.secret_key_ref {
                    match objects.secret_key(&r.name, &r.key) {
                        Lookup::Found(v) => v,
                        _ if r.optional == Some(true) => continue,
                        Lookup::NoKey => {
                            return Err(format!(
                                "couldn't find key {} in Secret {ns}/{}",
                                r.key, r.name
                            ))
                        }
                        Lookup::NoObject => return Err(format!("secret \"{}\" not found", r.name)),
                    }
                } else {
                    return Err(format!(
                        "env {}: valueFrom has no supported source (fieldRef, resourceFieldRef, configMapKeyRef, secretKeyRef)",
                        e.name
                    ));
                }
            }
            (Some(v), None) => expand(v, |name| env.get(name).map(str::to_string)),
            (None, None) => String::new(),
        };
        env.set(e.name.clone(), value);
    }
    Ok(env)
}

/// Kubernetes `$(VAR)` expansion: `$$` is a literal `$`, unknown variables stay as written.
pub fn expand(input: &str, lookup: impl Fn(&str) -> Option<String>) -> String {
    let bytes = input.as_bytes();
    let mut out = String::with_capacity(input.len());
    let mut checkpoint = 0;
    let mut cursor = 0;
    while cursor < bytes.len() {
        if bytes[cursor] == b'$' && cursor + 1 < bytes.len() {
            out.push_str(&input[checkpoint..cursor]);
            let rest = &input[cursor + 1..];
            let advance = match rest.as_bytes()[0] {
                b'$' => {
                    out.push('$');
                    1
                }
                b'(' => match rest.find(')') {
                    Some(end) => {
                        let name = &rest[1..end];
                        match lookup(name) {
                            Some(v) => out.push_str(&v),
                            None => {
                                out.push_str("$(");
                                out.push_str(name);
                                out.push(')');
                            }
                        }
                        end + 1
                    }
                    None => {
                        out.push_str("$(");
                        1
                    }
                },
                _ => {
                    // A literal `$` followed by whatever comes next (which may be multi-byte).
                    out.push('$');
                    let ch_len = rest.chars().next().map(char::len_utf8).unwrap_or(1);
                    out.push_str(&rest[..ch_len]);
                    ch_len
                }
            };
            cursor += advance + 1;
            checkpoint = cursor;
        } else {
            cursor += 1;
        }
    }
    out.push_str(&input[checkpoint.min(input.len())..]);
    out
}

/// Expands `$(VAR)` in command/args using the final environment.
pub fn expand_all(items: &[String], env: &EnvList) -> Vec<String> {
    items
        .iter()
        .map(|s| expand(s, |n| env.get(n).map(str::to_string)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ConfigMapEnvSource, ConfigMapKeySelector, EnvFromSource, EnvVar, EnvVarSource,
        ObjectFieldSelector, Pod, SecretKeySelector,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use k8s_openapi::ByteString;

    fn pod() -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("web-0".into()),
                namespace: Some("team".into()),
                uid: Some("uid-1".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn facts(p: &Pod) -> PodFacts<'_> {
        PodFacts {
            pod: p,
            pod_ip: Some("10.244.3.7"),
            host_ip: "10.244.3.1",
            node_name: "n1",
            node_cpu: 2.0,
            node_memory: 1e9,
        }
    }

    fn svc() -> ServiceEnv {
        ServiceEnv {
            apiserver_host: "10.244.3.1".into(),
            apiserver_port: 6443,
        }
    }

    fn var(name: &str, value: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value: Some(value.into()),
            value_from: None,
        }
    }

    fn from(name: &str, src: EnvVarSource) -> EnvVar {
        EnvVar {
            name: name.into(),
            value: None,
            value_from: Some(src),
        }
    }

    fn objects() -> Objects {
        let cm = ConfigMap {
            data: Some(BTreeMap::from([
                ("LEVEL".to_string(), "debug".to_string()),
                ("MODE".to_string(), "fast".to_string()),
            ])),
            ..Default::default()
        };
        let secret = Secret {
            data: Some(BTreeMap::from([(
                "token".to_string(),
                ByteString(b"s3cret".to_vec()),
            )])),
            ..Default::default()
        };
        Objects {
            config_maps: BTreeMap::from([
                ("cfg".to_string(), Some(cm)),
                ("gone".to_string(), None),
            ]),
            secrets: BTreeMap::from([("sec".to_string(), Some(secret))]),
        }
    }

    #[test]
    fn expansion_rules() {
        let look = |n: &str| (n == "A").then(|| "x".to_string());
        assert_eq!(expand("$(A)-$(B)", look), "x-$(B)");
        assert_eq!(expand("$$(A)", look), "$(A)");
        assert_eq!(expand("cost $5", look), "cost $5");
        assert_eq!(expand("$(A", look), "$(A");
        assert_eq!(expand("end$", look), "end$");
        assert_eq!(expand("é$é$(A)", look), "é$éx");
    }

    #[test]
    fn full_resolution_order_and_sources() {
        let p = pod();
        let c = Container {
            name: "c".into(),
            env_from: Some(vec![EnvFromSource {
                config_map_ref: Some(ConfigMapEnvSource {
                    name: "cfg".into(),
                    optional: None,
                }),
                prefix: Some("CM_".into()),
                secret_ref: None,
            }]),
            env: Some(vec![
                var("CM_MODE", "slow"),
                from(
                    "POD_IP",
                    EnvVarSource {
                        field_ref: Some(ObjectFieldSelector {
                            api_version: None,
                            field_path: "status.podIP".into(),
                        }),
                        ..Default::default()
                    },
                ),
                var("URL", "http://$(POD_IP):8080/$(CM_LEVEL)"),
                from(
                    "TOKEN",
                    EnvVarSource {
                        secret_key_ref: Some(SecretKeySelector {
                            name: "sec".into(),
                            key: "token".into(),
                            optional: None,
                        }),
                        ..Default::default()
                    },
                ),
                from(
                    "OPT",
                    EnvVarSource {
                        config_map_key_ref: Some(ConfigMapKeySelector {
                            name: "gone".into(),
                            key: "k".into(),
                            optional: Some(true),
                        }),
                        ..Default::default()
                    },
                ),
            ]),
            ..Default::default()
        };
        let env = resolve(&facts(&p), &c, &objects(), &svc(), 1000).expect("resolves");
        assert_eq!(env.get("CM_LEVEL"), Some("debug"));
        assert_eq!(env.get("CM_MODE"), Some("slow"));
        assert_eq!(env.get("POD_IP"), Some("10.244.3.7"));
        assert_eq!(env.get("URL"), Some("http://10.244.3.7:8080/debug"));
        assert_eq!(env.get("TOKEN"), Some("s3cret"));
        assert_eq!(env.get("OPT"), None);
        assert_eq!(env.get("KUBERNETES_SERVICE_HOST"), Some("10.244.3.1"));
        assert_eq!(env.get("KUBERNETES_SERVICE_PORT"), Some("6443"));
        assert_eq!(env.get("HOSTNAME"), Some("web-0"));
        assert_eq!(env.get("HOME"), Some("/"));
        let args = expand_all(&["--ip=$(POD_IP)".to_string()], &env);
        assert_eq!(args, vec!["--ip=10.244.3.7".to_string()]);
    }

    #[test]
    fn missing_objects_are_config_errors() {
        let p = pod();
        let missing_secret = Container {
            name: "c".into(),
            env: Some(vec![from(
                "T",
                EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: "nope".into(),
                        key: "k".into(),
                        optional: None,
                    }),
                    ..Default::default()
                },
            )]),
            ..Default::default()
        };
        let err = resolve(&facts(&p), &missing_secret, &objects(), &svc(), 0).expect_err("missing");
        assert_eq!(err, "secret \"nope\" not found");
        let missing_key = Container {
            name: "c".into(),
            env: Some(vec![from(
                "T",
                EnvVarSource {
                    config_map_key_ref: Some(ConfigMapKeySelector {
                        name: "cfg".into(),
                        key: "NOPE".into(),
                        optional: None,
                    }),
                    ..Default::default()
                },
            )]),
            ..Default::default()
        };
        let err = resolve(&facts(&p), &missing_key, &objects(), &svc(), 0).expect_err("no key");
        assert_eq!(err, "couldn't find key NOPE in ConfigMap team/cfg");
    }

    #[test]
    fn referenced_objects_are_deduplicated() {
        let c = Container {
            name: "c".into(),
            env: Some(vec![
                from(
                    "A",
                    EnvVarSource {
                        secret_key_ref: Some(SecretKeySelector {
                            name: "s".into(),
                            key: "a".into(),
                            optional: None,
                        }),
                        ..Default::default()
                    },
                ),
                from(
                    "B",
                    EnvVarSource {
                        secret_key_ref: Some(SecretKeySelector {
                            name: "s".into(),
                            key: "b".into(),
                            optional: None,
                        }),
                        ..Default::default()
                    },
                ),
            ]),
            ..Default::default()
        };
        assert_eq!(referenced_objects(&c), (vec![], vec!["s".to_string()]));
    }
}
