//! [`Mcp`]: an MCP client (JSON-RPC over Streamable HTTP, TLS with the instance CA, a
//! ServiceAccount token) of one instance, and readers of its tool results.

use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;

use crate::jsonrpc::{self, response};
use crate::{http, ServiceForward};

/// An MCP client (JSON-RPC over Streamable HTTP) of one instance.
#[derive(Clone)]
pub struct Mcp {
    pub http: reqwest::Client,
    pub base: String,
    pub token: String,
    /// The Service's DNS name, what the TLS certificate names.
    host: String,
    ca: String,
    pub(super) fwd: Option<Arc<ServiceForward>>,
}

/// Why a call brought no tool result.
#[derive(Debug)]
pub enum CallError {
    /// No HTTP response at all (connection refused, reset, or closed before the answer):
    /// the call may never have reached a server.
    NoResponse(String),
    /// An answer, but not a tool result: a client timeout, an HTTP status, a JSON-RPC error.
    Answered(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::NoResponse(m) | CallError::Answered(m) => f.write_str(m),
        }
    }
}

/// An error with its sources (reqwest's Display stops at "error sending request").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

impl Mcp {
    /// A client for the instance whose Service is `host` (TLS name), reached at `to`;
    /// `pooled: false` opens a connection per call.
    pub(super) fn new(
        host: String,
        ca: String,
        token: String,
        to: SocketAddr,
        pooled: bool,
    ) -> Mcp {
        let mut b = http::client(Some(&ca)).resolve(&host, to);
        if !pooled {
            b = b.pool_max_idle_per_host(0);
        }
        Mcp {
            http: b.build().expect("client"),
            base: format!("https://{host}:{}", to.port()),
            token,
            host,
            ca,
            fwd: None,
        }
    }

    /// The same instance and identity reached at `to`: a server pod's IP and port 8443
    /// (bypassing the Service), or the forward again with a connection pool of its own
    /// (the forward picks an endpoint per connection).
    pub fn via(&self, to: SocketAddr, pooled: bool) -> Mcp {
        let mut m = Mcp::new(
            self.host.clone(),
            self.ca.clone(),
            self.token.clone(),
            to,
            pooled,
        );
        m.fwd = self.fwd.clone();
        m
    }

    /// Where the loopback forward to the Service listens.
    pub fn forward_addr(&self) -> SocketAddr {
        self.fwd
            .as_ref()
            .expect("a client made by Env::client")
            .local_addr()
    }

    /// A POST to `/mcp` as session `sid` with the token, without a body.
    fn post(&self, sid: &str) -> reqwest::RequestBuilder {
        jsonrpc::post(
            &self.http,
            &format!("{}/mcp", self.base),
            Some(sid),
            Some(&self.token),
        )
    }

    /// The POST of one `bash` tool call, not sent yet (to race it against a fault).
    pub fn post_bash(&self, sid: &str, command: &str) -> reqwest::RequestBuilder {
        self.post(sid)
            .json(&jsonrpc::bash(json!({ "command": command })))
    }

    /// A `bash` tool call whose failure is returned: the tool result (with `isError` true or
    /// false), or why there is none.
    pub async fn try_bash(&self, sid: &str, command: &str) -> Result<Value, CallError> {
        let r = self.post_bash(sid, command).send().await.map_err(|e| {
            let detail = format!("transport: {}", error_chain(&e));
            if e.is_timeout() {
                CallError::Answered(detail)
            } else {
                CallError::NoResponse(detail)
            }
        })?;
        let status = r.status();
        let body = r.text().await.map_err(|e| {
            CallError::Answered(format!(
                "reading the response ({status}): {}",
                error_chain(&e)
            ))
        })?;
        if status != 200 {
            return Err(CallError::Answered(format!("HTTP {status}: {body}")));
        }
        let v = response(&body);
        match v.get("error") {
            Some(e) => Err(CallError::Answered(format!("JSON-RPC error: {e}"))),
            None => Ok(v["result"].clone()),
        }
    }

    /// Like [`Mcp::try_bash`], with a tool error (`isError: true`) as an `Err` too.
    pub async fn bash_ok(&self, sid: &str, command: &str) -> Result<Value, CallError> {
        let result = self.try_bash(sid, command).await?;
        if result["isError"] != false {
            return Err(CallError::Answered(format!("tool error: {result}")));
        }
        Ok(result)
    }

    /// `DELETE /sessions/{sid}`; the status, or why there is none.
    pub async fn try_delete(&self, sid: &str) -> Result<u16, CallError> {
        self.http
            .delete(format!("{}/sessions/{sid}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .map(|r| r.status().as_u16())
            .map_err(|e| CallError::NoResponse(format!("transport: {}", error_chain(&e))))
    }

    pub async fn rpc(&self, sid: &str, method: &str, params: Value) -> Value {
        let r = self
            .post(sid)
            .json(&jsonrpc::request(method, params))
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST /mcp {method}: {}", error_chain(&e)));
        let status = r.status();
        let text = r.text().await.expect("body");
        assert_eq!(status, 200, "{method}: {text}");
        response(&text)
    }

    /// A `bash` tool call; returns the tool result (`content`, `structuredContent`,
    /// `isError`).
    pub async fn bash(&self, sid: &str, command: &str) -> Value {
        let v = self
            .rpc(
                sid,
                "tools/call",
                json!({"name": "bash", "arguments": {"command": command}}),
            )
            .await;
        assert!(v.get("error").is_none(), "{command}: {v}");
        v["result"].clone()
    }

    pub async fn delete(&self, sid: &str) -> u16 {
        self.http
            .delete(format!("{}/sessions/{sid}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .expect("DELETE")
            .status()
            .as_u16()
    }
}
