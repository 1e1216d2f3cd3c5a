//! The seal of a sandbox pod: proof that a holder of the instance key wrote on this very pod.
//!
//! Whoever may create pods in an instance's namespace can copy everything a sandbox pod
//! shows: its name (after deleting the original), labels, annotations and env, including the
//! token commitments. Trusting a pod for those would let such an identity plant a look-alike
//! under a warm pod's or a session pod's name and be sent the next session's commands and
//! token. What cannot be copied is the pod's uid: the API server sets `metadata.uid` on
//! create, never the client, and a pod recreated under the same name gets a new one.
//!
//! So the writer of a sandbox pod (the operator for a pool pod, the server for a pod it
//! creates on demand) seals it right after the create returns, when it first knows the uid:
//!
//! ```text
//! seal = hex(HMAC-SHA256(key, "cli-mcp/v1/seal/" || frame(namespace) || frame(name) || frame(uid)))
//! frame(s) = the length of s in bytes as 8 bytes big-endian, then the bytes of s
//! ```
//!
//! and writes it to the [`annotation::SEAL`] annotation. A seal copied onto another pod does
//! not match that pod's uid, and without the key nobody can compute one. The length framing
//! makes the input unambiguous whatever the parts contain.
//!
//! A pod exists unsealed for the moment between its create and its seal. [`check`] tells
//! that moment ([`SealCheck::Awaited`], up to [`SEAL_GRACE`] after `creationTimestamp`) from a
//! pod that will never be sealed ([`SealCheck::Unsealed`]): a plant, a pod of another key,
//! or one whose writer crashed before sealing it.
//!
//! [`annotation::SEAL`]: crate::names::annotation::SEAL

use subtle::ConstantTimeEq;

use crate::token::HmacKey;

/// The seal of the pod `name` with uid `uid` in `namespace`: 64 lowercase hex characters.
pub fn seal(key: &HmacKey, namespace: &str, name: &str, uid: &str) -> String {
    hex::encode(mac(key, namespace, name, uid))
}

/// Whether `presented` is the seal of (`namespace`, `name`, `uid`) under `key`. The
/// comparison takes the same time wherever the first differing byte is.
pub fn is_seal_of(key: &HmacKey, namespace: &str, name: &str, uid: &str, presented: &str) -> bool {
    let mut bytes = [0u8; 32];
    if presented.len() != 64
        || !presented
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        return false;
    }
    if hex::decode_to_slice(presented, &mut bytes).is_err() {
        return false;
    }
    bytes.ct_eq(&mac(key, namespace, name, uid)).into()
}

fn mac(key: &HmacKey, namespace: &str, name: &str, uid: &str) -> [u8; 32] {
    let mut framed = Vec::with_capacity(3 * 8 + namespace.len() + name.len() + uid.len());
    for part in [namespace, name, uid] {
        // A usize always fits in a u64 on the targets Rust supports.
        framed.extend_from_slice(&(part.len() as u64).to_be_bytes());
        framed.extend_from_slice(part.as_bytes());
    }
    key.seal_mac(&framed)
}

#[cfg(feature = "k8s")]
pub use pod::*;

#[cfg(feature = "k8s")]
mod pod {
    use std::time::Duration;

    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use k8s_openapi::jiff::Timestamp;

    use super::{is_seal_of, seal};
    use crate::names::annotation;
    use crate::token::HmacKey;

    /// How long after its `creationTimestamp` an unsealed pod may still be sealed by its
    /// writer. Writers seal right after the create returns, so a pod still unsealed after
    /// this is not going to be.
    pub const SEAL_GRACE: Duration = Duration::from_secs(30);

    /// The seal `pod` should carry: `None` when it has no namespace, name or uid yet (a pod
    /// not read back from the API server).
    pub fn seal_for(pod: &Pod, key: &HmacKey) -> Option<String> {
        let m = &pod.metadata;
        Some(seal(
            key,
            m.namespace.as_deref()?,
            m.name.as_deref()?,
            m.uid.as_deref()?,
        ))
    }

