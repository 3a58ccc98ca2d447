//! Hostile inputs, route by route, against a real router on real etcd:
//! oversized and malformed request heads, slow bodies, pathological JSON,
//! odd lock names in paths, forged lockIds, oversized batches and media
//! type games. Each answer must be a 4xx with its stable JSON error code
//! (or the answer `docs/openapi.yaml` documents), never a 5xx, a hang, or a
//! connection dropped without an answer; and a lock held before each
//! barrage must still renew, under the same token, after it.
//!
//! Requests the HTTP client would refuse to send (or would normalise) go
//! over a raw TCP connection ([`raw`]); every request is bounded in time.
//! The answers hyper gives itself (malformed or oversized heads) are
//! rewritten into the API's error envelope on their way out
//! (`lockrouter::http::protocol`);
//! [`protocol_refusals_carry_the_json_error_envelope`] holds them to it.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use lockrouter::token::lock_id::LockId;
use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::router::{FileRouter, TestRouter};

const ACQUIRE: &str = "/api/v1/locks/acquire";
const RENEW: &str = "/api/v1/locks/renew";
const BATCH: &str = "/api/v1/locks/renew-batch";
const RELEASE: &str = "/api/v1/locks/release";
const POSTS: [&str; 4] = [ACQUIRE, RENEW, BATCH, RELEASE];
/// Longest a raw exchange may take before the test calls it a hang.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// One answer read off a raw connection.
struct Raw {
    status: u16,
    /// The status line and headers, header names in lower case.
    head: String,
    body: Vec<u8>,
}

impl std::fmt::Debug for Raw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let body = String::from_utf8_lossy(&self.body);
        write!(f, "{}\n{}", self.head, &body[..body.len().min(300)])
    }
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|line| {
            let (n, v) = line.split_once(':')?;
            (n.eq_ignore_ascii_case(name)).then(|| v.trim())
        })
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// `(status, error code)`; the code is `None` for a body that is not
    /// the error envelope.
    fn code(&self) -> (u16, Option<String>) {
        let code = self.json()["error"]["code"].as_str().map(str::to_string);
        (self.status, code)
    }
}

/// Sends `request` on a new connection to `addr` while reading, and reads
/// until the router closes it (the requests ask it to). Panics if no answer
/// arrives within [`ANSWER_WITHIN`] or the connection ends without one.
async fn raw(addr: &str, request: Vec<u8>) -> Raw {
    let stream = tokio::time::timeout(ANSWER_WITHIN, tokio::net::TcpStream::connect(addr))
        .await
        .expect("connect in time")
        .expect("connect");
    let (mut rd, mut wr) = stream.into_split();
    // Written concurrently: an oversized head is refused before it is all
    // sent, and the answer must still be read.
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&request).await;
        wr
    });
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let deadline = tokio::time::Instant::now() + ANSWER_WITHIN;
    loop {
        match tokio::time::timeout_at(deadline, rd.read(&mut buf)).await {
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            // A reset after a complete answer (unread request bytes) is TCP,
            // not a dropped answer.
            Ok(Err(e)) if has_whole_answer(&got) => {
                eprintln!("reset after the answer: {e}");
                break;
            }
            Ok(Err(e)) => panic!("connection dropped without an answer: {e}"),
            Err(_) => panic!(
                "no answer within {ANSWER_WITHIN:?} (a hang): {:?}",
                String::from_utf8_lossy(&got)
            ),
        }
    }
    drop(writer.await);
    parse_answer(&got)
}

fn split_answer(got: &[u8]) -> Option<(String, Vec<u8>)> {
    let end = got.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&got[..end]).into_owned();
    Some((head, got[end + 4..].to_vec()))
}

fn has_whole_answer(got: &[u8]) -> bool {
    let Some((head, body)) = split_answer(got) else {
        return false;
    };
    let len = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().to_string())
        })
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    body.len() >= len
}

fn parse_answer(got: &[u8]) -> Raw {
    let (head, body) = split_answer(got).unwrap_or_else(|| {
        panic!(
            "the connection closed without a whole answer: {:?}",
            String::from_utf8_lossy(got)
        )
    });
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {head:?}"));
    Raw { status, head, body }
}

