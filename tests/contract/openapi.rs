//! Real answers against `docs/openapi.yaml`: every route is driven into
//! its main outcomes on real etcd, and each answer's status, media type,
//! required headers and body must be the documented ones. Request bodies
//! are checked the other way: a request the schema accepts is never
//! refused for its shape (the schema is stricter on length only: it counts
//! characters, the server bytes).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use lockrouter_testkit::api::Api;
use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::openapi::{Exchange, Spec};
use lockrouter_testkit::router::{FileRouter, TestRouter};
use lockrouter_testkit::sleep_ms;

use crate::rebalance::{moving_name, ring, toml, wait_granting};

/// The document the answers are held to.
const SPEC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.yaml");
const ACQUIRE: &str = "/api/v1/locks/acquire";
const RENEW: &str = "/api/v1/locks/renew";
const BATCH: &str = "/api/v1/locks/renew-batch";
const RELEASE: &str = "/api/v1/locks/release";
const INSPECT: &str = "/api/v1/locks/{name}";
const BUMP: &str = "/admin/v1/bump-epoch";

/// A client of one router whose every answer is checked against the spec.
struct Checked {
    spec: Spec,
    http: reqwest::Client,
    base: String,
}

impl Checked {
    fn new(api: &Api) -> Self {
        Self {
            spec: Spec::load(SPEC),
            http: api.http.clone(),
            base: api.base.clone(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends `req`, an operation `method template`, and checks the answer.
    async fn call(&self, method: &str, template: &str, req: reqwest::RequestBuilder) -> Exchange {
        let answer = exchange(req).await;
        self.spec.assert(method, template, &answer);
        answer
    }

    async fn post(&self, path: &str, body: &Value) -> Exchange {
        let req = self.http.post(self.url(path)).json(body);
        self.call("POST", path, req).await
    }

    async fn get(&self, template: &str, path: &str) -> Exchange {
        self.call("GET", template, self.http.get(self.url(path)))
            .await
    }

    async fn inspect(&self, name: &str) -> Exchange {
        let enc = percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC);
        self.get(INSPECT, &format!("/api/v1/locks/{enc}")).await
    }

    /// Acquires `name` for `client`; returns `(lockId, token)`.
    async fn grant(&self, name: &str, client: &str) -> (String, u64) {
        let a = self
            .post(
                ACQUIRE,
                &json!({"name": name, "ttlMs": 5000, "clientId": client}),
            )
            .await;
        let body = a.json();
        assert_eq!((a.status, &body["acquired"]), (200, &json!(true)), "{a:?}");
        (
            body["lockId"].as_str().unwrap().to_string(),
            body["fencingToken"].as_u64().unwrap(),
        )
    }
}

async fn exchange(req: reqwest::RequestBuilder) -> Exchange {
    let resp = req.send().await.expect("the router answers");
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(n, v)| (n.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let body = resp.bytes().await.unwrap().to_vec();
    Exchange {
        status,
        headers,
        body,
    }
}

fn lock_ref(lock: &(String, u64)) -> Value {
    json!({"lockId": lock.0, "fencingToken": lock.1})
}

fn code(x: &Exchange) -> (u16, Value) {
    (x.status, x.json()["error"]["code"].clone())
}

/// Acquire requests: whatever the schema accepts the server accepts, and
/// the bad requests here, which the schema refuses, the server answers
/// with 400. Lengths are the edge: the server counts bytes, the schema
/// characters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_requests_the_schema_accepts_are_accepted() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let doc = Checked::new(&router.api);
    let wide = |n: usize| "\u{1D11E}".repeat(n); // 4 bytes of UTF-8 each
    let cases = [
        json!({"name": wide(128), "ttlMs": 5000, "clientId": wide(64)}),
        json!({"name": wide(129), "ttlMs": 5000, "clientId": "A"}),
        json!({"name": "n", "ttlMs": 5000, "clientId": wide(65)}),
        json!({"name": "x".repeat(513), "ttlMs": 5000, "clientId": "A"}),
        json!({"name": "", "ttlMs": 5000, "clientId": "A"}),
        json!({"name": "no\u{a0}break", "ttlMs": 5000, "clientId": "A"}),
        json!({"name": "bell\u{7}", "ttlMs": 5000, "clientId": "A"}),
        json!({"name": "next\u{85}line", "ttlMs": 5000, "clientId": "A"}),
        json!({"name": "del\u{7f}", "ttlMs": 5000, "clientId": "A"}),
        json!({"name": "n", "ttlMs": 5000, "clientId": "tab\t"}),
        json!({"name": "n", "ttlMs": 1999, "clientId": "A"}),
        json!({"name": "n", "ttlMs": 3_600_000, "clientId": "A"}),
        json!({"name": "n", "ttlMs": 2.5, "clientId": "A"}),
        json!({"name": "n", "ttlMs": "5000", "clientId": "A"}),
        json!({"name": "n", "clientId": "A"}),
        json!({"name": "w", "ttlMs": 5000, "clientId": "A", "waitMs": 60_001}),
        json!({"name": "w", "ttlMs": 5000, "clientId": "A", "waitMs": 1}),
        json!({"name": "n", "ttlMs": 5000, "clientId": "A", "tllMs": 1}),
        json!(["not", "an", "object"]),
    ];
    for body in cases {
        let problems = doc.spec.request_problems("POST", ACQUIRE, &body);
        let a = doc.post(ACQUIRE, &body).await;
        match problems {
            None => assert_eq!(a.status, 200, "schema-valid {body} refused: {a:?}"),
            Some(why) => assert_eq!(
                code(&a),
                (400, json!("invalid_argument")),
                "{body} is schema-invalid ({why}) but was not refused: {a:?}"
            ),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_routes_answer_as_documented() {
    let etcd = EtcdCluster::single();
    let extra = "[limits]\nmax_waiters = 1\n";
    let router = TestRouter::with_toml(&config_toml(&[&etcd], "127.0.0.1:0", extra)).await;
    let doc = Checked::new(&router.api);

    // Acquire: granted, granted again (idempotent), held by another.
    let a = doc.grant("doc:1", "A").await;
    assert_eq!(doc.grant("doc:1", "A").await, a);
    let held = doc
        .post(
            ACQUIRE,
            &json!({"name": "doc:1", "ttlMs": 5000, "clientId": "B"}),
        )
        .await;
    assert_eq!(held.json()["acquired"], false, "{held:?}");

    // A waiter, and one more beyond max_waiters (429), then a handover.
    let waiter = {
        let req = doc
            .http
            .post(doc.url(ACQUIRE))
            .json(&json!({"name": "doc:1", "ttlMs": 5000, "clientId": "W", "waitMs": 10_000}));
        tokio::spawn(exchange(req))
    };
    wait_queued(&etcd).await;
    let r = doc
        .post(
            ACQUIRE,
            &json!({"name": "doc:2", "ttlMs": 5000, "clientId": "C", "waitMs": 1000}),
        )
        .await;
    assert_eq!(code(&r), (429, json!("rate_limited")));
    assert!(!waiter.is_finished(), "the waiter did not wait");
    assert_eq!(doc.post(RELEASE, &lock_ref(&a)).await.status, 204);
    let handed = waiter.await.unwrap();
    doc.spec.assert("POST", ACQUIRE, &handed);
    assert_eq!(handed.json()["acquired"], true, "{handed:?}");

    // Renew: renewed, expired (released), stolen (granted to another since).
    let b = doc.grant("doc:3", "A").await;
    assert_eq!(doc.post(RENEW, &lock_ref(&b)).await.status, 200);
    let mut with_ttl = lock_ref(&b);
    with_ttl["ttlMs"] = json!(60_000);
    assert_eq!(code(&doc.post(RENEW, &with_ttl).await).0, 400);
    let bad_token = json!({"lockId": b.0, "fencingToken": b.1 + 1});
    assert_eq!(code(&doc.post(RENEW, &bad_token).await).0, 400);
    assert_eq!(doc.post(RELEASE, &lock_ref(&b)).await.status, 204);
    assert_eq!(doc.post(RELEASE, &lock_ref(&b)).await.status, 204);
    let expired = doc.post(RENEW, &lock_ref(&b)).await;
    assert_eq!(
        (expired.status, expired.json()["reason"].clone()),
        (409, json!("expired"))
    );
    doc.grant("doc:3", "B").await;
    let stolen = doc.post(RENEW, &lock_ref(&b)).await;
    assert_eq!(
        (stolen.status, stolen.json()["reason"].clone()),
        (409, json!("stolen"))
    );

    // A lockId naming a shard this router does not know.
    let mut id = lockrouter::token::lock_id::LockId::decode(&b.0).unwrap();
    id.shard = "zz".into();
    let elsewhere = (id.encode(), b.1);
    let unknown = doc.post(RENEW, &lock_ref(&elsewhere)).await;
    assert_eq!(code(&unknown), (503, json!("shard_unavailable")));
    assert_eq!(code(&doc.post(RELEASE, &lock_ref(&elsewhere)).await).0, 503);

    // Renew-batch: one result per entry, in order; malformed batches 400.
    let c = doc.grant("doc:4", "A").await;
    let batch = json!({"locks": [lock_ref(&c), lock_ref(&b), lock_ref(&elsewhere)]});
    let results = doc.post(BATCH, &batch).await.json()["results"].clone();
    let reasons: Vec<Value> = results
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["reason"].clone())
        .collect();
    assert_eq!(
        reasons,
        [json!(null), json!("stolen"), json!("shard_unavailable")]
    );
    assert_eq!(doc.post(BATCH, &json!({"locks": []})).await.status, 400);
    let garbage = json!({"locks": [{"lockId": "x", "fencingToken": 1}]});
    assert_eq!(doc.post(BATCH, &garbage).await.status, 400);

    // Inspect: held, free, undecodable.
    assert_eq!(doc.inspect("doc:4").await.json()["held"], true);
    assert_eq!(doc.inspect("never held").await.json()["held"], false);
    let bad = doc.get(INSPECT, "/api/v1/locks/%FF%FE").await;
    assert_eq!(code(&bad), (400, json!("invalid_argument")));

    // The body's media type and size, the method, the path.
    let untyped = doc.http.post(doc.url(ACQUIRE)).body("{}");
    let r = doc.call("POST", ACQUIRE, untyped).await;
    assert_eq!(code(&r), (415, json!("unsupported_media_type")));
    let big = format!("{{\"name\": \"{}\"}}", "x".repeat(1 << 20));
    let req = doc
        .http
        .post(doc.url(RENEW))
        .header("content-type", "application/json")
        .body(big);
    let r = doc.call("POST", RENEW, req).await;
    assert_eq!(code(&r), (413, json!("payload_too_large")));
    // A 405 is documented with the path's one operation.
    let r = doc
        .call("POST", ACQUIRE, doc.http.put(doc.url(ACQUIRE)))
        .await;
    assert_eq!(code(&r), (405, json!("method_not_allowed")));
    for (template, path) in [(INSPECT, "/api/v1/locks/x"), ("/healthz", "/healthz")] {
        let r = doc
            .call("GET", template, doc.http.delete(doc.url(path)))
            .await;
        assert_eq!(code(&r), (405, json!("method_not_allowed")));
    }
    let missing = exchange(doc.http.get(doc.url("/api/v2/nothing"))).await;
    assert_eq!(code(&missing), (404, json!("not_found")));
    let documented = doc.spec.doc()["components"]["responses"]["NotFound"].clone();
    doc.spec
        .validate(
            &documented["content"]["application/json"]["schema"],
            &missing.json(),
        )
        .unwrap();

    // Operations.
    assert_eq!(doc.get("/healthz", "/healthz").await.status, 200);
    assert_eq!(doc.get("/readyz", "/readyz").await.status, 200);
    assert_eq!(doc.get("/metrics", "/metrics").await.status, 200);
    assert_eq!(
        doc.get("/admin/v1/ring", "/admin/v1/ring").await.status,
        200
    );
    // Started without a config file, this router cannot reload one.
    let reload = doc.post("/admin/v1/reload", &json!({})).await;
    assert_eq!(code(&reload), (400, json!("invalid_argument")));
}

/// Waits until some caller is queued (`waitMs`) on `etcd`.
async fn wait_queued(etcd: &EtcdCluster) {
    let mut client = etcd.client().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let prefix = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    while client
        .get("/lockrouter/waiters/", Some(prefix.clone()))
        .await
        .unwrap()
        .count()
        == 0
    {
        assert!(Instant::now() < deadline, "the waiter never queued");
        sleep_ms(20).await;
    }
}

/// Polls `/readyz` (each answer checked) until `want` holds, or panics.
async fn readyz_until(doc: &Checked, what: &str, want: impl Fn(&Exchange) -> bool) -> Exchange {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = doc.get("/readyz", "/readyz").await;
        if want(&r) {
            return r;
        }
        assert!(Instant::now() < deadline, "readyz never {what}: {r:?}");
        sleep_ms(50).await;
    }
}

fn state_of(r: &Exchange, shard: &str) -> Value {
    let body = r.json();
    let shards = body["shards"].as_array().cloned().unwrap_or_default();
    shards
        .into_iter()
        .find(|s| s["name"] == shard)
        .map_or(Value::Null, |s| s["state"].clone())
}

/// Readiness with a shard down, wiped and back, and the epoch bump.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_and_epoch_bumps_answer_as_documented() {
    let (mut c1, mut c2) = (EtcdCluster::single(), EtcdCluster::single());
    let shards = [("a", &c1, 1), ("b", &c2, 1)];
    let placed = ring(&shards);
    let on = |shard: &str, tag: &str| {
        (0..)
            .map(|i| format!("{tag}-{i}"))
            .find(|n| placed.shard_name(n) == shard)
            .unwrap()
    };
    let r = FileRouter::start(&toml(&shards)).await;
    let doc = Checked::new(&r.api);
    let ready = doc.get("/readyz", "/readyz").await;
    assert_eq!((ready.status, state_of(&ready, "b")), (200, json!("up")));
    assert_eq!(doc.post("/admin/v1/reload", &json!({})).await.status, 200);

    // No body and no Content-Type: refused, as a web page's form would be;
    // an empty body as JSON bumps, as does a body.
    let bare = doc.call("POST", BUMP, doc.http.post(doc.url(BUMP))).await;
    assert_eq!(bare.status, 415);
    let empty = doc
        .call(
            "POST",
            BUMP,
            doc.http
                .post(doc.url(BUMP))
                .header("content-type", "application/json"),
        )
        .await;
    assert_eq!(
        (empty.status, empty.json()["epoch"].clone()),
        (200, json!(2))
    );
    let min = doc.post(BUMP, &json!({"minEpoch": 7})).await;
    assert_eq!((min.status, min.json()["epoch"].clone()), (200, json!(7)));
    for (body, valid) in [
        (json!({"minEpoch": 7}), true),
        (json!({"reinitialize": ["b"]}), true),
        (json!({"bogus": 1}), false),
        (json!({"minEpoch": -1}), false),
    ] {
        let problems = doc.spec.request_problems("POST", BUMP, &body);
        assert_eq!(problems.is_none(), valid, "{body}: {problems:?}");
    }
    assert_eq!(code(&doc.post(BUMP, &json!({"bogus": 1})).await).0, 400);
    assert_eq!(code(&doc.post(BUMP, &json!({"minEpoch": -1})).await).0, 400);
    let untyped = doc.http.post(doc.url(BUMP)).body("{}");
    assert_eq!(code(&doc.call("POST", BUMP, untyped).await).0, 415);

    // Shard b down: still ready; b's names answer 503, a's work.
    let la = doc.grant(&on("a", "kept"), "A").await;
    let lb = doc.grant(&on("b", "lost"), "A").await;
    c2.kill();
    let down = readyz_until(&doc, "shows b unreachable", |r| {
        state_of(r, "b") == "unreachable"
    })
    .await;
    assert_eq!(down.status, 200, "one unreachable shard keeps it ready");
    assert_eq!(down.json()["unreachableShards"], json!(["b"]));
    let refused = doc
        .post(
            ACQUIRE,
            &json!({"name": on("b", "new"), "ttlMs": 5000, "clientId": "A"}),
        )
        .await;
    assert_eq!(code(&refused), (503, json!("shard_unavailable")));
    assert_eq!(doc.post(RENEW, &lock_ref(&lb)).await.status, 503);
    assert_eq!(doc.post(RELEASE, &lock_ref(&lb)).await.status, 503);
    assert_eq!(doc.inspect(&on("b", "lost")).await.status, 503);
    let batch = json!({"locks": [lock_ref(&la), lock_ref(&lb)]});
    let results = doc.post(BATCH, &batch).await.json()["results"].clone();
    assert_eq!(results[0]["renewed"], true, "{results}");
    assert_eq!(results[1]["reason"], "shard_unavailable", "{results}");
    assert_eq!(code(&doc.post(BUMP, &json!({})).await).0, 409);

    // b comes back empty: it refuses its names until a bump names it, but
    // the replica stays ready (every replica shares the problem).
    c2.wipe();
    let wiped = readyz_until(&doc, "shows b uninitialised", |r| {
        state_of(r, "b") == "uninitialised"
    })
    .await;
    assert_eq!(wiped.status, 200);
    assert_eq!(wiped.json()["refusingShards"], json!(["b"]));
    let refused = doc.post(BUMP, &json!({})).await;
    assert_eq!(code(&refused), (409, json!("failed_precondition")));
    let named = doc.post(BUMP, &json!({"reinitialize": ["b"]})).await;
    assert_eq!(
        (named.status, named.json()["epoch"].clone()),
        (200, json!(8))
    );
    readyz_until(&doc, "b up again", |r| state_of(r, "b") == "up").await;
    assert_eq!(
        doc.get("/admin/v1/ring", "/admin/v1/ring").await.status,
        200
    );

    // Every shard down: not ready.
    c1.kill();
    c2.kill();
    let none = readyz_until(&doc, "unready", |r| r.status == 503).await;
    assert_eq!(none.json()["ready"], false);
}

/// An open migration as readiness and the admin ring show it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_answers_as_documented() {
    let (c1, c2) = (EtcdCluster::single(), EtcdCluster::single());
    let (one, two) = ([("a", &c1, 1)], [("a", &c1, 1), ("b", &c2, 1)]);
    let r = FileRouter::start(&toml(&one)).await;
    let doc = Checked::new(&r.api);
    let name = moving_name(&ring(&one), "a", &ring(&two), "b");
    let lock = doc.grant(&name, "A").await;
    std::fs::write(&r.path, toml(&two)).unwrap();
    assert_eq!(doc.post("/admin/v1/reload", &json!({})).await.status, 200);
    wait_granting(&r).await;
    let open = readyz_until(&doc, "shows the migration", |r| {
        r.json()["migration"].is_object()
    })
    .await;
    assert_eq!(open.status, 200, "{open:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // Empty until the first count of moved locks.
        let ring = doc.get("/admin/v1/ring", "/admin/v1/ring").await.json();
        if ring["migration"]["movedLocksHeld"]["a"] == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the moved lock is never counted: {ring}"
        );
        sleep_ms(50).await;
    }
    assert_eq!(doc.inspect(&name).await.json()["shard"], "a");
    assert_eq!(doc.post(RELEASE, &lock_ref(&lock)).await.status, 204);
    r.wait_migration_closed(Duration::from_secs(10)).await;
    let closed = doc.get("/readyz", "/readyz").await;
    assert_eq!(
        (closed.status, closed.json()["migration"].clone()),
        (200, Value::Null)
    );
}

