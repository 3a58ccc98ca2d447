//! The HTTP contract: every bad input gets its 4xx and a JSON error (never a
//! 500 or a dropped connection), HTTP/2 works, and the OpenAPI document
//! lists exactly the routes the server serves; `openapi` checks that real
//! answers match the document's schemas.

mod openapi;

use serde_json::{json, Value};

use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::router::TestRouter;

const ACQUIRE: &str = "/api/v1/locks/acquire";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_4xx() {
    let etcd = EtcdCluster::single();
    // A shard name of its own: every router in this process shares one
    // metrics recorder, and only this router's acquires count below.
    let toml = lockrouter_testkit::config::one_named_shard(&etcd, "bad-input", "");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let good = api.must_acquire("good", 5_000, "A").await;
    let long = "x".repeat(513);
    let acquire_cases: Vec<(Value, &str)> = vec![
        (json!({"name": "", "ttlMs": 5000, "clientId": "A"}), "name"),
        (
            json!({"name": long, "ttlMs": 5000, "clientId": "A"}),
            "name",
        ),
        (
            json!({"name": "a\u{7}b", "ttlMs": 5000, "clientId": "A"}),
            "control",
        ),
        (
            json!({"name": "n", "ttlMs": 5000, "clientId": ""}),
            "clientId",
        ),
        (
            json!({"name": "n", "ttlMs": 5000, "clientId": "c".repeat(257)}),
            "clientId",
        ),
        (
            json!({"name": "n", "ttlMs": 1999, "clientId": "A"}),
            "ttlMs",
        ),
        (
            json!({"name": "n", "ttlMs": 3_600_001, "clientId": "A"}),
            "ttlMs",
        ),
        (json!({"name": "n", "ttlMs": -5, "clientId": "A"}), "ttlMs"),
        (json!({"name": "n", "ttlMs": 2.5, "clientId": "A"}), "ttlMs"),
        (
            json!({"name": "n", "ttlMs": "5000", "clientId": "A"}),
            "ttlMs",
        ),
        (json!({"name": "n", "clientId": "A"}), "ttlMs"),
        (
            json!({"name": "n", "ttlMs": 5000, "clientId": "A", "waitMs": 60_001}),
            "waitMs must be at most 60000",
        ),
        (
            json!({"name": "n", "ttlMs": 5000, "clientId": "A", "tllMs": 1}),
            "tllMs",
        ),
        (json!(["not", "an", "object"]), "invalid JSON"),
    ];
    for (body, needle) in acquire_cases {
        let r = api.post(ACQUIRE, body.clone()).await;
        assert_eq!(r.status, 400, "{body}: {r:?}");
        assert_eq!(r.body["error"]["code"], "invalid_argument", "{body}");
        let msg = r.body["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains(needle),
            "{body}: {msg:?} should mention {needle:?}"
        );
    }
    let mut tampered = good.0.clone().into_bytes();
    tampered[10] = if tampered[10] == b'A' { b'B' } else { b'A' };
    let tampered = String::from_utf8(tampered).unwrap();
    for path in ["/api/v1/locks/renew", "/api/v1/locks/release"] {
        for body in [
            json!({"lockId": "garbage", "fencingToken": 1}),
            json!({"lockId": tampered, "fencingToken": good.1}),
            json!({"lockId": good.0, "fencingToken": good.1 + 1}),
            json!({"lockId": good.0}),
            json!({"lockId": good.0, "fencingToken": -1}),
        ] {
            let r = api.post(path, body.clone()).await;
            assert_eq!(
                (r.status, r.body["error"]["code"].as_str()),
                (400, Some("invalid_argument")),
                "{path} {body}"
            );
        }
    }
    let r = api
        .post(
            "/api/v1/locks/renew",
            json!({"lockId": good.0, "fencingToken": good.1, "ttlMs": 60000}),
        )
        .await;
    assert_eq!(r.status, 400, "{r:?}");
    for body in [
        json!({"locks": []}),
        json!({"locks": vec![json!({"lockId": good.0, "fencingToken": good.1}); 1001]}),
    ] {
        let r = api.post("/api/v1/locks/renew-batch", body).await;
        assert_eq!(r.status, 400, "{r:?}");
    }
    // A lockId may come with JSON escapes in it: the same lock.
    let escaped = format!(
        "{{\"locks\": [{{\"lockId\": \"\\u{:04x}{}\", \"fencingToken\": {}}}]}}",
        good.0.as_bytes()[0],
        &good.0[1..],
        good.1
    );
    let r = api
        .send(
            api.http
                .post(format!("{}/api/v1/locks/renew-batch", api.base))
                .header("content-type", "application/json")
                .body(escaped),
        )
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["results"][0]["lockId"], good.0.as_str(), "{r:?}");
    assert_eq!(r.body["results"][0]["renewed"], true, "{r:?}");
    let r = api.post("/api/v1/locks/renew-batch", json!({"locks": [{"lockId": good.0, "fencingToken": good.1}, {"lockId": "x", "fencingToken": 1}]})).await;
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("locks[1]"),
        "{r:?}"
    );

    let http = &api.http;
    let base = &api.base;
    let raw = |req: reqwest::RequestBuilder| async { api.send(req).await };
    let r = raw(http.post(format!("{base}{ACQUIRE}")).body("{\"name\":")).await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (415, Some("unsupported_media_type"))
    );
    let r = raw(http
        .post(format!("{base}{ACQUIRE}"))
        .header("content-type", "application/json")
        .body("{\"name\":"))
    .await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (400, Some("invalid_argument"))
    );
    let r = raw(http
        .post(format!("{base}{ACQUIRE}"))
        .header("content-type", "application/json")
        .body("\u{0}\u{ff}"))
    .await;
    assert_eq!(r.status, 400);
    // The router reads an oversized body to its end before answering, so a
    // client still sending reads the 413 rather than a reset connection:
    // every one of these gets its answer.
    for size in [(1 << 20) + 1, 4 << 20] {
        for _ in 0..8 {
            let big = format!("{{\"name\": \"{}\"}}", "x".repeat(size));
            let r = raw(http
                .post(format!("{base}{ACQUIRE}"))
                .header("content-type", "application/json")
                .body(big))
            .await;
            assert_eq!(
                (r.status, r.body["error"]["code"].as_str()),
                (413, Some("payload_too_large"))
            );
        }
    }
    let r = raw(http.get(format!("{base}{ACQUIRE}"))).await;
    assert_eq!(
        r.status, 200,
        "GET of a lock named 'acquire' is an inspect: {r:?}"
    );
    let r = raw(http.put(format!("{base}{ACQUIRE}"))).await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (405, Some("method_not_allowed"))
    );
    let r = raw(http.delete(format!("{base}/api/v1/locks/foo"))).await;
    assert_eq!(r.status, 405);
    let r = raw(http.get(format!("{base}/api/v2/nothing"))).await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    let r = raw(http.get(format!("{base}/api/v1/locks/%FF%FE"))).await;
    assert_eq!(r.status, 400);
    let r = raw(http.get(format!("{base}/api/v1/locks/"))).await;
    assert_eq!(r.status, 400);

    // Still serving, and the good lock is untouched.
    assert_eq!(api.get("/healthz").await.status, 200);
    assert_eq!(api.renew(&good).await.status, 200);
    // Series, not values, for what is not this shard's own: the tests'
    // routers share one process, so one metrics registry, and other tests
    // take shards down or migrate.
    let metrics = api.metrics().await;
    for series in [
        "lockrouter_requests_total",
        "lockrouter_acquires_total{shard=\"bad-input\",outcome=\"acquired\"} 1\n",
        "lockrouter_shard_up{shard=\"bad-input\"} 1\n",
        "lockrouter_migration_open ",
        "process_resident_memory_bytes",
    ] {
        assert!(metrics.contains(series), "no {series} in\n{metrics}");
    }
    let own: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("lockrouter_acquires_total{shard=\"bad-input\""))
        .collect();
    assert_eq!(
        own,
        ["lockrouter_acquires_total{shard=\"bad-input\",outcome=\"acquired\"} 1"],
        "a bad input reached the shard"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_reports_holder_and_shard() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let name = "with/slash and spaces ü";
    let free = api.inspect(name).await;
    assert_eq!(
        free.body,
        json!({"name": name, "held": false, "shard": "a"})
    );
    let lock = api.must_acquire(name, 5_000, "A").await;
    let held = api.inspect(name).await;
    assert_eq!(held.body["held"], true);
    assert_eq!(held.body["fencingToken"].as_u64(), Some(lock.1));
    assert!(held.body["expiresAt"].as_str().unwrap().ends_with('Z'));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_without_tls_is_served() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let resp = h2
        .post(format!("{}{ACQUIRE}", router.api.base))
        .json(&json!({"name": "h2", "ttlMs": 5000, "clientId": "A"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.version(), reqwest::Version::HTTP_2);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["acquired"], true);
}

#[test]
fn openapi_lists_exactly_the_served_routes() {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.yaml")).unwrap();
    let mut documented = Vec::new();
    let mut in_paths = false;
    let mut path = String::new();
    for line in text.lines() {
        if !line.starts_with(' ') && !line.is_empty() {
            in_paths = line.trim_end() == "paths:";
            continue;
        }
        if !in_paths {
            continue;
        }
        if let Some(p) = line.strip_prefix("  /") {
            path = format!("/{}", p.trim_end().trim_end_matches(':'));
        } else if let Some(m) = line.strip_prefix("    ") {
            let m = m.trim_end().trim_end_matches(':');
            if ["get", "post", "put", "delete", "patch", "head", "options"].contains(&m) {
                documented.push((m.to_uppercase(), path.clone()));
            }
        }
    }
    let mut served: Vec<(String, String)> = lockrouter::http::Route::ALL
        .iter()
        .map(|r| (r.method().to_string(), r.template().to_string()))
        .collect();
    documented.sort();
    served.sort();
    assert_eq!(documented, served);
}

/// Reads from `stream` until it closes or `within` passes; returns what
/// arrived and whether the server closed the connection.
async fn read_until_closed(
    stream: &mut tokio::net::TcpStream,
    within: std::time::Duration,
) -> (String, bool) {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&got).into(), true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&got).into(), false),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off() {
    use tokio::io::AsyncWriteExt;
    let etcd = EtcdCluster::single();
    let toml = lockrouter_testkit::config::config_toml(&[&etcd], "127.0.0.1:0", "").replace(
        "[server]\n",
        "[server]\nheader_read_timeout_ms = 300\nbody_read_timeout_ms = 300\n",
    );
    let router = TestRouter::with_toml(&toml).await;
    let addr = router.api.base.trim_start_matches("http://").to_string();
    let long = std::time::Duration::from_secs(3);
    // Headers that never end: the connection is closed.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(format!("POST {ACQUIRE} HTTP/1.1\r\nHost: x\r\n").as_bytes())
        .await
        .unwrap();
    let (answer, closed) = read_until_closed(&mut slow, long).await;
    assert!(closed, "a connection with unfinished headers was kept open");
    assert_eq!(answer, "", "closed without an answer, as documented");
    // A body that never arrives in full: 408 and a JSON error.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST {ACQUIRE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: 100\r\n\r\n{{\"name\":"
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    let (answer, _) = read_until_closed(&mut slow, long).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(answer.contains("\"code\":\"timeout\""), "{answer:?}");
    // An idle keep-alive connection is closed too.
    let mut idle = tokio::net::TcpStream::connect(&addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (answer, closed) = read_until_closed(&mut idle, long).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert!(closed, "an idle keep-alive connection was kept open");
}

/// Every answer names its request in `X-Request-Id` (the caller's id when
/// usable, else a `traceparent`'s trace id, else a made-up one), and every
/// error body carries it as `requestId`. HEAD on a GET route answers as GET
/// without a body; on a POST route it is a 405 naming POST.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_carry_their_request_id_and_head_is_a_bodiless_get() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let held = api.must_acquire("ids", 5_000, "A").await;
    let send = |req: reqwest::RequestBuilder| async move { req.send().await.unwrap() };
    let id_of = |r: &reqwest::Response| {
        r.headers()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_string())
    };
    let url = |p: &str| format!("{}{p}", api.base);

    let ok = send(
        api.http
            .get(url("/api/v1/locks/ids"))
            .header("X-Request-Id", "job-42/try-1"),
    )
    .await;
    assert_eq!(ok.status(), 200);
    assert_eq!(id_of(&ok).as_deref(), Some("job-42/try-1"));
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let traced = send(api.http.get(url("/healthz")).header("traceparent", tp)).await;
    assert_eq!(
        id_of(&traced).as_deref(),
        Some("4bf92f3577b34da6a3ce929d0e0e4736")
    );
    let (a, b) = (
        send(api.http.get(url("/healthz"))).await,
        send(api.http.get(url("/healthz"))).await,
    );
    assert_ne!(id_of(&a), id_of(&b), "made-up ids differ");
    assert!(id_of(&a).is_some_and(|id| id.len() == 32));

    let bad = send(
        api.http
            .post(url(ACQUIRE))
            .header("X-Request-Id", "bad-one")
            .json(&json!({"name": "", "ttlMs": 5000, "clientId": "A"})),
    )
    .await;
    assert_eq!(bad.status(), 400);
    assert_eq!(id_of(&bad).as_deref(), Some("bad-one"));
    let body: Value = bad.json().await.unwrap();
    assert_eq!(body["error"]["requestId"], "bad-one", "{body}");
    assert_eq!(body["error"]["code"], "invalid_argument", "{body}");

    for path in [
        "/api/v1/locks/ids",
        "/healthz",
        "/readyz",
        "/metrics",
        "/admin/v1/ring",
    ] {
        let get = send(api.http.get(url(path))).await;
        let head = send(api.http.head(url(path))).await;
        assert_eq!(head.status(), get.status(), "{path}");
        assert_eq!(
            head.headers().get("content-type"),
            get.headers().get("content-type"),
            "{path}"
        );
        assert!(
            head.bytes().await.unwrap().is_empty(),
            "HEAD {path} sent a body"
        );
    }
    let head_post = send(api.http.head(url(ACQUIRE))).await;
    assert_eq!(head_post.status(), 405);
    assert_eq!(head_post.headers().get("allow").unwrap(), "POST");
    let delete = send(api.http.delete(url("/healthz"))).await;
    assert_eq!(delete.status(), 405);
    assert_eq!(delete.headers().get("allow").unwrap(), "GET, HEAD");
    assert_eq!(api.release(&held).await.status, 204);
}