/// `METHOD path HTTP/1.1` with `Host`, `Connection: close`, the given
/// headers, and `body` with its Content-Length when there is one.
fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut r = format!("{method} {path} HTTP/1.1\r\nHost: lockrouter\r\nConnection: close\r\n");
    for (n, v) in headers {
        r.push_str(&format!("{n}: {v}\r\n"));
    }
    if !body.is_empty() {
        r.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    r.push_str("\r\n");
    let mut bytes = r.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// A JSON POST, as raw bytes (so bodies need not be valid UTF-8 or JSON).
fn post_json(path: &str, body: &[u8]) -> Vec<u8> {
    request("POST", path, &[("Content-Type", "application/json")], body)
}

/// A router on its own etcd, and a lock it granted before any barrage.
struct Target {
    router: TestRouter,
    /// `(lockId, fencingToken)` of the lock that must survive.
    held: (String, u64),
    /// `host:port` of the router, for raw connections.
    addr: String,
    /// Dropped after the router.
    _etcd: EtcdCluster,
}

impl Target {
    async fn start() -> Self {
        Self::with_server("").await
    }

    /// `server` goes at the top of the `[server]` table.
    async fn with_server(server: &str) -> Self {
        let etcd = EtcdCluster::single();
        let toml = config_toml(&[&etcd], "127.0.0.1:0", "")
            .replace("[server]\n", &format!("[server]\n{server}"));
        let router = TestRouter::with_toml(&toml).await;
        let held = router
            .api
            .must_acquire("hostile:held", 10_000, "keeper")
            .await;
        let addr = router.api.base.trim_start_matches("http://").to_string();
        Self {
            router,
            held,
            addr,
            _etcd: etcd,
        }
    }

    async fn raw(&self, request: Vec<u8>) -> Raw {
        raw(&self.addr, request).await
    }

    /// The lock held before the barrage renews, under the same token, and
    /// the router still serves.
    async fn assert_lock_survives(&self) {
        let api = &self.router.api;
        let r = api.renew(&self.held).await;
        assert_eq!((r.status, &r.body["renewed"]), (200, &json!(true)), "{r:?}");
        let seen = api.inspect("hostile:held").await;
        assert_eq!(
            seen.body["fencingToken"].as_u64(),
            Some(self.held.1),
            "{seen:?}"
        );
        assert_eq!(api.get("/healthz").await.status, 200);
    }
}

/// Asserts `answer` is the 4xx `status` with the JSON error `code`.
#[track_caller]
fn assert_refused(label: &str, answer: &Raw, status: u16, code: &str) {
    assert_eq!(
        answer.code(),
        (status, Some(code.to_string())),
        "{label}: {answer:?}"
    );
    assert!(
        answer
            .header("content-type")
            .is_some_and(|v| v.starts_with("application/json")),
        "{label}: {answer:?}"
    );
}

/// Oversized and malformed request heads, odd methods and HTTP/1.0: each
/// gets its 4xx (or is served, where nothing is wrong with it) and the
/// connection is closed cleanly after the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_malformed_heads_get_a_4xx_and_the_lock_survives() {
    let t = Target::start().await;
    let v64k = "v".repeat(64 * 1024);
    let v1m = "v".repeat(1 << 20);
    let many: Vec<(String, String)> = (0..200).map(|i| (format!("X-H{i}"), "v".into())).collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    let long_method = "G".repeat(64 * 1024);
    let acquire = br#"{"name":"hostile:http10","ttlMs":5000,"clientId":"A"}"#;

    // Served: nothing in them is wrong for this router.
    let served = [
        (
            "a 64 KiB header value",
            request("GET", "/healthz", &[("X-Big", &v64k)], b""),
        ),
        (
            "HTTP/1.0 without Host",
            b"GET /healthz HTTP/1.0\r\n\r\n".to_vec(),
        ),
    ];
    for (label, req) in served {
        let a = t.raw(req).await;
        assert_eq!(
            (a.status, a.json()),
            (200, json!({"status": "ok"})),
            "{label}: {a:?}"
        );
    }
    // A 64 KiB X-Request-Id is not echoed: the router makes one up.
    let a = t
        .raw(request("GET", "/healthz", &[("X-Request-Id", &v64k)], b""))
        .await;
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.header("x-request-id").map(str::len), Some(32), "{a:?}");
    // An acquire over HTTP/1.0 without Host, its body delimited by length.
    let mut http10 = format!(
        "POST {ACQUIRE} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        acquire.len()
    )
    .into_bytes();
    http10.extend_from_slice(acquire);
    let a = t.raw(http10).await;
    assert_eq!(
        (a.status, &a.json()["acquired"]),
        (200, &json!(true)),
        "{a:?}"
    );
    assert!(a.head.starts_with("HTTP/1.0 200"), "{a:?}");

    // Refused by the router, with its JSON error.
    let methods = [
        (
            "a 64 KiB method on /healthz",
            request(&long_method, "/healthz", &[], b""),
            "GET, HEAD",
        ),
        (
            "an unknown method on acquire",
            request("BREW", ACQUIRE, &[], b""),
            "POST",
        ),
    ];
    for (label, req, allow) in methods {
        let a = t.raw(req).await;
        assert_refused(label, &a, 405, "method_not_allowed");
        assert_eq!(a.header("allow"), Some(allow), "{label}");
    }
    let json_refusals = [
        (
            "a malformed chunk size",
            format!(
                "POST {ACQUIRE} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
                 Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{{}}\r\n0\r\n\r\n"
            )
            .into_bytes(),
        ),
        (
            // Chunked wins over Content-Length (RFC 9112 6.3): the body
            // read is the chunked `{}`, not a smuggled second request.
            "Content-Length beside Transfer-Encoding: chunked",
            format!(
                "POST {ACQUIRE} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
                 Content-Type: application/json\r\nContent-Length: 2\r\n\
                 Transfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n"
            )
            .into_bytes(),
        ),
    ];
    for (label, req) in json_refusals {
        let a = t.raw(req).await;
        assert_refused(label, &a, 400, "invalid_argument");
    }

    // Refused by hyper before the router sees them: bare 4xx, then close.
    for (label, req, status) in protocol_refusals(&v1m, &many) {
        let a = t.raw(req).await;
        assert_eq!(a.status, status, "{label}: {a:?}");
        assert_eq!(a.header("connection"), Some("close"), "{label}: {a:?}");
    }
    t.assert_lock_survives().await;
}

