//! One connection to a router for the operator's commands: made once from
//! the connection flags ([`Target`]) and reused by every request of a
//! command (`locks` sends one per page, and one inspect per lock for its
//! table; `status` two). Failing to reach the router, or an answer that
//! breaks off, is a [`Failed`].

use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::target::Target;

/// Why a command got no answer.
#[derive(Debug)]
pub enum Failed {
    /// The flags make no request: a URL that is not http(s), a CA file
    /// that cannot be read.
    Usage(String),
    /// The router could not be reached, or its answer broke off.
    Unavailable(String),
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failed::Usage(why) | Failed::Unavailable(why) => f.write_str(why),
        }
    }
}

fn usage(why: String) -> Failed {
    Failed::Usage(why)
}

fn unavailable(why: String) -> Failed {
    Failed::Unavailable(why)
}

/// A router's base URL, its token and an HTTP client that trusts its CA.
pub struct Conn {
    base: String,
    token: Option<String>,
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl Conn {
    pub fn new(target: &Target) -> Result<Self, Failed> {
        let base = target.url.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(usage(format!(
                "--url must be an http:// or https:// URL, got {base:?}"
            )));
        }
        let ca = target.ca_pem().map_err(usage)?;
        let connector = lockrouter_client::connector(ca.as_deref())
            .map_err(|e| usage(format!("--ca-file: {e}")))?;
        Ok(Self {
            base,
            token: target.token.clone(),
            client: Client::builder(TokioExecutor::new()).build(connector),
        })
    }

    /// Sends one request (`body` as JSON) and reads the whole answer.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(StatusCode, String), Failed> {
        let base = &self.base;
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{base}{path}"));
        if let Some(token) = &self.token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let body = match body {
            Some(json) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(json.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        let req = req
            .body(body)
            .map_err(|e| usage(format!("bad request for {base}: {e}")))?;
        let resp = tokio::time::timeout(Duration::from_secs(60), self.client.request(req))
            .await
            .map_err(|_| unavailable(format!("{base} did not answer within 60 s")))?
            .map_err(|e| unavailable(format!("cannot reach {base}: {e}")))?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| unavailable(format!("the answer from {base} broke off: {e}")))?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    }
}
