//! The token scheme.
//!
//! One random key per instance derives every token, so nothing per-session is ever stored:
//! `session_token = hex(HMAC-SHA256(key, "cli-mcp/v2/session/" + sid + "/" + nonce))` and
//! `assign_token = hex(HMAC-SHA256(key, "cli-mcp/v1/assign/" + pod_name))`. Pods only carry
//! the *commitment* `sha256_hex(token)`, which proves nothing to whoever reads it.
//!
//! The nonce ([`SandboxNonce`]) is drawn afresh for every sandbox a session gets and stored in
//! the clear on its pod: it is not a secret, it only binds the token to that one sandbox. A
//! token that leaked from an earlier sandbox of the same session id (read from its memory, say)
//! therefore never opens a later one — without the nonce, the session id alone would make
//! every sandbox of that id accept the same token forever.

use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::SessionId;

type HmacSha256 = Hmac<Sha256>;

const SESSION_DOMAIN: &str = "cli-mcp/v2/session/";
const ASSIGN_DOMAIN: &str = "cli-mcp/v1/assign/";
/// Domain of a sandbox pod's seal ([`crate::seal`]): distinct from both token domains, so no
/// seal is ever a token's HMAC or the other way round.
const SEAL_DOMAIN: &str = "cli-mcp/v1/seal/";

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
    #[error("sandbox nonce must be {} lowercase hex characters", NONCE_LEN * 2)]
    BadNonce,
}

/// Length of a sandbox nonce in bytes.
pub const NONCE_LEN: usize = 16;

/// The per-sandbox value a session token is bound to (see the module docs). Only a
/// well-formed nonce can exist, so a derivation can never run over a truncated or empty one.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct SandboxNonce([u8; NONCE_LEN]);

impl SandboxNonce {
    /// A nonce from random bytes the caller drew (the crate stays free of an RNG).
    pub fn from_bytes(bytes: [u8; NONCE_LEN]) -> Self {
        Self(bytes)
    }

    /// Parses the lowercase hex form stored in the pod's annotation.
    pub fn parse(text: &str) -> Result<Self, TokenError> {
        if text.len() != NONCE_LEN * 2 || !is_lower_hex(text) {
            return Err(TokenError::BadNonce);
        }
        let mut out = [0u8; NONCE_LEN];
        hex::decode_to_slice(text, &mut out).map_err(|_| TokenError::BadNonce)?;
        Ok(Self(out))
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for SandboxNonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SandboxNonce({})", self.to_hex())
    }
}

impl fmt::Display for SandboxNonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
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

    fn mac(&self) -> HmacSha256 {
        // HMAC takes keys of any length, so this cannot fail for any input.
        <HmacSha256 as KeyInit>::new_from_slice(&self.0).expect("HMAC accepts keys of any length")
    }

    fn derive(&self, parts: &[&str]) -> Token {
        let mut mac = self.mac();
        for part in parts {
            mac.update(part.as_bytes());
        }
        Token(hex::encode(mac.finalize().into_bytes()))
    }

    /// `HMAC-SHA256(key, SEAL_DOMAIN || framed)`: the MAC behind a sandbox pod's seal. The
    /// caller ([`crate::seal`]) frames the parts so that no two part lists share an input.
    pub(crate) fn seal_mac(&self, framed: &[u8]) -> [u8; 32] {
        let mut mac = self.mac();
        mac.update(SEAL_DOMAIN.as_bytes());
        mac.update(framed);
        mac.finalize().into_bytes().into()
    }

    /// The bearer token that authorises `POST /exec` on the one sandbox of session `sid`
    /// that carries `nonce`. The nonce has a fixed length and comes last, so no two
    /// (sid, nonce) pairs share an input.
    pub fn session_token(&self, sid: &SessionId, nonce: &SandboxNonce) -> Token {
        self.derive(&[SESSION_DOMAIN, sid.as_str(), "/", &nonce.to_hex()])
    }

    /// The bearer token that authorises `POST /assign` on warm pod `pod_name`.
    pub fn assign_token(&self, pod_name: &str) -> Token {
        self.derive(&[ASSIGN_DOMAIN, pod_name])
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

    fn nonce(b: u8) -> SandboxNonce {
        SandboxNonce::from_bytes([b; NONCE_LEN])
    }

    /// Known-answer vectors computed independently with
    /// `printf %s 'cli-mcp/v2/session/abc/0101…01' | openssl dgst -sha256 -mac HMAC -macopt hexkey:0f0f…`
    /// so the scheme cannot silently change under the other implementations.
    #[test]
    fn known_answer_vectors() {
        let sid = SessionId::parse("abc").expect("valid");
        assert_eq!(
            key().session_token(&sid, &nonce(1)).expose(),
            "8262fba4f0b6d448595ce3f505637902bf596041f3d94a4205e45a6b309dee3e"
        );
        assert_eq!(
            key().assign_token("cli-mcp-demo-pool-abcdefghij").expose(),
            "c5cb689792d72b63433a3b318c66c0836e0533daf882e07bd4cb6ec981ecdd1e"
        );
    }

    #[test]
    fn domains_are_separated() {
        let sid = SessionId::parse("p1").expect("valid");
        assert_ne!(
            key().session_token(&sid, &nonce(0)),
            key().assign_token("p1")
        );
    }

    #[test]
    fn a_session_token_opens_only_its_own_sandbox() {
        let sid = SessionId::parse("s1").expect("valid");
        let earlier = key().session_token(&sid, &nonce(1));
        let later = key().session_token(&sid, &nonce(2));
        assert_ne!(earlier, later, "another sandbox of the same session id");
        assert!(!later.commitment().verify(earlier.expose()));
        assert_eq!(
            earlier,
            key().session_token(&sid, &nonce(1)),
            "deterministic"
        );
    }

    #[test]
    fn nonces_parse_only_in_their_canonical_form() {
        let n = nonce(0xab);
        assert_eq!(SandboxNonce::parse(&n.to_hex()), Ok(n.clone()));
        assert_eq!(n.to_string(), "ab".repeat(NONCE_LEN));
        for bad in [
            "",
            "ab",
            &"AB".repeat(NONCE_LEN),
            &"ab".repeat(NONCE_LEN + 1),
            &"zz".repeat(NONCE_LEN),
        ] {
            assert_eq!(
                SandboxNonce::parse(bad),
                Err(TokenError::BadNonce),
                "{bad:?}"
            );
        }
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
        let t = k.session_token(&SessionId::parse("s").expect("valid"), &nonce(3));
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