/// Requests hyper refuses itself, and the status it answers with.
fn protocol_refusals(v1m: &str, many: &[(&str, &str)]) -> Vec<(&'static str, Vec<u8>, u16)> {
    let long_path = format!("/api/v1/locks/{}", "n".repeat(64 * 1024));
    vec![
        (
            "a 1 MiB header value",
            request("GET", "/healthz", &[("X-Big", v1m)], b""),
            431,
        ),
        ("200 headers", request("GET", "/healthz", many, b""), 431),
        ("a 64 KiB path", request("GET", &long_path, &[], b""), 414),
        (
            "invalid UTF-8 in the raw path",
            b"GET /api/v1/locks/\xff\xfe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
            400,
        ),
        (
            "a method with a non-token byte",
            request("G{T", "/healthz", &[], b""),
            400,
        ),
        (
            "an unknown HTTP version",
            b"GET /healthz HTTP/9.9\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
            400,
        ),
        (
            "a TLS ClientHello on the plain port",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03hello\r\n\r\n".to_vec(),
            400,
        ),
        (
            "a non-numeric Content-Length",
            request(
                "POST",
                ACQUIRE,
                &[
                    ("Content-Type", "application/json"),
                    ("Content-Length", "abc"),
                ],
                b"",
            ),
            400,
        ),
        (
            "two different Content-Lengths",
            request(
                "POST",
                ACQUIRE,
                &[
                    ("Content-Type", "application/json"),
                    ("Content-Length", "2"),
                    ("Content-Length", "3"),
                ],
                b"",
            ),
            400,
        ),
        (
            "a Content-Length beyond u64",
            request(
                "POST",
                ACQUIRE,
                &[
                    ("Content-Type", "application/json"),
                    ("Content-Length", "99999999999999999999999"),
                ],
                b"",
            ),
            400,
        ),
    ]
}

