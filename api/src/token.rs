//! The token scheme.
//!
//! One random key per instance derives every token, so nothing per-session is ever stored:
//! `session_token = hex(HMAC-SHA256(key, "cli-mcp/v1/session/" + sid))` and
//! `assign_token = hex(HMAC-SHA256(key, "cli-mcp/v1/assign/" + pod_name))`. Pods only carry
//! the *commitment* `sha256_hex(token)`, which proves nothing to whoever reads it.

use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::SessionId;

type HmacSha256 = Hmac<Sha256>;

const SESSION_DOMAIN: &str = "cli-mcp/v1/session/";
const ASSIGN_DOMAIN: &str = "cli-mcp/v1/assign/";

/// Length of the instance key in bytes.
pub const KEY_LEN: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("HMAC key must be {expected} lowercase hex characters ({KEY_LEN} bytes), got {got} characters; regenerate it by deleting the Secret")]
    KeyLength { expected: usize, got: usize },
    #[error("HMAC key is not lowercase hex")]
    KeyNotHex,
    #[error("commitment must be 64 lowercase hex characters (a SHA-256 digest)")]
    BadCommitment,
}

/// The instance HMAC key. Its `Debug` never prints the key.
#[derive(Clone)]
pub struct HmacKey([u8; KEY_LEN]);

impl HmacKey {
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        Self(bytes)
    }

    /// Parses the hex text stored in the Secret; surrounding whitespace (a trailing newline
    /// from `kubectl create secret --from-file`) is tolerated.
    pub fn from_hex(text: &str) -> Result<Self, TokenError> {
        let text = text.trim();
        if text.len() != KEY_LEN * 2 {
            return Err(TokenError::KeyLength {
                expected: KEY_LEN * 2,
                got: text.len(),
            });
        }
        if !is_lower_hex(text) {
            return Err(TokenError::KeyNotHex);
        }
        let mut key = [0u8; KEY_LEN];
        hex::decode_to_slice(text, &mut key).map_err(|_| TokenError::KeyNotHex)?;
        Ok(Self(key))
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    fn derive(&self, domain: &str, subject: &str) -> Token {
        // HMAC takes keys of any length, so this cannot fail for any input.
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(&self.0)
            .expect("HMAC accepts keys of any length");
        mac.update(domain.as_bytes());
        mac.update(subject.as_bytes());
        Token(hex::encode(mac.finalize().into_bytes()))
    }

    /// The bearer token that authorises `POST /exec` on the pod of session `sid`.
    pub fn session_token(&self, sid: &SessionId) -> Token {
        self.derive(SESSION_DOMAIN, sid.as_str())
    }

    /// The bearer token that authorises `POST /assign` on warm pod `pod_name`.
    pub fn assign_token(&self, pod_name: &str) -> Token {
        self.derive(ASSIGN_DOMAIN, pod_name)
    }
}

impl fmt::Debug for HmacKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HmacKey(<redacted>)")
    }
}

/// A bearer token (lowercase hex). Its `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// The text to send as `Authorization: Bearer <token>`.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn commitment(&self) -> Commitment {
        Commitment::of(&self.0)
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// `sha256_hex(token)`: what a pod stores instead of the token.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Commitment([u8; 32]);

impl Commitment {
    /// Commitment of any presented text.
    pub fn of(token: &str) -> Self {
        Self(Sha256::digest(token.as_bytes()).into())
    }

    /// Parses a commitment from its lowercase hex form (env var or annotation).
    pub fn parse(text: &str) -> Result<Self, TokenError> {
        let text = text.trim();
        if text.len() != 64 || !is_lower_hex(text) {
            return Err(TokenError::BadCommitment);
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(text, &mut out).map_err(|_| TokenError::BadCommitment)?;
        Ok(Self(out))
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Constant-time check that `presented` hashes to this commitment. Hashing first means
    /// the comparison time does not depend on the presented length either.
    pub fn verify(&self, presented: &str) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        digest.ct_eq(&self.0).into()
    }
}

impl fmt::Debug for Commitment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Commitment({})", self.to_hex())
    }
}

/// Extracts the token from an `Authorization` header value (`Bearer <token>`, scheme
/// case-insensitive per RFC 7235).
pub fn parse_bearer(header: &str) -> Option<&str> {
    let (scheme, rest) = header.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = rest.trim();
    (!token.is_empty()).then_some(token)
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> HmacKey {
        HmacKey::from_hex(&"0f".repeat(32)).expect("valid key")
    }

    /// Known-answer vectors computed independently with
    /// `printf %s 'cli-mcp/v1/session/abc' | openssl dgst -sha256 -mac HMAC -macopt hexkey:0f0f…`
    /// so the scheme cannot silently change under the other implementations.
    #[test]
    fn known_answer_vectors() {
        let sid = SessionId::parse("abc").expect("valid");
        assert_eq!(
            key().session_token(&sid).expose(),
            "a0172e494d868ae5627da400b69f18ab7befe1ced31dc1561a94c395cc8b4166"
        );
        assert_eq!(
            key().assign_token("cli-mcp-demo-pool-abcdefghij").expose(),
            "c5cb689792d72b63433a3b318c66c0836e0533daf882e07bd4cb6ec981ecdd1e"
        );
    }

    #[test]
    fn domains_are_separated() {
        let sid = SessionId::parse("p1").expect("valid");
        assert_ne!(key().session_token(&sid), key().assign_token("p1"));
    }

    #[test]
    fn commitment_verifies_only_the_token() {
        let t = key().assign_token("cli-mcp-demo-pool-abc");
        let c = t.commitment();
        assert!(c.verify(t.expose()));
        assert!(!c.verify(""));
        assert!(!c.verify(&t.expose()[1..]));
        let parsed = Commitment::parse(&c.to_hex()).expect("roundtrip");
        assert_eq!(parsed, c);
        // sha256_hex of the ASCII token: the commitment is over the hex text, not the bytes.
        assert_eq!(
            c.to_hex(),
            hex::encode(Sha256::digest(t.expose().as_bytes()))
        );
    }

    #[test]
    fn bad_inputs_are_clear_errors() {
        assert_eq!(
            HmacKey::from_hex("abcd").map(|_| ()),
            Err(TokenError::KeyLength {
                expected: 64,
                got: 4
            })
        );
        assert_eq!(
            HmacKey::from_hex(&"0G".repeat(32)).map(|_| ()),
            Err(TokenError::KeyNotHex)
        );
        assert!(HmacKey::from_hex(&format!("{}\n", "ab".repeat(32))).is_ok());
        assert_eq!(Commitment::parse("xyz"), Err(TokenError::BadCommitment));
        assert_eq!(
            Commitment::parse(&"A".repeat(64)),
            Err(TokenError::BadCommitment)
        );
    }

    #[test]
    fn secrets_never_print() {
        let k = key();
        let t = k.session_token(&SessionId::parse("s").expect("valid"));
        assert_eq!(format!("{k:?}"), "HmacKey(<redacted>)");
        assert_eq!(format!("{t:?}"), "Token(<redacted>)");
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(parse_bearer("Bearer abc"), Some("abc"));
        assert_eq!(parse_bearer("bearer  abc "), Some("abc"));
        assert_eq!(parse_bearer("Basic abc"), None);
        assert_eq!(parse_bearer("Bearer "), None);
        assert_eq!(parse_bearer("Bearerabc"), None);
    }
}
