//! The v1 HTTP API on the wire: JSON bodies over hyper-util's pooled
//! HTTP/1.1 client (keep-alive, connections reused across calls and across
//! the renewal task), each call bounded by a timeout; `https://` routers
//! over rustls, trusting the public web roots and any CA the caller adds.
//! An error answer becomes [`Error::Router`] here, with the router's
//! `Retry-After` read from its headers. Nothing here knows about validity
//! or renewal policy.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{connect::HttpConnector, Client as HttpClient};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::info::LockInfo;

/// The longest `Retry-After` taken as asked: a router that asks for more is
/// misconfigured or confused, and a client waiting days on its word would
/// look hung.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// A handle to the router's API; cheap to clone (the pool is shared).
#[derive(Clone)]
pub(crate) struct Transport {
    http: HttpClient<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// `scheme://authority[/prefix]` without a trailing slash.
    base: String,
    /// `Bearer <token>` of the caller's principal, sent with every call.
    authorization: Option<http::HeaderValue>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct AcquireBody<'a> {
    name: &'a str,
    ttl_ms: u64,
    client_id: &'a str,
    #[serde(skip_serializing_if = "is_zero")]
    wait_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<&'a serde_json::Value>,
}

/// What an acquire sends besides the client id.
pub(crate) struct AcquireArgs<'a> {
    pub name: &'a str,
    pub ttl_ms: u64,
    pub wait_ms: u64,
    pub metadata: Option<&'a serde_json::Value>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The router's answer to an acquire.
#[derive(Deserialize, Debug)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Acquired {
    pub acquired: bool,
    pub lock_id: Option<String>,
    pub fencing_token: Option<u64>,
    pub expires_in_ms: Option<u64>,
}

#[derive(Serialize, Clone)]
#[serde(rename_all = "camelCase")]
pub(crate) struct LockRef {
    pub lock_id: String,
    pub fencing_token: u64,
}

#[derive(Serialize)]
struct RenewBatchBody<'a> {
    locks: &'a [LockRef],
}

/// One renewal result, from `renew` or one item of `renew-batch`.
#[derive(Deserialize, Debug, Clone)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Renewed {
    pub renewed: bool,
    pub expires_in_ms: Option<u64>,
    pub reason: Option<String>,
}

/// The router's answer to an extend: a renewal that may name a new lockId.
#[derive(Deserialize, Debug, Clone)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Extended {
    pub renewed: bool,
    pub lock_id: Option<String>,
    pub expires_in_ms: Option<u64>,
    pub reason: Option<String>,
}

#[derive(Deserialize)]
struct RenewBatchAnswer {
    results: Vec<Renewed>,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Deserialize)]
struct ErrorDetail {
    code: String,
    message: String,
}

/// One HTTP answer, as much of it as the calls read.
struct Answer {
    status: StatusCode,
    body: Bytes,
    /// The router's `Retry-After`, carried to the [`Error::Router`] an
    /// error answer becomes.
    retry_after: Option<Duration>,
}

impl Answer {
    fn new(status: StatusCode, headers: &HeaderMap, body: Bytes) -> Self {
        Self {
            status,
            body,
            retry_after: retry_after(headers),
        }
    }
}

/// The `Retry-After` in `headers` as delta-seconds: digits only, as the
/// router sends it (`Retry-After: 1`), capped at [`MAX_RETRY_AFTER`].
/// Anything else (no header, an empty one, a sign, a fraction) is `None`,
/// an HTTP date too: it could only be read against the wall clock, which
/// this client never trusts (wall clocks jump).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // All digits, so only a number too large for a u64 fails to parse.
    let secs = value.parse().unwrap_or(u64::MAX);
    Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER))
}

/// Trusts the public web roots, and the CA certificates in `ca_pem`.
fn tls_config(ca_pem: Option<&[u8]>) -> Result<rustls::ClientConfig, Error> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    if let Some(pem) = ca_pem {
        let mut added = 0;
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| Error::Config(format!("CA certificates: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| Error::Config(format!("CA certificate: {e}")))?;
            added += 1;
        }
        if added == 0 {
            return Err(Error::Config("no CA certificate in the PEM given".into()));
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// A connector for `http://` and `https://` routers over rustls, trusting
/// the public web roots and the CA certificates in `ca_pem` (for tools
/// that speak to routers beyond the lock API, such as the operator's
/// commands).
pub fn connector(ca_pem: Option<&[u8]>) -> Result<HttpsConnector<HttpConnector>, Error> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.enforce_http(false);
    Ok(hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls_config(ca_pem)?)
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector))
}