/// The API promises every error as `{"error": {"code", "message"}}`, the
/// requests hyper refuses before routing included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_refusals_carry_the_json_error_envelope() {
    let t = Target::start().await;
    let v1m = "v".repeat(1 << 20);
    let many: Vec<(String, String)> = (0..200).map(|i| (format!("X-H{i}"), "v".into())).collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    for (label, req, status) in protocol_refusals(&v1m, &many) {
        let a = t.raw(req).await;
        assert_eq!(a.status, status, "{label}: {a:?}");
        assert!(a.code().1.is_some(), "{label}: no JSON error: {a:?}");
    }
    t.assert_lock_survives().await;
}

/// A body dribbled in slower than `server.body_read_timeout_ms` allows,
/// on every POST route at once: each is cut off with 408 `timeout` at the
/// deadline (not when the dribble ends), while other requests are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_bodies_get_408_at_the_deadline() {
    let t = Target::with_server("body_read_timeout_ms = 300\n").await;
    let dribblers: Vec<_> = POSTS
        .iter()
        .map(|path| {
            let addr = t.addr.clone();
            let path = path.to_string();
            tokio::spawn(async move { dribble(&addr, &path).await })
        })
        .collect();
    // Served meanwhile.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(t.router.api.get("/healthz").await.status, 200);
    for (path, d) in POSTS.iter().zip(dribblers) {
        let (answer, took) = d.await.unwrap();
        assert_refused(path, &answer, 408, "timeout");
        // The deadline is 300 ms; the whole dribble would take 6 s.
        assert!(
            took < Duration::from_secs(3),
            "{path}: cut off after {took:?}"
        );
    }
    t.assert_lock_survives().await;
}

/// A reload that shortens `server.body_read_timeout_ms` holds the next
/// request to the new deadline, as a start with it would: the deadlines
/// come with the rest of the generation a config builds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_body_deadline_applies_to_the_next_request() {
    let etcd = EtcdCluster::single();
    let toml = |ms: u32| {
        config_toml(&[&etcd], "127.0.0.1:0", "").replace(
            "[server]\n",
            &format!("[server]\nbody_read_timeout_ms = {ms}\n"),
        )
    };
    let router = FileRouter::start(&toml(10_000)).await;
    let reloaded = router.reload(&toml(300)).await;
    assert_eq!(reloaded.status, 200, "{reloaded:?}");
    let addr = router.api.base.trim_start_matches("http://").to_string();
    let (answer, took) = dribble(&addr, ACQUIRE).await;
    assert_refused("acquire", &answer, 408, "timeout");
    // The deadline is now 300 ms; the one it started with, 10 s.
    assert!(took < Duration::from_secs(3), "cut off after {took:?}");
}

/// Sends a head announcing 60 bytes of body, then one byte every 100 ms;
/// returns the answer and how long after the head it came.
async fn dribble(addr: &str, path: &str) -> (Raw, Duration) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: 60\r\n\r\n"
    );
    wr.write_all(head.as_bytes()).await.unwrap();
    let sent = Instant::now();
    let writer = tokio::spawn(async move {
        for _ in 0..60 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if wr.write_all(b" ").await.is_err() {
                return;
            }
        }
    });
    let mut got = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            if has_whole_answer(&got) {
                return;
            }
        }
    };
    tokio::time::timeout(ANSWER_WITHIN, read)
        .await
        .expect("the slow body got no answer (a hang)");
    let took = sent.elapsed();
    writer.abort();
    (parse_answer(&got), took)
}

