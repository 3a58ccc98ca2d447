//! A small JSON client for the router's HTTP API, for tests: each call
//! returns the status, the JSON body and `Retry-After`, and panics if the
//! router cannot be reached (a test asserts on answers, not on transport).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::sleep_ms;

/// The lock a granted acquire's answer names: its lockId and fencing token.
pub fn lock_of(body: &Value) -> (String, u64) {
    (
        body["lockId"].as_str().unwrap().to_string(),
        body["fencingToken"].as_u64().unwrap(),
    )
}

/// A status code and a JSON body (Null when empty).
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    /// `Null` when the answer had no body (204).
    pub body: Value,
    /// The `Retry-After` header, which the router sends with 429 and 503.
    pub retry_after: Option<String>,
}

impl Reply {
    /// `(lockId, fencingToken)` of an acquire's answer, which must be a
    /// grant.
    pub fn granted(&self) -> (String, u64) {
        assert_eq!(
            (self.status, &self.body["acquired"]),
            (200, &json!(true)),
            "expected a grant: {self:?}"
        );
        (
            self.body["lockId"].as_str().unwrap().to_string(),
            self.body["fencingToken"].as_u64().unwrap(),
        )
    }
}

#[derive(Clone)]
pub struct Api {
    /// `http://<addr>`, for clients a test builds itself.
    pub base: String,
    /// Shared, so tests can send requests the helpers do not cover.
    pub http: reqwest::Client,
}

impl Api {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            base: format!("http://{addr}"),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                // Well before the router closes an idle connection (10 s):
                // a request sent as it closes would be reset.
                .pool_idle_timeout(Duration::from_secs(5))
                .build()
                .unwrap(),
        }
    }

    /// The same router, every request carrying `Authorization: Bearer
    /// <token>` (a principal's or the admin token).
    pub fn with_bearer(&self, token: &str) -> Self {
        let mut headers = reqwest::header::HeaderMap::new();
        let value = format!("Bearer {token}").parse().expect("a header value");
        headers.insert(reqwest::header::AUTHORIZATION, value);
        Self {
            base: self.base.clone(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .pool_idle_timeout(Duration::from_secs(5))
                .default_headers(headers)
                .build()
                .unwrap(),
        }
    }

    pub async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(r) = self.http.get(format!("{}/readyz", self.base)).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            sleep_ms(50).await;
        }
        panic!("router at {} did not become ready", self.base);
    }

    pub async fn send(&self, req: reqwest::RequestBuilder) -> Reply {
        self.try_send(req)
            .await
            .expect("request reaches the router")
    }

    /// Like [`send`](Self::send), but an answer that never arrives (the
    /// router killed or not yet started again, the connection cut) is an
    /// `Err`, not a panic: for tests that kill routers under load.
    pub async fn try_send(&self, req: reqwest::RequestBuilder) -> Result<Reply, reqwest::Error> {
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let text = resp.text().await?;
        let body = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).expect("JSON body")
        };
        Ok(Reply {
            status,
            body,
            retry_after,
        })
    }

    /// [`post`](Self::post) through [`try_send`](Self::try_send).
    pub async fn try_post(&self, path: &str, body: Value) -> Result<Reply, reqwest::Error> {
        self.try_send(self.http.post(format!("{}{path}", self.base)).json(&body))
            .await
    }

    pub async fn post(&self, path: &str, body: Value) -> Reply {
        self.send(self.http.post(format!("{}{path}", self.base)).json(&body))
            .await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(self.http.get(format!("{}{path}", self.base)))
            .await
    }

    pub async fn acquire(&self, name: &str, ttl_ms: u64, client: &str) -> Reply {
        self.post(
            "/api/v1/locks/acquire",
            json!({"name": name, "ttlMs": ttl_ms, "clientId": client}),
        )
        .await
    }

    /// Acquires and asserts the grant; returns `(lockId, token)`.
    pub async fn must_acquire(&self, name: &str, ttl_ms: u64, client: &str) -> (String, u64) {
        let r = self.acquire(name, ttl_ms, client).await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(
            r.body["acquired"], true,
            "{name} should be granted to {client}: {r:?}"
        );
        lock_of(&r.body)
    }

    /// Clients `c0`, `c1`, ... each acquire one name, `{prefix}-0`,
    /// `{prefix}-1`, ..., all at once (`n` sessions); asserts every grant.
    pub async fn must_acquire_each(
        &self,
        prefix: &str,
        n: usize,
        ttl_ms: u64,
    ) -> Vec<(String, u64)> {
        let acquires = (0..n).map(|i| async move {
            let (name, client) = (format!("{prefix}-{i}"), format!("c{i}"));
            self.must_acquire(&name, ttl_ms, &client).await
        });
        futures::future::join_all(acquires).await
    }

    pub async fn renew(&self, lock: &(String, u64)) -> Reply {
        self.post(
            "/api/v1/locks/renew",
            json!({"lockId": lock.0, "fencingToken": lock.1}),
        )
        .await
    }

    pub async fn release(&self, lock: &(String, u64)) -> Reply {
        self.post(
            "/api/v1/locks/release",
            json!({"lockId": lock.0, "fencingToken": lock.1}),
        )
        .await
    }

    /// The router's Prometheus text.
    pub async fn metrics(&self) -> String {
        let resp = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap();
        resp.text().await.unwrap()
    }

    pub async fn inspect(&self, name: &str) -> Reply {
        let enc = percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC);
        self.get(&format!("/api/v1/locks/{enc}")).await
    }

    /// [`inspect`](Self::inspect), asked again every 100 ms for up to 5 s
    /// while the router answers 503, as a client retries it. On a loaded
    /// machine one etcd call past the tests' 1 s `request_timeout_ms`
    /// marks the shard down until its next health probe; a test of what a
    /// name's state is must not take that answer for the state.
    pub async fn inspect_up(&self, name: &str) -> Reply {
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            let seen = self.inspect(name).await;
            if seen.status != 503 || Instant::now() >= end {
                return seen;
            }
            sleep_ms(100).await;
        }
    }
}
