//! What the operator's calls to the API server share: telling a refusal by its status code,
//! and delete options that remove exactly the object that was read. Every step that talks
//! to the API server uses these, so they import nothing of the operator.

use kube::api::{DeleteParams, Preconditions};
use kube::Resource;

/// Whether `e` is the API server's answer with status `code` (404 gone, 409 conflict, …).
pub fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// Delete options that remove exactly the object that was read: its UID and, with
/// `unchanged`, its resourceVersion too, so an object made again under the name, or changed
/// since the read (a claim, an activity stamp), fails the delete (409) instead of going.
pub fn delete_exactly<K: Resource>(obj: &K, unchanged: bool) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            uid: obj.meta().uid.clone(),
            resource_version: if unchanged {
                obj.meta().resource_version.clone()
            } else {
                None
            },
        }),
        ..Default::default()
    }
}