/// Pathological JSON on every POST route: deep nesting, numbers out of
/// every range, invalid UTF-8 and lone surrogates, duplicate keys, a BOM,
/// NUL, empty and oversized bodies. All 400 `invalid_argument` (413 for
/// size), parsed without a stack overflow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_json_bodies_get_invalid_argument() {
    let t = Target::start().await;
    let deep_arrays = "[".repeat(10_000).into_bytes();
    let closed_arrays = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000)).into_bytes();
    let deep_objects = "{\"a\":".repeat(10_000).into_bytes();
    let deep_in_field = format!("{{\"name\":{}", "[".repeat(10_000)).into_bytes();
    let long_number = format!("{{\"ttlMs\":{}}}", "9".repeat(100_000)).into_bytes();
    let common: Vec<(&str, Vec<u8>)> = vec![
        ("10,000 levels of [", deep_arrays),
        ("10,000 closed levels of []", closed_arrays),
        ("10,000 levels of {\"a\":", deep_objects),
        ("10,000 levels of [ in a field", deep_in_field),
        ("a 100,000-digit number", long_number),
        ("a UTF-8 BOM", b"\xef\xbb\xbf{}".to_vec()),
        ("NUL", b"\0".to_vec()),
        ("an empty body", b" ".to_vec()),
        ("a JSON string", b"\"lock\"".to_vec()),
        ("null", b"null".to_vec()),
    ];
    let per_route: [(&str, Vec<&[u8]>); 4] = [
        (
            ACQUIRE,
            vec![
                br#"{"name":"n","ttlMs":1e400,"clientId":"A"}"#,
                br#"{"name":"n","ttlMs":18446744073709551616,"clientId":"A"}"#,
                br#"{"name":"n","ttlMs":18446744073709551615,"clientId":"A"}"#,
                br#"{"name":"n","ttlMs":-5000,"clientId":"A"}"#,
                br#"{"name":"n","ttlMs":5000.5,"clientId":"A"}"#,
                br#"{"name":"n","ttlMs":5e3,"clientId":"A"}"#,
                br#"{"name":"n","ttlMs":NaN,"clientId":"A"}"#,
                br#"{"name":"n","ttlMs":5000,"clientId":"A","waitMs":18446744073709551615}"#,
                b"{\"name\":\"\xff\xfe\",\"ttlMs\":5000,\"clientId\":\"A\"}",
                br#"{"name":"\ud800","ttlMs":5000,"clientId":"A"}"#,
                br#"{"name":"a","name":"b","ttlMs":5000,"clientId":"A"}"#,
                br#"{"name":"n","ttlMs":5000,"ttlMs":6000,"clientId":"A"}"#,
            ],
        ),
        (
            RENEW,
            vec![
                br#"{"lockId":"x","fencingToken":1e400}"#,
                br#"{"lockId":"x","fencingToken":18446744073709551616}"#,
                br#"{"lockId":"x","fencingToken":-1}"#,
                br#"{"lockId":"x","fencingToken":1.5}"#,
                br#"{"lockId":"x","fencingToken":1e3}"#,
                b"{\"lockId\":\"\xff\xfe\",\"fencingToken\":1}",
                br#"{"lockId":"\udfff","fencingToken":1}"#,
                br#"{"lockId":"x","lockId":"y","fencingToken":1}"#,
                br#"{"lockId":"x","fencingToken":1,"ttlMs":1e400}"#,
            ],
        ),
        (
            BATCH,
            vec![
                br#"{"locks":[{"lockId":"x","fencingToken":1e400}]}"#,
                br#"{"locks":[{"lockId":"x","fencingToken":-1}]}"#,
                b"{\"locks\":[{\"lockId\":\"\xff\",\"fencingToken\":1}]}",
                br#"{"locks":[],"locks":[]}"#,
                br#"{"locks":{"lockId":"x","fencingToken":1}}"#,
            ],
        ),
        (
            RELEASE,
            vec![
                br#"{"lockId":"x","fencingToken":18446744073709551616}"#,
                br#"{"lockId":"x","fencingToken":-9223372036854775808}"#,
                br#"{"lockId":"x","fencingToken":0.0}"#,
                b"{\"lockId\":\"\xc0\xaf\",\"fencingToken\":1}",
                br#"{"lockId":"x","fencingToken":1,"fencingToken":2}"#,
            ],
        ),
    ];
    for (path, bodies) in per_route {
        let cases = common
            .iter()
            .map(|(l, b)| (l.to_string(), b.clone()))
            .chain(
                bodies
                    .into_iter()
                    .map(|b| (String::from_utf8_lossy(b).into_owned(), b.to_vec())),
            );
        for (label, body) in cases {
            let a = t.raw(post_json(path, &body)).await;
            assert_refused(&format!("{path} {label}"), &a, 400, "invalid_argument");
        }
        let big = format!("{{\"name\":\"{}\"}}", "x".repeat(1 << 20));
        let a = t.raw(post_json(path, big.as_bytes())).await;
        assert_refused(path, &a, 413, "payload_too_large");
    }
    t.assert_lock_survives().await;
}

