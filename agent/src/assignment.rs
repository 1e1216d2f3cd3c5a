//! Who may use this agent: the token commitments, and how they are recovered.
//!
//! A pod starts either assigned (`TOKEN_SHA256`: created for a session) or waiting for
//! `/assign` (`ASSIGN_SHA256`: a warm pool pod). A restarted agent container finds a claim
//! made while it was down in the pod's annotations (downward API file).

use cli_mcp_api::names::annotation;
use cli_mcp_api::token::{parse_bearer, Commitment};
use cli_mcp_api::wire::AssignRequest;
use cli_mcp_api::SessionId;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assignment {
    /// Waiting for `/assign` with the token committed to here.
    Unassigned { assign: Commitment },
    /// Serving one session.
    Assigned {
        /// Known when assigned through `/assign`; a pod created for a session or recovered
        /// from annotations does not need it.
        session: Option<SessionId>,
        token: Commitment,
        /// Kept so a retried `/assign` (lost response) is answered idempotently.
        assign: Option<Commitment>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartupError {
    #[error("neither TOKEN_SHA256 (assigned pod) nor ASSIGN_SHA256 (warm pod) is set, and {0} holds no token-sha256 annotation; the agent cannot authenticate anyone")]
    NoCommitment(String),
    #[error("{var} is not a 64-character lowercase hex SHA-256 commitment")]
    BadCommitment { var: String },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("this sandbox is waiting for a session to be assigned; retry after POST /assign")]
    NotAssigned,
    #[error("missing or malformed Authorization header; send `Authorization: Bearer <token>`")]
    MissingBearer,
    #[error("the bearer token is not valid for this sandbox")]
    WrongToken,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignError {
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error("this sandbox is already assigned to another session")]
    AlreadyAssigned,
    #[error("token_sha256 must be a 64-character lowercase hex SHA-256 commitment")]
    BadCommitment,
}

impl Assignment {
    /// Decides the start state from the env vars and the annotations file's content.
    pub fn from_sources(
        env_token: Option<&str>,
        env_assign: Option<&str>,
        annotations: Option<&str>,
        annotations_path: &str,
    ) -> Result<Self, StartupError> {
        let parse = |v: &str, var: &str| {
            Commitment::parse(v).map_err(|_| StartupError::BadCommitment { var: var.into() })
        };
        let assign = env_assign
            .filter(|v| !v.is_empty())
            .map(|v| parse(v, "ASSIGN_SHA256"))
            .transpose()?;
        if let Some(t) = env_token.filter(|v| !v.is_empty()) {
            return Ok(Self::Assigned {
                session: None,
                token: parse(t, "TOKEN_SHA256")?,
                assign,
            });
        }
        if let Some(t) = annotations.and_then(|a| annotation_value(a, annotation::TOKEN_SHA256)) {
            return Ok(Self::Assigned {
                session: None,
                token: parse(&t, annotation::TOKEN_SHA256)?,
                assign,
            });
        }
        match assign {
            Some(assign) => Ok(Self::Unassigned { assign }),
            None => Err(StartupError::NoCommitment(annotations_path.into())),
        }
    }

    /// Checks an `/assign` caller before its body is read.
    pub fn authenticate_assign(&self, authorization: Option<&str>) -> Result<(), AssignError> {
        match self {
            Self::Unassigned { assign }
            | Self::Assigned {
                assign: Some(assign),
                ..
            } => Ok(check(assign, authorization)?),
            Self::Assigned { assign: None, .. } => Err(AssignError::AlreadyAssigned),
        }
    }

    /// Checks an `/exec` caller.
    pub fn authorize_exec(&self, authorization: Option<&str>) -> Result<(), AuthError> {
        match self {
            Self::Unassigned { .. } => Err(AuthError::NotAssigned),
            Self::Assigned { token, .. } => check(token, authorization),
        }
    }

    /// Applies `/assign`. Repeating the exact same assignment succeeds (the caller may have
    /// lost the first response); anything else on an assigned pod is a conflict.
    pub fn assign(
        &mut self,
        authorization: Option<&str>,
        req: &AssignRequest,
    ) -> Result<SessionId, AssignError> {
        let token = Commitment::parse(&req.token_sha256).map_err(|_| AssignError::BadCommitment);
        match self {
            Self::Unassigned { assign } => {
                check(assign, authorization)?;
                let token = token?;
                *self = Self::Assigned {
                    session: Some(req.session_id.clone()),
                    token,
                    assign: Some(assign.clone()),
                };
                Ok(req.session_id.clone())
            }
            Self::Assigned {
                session,
                token: current,
                assign,
            } => {
                let Some(assign) = assign else {
                    return Err(AssignError::AlreadyAssigned);
                };
                check(assign, authorization)?;
                let same_token = token.as_ref().is_ok_and(|t| t == current);
                let same_session = session.as_ref().is_none_or(|s| *s == req.session_id);
                if same_token && same_session {
                    *session = Some(req.session_id.clone());
                    Ok(req.session_id.clone())
                } else {
                    Err(AssignError::AlreadyAssigned)
                }
            }
        }
    }

    pub fn is_assigned(&self) -> bool {
        matches!(self, Self::Assigned { .. })
    }
}

fn check(commitment: &Commitment, authorization: Option<&str>) -> Result<(), AuthError> {
    let bearer = authorization
        .and_then(parse_bearer)
        .ok_or(AuthError::MissingBearer)?;
    if commitment.verify(bearer) {
        Ok(())
    } else {
        Err(AuthError::WrongToken)
    }
}

/// Reads one annotation from a downward-API annotations file (`key="go-quoted value"` per
/// line).
pub fn annotation_value(file: &str, key: &str) -> Option<String> {
    file.lines().find_map(|line| {
        let (k, v) = line.split_once('=')?;
        if k != key {
            return None;
        }
        // Go's %q output is a valid JSON string for the characters a hex digest can hold.
        serde_json::from_str::<String>(v)
            .ok()
            .or_else(|| Some(v.trim_matches('"').to_owned()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli_mcp_api::token::HmacKey;

    fn key() -> HmacKey {
        HmacKey::from_bytes([3; 32])
    }

    fn bearer(t: &str) -> String {
        format!("Bearer {t}")
    }

    #[test]
    fn start_states() {
        let tok = key().session_token(
            &SessionId::parse("s").expect("valid"),
            &cli_mcp_api::token::SandboxNonce::from_bytes([1; 16]),
        );
        let c = tok.commitment().to_hex();
        assert!(Assignment::from_sources(Some(&c), None, None, "f")
            .expect("assigned")
            .is_assigned());
        assert!(!Assignment::from_sources(None, Some(&c), None, "f")
            .expect("unassigned")
            .is_assigned());
        let ann = format!("a=\"b\"\ncli-mcp.redhat.com/token-sha256=\"{c}\"\n");
        let rec = Assignment::from_sources(None, Some(&c), Some(&ann), "f").expect("recovered");
        assert!(rec.is_assigned());
        let err = Assignment::from_sources(None, None, None, "/x").expect_err("nothing");
        assert!(err.to_string().contains("/x"), "{err}");
        assert!(matches!(
            Assignment::from_sources(Some("zz"), None, None, "f"),
            Err(StartupError::BadCommitment { .. })
        ));
    }

    #[test]
    fn assign_then_exec() {
        let pod = "cli-mcp-d-pool-abcdefghij";
        let sid = SessionId::parse("s1").expect("valid");
        let at = key().assign_token(pod);
        let st = key().session_token(&sid, &cli_mcp_api::token::SandboxNonce::from_bytes([1; 16]));
        let mut a = Assignment::Unassigned {
            assign: at.commitment(),
        };
        assert_eq!(
            a.authorize_exec(Some(&bearer(st.expose()))),
            Err(AuthError::NotAssigned)
        );
        let req = AssignRequest {
            session_id: sid.clone(),
            token_sha256: st.commitment().to_hex(),
        };
        assert_eq!(
            a.assign(Some(&bearer(st.expose())), &req),
            Err(AssignError::Auth(AuthError::WrongToken))
        );
        assert_eq!(
            a.assign(None, &req),
            Err(AssignError::Auth(AuthError::MissingBearer))
        );
        assert_eq!(a.assign(Some(&bearer(at.expose())), &req), Ok(sid.clone()));
        // Same assignment again (lost response): idempotent.
        assert_eq!(a.assign(Some(&bearer(at.expose())), &req), Ok(sid));
        // A different session: conflict.
        let other = AssignRequest {
            session_id: SessionId::parse("s2").expect("valid"),
            token_sha256: st.commitment().to_hex(),
        };
        assert_eq!(
            a.assign(Some(&bearer(at.expose())), &other),
            Err(AssignError::AlreadyAssigned)
        );
        assert_eq!(a.authorize_exec(Some(&bearer(st.expose()))), Ok(()));
        assert_eq!(
            a.authorize_exec(Some(&bearer(at.expose()))),
            Err(AuthError::WrongToken)
        );
        assert_eq!(
            a.authorize_exec(Some("Basic x")),
            Err(AuthError::MissingBearer)
        );
    }

    #[test]
    fn annotation_file_parsing() {
        let f = "kubernetes.io/x=\"1\"\ncli-mcp.redhat.com/token-sha256=\"abc\"\n";
        assert_eq!(
            annotation_value(f, "cli-mcp.redhat.com/token-sha256").as_deref(),
            Some("abc")
        );
        assert_eq!(annotation_value(f, "nope"), None);
    }
}