impl Transport {
    /// A transport to `base_url` (`http://` or `https://`); `ca_pem`: PEM
    /// CA certificates to trust besides the public web roots (a private
    /// CA's routers).
    pub fn new(base_url: &str, ca_pem: Option<&[u8]>) -> Result<Self, Error> {
        let base = base_url.trim_end_matches('/').to_string();
        let uri: http::Uri = base
            .parse()
            .map_err(|e| Error::Config(format!("router URL {base_url:?}: {e}")))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
            return Err(Error::Config(format!(
                "router URL {base_url:?} must look like http://host:port or https://host:port"
            )));
        }
        let http = HttpClient::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            // Below the router's idle close (`server.header_read_timeout_ms`,
            // 10 s by default): a request sent on a connection the router is
            // closing would be reset.
            .pool_idle_timeout(Duration::from_secs(5))
            .build(connector(ca_pem)?);
        Ok(Self {
            http,
            base,
            authorization: None,
        })
    }

    /// The same transport, sending `Authorization: Bearer <token>` (a
    /// principal's token, see the router's docs/security.md) with every
    /// call.
    pub fn with_bearer(mut self, token: &str) -> Result<Self, Error> {
        let mut value = http::HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
            Error::Config("the bearer token has characters a header cannot carry".into())
        })?;
        value.set_sensitive(true);
        self.authorization = Some(value);
        Ok(self)
    }

    pub async fn acquire(
        &self,
        args: &AcquireArgs<'_>,
        client_id: &str,
        timeout: Duration,
    ) -> Result<Acquired, Error> {
        let body = AcquireBody {
            name: args.name,
            ttl_ms: args.ttl_ms,
            client_id,
            wait_ms: args.wait_ms,
            metadata: args.metadata,
        };
        let answer = self.post("/api/v1/locks/acquire", &body, timeout).await?;
        expect_ok(&answer)?;
        parse(&answer)
    }

    /// Inspects `name`: held or free, by which grant, its waiters.
    pub async fn inspect(&self, name: &str, timeout: Duration) -> Result<LockInfo, Error> {
        let path = percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC);
        let req = self.request(Method::GET, &format!("/api/v1/locks/{path}"), Bytes::new())?;
        let answer = self.send(req, timeout).await?;
        expect_ok(&answer)?;
        parse(&answer)
    }

    /// Renews one lock: a 409 is an answer (`renewed: false`), not an error.
    pub async fn renew(&self, lock: &LockRef, timeout: Duration) -> Result<Renewed, Error> {
        self.renew_with(lock, None, timeout).await
    }

    /// A renew that names the lock's TTL: the router renews its session
    /// lease now (an `extend`), not only once half its TTL is gone.
    pub async fn renew_now(
        &self,
        lock: &LockRef,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<Renewed, Error> {
        self.renew_with(lock, Some(ttl.as_millis() as u64), timeout)
            .await
    }

    async fn renew_with(
        &self,
        lock: &LockRef,
        ttl_ms: Option<u64>,
        timeout: Duration,
    ) -> Result<Renewed, Error> {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Body<'a> {
            #[serde(flatten)]
            lock: &'a LockRef,
            #[serde(skip_serializing_if = "Option::is_none")]
            ttl_ms: Option<u64>,
        }
        let body = Body { lock, ttl_ms };
        let answer = self.post("/api/v1/locks/renew", &body, timeout).await?;
        if answer.status != StatusCode::CONFLICT {
            expect_ok(&answer)?;
        }
        parse(&answer)
    }

    /// Moves a lock to its client's session lease of `ttl`: the same
    /// token, a new lockId. A 409 is an answer (`renewed: false`), not an
    /// error.
    pub async fn extend(
        &self,
        lock: &LockRef,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<Extended, Error> {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Body<'a> {
            #[serde(flatten)]
            lock: &'a LockRef,
            ttl_ms: u64,
        }
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        let body = Body { lock, ttl_ms };
        let answer = self.post("/api/v1/locks/extend", &body, timeout).await?;
        if answer.status != StatusCode::CONFLICT {
            expect_ok(&answer)?;
        }
        parse(&answer)
    }

    /// Renews up to 1,000 locks; results come back in request order.
    pub async fn renew_batch(
        &self,
        locks: &[LockRef],
        timeout: Duration,
    ) -> Result<Vec<Renewed>, Error> {
        let body = RenewBatchBody { locks };
        let answer = self
            .post("/api/v1/locks/renew-batch", &body, timeout)
            .await?;
        expect_ok(&answer)?;
        let batch: RenewBatchAnswer = parse(&answer)?;
        if batch.results.len() != locks.len() {
            return Err(malformed(
                answer.status,
                "renew-batch answered a different number of results",
            ));
        }
        Ok(batch.results)
    }

    pub async fn release(&self, lock: &LockRef, timeout: Duration) -> Result<(), Error> {
        let answer = self.post("/api/v1/locks/release", lock, timeout).await?;
        expect_ok(&answer)
    }

    async fn post(
        &self,
        path: &str,
        body: &impl Serialize,
        timeout: Duration,
    ) -> Result<Answer, Error> {
        let json = serde_json::to_vec(body).map_err(|e| Error::Config(e.to_string()))?;
        let req = self.request(Method::POST, path, Bytes::from(json))?;
        self.send(req, timeout).await
    }

    fn request(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
    ) -> Result<Request<Full<Bytes>>, Error> {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(auth) = &self.authorization {
            req = req.header(header::AUTHORIZATION, auth.clone());
        }
        req.body(Full::new(body))
            .map_err(|e| Error::Config(e.to_string()))
    }

    async fn send(&self, req: Request<Full<Bytes>>, timeout: Duration) -> Result<Answer, Error> {
        let call = async {
            let resp = self
                .http
                .request(req)
                .await
                .map_err(|e| Error::Transport(error_chain(&e)))?;
            let (head, body) = resp.into_parts();
            let bytes = body
                .collect()
                .await
                .map_err(|e| Error::Transport(format!("reading the answer: {e}")))?
                .to_bytes();
            Ok(Answer::new(head.status, &head.headers, bytes))
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| Error::Transport(format!("no answer within {timeout:?}")))?
    }
}