/// A valid body followed by anything else is not a JSON body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_body_with_trailing_garbage_is_refused() {
    let t = Target::start().await;
    let held = json!({"lockId": t.held.0, "fencingToken": t.held.1});
    let cases = [
        (
            ACQUIRE,
            json!({"name": "trailing", "ttlMs": 5000, "clientId": "A"}),
        ),
        (RENEW, held.clone()),
        (BATCH, json!({"locks": [held.clone()]})),
        (RELEASE, held),
    ];
    for (path, body) in cases {
        for tail in [" x", " {}", "]", "\u{0}"] {
            let text = format!("{body}{tail}");
            let a = t.raw(post_json(path, text.as_bytes())).await;
            assert_refused(&format!("{path} {text}"), &a, 400, "invalid_argument");
        }
    }
    t.assert_lock_survives().await;
}

/// Names in `GET /api/v1/locks/{name}` are opaque: dot segments and
/// encoded slashes name a lock (never another route or a file), NUL and
/// other control characters, bytes that are not UTF-8 (overlong forms
/// included) and names over 512 bytes are refused with 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_names_in_the_path_are_names_or_a_400() {
    let t = Target::start().await;
    let http = &t.router.api.http;
    let base = &t.router.api.base;
    let n600 = "n".repeat(600);
    let n512 = "n".repeat(512);
    let free: Vec<(&str, &str)> = vec![
        ("..%2F..", "../.."),
        ("..%2F..%2Fadmin%2Fv1%2Fring", "../../admin/v1/ring"),
        ("%2E%2E%2F%2E%2E%2Fetc%2Fpasswd", "../../etc/passwd"),
        ("acquire%2F..%2F..%2Fhealthz", "acquire/../../healthz"),
        // Not a valid escape: taken literally.
        ("%zz", "%zz"),
        ("%", "%"),
        ("%20", " "),
        (&n512, &n512),
    ];
    for (path, name) in free {
        let r = t
            .router
            .api
            .send(http.get(format!("{base}/api/v1/locks/{path}")))
            .await;
        assert_eq!(
            (r.status, &r.body),
            (200, &json!({"name": name, "held": false, "shard": "a"})),
            "{path}"
        );
    }
    let refused = [
        "%00",
        "a%00b",
        "%0A",
        "%7F",
        "%FF",
        "%FF%FE",
        "%C0%AF",
        "%ED%A0%80",
        &n600,
    ];
    for path in refused {
        let r = t
            .router
            .api
            .send(http.get(format!("{base}/api/v1/locks/{path}")))
            .await;
        assert_eq!(
            (r.status, r.body["error"]["code"].as_str()),
            (400, Some("invalid_argument")),
            "{path}: {r:?}"
        );
    }
    // Raw dot segments are not normalised away: still an inspect.
    let a = t
        .raw(request(
            "GET",
            "/api/v1/locks/../../admin/v1/ring",
            &[],
            b"",
        ))
        .await;
    assert_eq!(
        (a.status, a.json()),
        (
            200,
            json!({"name": "../../admin/v1/ring", "held": false, "shard": "a"})
        ),
        "{a:?}"
    );
    // The held lock, however its name is spelled.
    for spelled in ["hostile:held", "hostile%3Aheld", "hostile%3aheld"] {
        let r = t.router.api.get(&format!("/api/v1/locks/{spelled}")).await;
        assert_eq!(
            r.body["fencingToken"].as_u64(),
            Some(t.held.1),
            "{spelled}: {r:?}"
        );
    }
    t.assert_lock_survives().await;
}

