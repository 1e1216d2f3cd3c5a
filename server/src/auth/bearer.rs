//! The `Authorization` header, read strictly (RFC 6750 §2.1), and what a JWT says about its
//! own issuer and audience.
//!
//! A malformed header is refused here, before any review: two `Authorization` headers (a
//! proxy and a client each adding one must never let either pick the identity), a token
//! with spaces or other characters outside the `b64token` syntax, a scheme without a token.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use http::header::AUTHORIZATION;
use serde::Deserialize;

use super::AuthError;

/// The bearer token of a request: `Ok(None)` when no `Authorization` header was sent.
pub fn token(headers: &http::HeaderMap) -> Result<Option<&str>, AuthError> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(AuthError::BadRequest(
            "the Authorization header is sent more than once; send exactly one: \
             `Authorization: Bearer <token>`"
                .into(),
        ));
    }
    let value = value.to_str().map_err(|_| {
        AuthError::BadRequest(
            "the Authorization header is not visible ASCII; send `Authorization: Bearer <token>`"
                .into(),
        )
    })?;
    parse(value).map(Some)
}

/// The token of one `Authorization` header value.
pub fn parse(value: &str) -> Result<&str, AuthError> {
    let (scheme, rest) = value.split_once(' ').unwrap_or((value, ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        // Not ours (RFC 6750 §3: a request without bearer credentials gets a plain challenge).
        return Err(AuthError::Unauthenticated(format!(
            "the Authorization header uses the {:?} scheme; this server takes only \
             `Authorization: Bearer <token>`",
            scheme.chars().take(20).collect::<String>()
        )));
    }
    let token = rest.trim_start_matches(' ');
    if token.is_empty() {
        return Err(AuthError::BadRequest(
            "the Authorization header has no token after `Bearer`; send `Authorization: Bearer \
             <token>`"
                .into(),
        ));
    }
    if !is_b64token(token) {
        let what = if token.contains(' ') {
            "contains a space"
        } else {
            "has a character outside the bearer token syntax (letters, digits, - . _ ~ + / and \
             trailing =)"
        };
        return Err(AuthError::BadRequest(format!(
            "the bearer token {what}; send the token exactly as issued"
        )));
    }
    Ok(token)
}

/// RFC 6750 §2.1: `1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="`.
fn is_b64token(token: &str) -> bool {
    let body = token.trim_end_matches('=');
    !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

/// The `iss` and `aud` claims of a JWT, read without checking its signature: use them only
/// after the Kubernetes API accepted these very bytes (which checks the signature).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtClaims {
    pub iss: String,
    pub aud: Vec<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Audience {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct RawClaims {
    iss: Option<String>,
    aud: Option<Audience>,
}

/// `None` when `token` is not a JWS compact serialisation with an `iss` claim.
pub fn jwt_claims(token: &str) -> Option<JwtClaims> {
    let mut parts = token.split('.');
    let (_header, payload, _signature) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let bytes = URL_SAFE_NO_PAD.decode(payload.trim_end_matches('=')).ok()?;
    let raw: RawClaims = serde_json::from_slice(&bytes).ok()?;
    let aud = match raw.aud {
        None => Vec::new(),
        Some(Audience::One(a)) => vec![a],
        Some(Audience::Many(a)) => a,
    };
    Some(JwtClaims { iss: raw.iss?, aud })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(values: &[&str]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for v in values {
            h.append(AUTHORIZATION, HeaderValue::from_str(v).expect("header"));
        }
        h
    }

    #[test]
    fn one_well_formed_bearer_header() {
        assert_eq!(token(&headers(&[])), Ok(None));
        assert_eq!(
            token(&headers(&["Bearer abc.def-_~+/=="])),
            Ok(Some("abc.def-_~+/=="))
        );
        assert_eq!(token(&headers(&["bearer  abc"])), Ok(Some("abc")));
    }

    #[test]
    fn malformed_headers_are_bad_requests_that_say_why() {
        for (values, needle) in [
            (vec!["Bearer a", "Bearer b"], "more than once"),
            (vec!["Bearer a b"], "contains a space"),
            (vec!["Bearer a\"b"], "outside the bearer token syntax"),
            (vec!["Bearer =="], "outside the bearer token syntax"),
            (vec!["Bearer"], "no token after `Bearer`"),
            (vec!["Bearer    "], "no token after `Bearer`"),
        ] {
            let e = token(&headers(&values)).expect_err("malformed");
            assert!(matches!(e, AuthError::BadRequest(_)), "{values:?}: {e:?}");
            assert!(e.to_string().contains(needle), "{values:?}: {e}");
        }
        let mut h = http::HeaderMap::new();
        h.insert(
            AUTHORIZATION,
            HeaderValue::from_bytes(b"Bearer \xff").expect("opaque bytes"),
        );
        assert!(token(&h)
            .expect_err("not ASCII")
            .to_string()
            .contains("not visible ASCII"));
    }

    #[test]
    fn another_scheme_is_a_missing_bearer_token() {
        let e = token(&headers(&["Basic dXNlcjpwYXNz"])).expect_err("not bearer");
        assert!(matches!(e, AuthError::Unauthenticated(_)), "{e:?}");
        assert!(e.to_string().contains("\"Basic\""), "{e}");
    }

    #[test]
    fn jwt_claims_are_read_from_the_payload() {
        let enc = |v: serde_json::Value| URL_SAFE_NO_PAD.encode(v.to_string());
        let jwt = |payload| {
            format!(
                "{}.{}.sig",
                enc(serde_json::json!({"alg": "ES256"})),
                payload
            )
        };
        let one = jwt(enc(serde_json::json!({"iss": "https://idp", "aud": "a"})));
        assert_eq!(
            jwt_claims(&one),
            Some(JwtClaims {
                iss: "https://idp".into(),
                aud: vec!["a".into()]
            })
        );
        let many = jwt(enc(
            serde_json::json!({"iss": "https://idp", "aud": ["a", "b"]}),
        ));
        assert_eq!(jwt_claims(&many).map(|c| c.aud.len()), Some(2));
        for not_a_jwt in [
            "opaque".to_owned(),
            "a.b".to_owned(),
            "a.b.c.d".to_owned(),
            jwt("!!".into()),
            jwt(enc(serde_json::json!({"aud": "a"}))),
            jwt(enc(serde_json::json!({"iss": 5}))),
        ] {
            assert_eq!(jwt_claims(&not_a_jwt), None, "{not_a_jwt}");
        }
    }
}
