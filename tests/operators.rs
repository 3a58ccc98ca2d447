//! What operators see: inspect with when a lock was acquired, what its
//! holder attached and how many wait for it; the admin listing of held
//! locks across shards, page by page with a cursor; what one client
//! holds with its session leases; and force-release, whose precondition
//! (a fencing token) never takes a name from a holder the operator did
//! not look at. `status` exits 69 when the router is not ready (the
//! status still shown) or cannot be reached. Real routers on real etcd,
//! and the `lockrouter` binary.

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

use lockrouter_testkit::api::Api;
use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router::TestRouter;

const ACQUIRE: &str = "/api/v1/locks/acquire";

async fn acquire_with(api: &Api, name: &str, client: &str, extra: Value) -> Value {
    let mut body = json!({"name": name, "ttlMs": 10_000, "clientId": client});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let r = api.post(ACQUIRE, body).await;
    assert_eq!(r.status, 200, "{r:?}");
    r.body
}

/// Every page of `GET /admin/v1/locks?prefix=...&limit=...` until the
/// last; the names listed, in order, and how many pages it took.
async fn list_all(api: &Api, prefix: &str, limit: usize) -> (Vec<Value>, usize) {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let mut path = format!("/admin/v1/locks?prefix={prefix}&limit={limit}");
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let r = api.get(&path).await;
        assert_eq!(r.status, 200, "{r:?}");
        pages += 1;
        let page = r.body["locks"].as_array().unwrap();
        assert!(
            page.len() <= limit,
            "{} locks in a page of {limit}",
            page.len()
        );
        out.extend(page.iter().cloned());
        match r.body["nextCursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return (out, pages),
        }
        assert!(pages < 10_000, "the listing never ends");
    }
}