    /// Whether `pod` carries a valid seal for its own namespace, name and uid under `key`.
    /// False when any of those or the annotation is missing or malformed.
    pub fn sealed(pod: &Pod, key: &HmacKey) -> bool {
        sealed_meta(&pod.metadata, key)
    }

    /// [`sealed`] on a pod's metadata alone.
    pub fn sealed_meta(m: &ObjectMeta, key: &HmacKey) -> bool {
        let (Some(ns), Some(name), Some(uid)) = (&m.namespace, &m.name, &m.uid) else {
            return false;
        };
        m.annotations
            .as_ref()
            .and_then(|a| a.get(annotation::SEAL))
            .is_some_and(|presented| is_seal_of(key, ns, name, uid, presented))
    }

    /// What a pod's seal says about it at `now`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum SealCheck {
        /// Sealed for its uid under the key: a pod its writer made.
        Sealed,
        /// Not sealed yet, but young enough that its writer may still seal it; look again
        /// after this long (at most [`SEAL_GRACE`]).
        Awaited(Duration),
        /// Not sealed, and never going to be: never route to it, never count it as warm.
        Unsealed,
    }

    /// Whether `pod` is sealed, may still be, or will never be (see the module docs). A pod
    /// without a `creationTimestamp` cannot show it is young, so it counts as unsealed.
    pub fn check(pod: &Pod, key: &HmacKey, now: Timestamp) -> SealCheck {
        if sealed(pod, key) {
            return SealCheck::Sealed;
        }
        let Some(created) = pod.metadata.creation_timestamp.as_ref() else {
            return SealCheck::Unsealed;
        };
        // A creation time ahead of this clock (skew) counts as age zero: the wait stays
        // bounded by the grace.
        let age = Duration::try_from(now.duration_since(created.0)).unwrap_or(Duration::ZERO);
        match SEAL_GRACE.checked_sub(age) {
            Some(left) if !left.is_zero() => SealCheck::Awaited(left),
            _ => SealCheck::Unsealed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> HmacKey {
        HmacKey::from_hex(&"0f".repeat(32)).expect("valid key")
    }

    const NAME: &str = "cli-mcp-demo-pool-abcdefghij";
    const UID: &str = "6f1c2c1e-3c52-4d0c-9a8e-2b7c5f0e4d11";

    /// Computed independently with
    /// `printf 'cli-mcp/v1/seal/\x00\x00\x00\x00\x00\x00\x00\x03ns1\x00…\x1ccli-mcp-demo-pool-abcdefghij\x00…\x24'"$UID" | openssl dgst -sha256 -mac HMAC -macopt hexkey:0f0f…`
    /// so the scheme cannot silently change under the other writers.
    #[test]
    fn known_answer_vector() {
        assert_eq!(
            seal(&key(), "ns1", NAME, UID),
            "d2e357473eb466c6ee0acf3287826b8d3b99d1b9c6990db1f4a4f06fd7ae29b2"
        );
    }

    #[test]
    fn a_seal_binds_every_part_and_its_boundaries() {
        let s = seal(&key(), "ns1", NAME, UID);
        assert!(is_seal_of(&key(), "ns1", NAME, UID, &s));
        assert!(!is_seal_of(&key(), "ns2", NAME, UID, &s), "namespace");
        assert!(!is_seal_of(&key(), "ns1", "other", UID, &s), "name");
        assert!(!is_seal_of(&key(), "ns1", NAME, "other-uid", &s), "uid");
        let other_key = HmacKey::from_bytes([1; 32]);
        assert!(!is_seal_of(&other_key, "ns1", NAME, UID, &s), "key");
        // Moving a boundary between parts changes the seal.
        assert_ne!(seal(&key(), "ab", "c", "d"), seal(&key(), "a", "bc", "d"));
        // Not a token of the same key over the same text.
        assert_ne!(s, key().assign_token(NAME).expose());
    }

    #[test]
    fn only_the_canonical_form_is_accepted() {
        let s = seal(&key(), "ns1", NAME, UID);
        for bad in [
            String::new(),
            s[..62].to_owned(),
            format!("{s}00"),
            s.to_uppercase(),
            format!(" {}", &s[1..]),
        ] {
            assert!(!is_seal_of(&key(), "ns1", NAME, UID, &bad), "{bad:?}");
        }
    }

    #[cfg(feature = "k8s")]
    mod pods {
        use std::time::Duration;

        use k8s_openapi::api::core::v1::Pod;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        use k8s_openapi::jiff::Timestamp;

        use super::super::*;
        use super::{key, NAME, UID};
        use crate::names::annotation;

        fn at(second: i64) -> Timestamp {
            Timestamp::from_second(1_800_000_000 + second).expect("timestamp")
        }

        /// A pod as read back from the API server, created at second 0.
        fn pod(uid: Option<&str>) -> Pod {
            let mut p = Pod::default();
            p.metadata.namespace = Some("ns1".into());
            p.metadata.name = Some(NAME.into());
            p.metadata.uid = uid.map(str::to_owned);
            p.metadata.creation_timestamp = Some(Time(at(0)));
            p
        }

        fn with_seal(mut p: Pod, seal: &str) -> Pod {
            p.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(annotation::SEAL.into(), seal.into());
            p
        }

        #[test]
        fn a_pod_is_sealed_by_the_seal_of_its_own_uid() {
            let original = pod(Some(UID));
            let s = seal_for(&original, &key()).expect("namespace, name and uid");
            assert_eq!(s, seal(&key(), "ns1", NAME, UID));
            assert!(sealed(&with_seal(original.clone(), &s), &key()));
            assert!(!sealed(&original, &key()), "no annotation");
            assert!(
                !sealed(&with_seal(original, &s), &HmacKey::from_bytes([2; 32])),
                "another key"
            );
        }

        #[test]
        fn a_namesake_with_a_copied_seal_is_not_sealed() {
            let s = seal(&key(), "ns1", NAME, UID);
            let planted = with_seal(pod(Some("a-uid-the-api-server-gave-the-plant")), &s);
            assert!(!sealed(&planted, &key()));
            assert_eq!(check(&planted, &key(), at(60)), SealCheck::Unsealed);
        }

        #[test]
        fn a_pod_without_a_uid_or_namespace_is_not_sealed() {
            let s = seal(&key(), "ns1", NAME, UID);
            assert!(!sealed(&with_seal(pod(None), &s), &key()));
            assert_eq!(seal_for(&pod(None), &key()), None);
            let mut no_ns = with_seal(pod(Some(UID)), &s);
            no_ns.metadata.namespace = None;
            assert!(!sealed(&no_ns, &key()));
        }

        #[test]
        fn an_unsealed_pod_is_awaited_only_within_the_grace() {
            let p = pod(Some(UID));
            let k = key();
            assert_eq!(
                check(&p, &k, at(10)),
                SealCheck::Awaited(SEAL_GRACE - Duration::from_secs(10))
            );
            // Clock skew: a creation time ahead of now waits the whole grace, no more.
            assert_eq!(check(&p, &k, at(-5)), SealCheck::Awaited(SEAL_GRACE));
            let grace = i64::try_from(SEAL_GRACE.as_secs()).expect("small");
            assert_eq!(check(&p, &k, at(grace)), SealCheck::Unsealed);
            assert_eq!(check(&p, &k, at(grace + 100)), SealCheck::Unsealed);
            let sealed_pod = with_seal(p.clone(), &seal(&k, "ns1", NAME, UID));
            assert_eq!(check(&sealed_pod, &k, at(grace + 100)), SealCheck::Sealed);
            let mut no_time = p;
            no_time.metadata.creation_timestamp = None;
            assert_eq!(check(&no_time, &k, at(0)), SealCheck::Unsealed);
        }
    }
}
