//! The security settings every pod we build carries: what the Pod Security Standard
//! `restricted` requires (non-root, no privilege escalation, every capability dropped, the
//! runtime's default seccomp profile), plus a read-only root filesystem. Written once so the
//! sandbox pods and the server's Deployment cannot drift apart.

use k8s_openapi::api::core::v1::{
    Capabilities, PodSecurityContext, SeccompProfile, SecurityContext,
};

/// The container-level settings.
pub fn restricted_container() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The pod-level settings. `uid`, when set, is used as user, group and fsGroup; without it
/// the image's user applies (and OpenShift's restricted SCC may assign one).
pub fn restricted_pod(uid: Option<i64>) -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: uid,
        run_as_group: uid,
        fs_group: uid,
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restricted_settings_are_what_pod_security_restricted_checks() {
        let c = restricted_container();
        assert_eq!(c.allow_privilege_escalation, Some(false));
        assert_eq!(c.run_as_non_root, Some(true));
        assert_eq!(
            c.capabilities.and_then(|c| c.drop),
            Some(vec!["ALL".to_string()])
        );
        let p = restricted_pod(None);
        assert_eq!(p.run_as_non_root, Some(true));
        assert_eq!(p.run_as_user, None);
        assert_eq!(
            p.seccomp_profile.map(|s| s.type_),
            Some("RuntimeDefault".to_string())
        );
        let p = restricted_pod(Some(1001));
        assert_eq!(
            (p.run_as_user, p.run_as_group, p.fs_group),
            (Some(1001), Some(1001), Some(1001))
        );
    }
}
