//! Which platform the operator runs on, asked once at start. On OpenShift the default
//! `restricted-v2` SCC assigns every pod a UID from its namespace's range and refuses a pod
//! that fixes another, so sandbox pods there fix none; and its service CA issues the
//! server's certificate, which every router and pod there already trusts.

use std::time::Duration;

use kube::Client;

/// The API group only OpenShift serves (routes), as the Go operator checks.
pub const OPENSHIFT_GROUP: &str = "route.openshift.io";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Platform {
    #[default]
    Kubernetes,
    OpenShift,
}

impl Platform {
    /// From the names of the API groups the cluster serves.
    pub fn from_groups<'a>(groups: impl IntoIterator<Item = &'a str>) -> Self {
        if groups.into_iter().any(|g| g == OPENSHIFT_GROUP) {
            Self::OpenShift
        } else {
            Self::Kubernetes
        }
    }

    /// Whether the platform assigns pod UIDs (see the module docs).
    pub fn assigns_uid(self) -> bool {
        self == Self::OpenShift
    }

    /// Whether the platform's service CA issues serving certificates for annotated Services
    /// and injects its bundle into annotated ConfigMaps (OpenShift's service-ca operator).
    pub fn has_service_ca(self) -> bool {
        self == Self::OpenShift
    }
}

/// `--platform`: detect, or say which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlatformChoice {
    Auto,
    Kubernetes,
    #[value(name = "openshift")]
    OpenShift,
}

/// Asks the API server which groups it serves, until it answers (the health endpoints are
/// served meanwhile, `/readyz` failing; SIGTERM ends the wait). Never a guess: the Go
/// operator assumed plain Kubernetes after a failed discovery, and a guess on OpenShift after
/// a passing outage would fix the sandboxes' UID (refused by the SCC), switch the server
/// certificate away from the service CA and make every pool pod stale — until the next
/// restart flipped it all back. An operator without an API server has nothing to do anyway.
pub async fn detect(client: &Client) -> Platform {
    let mut delay = Duration::from_millis(500);
    loop {
        match client.list_api_groups().await {
            Ok(list) => {
                let p = Platform::from_groups(list.groups.iter().map(|g| g.name.as_str()));
                tracing::info!(platform = ?p, "platform detected");
                return p;
            }
            Err(e) => {
                tracing::warn!(
                    "listing API groups to detect OpenShift: {e}; retrying in {delay:?} (or set \
                     --platform kubernetes|openshift to skip the detection)"
                );
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(8));
            }
        }
    }
}

/// The platform `choice` names, detecting it for `Auto`.
pub async fn resolve(choice: PlatformChoice, client: &Client) -> Platform {
    match choice {
        PlatformChoice::Auto => detect(client).await,
        PlatformChoice::Kubernetes => Platform::Kubernetes,
        PlatformChoice::OpenShift => Platform::OpenShift,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openshift_is_the_route_group() {
        assert_eq!(
            Platform::from_groups(["apps", "route.openshift.io", "batch"]),
            Platform::OpenShift
        );
        assert_eq!(
            Platform::from_groups(["apps", "routes.example.com"]),
            Platform::Kubernetes
        );
        assert!(Platform::OpenShift.assigns_uid());
        assert!(!Platform::Kubernetes.assigns_uid());
        assert!(Platform::OpenShift.has_service_ca());
        assert!(!Platform::Kubernetes.has_service_ca());
    }
}
