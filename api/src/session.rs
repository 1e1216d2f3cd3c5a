//! The session identifier: the one piece of caller input that becomes part of object names
//! and label values, so it can only exist once validated.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Longest DNS-1123 label, which is also the longest Kubernetes label value.
pub const MAX_LEN: usize = 63;

/// A validated session id: a DNS-1123 label (`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`).
///
/// It is used verbatim as a label value and inside pod names, so no other form may exist.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(String);

/// Why a string is not a session id; the message tells the caller how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionIdError {
    #[error("session id is empty; send a DNS-1123 label such as `my-session-1` in X-Session-ID")]
    Empty,
    #[error("session id is {0} characters long; at most 63 are allowed")]
    TooLong(usize),
    #[error(
        "session id contains {0:?}; only lowercase letters a-z, digits 0-9 and '-' are allowed"
    )]
    InvalidChar(char),
    #[error("session id must start and end with a lowercase letter or digit, not '-'")]
    EdgeHyphen,
}

impl SessionId {
    /// Validates `s` as a DNS-1123 label.
    pub fn parse(s: &str) -> Result<Self, SessionIdError> {
        if s.is_empty() {
            return Err(SessionIdError::Empty);
        }
        let chars = s.chars().count();
        if chars > MAX_LEN {
            return Err(SessionIdError::TooLong(chars));
        }
        if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
        {
            return Err(SessionIdError::InvalidChar(c));
        }
        if s.starts_with('-') || s.ends_with('-') {
            return Err(SessionIdError::EdgeHyphen);
        }
        Ok(Self(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for SessionId {
    type Err = SessionIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for SessionId {
    type Error = SessionIdError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::parse(&s)
    }
}

impl AsRef<str> for SessionId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({})", self.0)
    }
}

impl Serialize for SessionId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for SessionId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reference implementation of the documented pattern (docs/contract.md), written
    /// differently on purpose.
    fn matches_the_documented_pattern(s: &str) -> bool {
        let b = s.as_bytes();
        let ok = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
        match b.len() {
            0 => false,
            1 => ok(b[0]),
            n if n <= 63 => {
                ok(b[0]) && ok(b[n - 1]) && b[1..n - 1].iter().all(|&c| ok(c) || c == b'-')
            }
            _ => false,
        }
    }

    #[test]
    fn accepts_typical_ids() {
        for s in ["a", "0", "abc-123", "a-b", &"x".repeat(63)] {
            assert_eq!(
                SessionId::parse(s).map(|x| x.to_string()),
                Ok(s.to_string())
            );
        }
    }

    #[test]
    fn rejects_with_specific_reasons() {
        assert_eq!(SessionId::parse(""), Err(SessionIdError::Empty));
        assert_eq!(
            SessionId::parse(&"x".repeat(64)),
            Err(SessionIdError::TooLong(64))
        );
        assert_eq!(
            SessionId::parse("Abc"),
            Err(SessionIdError::InvalidChar('A'))
        );
        assert_eq!(
            SessionId::parse("a_b"),
            Err(SessionIdError::InvalidChar('_'))
        );
        assert_eq!(
            SessionId::parse("a.b"),
            Err(SessionIdError::InvalidChar('.'))
        );
        assert_eq!(SessionId::parse("-ab"), Err(SessionIdError::EdgeHyphen));
        assert_eq!(SessionId::parse("ab-"), Err(SessionIdError::EdgeHyphen));
        assert_eq!(SessionId::parse("é"), Err(SessionIdError::InvalidChar('é')));
    }

    #[test]
    fn serde_validates() {
        let ok: SessionId = serde_json::from_str("\"s-1\"").expect("valid id deserializes");
        assert_eq!(serde_json::to_string(&ok).expect("serializes"), "\"s-1\"");
        let err = serde_json::from_str::<SessionId>("\"../etc\"").expect_err("must reject");
        assert!(err.to_string().contains("only lowercase letters"), "{err}");
    }

    proptest! {
        #[test]
        fn parse_agrees_with_regex(s in "[a-z0-9A-Z._-]{0,70}") {
            prop_assert_eq!(SessionId::parse(&s).is_ok(), matches_the_documented_pattern(&s));
        }

        #[test]
        fn any_valid_label_roundtrips(s in "[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?") {
            let id = SessionId::parse(&s).expect("generated from the regex");
            prop_assert_eq!(id.as_str(), s.as_str());
        }

        #[test]
        fn arbitrary_unicode_never_panics(s in "\\PC{0,80}") {
            let _ = SessionId::parse(&s);
        }
    }
}
