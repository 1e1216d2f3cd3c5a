//! Which uid/gid/groups a container runs as, and who owns the pod's volume files.

use k8s_openapi::api::core::v1::{Container, PodSpec};

/// The uid used when only `runAsNonRoot: true` is set (distroless "nonroot").
pub const NON_ROOT_UID: u32 = 65532;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub no_new_privs: bool,
}

fn id(v: i64) -> u32 {
    u32::try_from(v).unwrap_or(NON_ROOT_UID)
}

/// Container settings override pod settings; `runAsNonRoot` alone means uid/gid 65532.
pub fn for_container(spec: &PodSpec, c: &Container) -> Identity {
    let psc = spec.security_context.as_ref();
    let csc = c.security_context.as_ref();
    let run_as_user = csc
        .and_then(|s| s.run_as_user)
        .or(psc.and_then(|s| s.run_as_user));
    let run_as_group = csc
        .and_then(|s| s.run_as_group)
        .or(psc.and_then(|s| s.run_as_group));
    let non_root = csc
        .and_then(|s| s.run_as_non_root)
        .or(psc.and_then(|s| s.run_as_non_root))
        == Some(true);
    let uid = match run_as_user {
        Some(u) => id(u),
        None if non_root => NON_ROOT_UID,
        None => 0,
    };
    let gid = match run_as_group {
        Some(g) => id(g),
        None if run_as_user.is_none() && non_root => NON_ROOT_UID,
        None => 0,
    };
    let mut groups: Vec<u32> = psc
        .and_then(|s| s.supplemental_groups.clone())
        .unwrap_or_default()
        .into_iter()
        .map(id)
        .collect();
    if let Some(fs) = psc.and_then(|s| s.fs_group) {
        groups.push(id(fs));
    }
    groups.sort_unstable();
    groups.dedup();
    let no_new_privs = csc.and_then(|s| s.allow_privilege_escalation) == Some(false);
    Identity {
        uid,
        gid,
        groups,
        no_new_privs,
    }
}

/// Owner of volume files: the first container's uid, and `fsGroup` (else its gid), so the
/// pod's processes can read files even with restrictive modes.
pub fn volume_owner(spec: &PodSpec) -> (u32, u32) {
    let first = spec.containers.first().map(|c| for_container(spec, c));
    let uid = first.as_ref().map(|i| i.uid).unwrap_or(0);
    let gid = spec
        .security_context
        .as_ref()
        .and_then(|s| s.fs_group)
        .map(id)
        .or(first.map(|i| i.gid))
        .unwrap_or(0);
    (uid, gid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodSecurityContext, SecurityContext};

    fn spec(psc: Option<PodSecurityContext>, csc: Option<SecurityContext>) -> PodSpec {
        PodSpec {
            security_context: psc,
            containers: vec![Container {
                name: "c".into(),
                security_context: csc,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn defaults_to_root() {
        let s = spec(None, None);
        let i = for_container(&s, &s.containers[0]);
        assert_eq!((i.uid, i.gid), (0, 0));
        assert_eq!(volume_owner(&s), (0, 0));
    }

    #[test]
    fn non_root_without_uid_uses_65532() {
        let s = spec(
            Some(PodSecurityContext {
                run_as_non_root: Some(true),
                ..Default::default()
            }),
            None,
        );
        let i = for_container(&s, &s.containers[0]);
        assert_eq!((i.uid, i.gid), (65532, 65532));
    }

    #[test]
    fn container_overrides_pod_and_fs_group_joins() {
        let s = spec(
            Some(PodSecurityContext {
                run_as_user: Some(1000),
                run_as_group: Some(1000),
                fs_group: Some(2000),
                supplemental_groups: Some(vec![3000]),
                ..Default::default()
            }),
            Some(SecurityContext {
                run_as_user: Some(1001),
                allow_privilege_escalation: Some(false),
                ..Default::default()
            }),
        );
        let i = for_container(&s, &s.containers[0]);
        assert_eq!((i.uid, i.gid), (1001, 1000));
        assert_eq!(i.groups, vec![2000, 3000]);
        assert!(i.no_new_privs);
        assert_eq!(volume_owner(&s), (1001, 2000));
    }
}
