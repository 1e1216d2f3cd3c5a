//! Who is calling, and may they?
//!
//! With `--auth kubernetes` every request carries a Kubernetes bearer token: TokenReview says
//! who it is, SubjectAccessReview says whether that identity may `create` (POST), `delete`
//! (DELETE) or `get` (GET) the `mcp` subresource of this `CliMcpInstance`. Decisions are
//! cached briefly in a bounded map keyed by the token's SHA-256 (never the token itself).
//! With `--auth none` every caller is [`Caller::anonymous`].
//!
//! For MCP clients that discover how to get a token (the MCP authorization spec), the
//! listener publishes OAuth Protected Resource Metadata and answers a 401 with a
//! `WWW-Authenticate` challenge pointing at it ([`resource`]). Tokens of the authorization
//! servers it names are still checked with TokenReview: the API server trusts them as JWT
//! issuers (structured authentication configuration).

pub mod bearer;
mod coalesce;
pub mod resource;
pub mod tls;
pub mod tokenreview;

use sha2::{Digest, Sha256};

pub use tokenreview::{AuthError, AuthOptions, Authenticator};

/// The identity behind a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Username from TokenReview, or `anonymous`.
    pub name: String,
    /// `sha256_hex(username)`, stamped on the pods of the sessions this caller creates;
    /// `None` with auth off (sessions then have no owner).
    pub owner: Option<String>,
}

impl Caller {
    pub fn anonymous() -> Self {
        Self {
            name: "anonymous".into(),
            owner: None,
        }
    }

    pub fn identified(username: &str) -> Self {
        Self {
            name: username.to_owned(),
            owner: Some(owner_hash(username)),
        }
    }
}

/// The `owner` annotation of a caller: lowercase hex SHA-256 of the username, so an admin can
/// find a user's sessions with `printf %s "$user" | sha256sum`.
pub fn owner_hash(username: &str) -> String {
    hex::encode(Sha256::digest(username.as_bytes()))
}

/// What a request wants to do to the instance's `mcp` subresource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verb {
    /// `POST /mcp` (tool calls).
    Create,
    /// `DELETE /sessions/{id}`.
    Delete,
    /// `GET /sessions`.
    Get,
}

impl Verb {
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Create => "create",
            Verb::Delete => "delete",
            Verb::Get => "get",
        }
    }

    pub fn of_method(m: &http::Method) -> Self {
        match *m {
            http::Method::POST | http::Method::PUT | http::Method::PATCH => Verb::Create,
            http::Method::DELETE => Verb::Delete,
            _ => Verb::Get,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_is_sha256_of_the_username() {
        let c = Caller::identified("system:serviceaccount:ns:alice");
        assert_eq!(
            c.owner.as_deref(),
            Some(hex::encode(Sha256::digest(b"system:serviceaccount:ns:alice")).as_str())
        );
        assert_eq!(Caller::anonymous().owner, None);
    }

    #[test]
    fn verbs_follow_the_method() {
        assert_eq!(Verb::of_method(&http::Method::POST), Verb::Create);
        assert_eq!(Verb::of_method(&http::Method::DELETE), Verb::Delete);
        assert_eq!(Verb::of_method(&http::Method::GET), Verb::Get);
    }
}