/// Turns any non-2xx answer into [`Error::Router`], reading the API's
/// `{"error": {"code", "message"}}` body when there is one, and keeping
/// the answer's `Retry-After` whatever the body.
fn expect_ok(answer: &Answer) -> Result<(), Error> {
    if answer.status.is_success() {
        return Ok(());
    }
    let (code, message) = match serde_json::from_slice::<ErrorBody>(&answer.body) {
        Ok(b) => (b.error.code, b.error.message),
        Err(_) => (
            "unexpected_answer".to_string(),
            String::from_utf8_lossy(&answer.body)
                .chars()
                .take(200)
                .collect(),
        ),
    };
    Err(Error::Router {
        status: answer.status.as_u16(),
        code,
        message,
        retry_after: answer.retry_after,
    })
}

fn parse<T: serde::de::DeserializeOwned>(answer: &Answer) -> Result<T, Error> {
    serde_json::from_slice(&answer.body).map_err(|e| malformed(answer.status, &e.to_string()))
}

/// An answer the client cannot read: not a refusal, so no retry hint.
fn malformed(status: StatusCode, detail: &str) -> Error {
    Error::Router {
        status: status.as_u16(),
        code: "malformed_answer".into(),
        message: detail.to_string(),
        retry_after: None,
    }
}