/// Inspect shows when the lock was acquired, what its holder attached, and
/// how many wait for it; metadata is bounded and must be an object or a
/// string.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_acquired_at_metadata_and_waiters() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let before = SystemTime::now();
    let meta = json!({"job": "nightly-report", "host": "worker-7"});
    let granted = acquire_with(api, "ops:report", "w7", json!({"metadata": meta})).await;
    assert_eq!(granted["acquired"], true);
    let seen = api.inspect("ops:report").await.body;
    assert_eq!(seen["metadata"], meta);
    assert!(seen.get("waiters").is_none(), "nobody waits: {seen}");
    let at = humantime::parse_rfc3339(seen["acquiredAt"].as_str().unwrap()).unwrap();
    let slack = Duration::from_secs(2);
    assert!(
        at + slack >= before && at <= SystemTime::now() + slack,
        "{seen}"
    );
    // Two waiters queue for it.
    let mut waiting = Vec::new();
    for client in ["w8", "w9"] {
        let api = api.clone();
        waiting.push(tokio::spawn(async move {
            api.post(
                ACQUIRE,
                json!({"name": "ops:report", "ttlMs": 10_000, "clientId": client, "waitMs": 3_000}),
            )
            .await
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let seen = api.inspect("ops:report").await.body;
        if seen["waiters"] == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "waiters never counted: {seen}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for w in waiting {
        assert_eq!(w.await.unwrap().body["acquired"], false);
    }
    // Bounded, and an object or a string.
    for bad in [json!([1, 2]), json!(7), json!({"big": "x".repeat(2_000)})] {
        let r = api
            .post(
                ACQUIRE,
                json!({"name": "ops:bad", "ttlMs": 10_000, "clientId": "w", "metadata": bad}),
            )
            .await;
        assert_eq!(r.status, 400, "{r:?}");
    }
    let plain = acquire_with(api, "ops:plain", "w", json!({"metadata": "batch 7"})).await;
    assert_eq!(plain["acquired"], true);
    assert_eq!(api.inspect("ops:plain").await.body["metadata"], "batch 7");
}

/// The listing walks every held lock of a prefix across three shards
/// exactly once, page by page, while locks come and go between pages;
/// bad queries get 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listing_pages_through_every_held_lock_once() {
    let shards = [
        EtcdCluster::single(),
        EtcdCluster::single(),
        EtcdCluster::single(),
    ];
    let refs: Vec<&EtcdCluster> = shards.iter().collect();
    let router = TestRouter::with_toml(&config_toml(&refs, "127.0.0.1:0", "")).await;
    let api = &router.api;
    let mut kept = HashSet::new();
    for i in 0..120 {
        let name = format!("job/{i:03}");
        acquire_with(api, &name, &format!("w{}", i % 7), json!({})).await;
        kept.insert(name);
    }
    for i in 0..30 {
        acquire_with(api, &format!("other/{i}"), "w", json!({})).await;
    }
    // Page by page, acquiring and releasing other job/ names in between.
    let mut listed: Vec<String> = Vec::new();
    let mut cursor: Option<String> = None;
    let mut churn = 0;
    loop {
        let mut path = "/admin/v1/locks?prefix=job/&limit=25".to_string();
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let r = api.get(&path).await;
        assert_eq!(r.status, 200, "{r:?}");
        for l in r.body["locks"].as_array().unwrap() {
            assert!(
                l["fencingToken"].as_u64().is_some() && l["ttlMs"] == 10_000,
                "{l}"
            );
            listed.push(l["name"].as_str().unwrap().to_string());
        }
        let churned = format!("job/churn-{churn}");
        let lock = api.must_acquire(&churned, 10_000, "c").await;
        if churn % 2 == 0 {
            assert_eq!(api.release(&lock).await.status, 204);
        }
        churn += 1;
        match r.body["nextCursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    let unique: HashSet<&String> = listed.iter().collect();
    assert_eq!(
        unique.len(),
        listed.len(),
        "a lock listed twice: {listed:?}"
    );
    for name in &kept {
        assert!(
            unique.contains(name),
            "{name} held throughout but not listed"
        );
    }
    assert!(listed.iter().all(|n| n.starts_with("job/")), "{listed:?}");
    let (all, _) = list_all(api, "", 1000).await;
    assert!(all.len() >= 150, "{}", all.len());
    for bad in [
        "/admin/v1/locks?limit=0",
        "/admin/v1/locks?limit=1001",
        "/admin/v1/locks?cursor=not-a-cursor",
        "/admin/v1/locks?colour=blue",
        "/admin/v1/locks?limit=5&limit=6",
    ] {
        let r = api.get(bad).await;
        assert_eq!(r.status, 400, "{bad}: {r:?}");
    }
}

/// Many locks: the listing reads them all, a bounded page at a time
/// (prints the page time; no timed assertion). A page of a prefix that
/// matches nothing still ends, reading at most its bound of keys per page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listing_walks_many_locks_in_bounded_pages() {
    const LOCKS: usize = 10_000;
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..16 {
        let api = api.clone();
        tasks.push(tokio::spawn(async move {
            let mut names = Vec::new();
            let mut i = worker;
            while i < LOCKS {
                let name = format!("bulk/{i:06}");
                let r = api.acquire(&name, 60_000, &format!("bulk-{worker}")).await;
                assert_eq!(
                    (r.status, &r.body["acquired"]),
                    (200, &json!(true)),
                    "{r:?}"
                );
                names.push(name);
                i += 16;
            }
            names
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    println!("{LOCKS} locks acquired in {:?}", started.elapsed());
    let started = Instant::now();
    let (all, pages) = list_all(api, "bulk/", 1000).await;
    let took = started.elapsed();
    println!(
        "listed {} locks in {pages} pages in {took:?} ({:?} a page)",
        all.len(),
        took / pages as u32
    );
    assert_eq!(all.len(), LOCKS);
    let unique: HashSet<&str> = all.iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert_eq!(unique.len(), LOCKS);
    let (none, pages) = list_all(api, "nothing/", 1000).await;
    assert!(none.is_empty());
    assert!(
        pages >= LOCKS / 5_000,
        "{pages} pages: each reads a bounded number of keys"
    );
}

/// A client's locks on every shard, with the session leases they ride on
/// (one per TTL on each shard) and the time etcd gives each; another
/// client's are not in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_view_lists_its_locks_and_sessions() {
    let shards = [EtcdCluster::single(), EtcdCluster::single()];
    let refs: Vec<&EtcdCluster> = shards.iter().collect();
    let router = TestRouter::with_toml(&config_toml(&refs, "127.0.0.1:0", "")).await;
    let api = &router.api;
    let mut mine = HashSet::new();
    for i in 0..8 {
        let name = format!("client-view/{i}");
        let ttl = if i % 2 == 0 { 10_000 } else { 20_000 };
        let r = api.acquire(&name, ttl, "worker/7 ü").await;
        assert_eq!(r.body["acquired"], true, "{r:?}");
        mine.insert(name);
    }
    api.must_acquire("client-view/other", 10_000, "worker-8")
        .await;
    let r = api.get("/admin/v1/clients/worker%2F7%20%C3%BC").await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["clientId"], "worker/7 ü");
    let locks = r.body["locks"].as_array().unwrap();
    let names: HashSet<String> = locks
        .iter()
        .map(|l| l["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, mine);
    let sessions = r.body["sessions"].as_array().unwrap();
    let per_shard_ttl: HashSet<(String, u64)> = sessions
        .iter()
        .map(|s| {
            (
                s["shard"].as_str().unwrap().to_string(),
                s["ttlMs"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        per_shard_ttl.len(),
        sessions.len(),
        "one session per shard and TTL"
    );
    let total: u64 = sessions.iter().map(|s| s["locks"].as_u64().unwrap()).sum();
    assert_eq!(total, 8);
    for s in sessions {
        let left = s["expiresInMs"].as_u64().unwrap();
        assert!(left > 0 && left <= s["ttlMs"].as_u64().unwrap(), "{s}");
    }
    let nobody = api.get("/admin/v1/clients/nobody").await;
    assert_eq!(nobody.status, 200);
    assert_eq!(nobody.body["locks"], json!([]));
    assert_eq!(
        api.get("/admin/v1/clients/x?who=y").await.status,
        400,
        "unknown query parameter"
    );
}

/// `lockrouter ARGS --url URL` with no token or CA from the environment:
/// its exit code, its stdout as it came and its stderr.
fn lockrouter_at(url: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockrouter"));
    cmd.args(args)
        .args(["--url", url])
        .env_remove("LOCKROUTER_URL")
        .env_remove("LOCKROUTER_TOKEN")
        .env_remove("LOCKROUTER_CA_FILE");
    let out = tokio::task::block_in_place(|| cmd.output().unwrap());
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// `lockrouter ARGS --url <router>`: its exit code, its stdout as JSON
/// (`Null` if it is not) and its stderr.
fn lockrouter(router: &TestRouter, args: &[&str]) -> (Option<i32>, Value, String) {
    let (code, stdout, stderr) = lockrouter_at(&router.api.base, args);
    let json = serde_json::from_str(&stdout).unwrap_or_default();
    (code, json, stderr)
}

/// `status` against an address where nothing listens exits 69
/// (EX_UNAVAILABLE), prints nothing on stdout, and says on stderr which
/// address it could not reach.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_of_a_router_that_cannot_be_reached_exits_69() {
    let url = format!("http://127.0.0.1:{}", free_port());
    for format in ["json", "table"] {
        let (code, stdout, stderr) = lockrouter_at(&url, &["status", "-o", format]);
        assert_eq!(code, Some(69), "-o {format}: {stdout} {stderr}");
        assert!(stdout.is_empty(), "-o {format}: {stdout}");
        assert!(
            stderr.contains("cannot reach") && stderr.contains(&url),
            "-o {format}: the message names the address: {stderr}"
        );
    }
}

/// `status`'s exit code is `/readyz`'s: 0 while the router is ready; 69
/// once its only shard's etcd is gone (`/readyz` 503), the status still
/// shown with the shard unreachable, as JSON and as a table; 0 again once
/// etcd is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_of_a_router_that_is_not_ready_exits_69_and_still_shows_it() {
    let mut etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let status = |format: &str| lockrouter_at(&router.api.base, &["status", "-o", format]);

    let (code, stdout, stderr) = status("json");
    assert_eq!(code, Some(0), "ready: {stdout} {stderr}");
    let shown: Value = serde_json::from_str(&stdout).unwrap_or_default();
    assert_eq!(shown["readyz"]["ready"], true, "{shown}");
    assert_eq!(
        shown["readyz"]["shards"],
        json!([{"name": "a", "state": "up"}])
    );

    etcd.kill();
    await_readyz(&router, 503, "its only shard killed").await;
    let (code, stdout, stderr) = status("json");
    assert_eq!(code, Some(69), "not ready: {stdout} {stderr}");
    let shown: Value = serde_json::from_str(&stdout).unwrap_or_default();
    assert_eq!(shown["readyz"]["ready"], false, "{stdout} {stderr}");
    assert_eq!(
        shown["readyz"]["shards"],
        json!([{"name": "a", "state": "unreachable"}]),
        "{shown}"
    );
    assert_eq!(
        shown["readyz"]["unreachableShards"],
        json!(["a"]),
        "{shown}"
    );
    let (code, table, stderr) = status("table");
    assert_eq!(code, Some(69), "not ready: {table} {stderr}");
    assert!(table.contains("READY       no\n"), "{table}");
    let row = table
        .lines()
        .find(|l| l.starts_with("a "))
        .unwrap_or_else(|| panic!("no row for shard a: {table}"));
    assert_eq!(
        row.split_whitespace().take(2).collect::<Vec<_>>(),
        ["a", "unreachable"],
        "{table}"
    );

    etcd.restart();
    await_readyz(&router, 200, "its shard back").await;
    let (code, stdout, stderr) = status("table");
    assert_eq!(code, Some(0), "ready again: {stdout} {stderr}");
    assert!(stdout.contains("READY       yes\n"), "{stdout}");
}

/// Polls `/readyz` until it answers `status`, or panics after 30 s.
async fn await_readyz(router: &TestRouter, status: u16, after: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = router.api.get("/readyz").await;
        if r.status == status {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz never answered {status} with {after}: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A force-release of a name nobody holds releases nothing and says so
/// with its exit code (a typo in a runbook must not look like success);
/// `--help` lists the exit codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_releasing_a_free_name_exits_non_zero() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let (code, answer, stderr) = lockrouter(
        &router,
        &["force-release", "nightly:reprot", "--reason", "stuck"],
    );
    assert_eq!(answer["released"], false, "{answer} {stderr}");
    assert_eq!(code, Some(66), "nothing held the name: {stderr}");
    assert!(stderr.contains("nothing held"), "{stderr}");
    let held = router.api.must_acquire("nightly:report", 10_000, "w").await;
    let (code, answer, _) = lockrouter(
        &router,
        &["force-release", "nightly:report", "--reason", "stuck"],
    );
    assert_eq!((code, &answer["fencingToken"]), (Some(0), &json!(held.1)));
    let out = tokio::task::block_in_place(|| {
        Command::new(env!("CARGO_BIN_EXE_lockrouter"))
            .args(["force-release", "--help"])
            .output()
            .unwrap()
    });
    let help = String::from_utf8_lossy(&out.stdout);
    for code in ["0 ", "65 ", "66 ", "64 ", "69 ", "77 "] {
        assert!(help.contains(code), "--help names exit code {code}: {help}");
    }
    assert!(help.contains("--if-token"), "{help}");
}

/// With a fencing token (`--if-token`, `fencingToken`), force-release
/// takes the name only from that grant: a holder that took the name
/// between the operator's inspect and the force-release keeps it (409
/// `failed_precondition`, exit 65), the grant named is released, and a
/// token no router issues is a bad request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_release_with_a_token_releases_only_that_grant() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let path = "/admin/v1/locks/ops%3Astuck/force-release";
    // The operator inspects: worker-1 holds it under `seen`.
    let first = api.must_acquire("ops:stuck", 10_000, "worker-1").await;
    let seen = api.inspect("ops:stuck").await.body["fencingToken"]
        .as_u64()
        .unwrap();
    assert_eq!(seen, first.1);
    // A token that is not the holder's releases nothing.
    let r = api
        .post(path, json!({"reason": "stuck", "fencingToken": seen + 1}))
        .await;
    assert_eq!(r.status, 409, "{r:?}");
    assert_eq!(r.body["error"]["code"], "failed_precondition", "{r:?}");
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&seen.to_string()),
        "the message names the holder's token: {r:?}"
    );
    assert_eq!(api.renew(&first).await.status, 200, "still held");
    // Meanwhile worker-1 lets go and worker-2, healthy, takes the name.
    assert_eq!(api.release(&first).await.status, 204);
    let second = api.must_acquire("ops:stuck", 10_000, "worker-2").await;
    let (code, answer, stderr) = lockrouter(
        &router,
        &[
            "force-release",
            "ops:stuck",
            "--reason",
            "worker-1 hung",
            "--if-token",
            &seen.to_string(),
        ],
    );
    assert_eq!(code, Some(65), "{answer} {stderr}");
    assert_eq!(answer["error"]["code"], "failed_precondition", "{answer}");
    assert_eq!(api.renew(&second).await.status, 200, "worker-2 keeps it");
    let now = api.inspect("ops:stuck").await.body;
    assert_eq!(now["fencingToken"], second.1, "{now}");
    // The grant named is released.
    let (code, answer, stderr) = lockrouter(
        &router,
        &[
            "force-release",
            "ops:stuck",
            "--reason",
            "worker-2 hung",
            "--if-token",
            &second.1.to_string(),
        ],
    );
    assert_eq!(code, Some(0), "{answer} {stderr}");
    assert_eq!(
        (&answer["released"], &answer["fencingToken"]),
        (&json!(true), &json!(second.1))
    );
    assert_eq!(api.renew(&second).await.status, 409);
    // Nothing holds it now: nothing released, whatever the token.
    let r = api
        .post(path, json!({"reason": "again", "fencingToken": second.1}))
        .await;
    assert_eq!((r.status, &r.body["released"]), (200, &json!(false)));
    // Tokens no router issues: 400, and the holder keeps its lock.
    let third = api.must_acquire("ops:stuck", 10_000, "worker-3").await;
    for bad in [
        json!(0),
        json!(-1),
        json!("7"),
        json!(1.5),
        json!(9_223_372_036_854_775_808u64),
        json!(u64::MAX),
    ] {
        let r = api
            .post(path, json!({"reason": "bad", "fencingToken": bad}))
            .await;
        assert_eq!(r.status, 400, "{bad}: {r:?}");
        assert_eq!(r.body["error"]["code"], "invalid_argument", "{r:?}");
    }
    assert_eq!(api.renew(&third).await.status, 200);
    assert!(
        api.inspect("ops:stuck").await.body["fencingToken"] == third.1,
        "worker-3 still holds it"
    );
}
