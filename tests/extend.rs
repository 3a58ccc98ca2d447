//! Extend (docs/design.md, "Extend"): a held lock moved onto its client's
//! session lease of another TTL keeps its fencing token and gets a new
//! lockId; the old lockId renews and releases nothing; an expired or
//! re-granted name is refused; two extends of one lock move it once.

use std::time::Duration;

use serde_json::json;

use lockrouter_testkit::api::{Api, Reply};
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::sleep_ms;

const EXTEND: &str = "/api/v1/locks/extend";

async fn extend(api: &Api, lock: &(String, u64), ttl_ms: u64) -> Reply {
    let body = json!({"lockId": lock.0, "fencingToken": lock.1, "ttlMs": ttl_ms});
    api.post(EXTEND, body).await
}

/// The new lock of a 200 answer, checked to keep the token.
fn moved(r: &Reply, token: u64) -> (String, u64) {
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["renewed"], true, "{r:?}");
    assert_eq!(r.body["fencingToken"], token, "the token is kept: {r:?}");
    let lock_id = r.body["lockId"].as_str().expect("a new lockId").to_string();
    (lock_id, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extended_lock_keeps_its_token_outlives_its_old_ttl_and_moves_to_its_new_lock_id() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let old = api.must_acquire("extend/me", 2_000, "A").await;
    let r = extend(api, &old, 6_000).await;
    let new = moved(&r, old.1);
    assert_ne!(new.0, old.0, "the lockId names the new lease");
    let left = r.body["expiresInMs"].as_u64().unwrap();
    assert!(
        (4_000..=6_000).contains(&left),
        "the new lease's time: {r:?}"
    );

    // The old lockId no longer holds it: renew says so, release deletes
    // nothing.
    let r = api.renew(&old).await;
    assert_eq!(
        (r.status, r.body["reason"].as_str()),
        (409, Some("stolen")),
        "{r:?}"
    );
    assert_eq!(api.release(&old).await.status, 204);
    let held = api.inspect("extend/me").await;
    assert_eq!(held.body["held"], true, "{held:?}");
    assert_eq!(held.body["fencingToken"], old.1);

    // Past the old TTL (2 s) with no renewal at all, it is still held.
    sleep_ms(3_000).await;
    let held = api.inspect("extend/me").await;
    assert_eq!(held.body["held"], true, "outlived its old TTL: {held:?}");
    let r = api.renew(&new).await;
    assert_eq!(r.status, 200, "the new lockId renews: {r:?}");
    let taken = api.acquire("extend/me", 2_000, "B").await;
    assert_eq!(taken.body["acquired"], false, "{taken:?}");

    // The same TTL again is a renewal under the same lockId.
    let again = moved(&extend(api, &new, 6_000).await, new.1);
    assert_eq!(again.0, new.0);

    assert_eq!(api.release(&new).await.status, 204);
    let next = api.must_acquire("extend/me", 2_000, "B").await;
    assert!(next.1 > old.1, "tokens stay monotonic");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_holder_after_an_extend_waits_out_the_new_ttl() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let old = api.must_acquire("extend/lost", 2_000, "A").await;
    let new = moved(&extend(api, &old, 4_000).await, old.1);
    // Never renewed: the key goes with the new lease, about 4 s on.
    let mut gone = false;
    for _ in 0..80 {
        sleep_ms(100).await;
        if api.inspect("extend/lost").await.body["held"] == false {
            gone = true;
            break;
        }
    }
    assert_eq!(api.renew(&new).await.status, 409);
    assert!(gone, "the lock expired with its new lease");
    // The lost holder was told up to 4 s of validity: the name waits out a
    // lock-delay of the new TTL (a lease of 5 s), not of the old (3 s).
    let seen_gone = std::time::Instant::now();
    let mut granted = None;
    while seen_gone.elapsed() < Duration::from_secs(10) {
        let r = api.acquire("extend/lost", 2_000, "B").await;
        if r.body["acquired"] == true {
            granted = Some(seen_gone.elapsed());
            break;
        }
        sleep_ms(200).await;
    }
    let after = granted.expect("the name is granted once its lock-delay ends");
    assert!(
        after > Duration::from_millis(4_200),
        "granted {after:?} after the loss: the old TTL's delay, not the new one's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extends_of_an_expired_or_regranted_name_are_refused_and_touch_nothing() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    // Released, then granted to B: A's lockId is stale.
    let a = api.must_acquire("extend/stale", 5_000, "A").await;
    assert_eq!(api.release(&a).await.status, 204);
    let r = extend(api, &a, 10_000).await;
    assert_eq!(
        (r.status, r.body["reason"].as_str()),
        (409, Some("expired")),
        "{r:?}"
    );
    let b = api.must_acquire("extend/stale", 5_000, "B").await;
    let r = extend(api, &a, 10_000).await;
    assert_eq!(
        (r.status, r.body["reason"].as_str()),
        (409, Some("stolen")),
        "{r:?}"
    );
    let held = api.inspect("extend/stale").await;
    assert_eq!(
        held.body["fencingToken"], b.1,
        "B's grant untouched: {held:?}"
    );
    assert_eq!(api.renew(&b).await.status, 200, "B still renews");
    // Bad input: a TTL out of range, a token not the lockId's.
    let r = extend(api, &b, 1_000).await;
    assert_eq!(r.status, 400, "{r:?}");
    let r = extend(api, &(b.0.clone(), b.1 + 1), 10_000).await;
    assert_eq!(r.status, 400, "{r:?}");
    let r = api
        .post(EXTEND, json!({"lockId": b.0, "fencingToken": b.1}))
        .await;
    assert_eq!(r.status, 400, "ttlMs is required: {r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_extends_of_one_lock_move_it_once_and_the_token_never_changes() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    for round in 0..5 {
        let name = format!("extend/race-{round}");
        let lock = api.must_acquire(&name, 2_000, "A").await;
        let (x, y) = tokio::join!(extend(api, &lock, 7_000), extend(api, &lock, 9_000));
        let won: Vec<&Reply> = [&x, &y].into_iter().filter(|r| r.status == 200).collect();
        for r in [&x, &y] {
            assert!(
                r.status == 200 || (r.status == 409 && r.body["reason"] == "stolen"),
                "{r:?}"
            );
        }
        assert!(!won.is_empty(), "one of them moves it: {x:?} {y:?}");
        // Whichever moved it last holds it: its lockId renews, with the
        // same token; the other lockIds renew nothing.
        let locks: Vec<(String, u64)> = won.iter().map(|r| moved(r, lock.1)).collect();
        let renewed: Vec<bool> = futures_renew(api, &locks).await;
        assert_eq!(
            renewed.iter().filter(|r| **r).count(),
            1,
            "exactly one lockId holds it: {x:?} {y:?}"
        );
        let held = api.inspect(&name).await;
        assert_eq!(held.body["fencingToken"], lock.1, "{held:?}");
        assert_eq!(api.renew(&lock).await.status, 409);
    }
}

async fn futures_renew(api: &Api, locks: &[(String, u64)]) -> Vec<bool> {
    let mut out = Vec::new();
    for lock in locks {
        out.push(api.renew(lock).await.status == 200);
    }
    out
}

/// An extend through a router while the lock's shard is cut off answers
/// 503 and leaves the lock where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extend_that_cannot_reach_the_shard_leaves_the_lock_as_it_was() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let lock = api.must_acquire("extend/down", 10_000, "A").await;
    etcd.pause_member(0);
    let r = tokio::time::timeout(Duration::from_secs(10), extend(api, &lock, 20_000))
        .await
        .expect("answered within its deadline");
    assert!(matches!(r.status, 503 | 504), "{r:?}");
    etcd.resume_member(0);
    let mut renewed = false;
    for _ in 0..50 {
        if api.renew(&lock).await.status == 200 {
            renewed = true;
            break;
        }
        sleep_ms(100).await;
    }
    assert!(renewed, "the old lockId still holds it");
}