/// Parses a raw HTTP/1.1 answer (status line, headers, body).
fn parse_raw(text: &str) -> Exchange {
    let (head, body) = text.split_once("\r\n\r\n").expect("a complete answer");
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Exchange {
        status,
        headers,
        body: body.as_bytes().to_vec(),
    }
}

/// Deadlines (408, 504) and the admin token (401, 403).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_and_admin_auth_answer_as_documented() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let etcd = EtcdCluster::single();
    let token = "a-test-admin-token-0123";
    let toml = config_toml(
        &[&etcd],
        "127.0.0.1:0",
        &format!("[admin]\ntoken = \"{token}\"\n"),
    )
    .replace(
        "[server]\n",
        "[server]\nbody_read_timeout_ms = 300\nrequest_timeout_ms = 300\n",
    );
    let router = TestRouter::with_toml(&toml).await;
    let doc = Checked::new(&router.api);
    let ring = "/admin/v1/ring";
    let r = doc.call("GET", ring, doc.http.get(doc.url(ring))).await;
    assert_eq!(code(&r), (401, json!("unauthenticated")));
    let wrong = doc.http.get(doc.url(ring)).bearer_auth("not-the-token");
    assert_eq!(code(&doc.call("GET", ring, wrong).await).0, 403);
    let right = doc.http.get(doc.url(ring)).bearer_auth(token);
    assert_eq!(doc.call("GET", ring, right).await.status, 200);
    assert_eq!(code(&doc.post(BUMP, &json!({})).await).0, 401);

    // A body that never arrives in full: 408.
    let addr = router.api.base.trim_start_matches("http://").to_string();
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST {RENEW} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: 100\r\n\r\n{{\"lockId\":"
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    let read = slow.read_to_end(&mut raw);
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("the router answers and closes")
        .unwrap();
    let late = parse_raw(&String::from_utf8_lossy(&raw));
    doc.spec.assert("POST", RENEW, &late);
    assert_eq!(code(&late), (408, json!("timeout")));

    // etcd stops answering: past request_timeout_ms, 504.
    etcd.pause_member(0);
    let stuck = doc
        .post(
            ACQUIRE,
            &json!({"name": "stuck", "ttlMs": 5000, "clientId": "S"}),
        )
        .await;
    etcd.resume_member(0);
    assert_eq!(code(&stuck), (504, json!("timeout")));
}

/// Every example in the document is valid for the schema beside it.
#[test]
fn the_examples_match_their_schemas() {
    let spec = Spec::load(SPEC);
    let doc = spec.doc();
    let mut media = Vec::new(); // (where, media type object)
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let at = format!("{method} {path}");
            if let Some(c) = op["requestBody"]["content"].as_object() {
                media.extend(c.values().map(|m| (format!("{at} request"), m)));
            }
            for (status, r) in op["responses"].as_object().unwrap() {
                if let Some(c) = r["content"].as_object() {
                    media.extend(c.values().map(|m| (format!("{at} {status}"), m)));
                }
            }
        }
    }
    for (name, r) in doc["components"]["responses"].as_object().unwrap() {
        if let Some(c) = r["content"].as_object() {
            media.extend(c.values().map(|m| (name.clone(), m)));
        }
    }
    let mut checked = 0;
    for (at, m) in media {
        for (example, e) in m["examples"].as_object().into_iter().flatten() {
            if let Err(why) = spec.validate(&m["schema"], &e["value"]) {
                panic!("{at}: example {example:?} does not match its schema: {why}");
            }
            checked += 1;
        }
    }
    assert!(checked > 20, "only {checked} examples found");
}
