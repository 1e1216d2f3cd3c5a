//! Every way the proxy says no: the status, a stable reason (metrics, logs) and a message
//! that tells the sandbox's user what happened and what decides it.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;

use cli_mcp_api::proxy::Domain;

use crate::k8s_path::PathRefusal;

#[derive(Debug, Clone)]
pub struct Refusal {
    pub status: StatusCode,
    /// Stable label: metrics and logs.
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    pub fn new(status: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            reason,
            message: message.into(),
        }
    }

    pub fn domain_not_allowed(domain: &Domain) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "domain_not_allowed",
            format!(
                "domain {domain} is not allowed through this proxy; spec.proxy.targets of the \
                 CliMcpInstance decides which domains a sandbox may reach"
            ),
        )
    }

    pub fn not_connect() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "not_connect",
            "this proxy forwards only HTTPS: use HTTPS through CONNECT (plain http:// requests \
             and other proxy methods are refused)",
        )
    }

    pub fn bad_target(target: &str, why: &str) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "bad_connect_target",
            format!("CONNECT target {target:?} is not a host:port: {why}"),
        )
    }

    pub fn path(p: &PathRefusal) -> Self {
        let status = match p {
            PathRefusal::Malformed(_) => StatusCode::BAD_REQUEST,
            PathRefusal::Forbidden(_) => StatusCode::FORBIDDEN,
        };
        Self::new(status, p.reason(), p.to_string())
    }

    /// A plain-text response; `Connection: close` when the connection must not be reused.
    pub fn text(&self) -> Response<Full<Bytes>> {
        let mut resp = Response::new(Full::new(Bytes::from(format!("{}\n", self.message))));
        *resp.status_mut() = self.status;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        resp
    }

    /// A Kubernetes `Status` object, which kubectl and client-go show as
    /// `Error from server (Forbidden): <message>`.
    pub fn kubernetes_status(&self) -> Response<Full<Bytes>> {
        let reason = match self.status {
            StatusCode::FORBIDDEN => "Forbidden",
            StatusCode::BAD_REQUEST => "BadRequest",
            StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT => "ServiceUnavailable",
            _ => "",
        };
        let body = serde_json::json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": reason,
            "code": self.status.as_u16(),
        });
        let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
        *resp.status_mut() = self.status;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    }
}