/// hyper-util's errors say little at the top ("client error (Connect)");
/// the cause chain says what happened.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer of `status` with `body` and, if given, that `Retry-After`.
    fn canned(status: u16, retry_after: Option<&str>, body: &'static [u8]) -> Answer {
        let mut headers = HeaderMap::new();
        if let Some(value) = retry_after {
            headers.insert(header::RETRY_AFTER, value.parse().unwrap());
        }
        let status = StatusCode::from_u16(status).unwrap();
        Answer::new(status, &headers, Bytes::from_static(body))
    }

    #[test]
    fn error_answers_keep_the_api_code_and_message() {
        let body = br#"{"error":{"code":"shard_unavailable","message":"shard b is unavailable"}}"#;
        let e = expect_ok(&canned(503, None, body)).unwrap_err();
        assert_eq!(
            e,
            Error::Router {
                status: 503,
                code: "shard_unavailable".into(),
                message: "shard b is unavailable".into(),
                retry_after: None,
            }
        );
        assert!(e.is_retryable());
        let e = expect_ok(&canned(502, None, b"<html>")).unwrap_err();
        assert!(
            matches!(e, Error::Router { status: 502, ref code, .. } if code == "unexpected_answer")
        );
        assert!(expect_ok(&canned(204, None, b"")).is_ok());
    }

    #[test]
    fn a_408_is_retryable_as_the_request_never_ran() {
        let body = br#"{"error":{"code":"timeout","message":"slow body"}}"#;
        let e = expect_ok(&canned(408, None, body)).unwrap_err();
        assert!(matches!(e, Error::Router { status: 408, ref code, .. } if code == "timeout"));
        assert!(e.is_retryable());
        let e = expect_ok(&canned(400, None, body)).unwrap_err();
        assert!(!e.is_retryable(), "other 4xx stay final");
    }

    #[test]
    fn retry_after_is_read_as_whole_seconds_and_nothing_else() {
        let read = |value: Option<&str>| canned(503, value, b"").retry_after;
        assert_eq!(read(Some("1")), Some(Duration::from_secs(1)));
        assert_eq!(read(Some("0")), Some(Duration::ZERO));
        assert_eq!(read(Some("120")), Some(Duration::from_secs(120)));
        assert_eq!(read(None), None, "absent");
        for garbage in ["", "soon", "-1", "+1", "1.5", "1s", "0x10", "1 2"] {
            assert_eq!(read(Some(garbage)), None, "{garbage:?}");
        }
        assert_eq!(read(Some("Wed, 21 Oct 2015 07:28:00 GMT")), None, "a date");
        assert_eq!(read(Some("86400")), Some(MAX_RETRY_AFTER), "capped");
        let huge = "99999999999999999999999999";
        assert_eq!(read(Some(huge)), Some(MAX_RETRY_AFTER), "beyond a u64");
    }

    #[test]
    fn refusals_carry_the_routers_retry_after() {
        let overloaded = br#"{"error":{"code":"overloaded","message":"retry after a second"}}"#;
        let e = expect_ok(&canned(503, Some("1"), overloaded)).unwrap_err();
        assert_eq!(
            e,
            Error::Router {
                status: 503,
                code: "overloaded".into(),
                message: "retry after a second".into(),
                retry_after: Some(Duration::from_secs(1)),
            }
        );
        assert_eq!(e.retry_after(), Some(Duration::from_secs(1)));
        let limited = br#"{"error":{"code":"rate_limited","message":"too many acquires"}}"#;
        let e = expect_ok(&canned(429, Some("2"), limited)).unwrap_err();
        assert!(matches!(e, Error::Router { status: 429, ref code, .. } if code == "rate_limited"));
        assert_eq!(e.retry_after(), Some(Duration::from_secs(2)));
        // A proxy's page instead of the API's body keeps the hint too.
        let e = expect_ok(&canned(503, Some("3"), b"<html>busy</html>")).unwrap_err();
        assert_eq!(e.retry_after(), Some(Duration::from_secs(3)));
        let e = expect_ok(&canned(503, Some("later"), overloaded)).unwrap_err();
        assert_eq!(e.retry_after(), None);
    }

    #[tokio::test]
    async fn http_and_https_urls_are_accepted_and_others_refused() {
        assert!(Transport::new("http://127.0.0.1:8080/", None).is_ok());
        assert!(Transport::new("https://router:8443", None).is_ok());
        for bad in ["127.0.0.1:8080", "ftp://router:21", "http://", "not a url"] {
            assert!(
                matches!(Transport::new(bad, None), Err(Error::Config(_))),
                "{bad:?} should be refused"
            );
        }
        let no_ca = Transport::new("https://router:8443", Some(b"not a certificate"));
        assert!(matches!(no_ca, Err(Error::Config(_))));
    }
}