/// `held`'s lockId, decoded, changed by `edit`, and encoded again with a
/// valid checksum: what a forger who read the format would send.
fn forge(held: &str, edit: impl FnOnce(&mut LockId)) -> (String, u64) {
    let mut id = LockId::decode(held).expect("a granted lockId decodes");
    edit(&mut id);
    let token = id.token().expect("forged within range");
    (id.encode(), token)
}

/// lockIds that were altered, cut, made up or taken from another
/// deployment: renew and release refuse them (400), find no lock under
/// them (409, 204), or, for a shard this router does not know, answer the
/// documented 503; none of them touches the lock actually held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_lock_ids_never_touch_the_holder() {
    let t = Target::start().await;
    let api = &t.router.api;
    let (id, token) = t.held.clone();
    let body = |id: &str, token: Value| json!({"lockId": id, "fencingToken": token});

    // Undecodable, or the token does not belong: 400 on both routes.
    let mut bad: Vec<(String, Value)> = Vec::new();
    for i in 0..id.len() - 1 {
        let mut b = id.clone().into_bytes();
        b[i] = if b[i] == b'A' { b'B' } else { b'A' };
        bad.push((String::from_utf8(b).unwrap(), json!(token)));
    }
    for len in [0, 1, id.len() / 2, id.len() - 4, id.len() - 1] {
        bad.push((id[..len].to_string(), json!(token)));
    }
    for garbage in [
        "!!!!",
        "====",
        "AAAA",
        "ü",
        "a b",
        &"A".repeat(600),
        &format!(" {id}"),
        &format!("{id}="),
    ] {
        bad.push((garbage.to_string(), json!(token)));
    }
    for wrong in [
        json!(token + 1),
        json!(token - 1),
        json!(0),
        json!(u64::MAX),
        json!(i64::MAX),
    ] {
        bad.push((id.clone(), wrong));
    }
    for path in [RENEW, RELEASE] {
        for (lock_id, tok) in &bad {
            let r = api.post(path, body(lock_id, tok.clone())).await;
            assert_eq!(
                (r.status, r.body["error"]["code"].as_str()),
                (400, Some("invalid_argument")),
                "{path} {lock_id:?} {tok}: {r:?}"
            );
        }
    }

    // Well-formed, checksummed, but not this grant: no lock is held under
    // them, and releasing them does nothing.
    let forged = [
        ("another revision", forge(&id, |l| l.revision += 1)),
        ("another lease", forge(&id, |l| l.lease ^= 1)),
        ("another name", forge(&id, |l| l.name_hash[0] ^= 0xff)),
    ];
    for (label, (lock_id, tok)) in &forged {
        let r = api.post(RENEW, body(lock_id, json!(tok))).await;
        assert_eq!(
            (r.status, &r.body["renewed"]),
            (409, &json!(false)),
            "renew {label}: {r:?}"
        );
        let r = api.post(RELEASE, body(lock_id, json!(tok))).await;
        assert_eq!(r.status, 204, "release {label}: {r:?}");
    }

    // A shard this router does not know: the documented 503 with Retry-After.
    let (stranger, tok) = forge(&id, |l| l.shard = "zz".into());
    for path in [RENEW, RELEASE] {
        let r = api.post(path, body(&stranger, json!(tok))).await;
        assert_eq!(
            (r.status, r.body["error"]["code"].as_str()),
            (503, Some("shard_unavailable")),
            "{path}: {r:?}"
        );
        assert!(r.retry_after.is_some(), "{r:?}");
    }

    // A lockId of the same name granted by another deployment, whose shard
    // is also called "a": not held here, and its release leaves ours alone.
    let other_etcd = EtcdCluster::single();
    let other = TestRouter::start(&[&other_etcd]).await;
    let theirs = other
        .api
        .must_acquire("hostile:held", 10_000, "keeper")
        .await;
    let r = api.renew(&theirs).await;
    assert_eq!(
        (r.status, &r.body["renewed"]),
        (409, &json!(false)),
        "{r:?}"
    );
    assert_eq!(api.release(&theirs).await.status, 204);

    t.assert_lock_survives().await;
}

