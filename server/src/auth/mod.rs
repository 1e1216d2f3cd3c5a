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

use cli_mcp_api::proxy::SessionCaller;

pub use tokenreview::{AuthError, AuthOptions, Authenticator};

/// Most groups recorded in a pod's `caller` annotation.
pub const MAX_CALLER_GROUPS: usize = 64;
/// Longest `caller` annotation value (bytes of its JSON); Kubernetes allows 256 KiB for all
/// of a pod's annotations together, and a caller must not be able to make a claim fail.
pub const MAX_CALLER_ANNOTATION: usize = 4 * 1024;

/// The identity behind a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Username from TokenReview, or `anonymous`.
    pub name: String,
    /// Groups from TokenReview (none for [`Caller::anonymous`]): at most
    /// [`MAX_CALLER_GROUPS`], and only those that fit in a `caller` annotation of
    /// [`MAX_CALLER_ANNOTATION`] bytes with the username (see [`Caller::with_groups`]).
    pub groups: Vec<String>,
    /// `sha256_hex(username)`, stamped on the pods of the sessions this caller creates;
    /// `None` with auth off (sessions then have no owner).
    pub owner: Option<String>,
}

impl Caller {
    pub fn anonymous() -> Self {
        Self {
            name: "anonymous".into(),
            groups: Vec::new(),
            owner: None,
        }
    }

    pub fn identified(username: &str) -> Self {
        Self {
            name: username.to_owned(),
            groups: Vec::new(),
            owner: Some(owner_hash(username)),
        }
    }

    /// This caller with `groups`, bounded: in their order, each group that still fits (at
    /// most [`MAX_CALLER_GROUPS`], the annotation's JSON at most [`MAX_CALLER_ANNOTATION`]
    /// bytes; the username is always kept). Dropping any is logged, once per process.
    pub fn with_groups(mut self, groups: Vec<String>) -> Self {
        let given = groups.len();
        self.groups = bounded_groups(&self.name, groups);
        if self.groups.len() < given {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    user = %self.name,
                    groups = given,
                    kept = self.groups.len(),
                    "the caller has more groups than a sandbox pod records (at most \
                     {MAX_CALLER_GROUPS}, {MAX_CALLER_ANNOTATION} bytes of annotation): the \
                     pod's caller annotation, and with it the credential proxy's audit and \
                     impersonation, name only the groups that fit (logged once)"
                );
            });
        }
        self
    }

    /// The value of a session pod's `caller` annotation (`{"user": …, "groups": [...]}`):
    /// `None` with auth off (no owner), when the server knows no caller.
    pub fn annotation(&self) -> Option<String> {
        self.owner.as_ref()?;
        Some(
            SessionCaller {
                user: self.name.clone(),
                groups: self.groups.clone(),
            }
            .to_annotation(),
        )
    }
}

/// The groups, in order, that fit next to `user` in a `caller` annotation.
fn bounded_groups(user: &str, groups: Vec<String>) -> Vec<String> {
    let json_len = |s: &str| serde_json::to_string(s).map_or(usize::MAX, |j| j.len());
    let empty = SessionCaller {
        user: user.to_owned(),
        groups: Vec::new(),
    };
    // `{"user":…,"groups":[]}`, then each group adds its JSON string and, after the first, a
    // comma.
    let mut len = empty.to_annotation().len();
    let mut kept: Vec<String> = Vec::new();
    for g in groups {
        if kept.len() == MAX_CALLER_GROUPS {
            break;
        }
        let more = json_len(&g).saturating_add(usize::from(!kept.is_empty()));
        if len.saturating_add(more) <= MAX_CALLER_ANNOTATION {
            len += more;
            kept.push(g);
        }
    }
    kept
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
    fn the_caller_annotation_names_user_and_groups_only_with_auth() {
        let c = Caller::identified("alice").with_groups(vec!["dev".into(), "ops".into()]);
        let back = SessionCaller::from_annotation(&c.annotation().expect("auth on"))
            .expect("the api's shape");
        assert_eq!(back.user, "alice");
        assert_eq!(back.groups, ["dev", "ops"]);
        let anon = Caller::anonymous().with_groups(vec!["dev".into()]);
        assert_eq!(anon.annotation(), None, "auth off: no caller");
        assert!(Caller::anonymous().groups.is_empty());
    }

    #[test]
    fn the_caller_annotation_is_bounded_and_keeps_the_user() {
        let many: Vec<String> = (0..200).map(|n| format!("g{n}")).collect();
        let c = Caller::identified("bob").with_groups(many.clone());
        assert_eq!(
            c.groups,
            many[..MAX_CALLER_GROUPS],
            "the first 64, in order"
        );

        // Long groups: as many as fit in 4 KiB, the annotation never longer.
        let long: Vec<String> = (0..40)
            .map(|n| format!("{n:03}-{}", "x".repeat(200)))
            .collect();
        let c = Caller::identified("carol").with_groups(long.clone());
        let a = c.annotation().expect("auth on");
        assert!(a.len() <= MAX_CALLER_ANNOTATION, "{}", a.len());
        let back = SessionCaller::from_annotation(&a).expect("valid JSON");
        assert_eq!(back.user, "carol");
        assert_eq!(back.groups, long[..back.groups.len()]);
        let with_next = SessionCaller {
            user: "carol".into(),
            groups: long[..=back.groups.len()].to_vec(),
        };
        assert!(
            with_next.to_annotation().len() > MAX_CALLER_ANNOTATION,
            "as many as fit"
        );

        // One huge group is skipped, the small ones after it are kept; escaping counts.
        let groups = vec!["a".into(), "\"".repeat(MAX_CALLER_ANNOTATION), "b".into()];
        let c = Caller::identified("dave").with_groups(groups);
        assert_eq!(c.groups, ["a", "b"]);

        // A user longer than the bound is still named, without groups.
        let user = "u".repeat(MAX_CALLER_ANNOTATION + 1);
        let c = Caller::identified(&user).with_groups(vec!["g".into()]);
        assert!(c.groups.is_empty());
        assert!(c.annotation().expect("auth on").contains(&user));
    }

    #[test]
    fn verbs_follow_the_method() {
        assert_eq!(Verb::of_method(&http::Method::POST), Verb::Create);
        assert_eq!(Verb::of_method(&http::Method::DELETE), Verb::Delete);
        assert_eq!(Verb::of_method(&http::Method::GET), Verb::Get);
    }
}
