//! Waiting acquire on real etcd: FIFO across replicas, no barging, clean
//! queues after timeouts, disconnects and dead sessions, handover on a
//! holder's death, and the waiter cap.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use lockrouter_testkit::api::{Api, Reply};
use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::sleep_ms;

fn waiting(api: &Api, name: &str, client: &str, wait_ms: u64) -> tokio::task::JoinHandle<Reply> {
    let (api, name, client) = (api.clone(), name.to_string(), client.to_string());
    tokio::spawn(async move {
        let body = json!({"name": name, "ttlMs": 10_000, "clientId": client, "waitMs": wait_ms});
        api.post("/api/v1/locks/acquire", body).await
    })
}

/// Keys queued for any name on `etcd`.
async fn queued(etcd: &EtcdCluster) -> i64 {
    let mut c = etcd.client().await;
    let opts = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    c.get("/lockrouter/waiters/", Some(opts))
        .await
        .unwrap()
        .count()
}

async fn wait_queued(etcd: &EtcdCluster, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while queued(etcd).await != n {
        assert!(
            Instant::now() < deadline,
            "queue never reached {n}: {}",
            queued(etcd).await
        );
        sleep_ms(20).await;
    }
}

/// The queue is empty within 2 s. A wait's entry is revoked just after its
/// answer is sent, so a test may look before the revoke lands; the entry's
/// own lease (5 s) would clear it later anyway, so the bound proves the
/// revoke.
async fn queue_empties(etcd: &EtcdCluster) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while queued(etcd).await != 0 {
        assert!(
            Instant::now() < deadline,
            "{} queue entries outlived their waits",
            queued(etcd).await
        );
        sleep_ms(20).await;
    }
}

/// The lease of the one entry queued for any name on `etcd` (its key ends
/// in `<lease, hex>`).
async fn entry_lease(etcd: &EtcdCluster) -> i64 {
    let mut c = etcd.client().await;
    let opts = etcd_client::GetOptions::new().with_prefix();
    let resp = c.get("/lockrouter/waiters/", Some(opts)).await.unwrap();
    assert_eq!(resp.kvs().len(), 1, "one entry queued");
    let key = resp.kvs()[0].key_str().unwrap();
    let last = key.rsplit('/').next().unwrap();
    u64::from_str_radix(last, 16).unwrap() as i64
}

/// `lease` is gone from etcd within 2 s: revoked, not left to lapse (an
/// entry's lease lives 5 s past its last renewal).
async fn lease_revoked(etcd: &EtcdCluster, lease: i64) {
    let mut c = etcd.client().await;
    let deadline = Instant::now() + Duration::from_secs(2);
    while c.lease_time_to_live(lease, None).await.unwrap().ttl() > 0 {
        assert!(Instant::now() < deadline, "lease {lease:x} was kept");
        sleep_ms(20).await;
    }
}