/// renew-batch: 1,001 entries are refused; 1,000 copies of one lock, and
/// duplicates among others, each get their own result; a forged entry
/// fails alone and an unknown shard only its own entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_batch_bounds_and_duplicates() {
    let t = Target::start().await;
    let api = &t.router.api;
    let held = json!({"lockId": t.held.0, "fencingToken": t.held.1});
    let r = api
        .post(BATCH, json!({"locks": vec![held.clone(); 1001]}))
        .await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (400, Some("invalid_argument")),
        "{r:?}"
    );
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("1000"),
        "{r:?}"
    );
    let r = api
        .post(BATCH, json!({"locks": vec![held.clone(); 1000]}))
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    let results = r.body["results"].as_array().unwrap();
    assert_eq!(results.len(), 1000);
    assert!(
        results
            .iter()
            .all(|e| e["renewed"] == true && e["lockId"] == t.held.0),
        "{r:?}"
    );

    let other = api.must_acquire("hostile:other", 10_000, "keeper").await;
    let other = json!({"lockId": other.0, "fencingToken": other.1});
    let (stolen, stolen_tok) = forge(&t.held.0, |l| l.revision += 1);
    let (stranger, stranger_tok) = forge(&t.held.0, |l| l.shard = "zz".into());
    let locks = json!([
        held,
        other,
        {"lockId": stolen, "fencingToken": stolen_tok},
        held,
        {"lockId": stranger, "fencingToken": stranger_tok},
        other,
    ]);
    let r = api.post(BATCH, json!({"locks": locks})).await;
    assert_eq!(r.status, 200, "{r:?}");
    let got: Vec<(Value, Value)> = r.body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["renewed"].clone(), e["reason"].clone()))
        .collect();
    let renewed = (json!(true), Value::Null);
    assert_eq!(
        got,
        vec![
            renewed.clone(),
            renewed.clone(),
            (json!(false), json!("stolen")),
            renewed.clone(),
            (json!(false), json!("shard_unavailable")),
            renewed,
        ],
        "{r:?}"
    );
    // One malformed entry among good ones fails the call, naming it.
    let r = api
        .post(
            BATCH,
            json!({"locks": [held, {"lockId": "garbage", "fencingToken": 1}]}),
        )
        .await;
    assert_eq!(r.status, 400, "{r:?}");
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("locks[1]"),
        "{r:?}"
    );
    t.assert_lock_survives().await;
}

/// Only `application/json` (any case, any parameters, surrounding spaces)
/// is a JSON body; every other media type, a missing one and one that is
/// not visible ASCII get 415 on every POST route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_type_variants() {
    let t = Target::start().await;
    let body = br#"{"name":"hostile:ct","ttlMs":5000,"clientId":"A"}"#;
    for ct in [
        "application/json",
        "application/json; charset=utf-8",
        "APPLICATION/JSON",
        "Application/Json;charset=UTF-8",
        "application/json;;;",
        "application/json ; q=1",
    ] {
        let a = t
            .raw(request("POST", ACQUIRE, &[("Content-Type", ct)], body))
            .await;
        assert_eq!(
            (a.status, &a.json()["acquired"]),
            (200, &json!(true)),
            "{ct:?}: {a:?}"
        );
    }
    let refused: [&[u8]; 10] = [
        b"text/plain",
        b"text/json",
        b"application/json+x",
        b"application/vnd.api+json",
        b"application/x-www-form-urlencoded",
        b"multipart/form-data; boundary=x",
        b"application/jsonp",
        b"json",
        b"",
        b"application/json\xff",
    ];
    for path in POSTS {
        let none = t.raw(request("POST", path, &[], body)).await;
        assert_refused(
            &format!("{path} without Content-Type"),
            &none,
            415,
            "unsupported_media_type",
        );
        for ct in refused {
            let mut req =
                format!("POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: ")
                    .into_bytes();
            req.extend_from_slice(ct);
            req.extend_from_slice(format!("\r\nContent-Length: {}\r\n\r\n", body.len()).as_bytes());
            req.extend_from_slice(body);
            let a = t.raw(req).await;
            let label = format!("{path} {:?}", String::from_utf8_lossy(ct));
            assert_refused(&label, &a, 415, "unsupported_media_type");
        }
    }
    t.assert_lock_survives().await;
}