fn lock_of(r: &Reply) -> (String, u64) {
    assert_eq!(r.body["acquired"], true, "{r:?}");
    lockrouter_testkit::api::lock_of(&r.body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_granted_in_arrival_order_across_replicas() {
    let etcd = EtcdCluster::single();
    let (r1, r2) = (
        TestRouter::start(&[&etcd]).await,
        TestRouter::start(&[&etcd]).await,
    );
    let mut held = r1.api.must_acquire("fifo", 10_000, "holder").await;
    let mut waiters = Vec::new();
    for i in 0..10 {
        let api = if i % 2 == 0 { &r1.api } else { &r2.api };
        waiters.push(waiting(api, "fifo", &format!("w{i}"), 30_000));
        wait_queued(&etcd, i + 1).await; // a known arrival order
    }
    // No barging while they wait.
    let barger = r2.api.acquire("fifo", 10_000, "barger").await;
    assert_eq!(barger.body["acquired"], false, "{barger:?}");
    for (i, w) in waiters.into_iter().enumerate() {
        let api = if i % 2 == 0 { &r2.api } else { &r1.api };
        assert_eq!(api.release(&held).await.status, 204);
        let started = Instant::now();
        let got = w.await.unwrap();
        let lock = lock_of(&got);
        assert!(lock.1 > held.1, "token {} after {}", lock.1, held.1);
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(
            r1.api.inspect("fifo").await.body["fencingToken"].as_u64(),
            Some(lock.1),
            "waiter {i}"
        );
        held = lock;
    }
    queue_empties(&etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_that_give_up_leave_no_trace() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let held = api.must_acquire("gone", 10_000, "holder").await;
    // One times out (waitMs), one disconnects (its HTTP client gives up).
    let timing_out = waiting(api, "gone", "short", 300);
    wait_queued(&etcd, 1).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let dropped = impatient
        .post(format!("{}/api/v1/locks/acquire", api.base))
        .json(&json!({"name": "gone", "ttlMs": 10_000, "clientId": "dropper", "waitMs": 30_000}))
        .send();
    let last = waiting(api, "gone", "last", 30_000);
    let (short, dropped) = (timing_out.await.unwrap(), dropped.await);
    assert_eq!(short.body["acquired"], false, "{short:?}");
    assert!(short.body["expiresAt"].is_string());
    assert!(
        dropped.is_err(),
        "the impatient client should have given up"
    );
    wait_queued(&etcd, 1).await; // only "last" is left
    assert_eq!(api.release(&held).await.status, 204);
    let got = last.await.unwrap();
    lock_of(&got);
    assert_eq!(
        api.inspect("gone").await.body["fencingToken"],
        got.body["fencingToken"]
    );
    queue_empties(&etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holder_hands_over_to_the_first_waiter_after_its_lock_delay() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let held = api.must_acquire("dies", 2_000, "holder").await;
    let started = Instant::now();
    let first = waiting(api, "dies", "first", 20_000);
    wait_queued(&etcd, 1).await;
    let second = waiting(api, "dies", "second", 20_000);
    wait_queued(&etcd, 2).await;
    let got = first.await.unwrap();
    let lock = lock_of(&got);
    assert!(lock.1 > held.1);
    // The holder was lost, not released: its name waits out the lock-delay
    // (one TTL after its key went) before the first waiter gets it.
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(4_000) && took < Duration::from_secs(12),
        "handover after {took:?}"
    );
    assert!(!second.is_finished());
    second.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_session_died_is_never_granted() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let held = api.must_acquire("sess", 10_000, "holder").await;
    let doomed = waiting(api, "sess", "doomed", 30_000);
    wait_queued(&etcd, 1).await;
    let next = waiting(api, "sess", "next", 30_000);
    wait_queued(&etcd, 2).await;
    // The doomed waiter's session lease dies (as if its client vanished).
    let mut c = etcd.client().await;
    let opts = etcd_client::GetOptions::new().with_prefix();
    let entries = c.get("/lockrouter/waiters/", Some(opts)).await.unwrap();
    let doomed_lease = entries
        .kvs()
        .iter()
        .find(|kv| kv.value() == b"doomed")
        .map(|kv| kv.lease())
        .unwrap();
    c.lease_revoke(doomed_lease).await.unwrap();
    let revoked = Instant::now();
    let answer = doomed.await.unwrap();
    // It watches its own entry: it learns at once, not at its next keepalive.
    assert!(
        revoked.elapsed() < Duration::from_secs(3),
        "{:?}",
        revoked.elapsed()
    );
    assert_eq!(answer.body["acquired"], false, "{answer:?}");
    assert_eq!(api.release(&held).await.status, 204);
    let got = next.await.unwrap();
    lock_of(&got);
    let holder: Value = api.inspect("sess").await.body;
    assert_eq!(holder["fencingToken"], got.body["fencingToken"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_beyond_the_cap_get_429() {
    let etcd = EtcdCluster::single();
    let toml = config_toml(&[&etcd], "127.0.0.1:0", "\n[limits]\nmax_waiters = 2\n");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    api.must_acquire("cap", 10_000, "holder").await;
    let a = waiting(api, "cap", "a", 5_000);
    let b = waiting(api, "cap", "b", 5_000);
    wait_queued(&etcd, 2).await;
    let body = json!({"name": "cap", "ttlMs": 10_000, "clientId": "c", "waitMs": 5_000});
    let r = api.post("/api/v1/locks/acquire", body).await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (429, Some("rate_limited")),
        "{r:?}"
    );
    assert!(r.retry_after.is_some());
    a.abort();
    b.abort();
}

/// A waiting acquire with its own TTL.
fn waiting_ttl(
    api: &Api,
    name: &str,
    client: &str,
    ttl_ms: u64,
    wait_ms: u64,
) -> tokio::task::JoinHandle<Reply> {
    let (api, name, client) = (api.clone(), name.to_string(), client.to_string());
    tokio::spawn(async move {
        let body = json!({"name": name, "ttlMs": ttl_ms, "clientId": client, "waitMs": wait_ms});
        api.post("/api/v1/locks/acquire", body).await
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_keeps_its_session_alive_through_a_churn_of_waiters_ahead() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    api.must_acquire("busy", 30_000, "holder").await;
    // W holds another lock on the session it waits with (same clientId and
    // TTL) and never renews it: only the wait keeps that session alive.
    api.must_acquire("w-other", 2_000, "W").await;
    // Waiters ahead of W leave one by one, the nearest first, every 250 ms
    // for about four seconds: each departure wakes W.
    let n = 16;
    let mut churn = Vec::new();
    for j in 0..n {
        churn.push(waiting(
            api,
            "busy",
            &format!("churn-{j}"),
            400 + (n - j) * 250,
        ));
        wait_queued(&etcd, j as i64 + 1).await;
    }
    let w = waiting_ttl(api, "busy", "W", 2_000, 8_000);
    wait_queued(&etcd, n as i64 + 1).await;
    sleep_ms(5_000).await;
    let other = api.inspect("w-other").await;
    assert_eq!(
        other.body["held"], true,
        "W's session lapsed while it waited: {other:?}"
    );
    let answer = w.await.unwrap();
    assert_eq!(answer.body["acquired"], false, "{answer:?}");
    for c in churn {
        assert_eq!(c.await.unwrap().body["acquired"], false);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_entry_never_outlives_its_router() {
    let etcd = EtcdCluster::single();
    let doomed = lockrouter_testkit::router_process::RouterProcess::start(
        &[&etcd],
        lockrouter_testkit::loopback::free_port(),
    )
    .await;
    let other = TestRouter::start(&[&etcd]).await;
    let held = other.api.must_acquire("contended", 30_000, "holder").await;
    // C's lock and C's wait ride on the same session of the doomed router.
    let kept = doomed.api.must_acquire("c-other", 10_000, "C").await;
    let body = json!({"name": "contended", "ttlMs": 10_000, "clientId": "C", "waitMs": 30_000});
    // The request dies with its router: its error is the point, not a failure.
    let send = doomed
        .api
        .http
        .post(format!("{}/api/v1/locks/acquire", doomed.api.base))
        .json(&body)
        .send();
    let wait = tokio::spawn(send);
    wait_queued(&etcd, 1).await;
    drop(doomed); // SIGKILL: the wait's cleanup never runs
    let _ = wait.await;
    assert_eq!(other.api.release(&held).await.status, 204);
    // C lives on, renewing its other lock through the other replica, so its
    // session stays alive; the dead wait's entry must not.
    let started = Instant::now();
    loop {
        assert_eq!(other.api.renew(&kept).await.status, 200);
        let r = other.api.acquire("contended", 10_000, "D").await;
        if r.body["acquired"] == true {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(12),
            "a dead router's queue entry still blocks the name: {r:?}"
        );
        sleep_ms(500).await;
    }
    queue_empties(&etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_own_client_gets_the_name_answers_at_once() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let held = api.must_acquire("mine", 10_000, "holder").await;
    let first = waiting(api, "mine", "C", 20_000);
    wait_queued(&etcd, 1).await;
    let second = waiting(api, "mine", "C", 20_000);
    wait_queued(&etcd, 2).await;
    let released = Instant::now();
    assert_eq!(api.release(&held).await.status, 204);
    let (a, b) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(lock_of(&a), lock_of(&b), "one grant, answered to both");
    assert!(
        released.elapsed() < Duration::from_secs(5),
        "the second wait waited on its own client: {:?}",
        released.elapsed()
    );
    queue_empties(&etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_lease_is_used_again_only_after_its_grant_emptied_it() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    // A granted wait's txn deleted its entry: the next entry rides on its lease.
    let held = api.must_acquire("n", 10_000, "holder").await;
    let first = waiting(api, "n", "w1", 30_000);
    wait_queued(&etcd, 1).await;
    let emptied = entry_lease(&etcd).await;
    assert_eq!(api.release(&held).await.status, 204);
    let held = lock_of(&first.await.unwrap());
    let timing_out = waiting(api, "n", "w2", 300);
    wait_queued(&etcd, 1).await;
    // The same key comes back, as a new entry (its lease names it).
    assert_eq!(entry_lease(&etcd).await, emptied, "not used again");
    // A wait that ends otherwise (its time ran out) has its lease revoked.
    assert_eq!(timing_out.await.unwrap().body["acquired"], false);
    queue_empties(&etcd).await;
    lease_revoked(&etcd, emptied).await;
    let third = waiting(api, "n", "w3", 30_000);
    wait_queued(&etcd, 1).await;
    let fresh = entry_lease(&etcd).await;
    assert_ne!(fresh, emptied, "a revoked lease handed out");
    assert_eq!(api.release(&held).await.status, 204);
    let held = lock_of(&third.await.unwrap());
    // A kept lease that ends early (etcd's lease bugs, an operator's
    // revoke) is not trusted: the next waiter queues on a new one.
    let mut c = etcd.client().await;
    c.lease_revoke(fresh).await.unwrap();
    let fourth = waiting(api, "n", "w4", 30_000);
    wait_queued(&etcd, 1).await;
    assert_ne!(entry_lease(&etcd).await, fresh);
    assert_eq!(api.release(&held).await.status, 204);
    let last = lock_of(&fourth.await.unwrap());
    assert!(last.1 > held.1);
    queue_empties(&etcd).await;
}
