//! Lock semantics on real etcd: mutual exclusion, fencing, expiry, stale
//! lockIds, renewals, idempotent re-acquire.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use futures::future::join_all;
use serde_json::json;

use lockrouter_testkit::api::{lock_of, Api};
use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::metrics;
use lockrouter_testkit::proxy::SilentProxy;
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::sleep_ms;

/// A router on `etcd` whose monitor counts locks (and samples the
/// lock-key cache, and sweeps lost holders) every `every_ms`.
async fn counting_router(etcd: &EtcdCluster, every_ms: u64) -> TestRouter {
    let extra = format!("count_interval_ms = {every_ms}\n");
    let toml = lockrouter_testkit::config::config_toml(&[etcd], "127.0.0.1:0", &extra);
    TestRouter::with_toml(&toml).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_of_many_concurrent_acquirers_wins() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let mut tokens = BTreeSet::new();
    for round in 0..5 {
        let name = format!("race-{round}");
        let attempts = (0..40).map(|c| {
            let api = router.api.clone();
            let name = name.clone();
            async move { api.acquire(&name, 10_000, &format!("client-{c}")).await }
        });
        let replies = join_all(attempts).await;
        let winners: Vec<_> = replies
            .iter()
            .filter(|r| r.body["acquired"] == true)
            .collect();
        assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
        assert_eq!(winners.len(), 1, "round {round}: {winners:?}");
        assert!(tokens.insert(winners[0].body["fencingToken"].as_u64().unwrap()));
        for loser in replies.iter().filter(|r| r.body["acquired"] == false) {
            assert!(loser.body["expiresAt"].is_string(), "{loser:?}");
            assert!(loser.body.get("lockId").is_none());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_strictly_increase_across_clients() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let mut last = 0;
    for i in 0..20 {
        let client = format!("client-{}", i % 3);
        let lock = router.api.must_acquire("order:42", 5_000, &client).await;
        assert!(lock.1 > last, "token {} after {last}", lock.1);
        assert!(lock.1 < i64::MAX as u64);
        last = lock.1;
        // Other names in between move the revision; tokens still only grow.
        router
            .api
            .must_acquire(&format!("other-{i}"), 5_000, &client)
            .await;
        assert_eq!(router.api.release(&lock).await.status, 204);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewed_lock_is_kept_and_unrenewed_lock_frees_after_ttl() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let a = api.must_acquire("job", 2_000, "A").await;
    // A renews every 500 ms for 4 s (two TTLs): B never gets the name.
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let r = api.renew(&a).await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.body["renewed"], true);
        let b = api.acquire("job", 2_000, "B").await;
        assert_eq!(b.body["acquired"], false, "{b:?}");
        sleep_ms(500).await;
    }
    // A stops renewing: within TTL plus etcd's expiry scan, B gets it.
    let stopped = Instant::now();
    let b = loop {
        let r = api.acquire("job", 2_000, "B").await;
        if r.body["acquired"] == true {
            break (
                r.body["lockId"].as_str().unwrap().to_string(),
                r.body["fencingToken"].as_u64().unwrap(),
            );
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(10),
            "lock never freed"
        );
        sleep_ms(100).await;
    };
    assert!(
        stopped.elapsed() >= Duration::from_millis(1_500),
        "freed before its TTL"
    );
    assert!(b.1 > a.1);
    let r = api.renew(&a).await;
    assert_eq!(
        (r.status, r.body["reason"].as_str()),
        (409, Some("stolen")),
        "{r:?}"
    );
    assert_eq!(api.release(&b).await.status, 204);
    let r = api.renew(&a).await;
    assert_eq!(
        (r.status, r.body["reason"].as_str()),
        (409, Some("expired")),
        "{r:?}"
    );
    let r = api.renew(&b).await;
    assert_eq!(
        (r.status, r.body["reason"].as_str()),
        (409, Some("expired")),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_lock_id_never_touches_the_new_holder() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let old = api.must_acquire("res", 2_000, "A").await;
    assert_eq!(api.release(&old).await.status, 204);
    let new = api.must_acquire("res", 2_000, "B").await;
    assert!(new.1 > old.1);
    // The same client acquiring again on the same session lease is a new grant too.
    let a_again = api.acquire("res-2", 2_000, "A").await;
    assert_eq!(a_again.body["acquired"], true);

    assert_eq!(api.release(&old).await.status, 204);
    let r = api.renew(&old).await;
    assert_eq!(r.body["reason"], "stolen", "{r:?}");
    let seen = api.inspect("res").await;
    assert_eq!(seen.body["held"], true);
    assert_eq!(seen.body["fencingToken"].as_u64(), Some(new.1));
    assert_eq!(api.renew(&new).await.status, 200);

    // Same client, same lease, new grant: the old lockId still cannot act.
    assert_eq!(api.release(&new).await.status, 204);
    let b2 = api.must_acquire("res", 2_000, "B").await;
    assert_eq!(api.release(&new).await.status, 204);
    assert_eq!(api.renew(&new).await.body["reason"], "stolen");
    assert_eq!(
        api.inspect("res").await.body["fencingToken"].as_u64(),
        Some(b2.1)
    );
}

/// A lockId re-encoded with a neighbour's lease id (etcd hands out
/// consecutive ids, and unsealed lockIds are only checksummed) renews
/// nothing: every renew and renew-batch of it is refused, and the
/// neighbour, who stopped renewing, loses its lock within its TTL as if the
/// forger were not there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_lock_id_never_keeps_another_holders_lease_alive() {
    use lockrouter::token::lock_id::LockId;
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let acquired = Instant::now();
    let victim = api.must_acquire("victim", 2_000, "V").await;
    let own = api.must_acquire("forger", 2_000, "F").await;
    let mut forged = LockId::decode(&own.0).unwrap();
    forged.lease = LockId::decode(&victim.0).unwrap().lease;
    let forged = (forged.encode(), forged.token().unwrap());
    let entry = json!({"lockId": forged.0, "fencingToken": forged.1});
    let mut batch = vec![entry.clone(); 50];
    batch.push(json!({"lockId": own.0, "fencingToken": own.1}));
    let freed = loop {
        assert!(
            acquired.elapsed() < Duration::from_secs(8),
            "the victim's 2 s lock outlived its TTL by far: the forger kept its lease alive"
        );
        let r = api.renew(&forged).await;
        assert_eq!(
            (r.status, &r.body["reason"]),
            (409, &json!("stolen")),
            "{r:?}"
        );
        let r = api
            .post("/api/v1/locks/renew-batch", json!({ "locks": batch }))
            .await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.body["results"][0]["renewed"], false, "{r:?}");
        assert_eq!(r.body["results"][50]["renewed"], true, "{r:?}");
        if api.inspect("victim").await.body["held"] == false {
            break acquired.elapsed();
        }
        sleep_ms(200).await;
    };
    // TTL 2 s, plus etcd's expiry scan (every 500 ms) and a slow machine.
    assert!(freed < Duration::from_secs(5), "freed after {freed:?}");
    assert_eq!(api.renew(&victim).await.status, 409);
}

/// Keepalives that come together go to etcd together: 200 clients' session
/// leases renewed at once leave the main stream in bursts of many (one
/// HTTP/2 frame each), not one by one; with `etcd.keepalive_burst_ms = 0`
/// each goes alone. Every renewal is answered either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalives_that_come_together_leave_in_bursts() {
    use lockrouter_testkit::metrics::sum;
    let etcd = EtcdCluster::single();
    for (burst_ms, bursting) in [(20u64, true), (0, false)] {
        let extra = format!(
            "keepalive_burst_ms = {burst_ms}\nkeepalive_coalesce_ms = 0\nkeepalive_below_pct = 100\n"
        );
        // A shard name of its own (one etcd, so one name for both routers):
        // the metrics recorder is shared by every test in this process, and
        // only this test's bursts count.
        let shard = "bursts";
        let toml = lockrouter_testkit::config::one_named_shard(&etcd, shard, &extra);
        let router = TestRouter::with_toml(&toml).await;
        let api = &router.api;
        let locks = api
            .must_acquire_each(&format!("burst-{burst_ms}"), 200, 10_000)
            .await;
        let before = api.metrics().await;
        let renewed = join_all(locks.iter().map(|l| api.renew(l))).await;
        assert!(renewed.iter().all(|r| r.status == 200), "{renewed:?}");
        let after = api.metrics().await;
        let on = [("shard", shard)];
        let delta = |name: &str| sum(&after, name, &on) - sum(&before, name, &on);
        let (sent, bursts) = (
            delta("lockrouter_keepalive_burst_size_sum"),
            delta("lockrouter_keepalive_burst_size_count"),
        );
        assert!(sent >= 200.0, "{sent} keepalives for 200 renewals");
        let mean = sent / bursts;
        if bursting {
            assert!(mean >= 4.0, "{sent} keepalives in {bursts} bursts");
        } else {
            assert_eq!(mean, 1.0, "{sent} keepalives in {bursts} bursts");
        }
    }
}

/// With `etcd.keepalive_streams = 4` a shard keeps four main keepalive
/// streams and every lease on one of them: 200 clients' session leases
/// renewed at once use all four, and every renewal is answered; a second
/// round (each lease on the stream it took before) as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalives_spread_over_several_streams() {
    use lockrouter_testkit::metrics::sum;
    let etcd = EtcdCluster::single();
    let extra = "keepalive_streams = 4\nkeepalive_coalesce_ms = 0\nkeepalive_below_pct = 100\n";
    let shard = "streams";
    let toml = lockrouter_testkit::config::one_named_shard(&etcd, shard, extra);
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let locks = api.must_acquire_each("stream", 200, 10_000).await;
    let before = api.metrics().await;
    for round in 0..2 {
        let renewed = join_all(locks.iter().map(|l| api.renew(l))).await;
        assert!(
            renewed.iter().all(|r| r.status == 200),
            "round {round}: {renewed:?}"
        );
    }
    let after = api.metrics().await;
    let mut total = 0.0;
    for stream in ["0", "1", "2", "3"] {
        let on = [("shard", shard), ("stream", stream)];
        let sent = sum(&after, "lockrouter_keepalive_burst_size_sum", &on)
            - sum(&before, "lockrouter_keepalive_burst_size_sum", &on);
        assert!(sent >= 10.0, "stream {stream} carried {sent} keepalives");
        total += sent;
    }
    assert!(total >= 400.0, "{total} keepalives for 400 renewals");
    let on = [("shard", shard), ("stream", "4")];
    assert_eq!(
        sum(&after, "lockrouter_keepalive_burst_size_count", &on),
        0.0
    );
}

/// A session lease is sent a keepalive only once less than half its TTL is
/// left (`etcd.keepalive_below_pct`, 50 by default): a renewal before that,
/// and an acquire, is one etcd request for the lock and nothing for the
/// lease, answered with the time the lease really has, never more. The
/// first renewal or acquire past half the TTL keeps the lease alive again,
/// also for a client that only acquires (its locks released at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_lease_is_kept_alive_only_when_half_its_ttl_is_gone() {
    use lockrouter_testkit::metrics::sum;
    let etcd = EtcdCluster::single();
    // A shard name of its own: the metrics recorder is shared by every test
    // in this process, and only this router's keepalives count.
    let toml = lockrouter_testkit::config::one_named_shard(&etcd, "half-ttl", "");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let sent = || async {
        sum(
            &api.metrics().await,
            "lockrouter_keepalives_sent_total",
            &[("shard", "half-ttl")],
        )
    };
    let expires = |r: &lockrouter_testkit::api::Reply| r.body["expiresInMs"].as_u64().unwrap();
    let first = api.acquire("half-1", 4_000, "A").await;
    assert_eq!(first.body["acquired"], true, "{first:?}");
    let lock = (
        first.body["lockId"].as_str().unwrap().to_string(),
        first.body["fencingToken"].as_u64().unwrap(),
    );
    let idle = api.acquire("idle-1", 4_000, "B").await;
    assert_eq!(idle.body["acquired"], true, "{idle:?}");
    api.release(&idle.granted()).await;
    // Past the coalescing window (a tenth of the TTL), well before half.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let before = sent().await;
    let renewed = api.renew(&lock).await;
    assert_eq!(renewed.status, 200, "{renewed:?}");
    assert!(
        expires(&renewed) <= expires(&first),
        "{first:?} {renewed:?}"
    );
    // A second lock on A's session: one txn, no keepalive, and no more
    // time than the session lease has.
    let second = api.acquire("half-2", 4_000, "A").await;
    assert_eq!(second.body["acquired"], true, "{second:?}");
    assert!(expires(&second) <= expires(&first), "{first:?} {second:?}");
    // B only acquires: the same.
    let idle_2 = api.acquire("idle-2", 4_000, "B").await;
    assert_eq!(idle_2.body["acquired"], true, "{idle_2:?}");
    assert!(expires(&idle_2) <= expires(&idle), "{idle:?} {idle_2:?}");
    api.release(&idle_2.granted()).await;
    assert_eq!(
        sent().await - before,
        0.0,
        "a keepalive with more than half the TTL left"
    );
    // Past half the TTL, a renewal sends one and reports a fresh lease.
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    let before = sent().await;
    let late = api.renew(&lock).await;
    assert_eq!(late.status, 200, "{late:?}");
    assert!(
        sent().await - before >= 1.0,
        "no keepalive with less than half the TTL left"
    );
    assert!(expires(&late) > 3_000, "{late:?}");
    // So does B's next acquire, on a session only its acquires keep alive.
    let before = sent().await;
    let idle_3 = api.acquire("idle-3", 4_000, "B").await;
    assert_eq!(idle_3.body["acquired"], true, "{idle_3:?}");
    assert!(
        sent().await - before >= 1.0,
        "no keepalive for an acquire with less than half the TTL left"
    );
    // Its answer comes with its txn: the fresh lease if the keepalive
    // beside it was answered first, else the time last confirmed (never
    // more than the lease has). That the keepalive took is shown below:
    // idle-3, never renewed, is still held past the first lease's end.
    assert!(expires(&idle_3) <= 4_000, "{idle_3:?}");
    // The leases live on: the locks outlive the first leases' TTL.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    assert_eq!(api.renew(&lock).await.status, 200);
    for name in ["half-2", "idle-3"] {
        let other = api.acquire(name, 4_000, "C").await;
        assert_eq!(other.body["acquired"], false, "{name}: {other:?}");
    }
}

/// A session that only acquires kept alive, and that ran out (by its last
/// confirmed keepalive) before the client's next acquire, is replaced by a
/// new one at once: asking etcd of the old lease would wait, if it expired,
/// until etcd revoked it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_on_a_session_that_ran_out_grants_a_new_one_without_asking_etcd() {
    use lockrouter_testkit::metrics::sum;
    let etcd = EtcdCluster::single();
    // A shard name of its own: the metrics recorder is shared by every test
    // in this process.
    let toml = lockrouter_testkit::config::one_named_shard(&etcd, "lapsed", "");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let count = |rpc: &'static str| async move {
        sum(
            &api.metrics().await,
            "lockrouter_etcd_requests_total",
            &[("shard", "lapsed"), ("rpc", rpc)],
        )
    };
    let first = api.must_acquire("lapse-1", 2_000, "L").await;
    assert_eq!(api.release(&first).await.status, 204);
    // Past the 2 s the session's grant gave it.
    tokio::time::sleep(Duration::from_millis(2_300)).await;
    let (grants, keepalives) = (count("LeaseGrant").await, count("LeaseKeepAlive").await);
    let second = api.acquire("lapse-2", 2_000, "L").await;
    assert_eq!(second.body["acquired"], true, "{second:?}");
    let left = second.body["expiresInMs"].as_u64().unwrap();
    assert!(left > 1_500, "a fresh session's lock: {second:?}");
    assert_eq!(count("LeaseGrant").await - grants, 1.0, "one new session");
    assert_eq!(
        count("LeaseKeepAlive").await - keepalives,
        0.0,
        "the run-out session was asked about"
    );
}

/// Idle sessions handed on (docs/design.md, "Idle sessions handed on"):
/// while new clients keep starting sessions, the leases of sessions with
/// no lock on them go to the new clients. A lease never carries two
/// clients' locks at once; a client whose session was handed on gets
/// another; and a dead holder's lock, whose session is idle but carries
/// it, is never handed on: it is freed within its TTL while the sessions
/// around it change hands (and their new clients' acquires keep their
/// leases alive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_are_handed_on_and_never_carry_another_clients_lock() {
    const TTL_MS: u64 = 6_000;
    let etcd = EtcdCluster::single();
    let toml = lockrouter_testkit::config::one_named_shard(&etcd, "handed-on", "");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let dead_at = Instant::now();
    api.must_acquire("dead-holder", TTL_MS, "dead").await;
    // A waiter's session carries its queue entry, and the lock it is then
    // granted, with no grant txn of its own: it is never handed on.
    let holder = api.must_acquire("contended", TTL_MS, "holder").await;
    let waiter = {
        let api = api.clone();
        let body =
            json!({"name": "contended", "ttlMs": TTL_MS, "clientId": "waiter", "waitMs": 20_000});
        tokio::spawn(async move { api.post("/api/v1/locks/acquire", body).await })
    };
    let mut idle_leases = BTreeSet::new();
    for c in 0..20 {
        let (client, name) = (format!("idle-{c}"), format!("idle-name-{c}"));
        let lock = api.must_acquire(&name, TTL_MS, &client).await;
        let keys = lock_keys(&etcd).await;
        idle_leases.insert(keys_of(&keys, &client).next().expect("its lock key").lease);
        assert_eq!(api.release(&lock).await.status, 204);
    }
    // New clients, one every 50 ms for 5 s, each keeping its lock.
    let mut fresh = Vec::new();
    let mut handed_on = BTreeSet::new();
    for n in 0..100 {
        let lock = api
            .must_acquire(&format!("fresh-name-{n}"), TTL_MS, &format!("fresh-{n}"))
            .await;
        fresh.push(lock);
        if n % 10 == 9 {
            assert_eq!(api.renew(&holder).await.status, 200);
            let keys = lock_keys(&etcd).await;
            one_client_per_lease(&keys);
            // Locks on leases handed on renew as any other.
            for k in keys.iter().filter(|k| idle_leases.contains(&k.lease)) {
                handed_on.insert((k.lease, k.client.clone()));
                let n: usize = k.client["fresh-".len()..].parse().unwrap();
                let renewed = api.renew(&fresh[n]).await;
                assert_eq!(renewed.status, 200, "{k:?}: {renewed:?}");
                let left = renewed.body["expiresInMs"].as_u64().unwrap();
                assert!(left <= TTL_MS, "{renewed:?}");
            }
        }
        sleep_ms(50).await;
    }
    assert!(
        !handed_on.is_empty(),
        "no idle session's lease was handed on"
    );
    assert_eq!(api.release(&holder).await.status, 204);
    let granted = waiter.await.unwrap();
    assert_eq!(granted.body["acquired"], true, "{granted:?}");
    one_client_per_lease(&lock_keys(&etcd).await);
    let recycled = spare_leases(api, "handed-on", "recycled").await;
    let leases: BTreeSet<i64> = handed_on.iter().map(|(lease, _)| *lease).collect();
    assert!(
        recycled >= leases.len() as f64,
        "{recycled} recycled: {handed_on:?}"
    );
    // The dead holder's key went with its lease, at its TTL.
    while keys_of(&lock_keys(&etcd).await, "dead").next().is_some() {
        let late = dead_at.elapsed().as_millis() as u64;
        assert!(
            late < TTL_MS + 2_500,
            "a dead holder's lock outlived its TTL: {late} ms"
        );
        sleep_ms(100).await;
    }
    // The idle clients acquire again, each on a lease of its own.
    for c in 0..20 {
        let (client, name) = (format!("idle-{c}"), format!("idle-name-{c}"));
        api.must_acquire(&name, TTL_MS, &client).await;
    }
    one_client_per_lease(&lock_keys(&etcd).await);
}

/// A lock key as etcd has it.
#[derive(Debug)]
struct LockKey {
    lease: i64,
    client: String,
}

async fn lock_keys(etcd: &EtcdCluster) -> Vec<LockKey> {
    let all = etcd_client::GetOptions::new().with_prefix();
    let mut client = etcd.client().await;
    let keys = client.get("/lockrouter/locks/", Some(all)).await.unwrap();
    let key = |kv: &etcd_client::KeyValue| {
        let value: serde_json::Value = serde_json::from_slice(kv.value()).unwrap();
        LockKey {
            lease: kv.lease(),
            client: value["client"].as_str().unwrap().to_string(),
        }
    };
    keys.kvs().iter().map(key).collect()
}

fn keys_of<'a>(keys: &'a [LockKey], client: &'a str) -> impl Iterator<Item = &'a LockKey> {
    keys.iter().filter(move |k| k.client == client)
}

/// Every lease carries the locks of one client at most.
fn one_client_per_lease(keys: &[LockKey]) {
    let mut owner = std::collections::HashMap::new();
    for k in keys {
        let first = owner.entry(k.lease).or_insert(&k.client);
        assert_eq!(
            *first, &k.client,
            "lease {} carries two clients' locks",
            k.lease
        );
    }
}

/// Many clients starting sessions one after another: after the first few,
/// their sessions start on spare leases granted ahead of need (no grant
/// in series with the txn), each client still on a lease of its own, every
/// acquire answering at least nine tenths of the TTL and no more than it,
/// and the locks renew and release as any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_sessions_in_a_stream_start_on_spares_with_honest_expiries() {
    let etcd = EtcdCluster::single();
    let toml = lockrouter_testkit::config::one_named_shard(&etcd, "spares", "");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let mut locks = Vec::new();
    for c in 0..60 {
        let r = api
            .acquire(&format!("spare-{c}"), 30_000, &format!("S{c}"))
            .await;
        assert_eq!(r.body["acquired"], true, "{r:?}");
        let left = r.body["expiresInMs"].as_u64().unwrap();
        assert!((27_000..=30_000).contains(&left), "client {c}: {r:?}");
        locks.push(lock_of(&r.body));
    }
    let used = spare_leases(api, "spares", "used").await;
    assert!(used > 0.0, "no session started on a spare");
    assert!(spare_leases(api, "spares", "granted").await >= used);
    // One lease per client: each lock key on a lease of its own.
    let leases = lock_key_leases(&etcd).await;
    let distinct: BTreeSet<i64> = leases.iter().copied().collect();
    assert_eq!((leases.len(), distinct.len()), (60, 60));
    for lock in &locks {
        let renewed = api.renew(lock).await;
        assert_eq!(renewed.status, 200, "{renewed:?}");
        assert_eq!(api.release(lock).await.status, 204);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reacquire_by_the_holder_is_idempotent() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let first = api.must_acquire("idem", 5_000, "A").await;
    let again = api.must_acquire("idem", 5_000, "A").await;
    assert_eq!(first, again);
    // Even with another TTL the grant is the same one (its TTL is fixed).
    let other_ttl = api.must_acquire("idem", 9_000, "A").await;
    assert_eq!(first, other_ttl);
    assert_eq!(
        api.acquire("idem", 5_000, "B").await.body["acquired"],
        false
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_batch_answers_each_lock_in_order() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let held = api.must_acquire("b1", 5_000, "A").await;
    let released = api.must_acquire("b2", 5_000, "A").await;
    api.release(&released).await;
    let stolen = api.must_acquire("b3", 5_000, "A").await;
    api.release(&stolen).await;
    api.must_acquire("b3", 5_000, "B").await;
    let items: Vec<_> = [&held, &released, &stolen, &held]
        .iter()
        .map(|l| json!({"lockId": l.0, "fencingToken": l.1}))
        .collect();
    let body = json!({ "locks": items });
    let r = api.post("/api/v1/locks/renew-batch", body).await;
    assert_eq!(r.status, 200, "{r:?}");
    let results = r.body["results"].as_array().unwrap();
    let got: Vec<(bool, Option<&str>)> = results
        .iter()
        .map(|x| (x["renewed"].as_bool().unwrap(), x["reason"].as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            (true, None),
            (false, Some("expired")),
            (false, Some("stolen")),
            (true, None)
        ]
    );
    for (res, lock) in results.iter().zip([&held, &released, &stolen, &held]) {
        assert_eq!(res["lockId"], lock.0.as_str());
    }
    assert!(results[0]["expiresInMs"].as_u64().unwrap() <= 5_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_is_never_later_than_the_lease() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let before = std::time::SystemTime::now();
    let r = api.acquire("honest", 2_500, "A").await;
    // 2,500 ms rounds up to a 3 s lease.
    let left = r.body["expiresInMs"].as_u64().unwrap();
    assert!((2_500..=3_000).contains(&left), "{r:?}");
    let at = humantime::parse_rfc3339(r.body["expiresAt"].as_str().unwrap()).unwrap();
    assert!(
        at <= before + Duration::from_secs(3) + Duration::from_millis(50),
        "{r:?}"
    );
    let lock = (
        r.body["lockId"].as_str().unwrap().to_string(),
        r.body["fencingToken"].as_u64().unwrap(),
    );
    // etcd's own count of the lease's time left is at least what we report.
    let mut etcd_client = etcd.client().await;
    let leases = etcd_client.leases().await.unwrap();
    for _ in 0..3 {
        let reported = api.renew(&lock).await.body["expiresInMs"].as_u64().unwrap();
        let ttl = etcd_client
            .lease_time_to_live(leases.leases()[0].id(), None)
            .await
            .unwrap()
            .ttl();
        // etcd rounds its count down to whole seconds; allow that second.
        assert!(
            reported <= (ttl as u64 + 1) * 1_000,
            "reported {reported} ms, etcd {ttl} s"
        );
        sleep_ms(700).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_session_lease_is_replaced_on_the_next_acquire() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let first = api.must_acquire("s1", 5_000, "A").await;
    // The session lease dies behind the router's back (as after a long pause).
    let mut client = etcd.client().await;
    let leases = client.leases().await.unwrap();
    assert_eq!(leases.leases().len(), 1);
    let revoked = leases.leases()[0].id();
    client.lease_revoke(revoked).await.unwrap();
    assert_eq!(api.renew(&first).await.body["reason"], "expired");
    let second = api.must_acquire("s2", 5_000, "A").await;
    assert_eq!(api.renew(&second).await.status, 200);
    // Its lock on a lease of its own (two sessions started within 100 ms
    // may leave a spare lease beside it, with no key on it).
    let leases = lock_key_leases(&etcd).await;
    assert_eq!(leases.len(), 1);
    assert_ne!(leases[0], revoked);
}

/// The lease of each lock key on `etcd`.
async fn lock_key_leases(etcd: &EtcdCluster) -> Vec<i64> {
    let all = etcd_client::GetOptions::new().with_prefix();
    let keys = etcd
        .client()
        .await
        .get("/lockrouter/locks/", Some(all))
        .await;
    keys.unwrap().kvs().iter().map(|kv| kv.lease()).collect()
}

/// `lockrouter_spare_leases_total` of `shard` and `event` (0 while absent).
async fn spare_leases(api: &Api, shard: &str, event: &str) -> f64 {
    let metrics = api.metrics().await;
    let labels = [("shard", shard), ("event", event)];
    // An absent series sums to -0.
    lockrouter_testkit::metrics::sum(&metrics, "lockrouter_spare_leases_total", &labels) + 0.0
}

/// Revokes every lease on `etcd`, as the stale-leader bug of etcd 3.4 and
/// 3.5 (etcd issues #12528, #15247) can do to leases renewed moments ago.
async fn revoke_all_leases(etcd: &EtcdCluster) {
    let mut client = etcd.client().await;
    for lease in client.leases().await.unwrap().leases() {
        client.lease_revoke(lease.id()).await.unwrap();
    }
}

/// Spare leases die with the rest when etcd ends leases early (its lease
/// bugs, an operator revoking them all): the first acquire that meets a
/// dead one makes the router drop every spare it holds and grant afresh,
/// so new clients are still granted their names, never answered 503 for
/// a pool of dead spares.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spares_revoked_early_are_dropped_and_new_clients_still_acquire() {
    let etcd = EtcdCluster::single();
    let toml = lockrouter_testkit::config::one_named_shard(&etcd, "revoked-spares", "");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let spares = |event| spare_leases(api, "revoked-spares", event);
    // A stream of new sessions fills the pool.
    for c in 0..30 {
        api.must_acquire(&format!("fill-{c}"), 30_000, &format!("F{c}"))
            .await;
    }
    let started = Instant::now();
    while spares("granted").await - spares("used").await < 3.0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no spares left ready"
        );
        sleep_ms(20).await;
    }
    revoke_all_leases(&etcd).await;
    for c in 0..10 {
        let r = api
            .acquire(&format!("after-{c}"), 30_000, &format!("N{c}"))
            .await;
        assert_eq!(r.body["acquired"], true, "client {c}: {r:?}");
        assert_eq!(api.renew(&lock_of(&r.body)).await.status, 200, "client {c}");
    }
    assert!(
        spares("expired").await >= 1.0,
        "the dead spares were not dropped"
    );
}

/// Idle sessions' leases handed on, then revoked behind the router's back
/// with every other lease (etcd's lease bugs, an operator's revoke): the
/// first acquire that meets a dead one drops the spares, and no idle
/// session's lease confirmed before then is handed on, so new clients
/// are still granted their names (never 503 for a run of dead leases).
/// A client waiting for a name, whose own session went with them, waits
/// on, on a new session, and is granted the name when it is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_revoked_early_are_not_handed_on_and_waits_go_on_on_new_sessions() {
    const TTL_MS: u64 = 6_000;
    let etcd = EtcdCluster::single();
    // The default etcd deadline, 3 s, half the TTL: every lease handed on
    // has less than that left, so a session that takes one asks etcd
    // before its txn goes, and learns there that it is gone.
    let toml = lockrouter_testkit::config::one_named_shard(&etcd, "revoked-idle", "")
        .replace("request_timeout_ms = 1000", "request_timeout_ms = 3000");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let spares = |event| spare_leases(api, "revoked-idle", event);
    // A client holding a lock: its session is never handed on.
    let sleeper = api.must_acquire("sleeper-own", TTL_MS, "sleeper").await;
    for c in 0..20 {
        let lock = api
            .must_acquire(&format!("idle-name-{c}"), TTL_MS, &format!("idle-{c}"))
            .await;
        assert_eq!(api.release(&lock).await.status, 204);
    }
    // New clients, one every 50 ms, until idle sessions' leases were
    // handed on (their sessions are idle after half the TTL).
    let started = Instant::now();
    let mut n = 0;
    let recycled = spares("recycled").await;
    while spares("recycled").await == recycled {
        assert!(
            started.elapsed() < Duration::from_millis(2 * TTL_MS),
            "no idle session's lease was handed on"
        );
        api.must_acquire(&format!("fresh-name-{n}"), TTL_MS, &format!("fresh-{n}"))
            .await;
        n += 1;
        sleep_ms(50).await;
    }
    assert_eq!(api.renew(&sleeper).await.status, 200);
    revoke_all_leases(&etcd).await;
    let holder = api.must_acquire("contended", TTL_MS, "holder").await;
    let waiter = {
        let api = api.clone();
        let body =
            json!({"name": "contended", "ttlMs": TTL_MS, "clientId": "sleeper", "waitMs": 10_000});
        tokio::spawn(async move { api.post("/api/v1/locks/acquire", body).await })
    };
    for c in 0..20 {
        let r = api
            .acquire(&format!("after-name-{c}"), TTL_MS, &format!("after-{c}"))
            .await;
        assert_eq!(r.body["acquired"], true, "client {c}: {r:?}");
        assert_eq!(api.renew(&lock_of(&r.body)).await.status, 200, "client {c}");
        sleep_ms(20).await;
    }
    assert!(
        spares("expired").await >= 1.0,
        "the dead leases were not dropped"
    );
    assert_eq!(api.release(&holder).await.status, 204);
    let granted = waiter.await.unwrap();
    assert_eq!(granted.body["acquired"], true, "{granted:?}");
    assert_eq!(api.renew(&lock_of(&granted.body)).await.status, 200);
    one_client_per_lease(&lock_keys(&etcd).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_revoked_early_keeps_the_name_until_its_holder_surely_stopped() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let sent = Instant::now();
    let r = api.acquire("early", 3_000, "A").await;
    assert_eq!(r.body["acquired"], true, "{r:?}");
    let valid_until = sent + Duration::from_millis(r.body["expiresInMs"].as_u64().unwrap());
    // A released lock is free at once: no delay for those.
    let released = api.must_acquire("released", 3_000, "A").await;
    assert_eq!(api.release(&released).await.status, 204);
    revoke_all_leases(&etcd).await;
    api.must_acquire("released", 3_000, "B").await;
    // The key of "early" is gone, but A was told it holds it until
    // `valid_until`: nobody gets it before then.
    let mut delayed_answers = 0;
    let granted = loop {
        let r = api.acquire("early", 3_000, "B").await;
        assert_eq!(r.status, 200, "{r:?}");
        if r.body["acquired"] == true {
            break Instant::now();
        }
        delayed_answers += 1;
        assert!(
            sent.elapsed() < Duration::from_secs(15),
            "never granted: {r:?}"
        );
        sleep_ms(100).await;
    };
    assert!(
        granted >= valid_until,
        "granted {:?} before the first holder's validity ended",
        valid_until - granted
    );
    assert!(delayed_answers > 0);
    // (Routers of this test binary share one metrics registry: at least.)
    let metrics = api.metrics().await;
    let delays: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("lockrouter_lock_delays_total{shard=\"a\"}"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(delays >= 1.0, "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_lock_delay_off_a_lost_holders_name_is_free_at_once() {
    let etcd = EtcdCluster::single();
    let toml = lockrouter_testkit::config::config_toml(
        &[&etcd],
        "127.0.0.1:0",
        "\n[locks]\nlock_delay = \"off\"\n",
    );
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let first = api.must_acquire("early", 3_000, "A").await;
    revoke_all_leases(&etcd).await;
    let second = api.must_acquire("early", 3_000, "B").await;
    assert!(second.1 > first.1);
}

/// etcd raises a TTL below its minimum (here 8 s for a 2 s lock), and
/// says so in every keepalive answer; the router still reports no more
/// than the lock's own TTL, which is what a lost holder's lock-delay
/// covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_lease_ttl_is_never_reported_past_the_locks_own() {
    let etcd = EtcdCluster::start_with(1, &["--election-timeout", "5000"]);
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let r = api.acquire("raised-ttl", 2_000, "A").await;
    let lock = r.granted();
    let at_most = |r: &lockrouter_testkit::api::Reply| {
        let left = r.body["expiresInMs"].as_u64().expect("expiresInMs");
        assert!(left <= 2_000, "told {left} ms of a 2 s lock: {r:?}");
    };
    at_most(&r);
    sleep_ms(500).await;
    let renewed = api.renew(&lock).await;
    assert_eq!(renewed.status, 200, "{renewed:?}");
    at_most(&renewed);
    let again = api.acquire("raised-ttl", 2_000, "A").await;
    assert_eq!(again.granted(), lock);
    at_most(&again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reacquire_returns_the_same_lock_when_etcd_raised_the_ttl() {
    // With a 5 s election timeout etcd raises every lease TTL to at least
    // 8 s: the lock asked for 2 s rides on a longer lease.
    let etcd = EtcdCluster::start_with(1, &["--election-timeout", "5000"]);
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let first = api.must_acquire("raised", 2_000, "A").await;
    // Past the keepalive coalescing window, so the re-acquire renews the
    // lease with etcd (which answers its real TTL).
    sleep_ms(500).await;
    let again = api.must_acquire("raised", 2_000, "A").await;
    assert_eq!(again, first);
    let r = api
        .post(
            "/api/v1/locks/renew",
            json!({"lockId": first.0, "fencingToken": first.1, "ttlMs": 2_000}),
        )
        .await;
    assert_eq!(r.status, 200, "the lock's TTL is the one asked for: {r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_life_is_still_two_raft_writes_with_its_held_record() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    // The session lease is granted once, before counting.
    api.must_acquire("warm-up", 30_000, "A").await;
    let before = etcd.metric("etcd_server_proposals_committed_total");
    for i in 0..50 {
        let lock = api.must_acquire(&format!("life-{i}"), 30_000, "A").await;
        assert_eq!(api.release(&lock).await.status, 204);
    }
    let writes = etcd.metric("etcd_server_proposals_committed_total") - before;
    // One txn to grant (lock key and held record), one to release (both):
    // the lock-delay's record costs no raft write of its own.
    assert!(
        (100.0..=103.0).contains(&writes),
        "{writes} raft writes for 50 lock lives"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_refused_because_the_name_is_held_cost_no_raft_write() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let held = api.must_acquire("hot", 30_000, "A").await;
    // B's session lease first, so that only the acquires are counted.
    api.must_acquire("warm-up", 30_000, "B").await;
    // Once the router's lock-key cache has seen the grant, B's acquires of
    // the held name are answered by a read.
    let started = Instant::now();
    while !api
        .metrics()
        .await
        .contains("lockrouter_acquire_reads_first_total")
    {
        let r = api.acquire("hot", 30_000, "B").await;
        assert_eq!(r.body["acquired"], false, "{r:?}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never read first"
        );
        sleep_ms(50).await;
    }
    let before = etcd.metric("etcd_server_proposals_committed_total");
    for _ in 0..30 {
        let r = api.acquire("hot", 30_000, "B").await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.body["acquired"], false, "{r:?}");
        assert!(r.body["expiresAt"].is_string(), "{r:?}");
    }
    // The holder's re-acquire is answered by the read too: the same lock.
    let again = api.must_acquire("hot", 30_000, "A").await;
    assert_eq!(again, held);
    let writes = etcd.metric("etcd_server_proposals_committed_total") - before;
    // A txn per acquire (etcd 3.4 proposes a txn whose compare fails) would
    // be 31.
    assert!(
        writes <= 2.0,
        "{writes} raft writes for 31 acquires of a held name"
    );
    // Released, the name is granted at once: the cache was only a hint.
    assert_eq!(api.release(&held).await.status, 204);
    let b = api.must_acquire("hot", 30_000, "B").await;
    assert!(b.1 > held.1);
}

/// While the router has a grant txn of a name in flight, its other
/// acquires of that name wait for it instead of each sending a txn that
/// would fail (a raft write each on etcd 3.4), and are then answered by a
/// read: the grant just made looks held before the cache has it. The link
/// to etcd is held silent so the grant stays in flight while the others
/// come; without the wait they would all reach a txn and none would read
/// first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_of_a_name_whose_grant_is_in_flight_wait_for_it_then_read() {
    let etcd = EtcdCluster::single();
    let proxy = SilentProxy::start(&etcd.endpoints()[0]).await;
    let router = router_behind(&proxy, &etcd, "in-flight").await;
    // The sessions first, so that the acquires below need nothing else.
    for c in std::iter::once("A").chain(OTHERS) {
        router
            .api
            .must_acquire(&format!("warm-up-{c}"), 30_000, c)
            .await;
    }
    // A's grant txn is on its way once its batch is counted (as it is
    // sent, after its mark).
    others_wait_for_the_grant_of_a(
        &router,
        &proxy,
        "in-flight",
        30_000,
        "lockrouter_commits_total",
    )
    .await;
}

/// The same when the first acquire's session must be kept alive before
/// its grant txn goes (its client was idle for half its TTL): the others
/// wait from the moment that acquire began, not only once its txn is on
/// its way, or theirs would reach etcd first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_wait_for_a_grant_whose_session_is_being_kept_alive_first() {
    let etcd = EtcdCluster::single();
    let proxy = SilentProxy::start(&etcd.endpoints()[0]).await;
    let router = router_behind(&proxy, &etcd, "in-flight-idle").await;
    let api = &router.api;
    for c in OTHERS {
        api.must_acquire(&format!("warm-up-{c}"), 30_000, c).await;
    }
    // A's 2 s session, idle for more than half of it: its next acquire
    // sends a keepalive first, and its txn only once that is answered. Z's
    // likewise, first, opens the shard's keepalive stream.
    api.must_acquire("warm-up-A", 2_000, "A").await;
    api.must_acquire("warm-up-Z", 2_000, "Z").await;
    sleep_ms(1_100).await;
    api.must_acquire("warm-up-Z-again", 2_000, "Z").await;
    let sent = "lockrouter_keepalives_sent_total";
    others_wait_for_the_grant_of_a(&router, &proxy, "in-flight-idle", 2_000, sent).await;
}

/// The clients that race A to a name in the tests above.
const OTHERS: [&str; 4] = ["B", "C", "D", "E"];

/// A router whose single shard, named `shard`, is `etcd` reached through
/// `proxy`. A shard name of its own: the metrics of in-process routers are
/// one process's, shared with the tests that run beside this one.
async fn router_behind(proxy: &SilentProxy, etcd: &EtcdCluster, shard: &str) -> TestRouter {
    let toml = config_toml(&[etcd], "127.0.0.1:0", "")
        .replace(&etcd.endpoints()[0], &proxy.url())
        .replace("name = \"a\"", &format!("name = \"{shard}\""));
    TestRouter::with_toml(&toml).await
}

/// With the link to etcd silent, A acquires a contended name (on its
/// `ttl_ms` session); once the router's counter `sent` on `shard` shows
/// A's grant under way, [`OTHERS`] (on warm 30 s sessions) acquire it too;
/// then the link speaks again. A is granted, and every other is refused by
/// a read first: none sent a txn that raced A's.
async fn others_wait_for_the_grant_of_a(
    router: &TestRouter,
    proxy: &SilentProxy,
    shard: &str,
    ttl_ms: u64,
    sent: &str,
) {
    let api = &router.api;
    let name = format!("hot-{shard}");
    let read_first = |text: &str| {
        let answered = [("shard", shard), ("answered", "true")];
        metrics::sum(text, "lockrouter_acquire_reads_first_total", &answered)
    };
    let sent = |text: &str| metrics::sum(text, sent, &[("shard", shard)]);
    let text = api.metrics().await;
    let (before, sent_before) = (read_first(&text), sent(&text));
    // Silent for well under the router's 1 s ping timeout.
    proxy.set_silent(true);
    let first = tokio::spawn({
        let (api, name) = (api.clone(), name.clone());
        async move { api.acquire(&name, ttl_ms, "A").await }
    });
    let started = Instant::now();
    while sent(&api.metrics().await) == sent_before {
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "A's grant never got under way"
        );
        sleep_ms(10).await;
    }
    let rest: Vec<_> = OTHERS
        .iter()
        .map(|&c| {
            let (api, name) = (api.clone(), name.clone());
            tokio::spawn(async move { api.acquire(&name, 30_000, c).await })
        })
        .collect();
    // Those that come only after A's txn was answered read first as well
    // (the router's own grant looks held).
    sleep_ms(150).await;
    proxy.set_silent(false);
    let granted = first.await.unwrap();
    assert_eq!(granted.body["acquired"], true, "{granted:?}");
    for r in join_all(rest).await {
        let r = r.unwrap();
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.body["acquired"], false, "{r:?}");
    }
    let read = read_first(&api.metrics().await) - before;
    assert_eq!(read, OTHERS.len() as f64, "every other acquire read first");
}

/// Keys under `prefix` on `etcd`.
async fn count(etcd: &EtcdCluster, prefix: &str) -> i64 {
    let mut c = etcd.client().await;
    let opts = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    c.get(prefix, Some(opts)).await.unwrap().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_holders_nobody_asks_about_get_their_delay_and_leave_no_records() {
    let etcd = EtcdCluster::single();
    let router = counting_router(&etcd, 100).await;
    for i in 0..5 {
        router
            .api
            .must_acquire(&format!("forgotten-{i}"), 2_000, "A")
            .await;
    }
    assert_eq!(count(&etcd, "/lockrouter/held/").await, 5);
    revoke_all_leases(&etcd).await;
    // The monitor's sweep turns the lost holders' records into lock-delays,
    // which end with their leases: nothing is left behind.
    let started = Instant::now();
    let mut saw_delays = false;
    loop {
        let (held, delays) = (
            count(&etcd, "/lockrouter/held/").await,
            count(&etcd, "/lockrouter/delay/").await,
        );
        saw_delays |= delays > 0;
        if held == 0 && delays == 0 && saw_delays {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{held} held records and {delays} delays left"
        );
        sleep_ms(100).await;
    }
    router.api.must_acquire("forgotten-0", 2_000, "B").await;
}

/// The sweep finds every lost holder among thousands in one pass: it reads
/// the held records page by page in slices of the hash space (etcd 3.4
/// reads a whole range before it applies a limit), settles a bounded
/// number of lost holders per step and goes on after the last one, and a
/// slice or step that skipped keys would leave records behind until a
/// pass ten minutes later. Live holders among them (whose lock keys the
/// sweep learns from the lock-key cache) keep their locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_finds_every_lost_holder_among_thousands() {
    const LOST: usize = 3_000;
    const LIVE: usize = 20;
    let etcd = EtcdCluster::single();
    // Held records whose lock keys are gone, as lost holders leave them,
    // there before the router's first pass.
    let keys = lockrouter::keys::Keys::new("/lockrouter");
    let mut c = etcd.client().await;
    for chunk in (0..LOST).collect::<Vec<_>>().chunks(100) {
        let ops: Vec<etcd_client::TxnOp> = chunk
            .iter()
            .map(|i| {
                let name = format!("lost-{i}");
                let value = lockrouter::keys::HeldValue {
                    name: name.clone(),
                    ttl: 2,
                };
                let key = keys.held(&lockrouter::keys::name_hash(&name));
                etcd_client::TxnOp::put(key, serde_json::to_vec(&value).unwrap(), None)
            })
            .collect();
        c.txn(etcd_client::Txn::new().and_then(ops)).await.unwrap();
    }
    // A pass at most every six counts: one pass in this test.
    let router = counting_router(&etcd, 100_000).await;
    let mut live = Vec::new();
    for i in 0..LIVE {
        live.push(
            router
                .api
                .must_acquire(&format!("live-{i}"), 60_000, "A")
                .await,
        );
    }
    let started = Instant::now();
    loop {
        let held = count(&etcd, "/lockrouter/held/").await;
        if held == LIVE as i64 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{} lost holders' records never swept",
            held - LIVE as i64
        );
        sleep_ms(200).await;
    }
    for lock in &live {
        assert_eq!(router.api.renew(lock).await.status, 200, "{lock:?}");
    }
    drop(router);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_sent_after_a_release_was_acknowledged_never_succeeds() {
    let etcd = EtcdCluster::single();
    let (a, b) = (
        TestRouter::start(&[&etcd]).await,
        TestRouter::start(&[&etcd]).await,
    );
    let mut late_renewals = 0;
    for round in 0..60 {
        let lock = a
            .api
            .must_acquire(&format!("race-{round}"), 10_000, "A")
            .await;
        // Renewals through the other replica, as fast as they go, while the
        // release goes through the first.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let renewer = {
            let (api, lock, stop) = (b.api.clone(), lock.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let sent = Instant::now();
                    let status = api.renew(&lock).await.status;
                    seen.push((sent, status));
                }
                seen
            })
        };
        sleep_ms(5 + round % 7).await;
        assert_eq!(a.api.release(&lock).await.status, 204);
        let acknowledged = Instant::now();
        // Long enough for renewals after the release to come in every
        // round: each waits for a barrier (50 ms apart by default).
        sleep_ms(100).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for (sent, status) in renewer.await.unwrap() {
            if sent > acknowledged {
                late_renewals += 1;
                assert_eq!(status, 409, "a renewal sent after the release succeeded");
            }
        }
    }
    assert!(
        late_renewals > 20,
        "only {late_renewals} renewals raced the releases"
    );
    // They were answered by the lock-key cache, not by reads.
    let metrics = b.api.metrics().await;
    assert!(
        metrics.contains("lockrouter_renewal_checks_total{shard=\"a\",by=\"cache\"}"),
        "{metrics}"
    );
}

/// A client idle past its TTL comes back to a session lease the router
/// still caches (idle sessions are swept only after twice the TTL) but
/// etcd has let expire. For up to half a second etcd has not revoked such a
/// lease yet, and a grant txn still attaches a key to it, which then goes
/// with the lease: the lock key vanishes and its held record stays behind,
/// looking like a holder lost without release. A fresh name must still be
/// granted, not refused for a lock-delay the router set against itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_back_after_its_session_lease_ran_out_is_granted_a_free_name() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    const CLIENTS: u64 = 48;
    for c in 0..CLIENTS {
        let lock = router
            .api
            .must_acquire(&format!("first-{c}"), 2_000, &format!("idle-{c}"))
            .await;
        assert_eq!(router.api.release(&lock).await.status, 204);
    }
    // Leases run out 2 s after their last keepalive; etcd revokes expired
    // leases every 500 ms. Clients come back spread over that span.
    let released = Instant::now();
    let comebacks = (0..CLIENTS).map(|c| {
        let api = router.api.clone();
        async move {
            let at = released + Duration::from_millis(1_700 + c * 30);
            tokio::time::sleep_until(at.into()).await;
            let r = api
                .acquire(&format!("second-{c}"), 2_000, &format!("idle-{c}"))
                .await;
            (c, r)
        }
    });
    for (c, r) in join_all(comebacks).await {
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(
            r.body["acquired"], true,
            "client idle-{c}, back after its lease ran out, was refused a free name: {r:?}"
        );
    }
}

/// Operators see whether each replica's lock-key cache vouches, and how
/// many keys it holds against the shard's count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_key_cache_reports_that_it_vouches_and_what_it_holds() {
    let etcd = EtcdCluster::single();
    // A shard name of its own: every router in this process reports its
    // gauges to one recorder, and other tests' shard `a` would overwrite them.
    let extra = "count_interval_ms = 200\n";
    let toml = lockrouter_testkit::config::one_named_shard(&etcd, "vouching", extra);
    let router = TestRouter::with_toml(&toml).await;
    for i in 0..3 {
        router
            .api
            .must_acquire(&format!("cached-{i}"), 10_000, "A")
            .await;
    }
    let started = Instant::now();
    loop {
        let text = router.api.metrics().await;
        let has = |line: &str| text.lines().any(|l| l == line);
        if has("lockrouter_cache_vouching{shard=\"vouching\"} 1")
            && has("lockrouter_cache_lock_keys{shard=\"vouching\"} 3")
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no vouching cache of 3 keys reported:\n{}",
            text.lines()
                .filter(|l| l.starts_with("lockrouter_cache_"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        sleep_ms(100).await;
    }
}

/// Renewals back to back share barriers: one shard writes at most one
/// barrier per `etcd.barrier_spacing_ms` (default 50 ms) however fast
/// renewals come, so etcd's raft writes for renewals stay bounded while
/// renewals grow. Counted by etcd itself (the
/// router's metrics are shared by every test in this process): while only
/// renewals run, barriers are the only raft writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_back_to_back_share_barriers_at_most_one_per_spacing() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let lock = router.api.must_acquire("spaced", 30_000, "A").await;
    let proposals = || etcd.metric("etcd_server_proposals_committed_total");
    // Wait until the cache vouches: a renewal then writes a barrier.
    let started = Instant::now();
    loop {
        let before = proposals();
        assert_eq!(router.api.renew(&lock).await.status, 200);
        if proposals() > before {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "no barrier");
        sleep_ms(50).await;
    }
    let before = proposals();
    let began = Instant::now();
    // Four renewers back to back: without spacing each renewal could take
    // a barrier of its own.
    let renewers = (0..4).map(|_| {
        let (api, lock) = (router.api.clone(), lock.clone());
        async move {
            for _ in 0..25 {
                assert_eq!(api.renew(&lock).await.status, 200);
            }
        }
    });
    join_all(renewers).await;
    let elapsed = began.elapsed();
    let written = proposals() - before;
    let spacing = lockrouter::config::EtcdSettings::default().barrier_spacing();
    let most = (elapsed.as_secs_f64() / spacing.as_secs_f64()).floor() + 1.0;
    assert!(
        written >= 1.0 && written <= most,
        "{written} barriers for 100 renewals in {elapsed:?}: at most {most}"
    );
}

/// An operator takes a name from a stuck holder: the answer names the
/// former holder and its token, the holder's renewals answer 409 and its
/// release does nothing, the next grant has a larger token, and a waiter
/// queued for the name gets it. Only admin callers see who holds a name,
/// and force-release needs the admin token and a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_force_releases_a_stuck_holder() {
    let etcd = EtcdCluster::single();
    let token = "an-admin-token-of-some-length";
    let toml = lockrouter_testkit::config::config_toml(&[&etcd], "127.0.0.1:0", "")
        + &format!("\n[admin]\ntoken = \"{token}\"\n");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let stuck = api
        .must_acquire("process_order:42", 30_000, "worker-17")
        .await;
    let force = |reason: Option<&str>, bearer: Option<&str>| {
        let mut req = api
            .http
            .post(format!(
                "{}/admin/v1/locks/process_order%3A42/force-release",
                api.base
            ))
            .json(&reason.map_or(json!({}), |r| json!({ "reason": r })));
        if let Some(b) = bearer {
            req = req.bearer_auth(b);
        }
        api.send(req)
    };
    // Who holds it: shown with the admin token only.
    let seen = |bearer: Option<&'static str>| {
        let mut req = api
            .http
            .get(format!("{}/api/v1/locks/process_order%3A42", api.base));
        if let Some(b) = bearer {
            req = req.bearer_auth(b);
        }
        api.send(req)
    };
    assert_eq!(seen(None).await.body.get("clientId"), None);
    let as_admin = seen(Some("an-admin-token-of-some-length")).await;
    assert_eq!(as_admin.body["clientId"], "worker-17", "{as_admin:?}");

    assert_eq!(force(Some("hung"), None).await.status, 401);
    assert_eq!(
        force(Some("hung"), Some("wrong-token-wrong-token"))
            .await
            .status,
        403
    );
    assert_eq!(
        force(None, Some(token)).await.status,
        400,
        "a reason is required"
    );
    assert_eq!(force(Some("  "), Some(token)).await.status, 400);

    // A waiter queued behind the stuck holder.
    let waiter = {
        let api = api.clone();
        tokio::spawn(async move {
            api.post(
                "/api/v1/locks/acquire",
                json!({"name": "process_order:42", "ttlMs": 30_000, "clientId": "worker-18", "waitMs": 10_000}),
            )
            .await
        })
    };
    sleep_ms(300).await;
    let r = force(Some("worker-17 hung, ticket OPS-42"), Some(token)).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        (
            &r.body["released"],
            &r.body["clientId"],
            r.body["fencingToken"].as_u64()
        ),
        (&json!(true), &json!("worker-17"), Some(stuck.1)),
        "{r:?}"
    );
    let next = waiter.await.unwrap();
    assert_eq!(next.body["acquired"], true, "{next:?}");
    let next_token = next.body["fencingToken"].as_u64().unwrap();
    assert!(next_token > stuck.1, "token {next_token} after {}", stuck.1);
    // The former holder lost it: 409, and its release touches nothing.
    let renew = api.renew(&stuck).await;
    assert_eq!(renew.status, 409, "{renew:?}");
    assert_eq!(api.release(&stuck).await.status, 204);
    let now = seen(Some("an-admin-token-of-some-length")).await;
    assert_eq!(
        (
            now.body["clientId"].as_str(),
            now.body["fencingToken"].as_u64()
        ),
        (Some("worker-18"), Some(next_token)),
        "{now:?}"
    );
    // Nothing else holds it once released: released false.
    let next_lock = (
        next.body["lockId"].as_str().unwrap().to_string(),
        next_token,
    );
    assert_eq!(api.release(&next_lock).await.status, 204);
    let r = force(Some("again"), Some(token)).await;
    assert_eq!(
        (r.status, &r.body["released"]),
        (200, &json!(false)),
        "{r:?}"
    );
    let forced = router.api.metrics().await;
    assert!(
        forced.contains("lockrouter_force_releases_total"),
        "no force-release counted"
    );
}

/// Inspect says `held` for as long as the lock key exists: etcd reports a
/// lease's time to live in whole seconds, and a lease with 0.9 s left must
/// not read as free while the name is still refused to others. Polled
/// through a lock's expiry, every `held: false` finds no key in etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_says_held_until_the_key_is_gone() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let keys = lockrouter::keys::Keys::new("/lockrouter");
    let key = keys.lock(&lockrouter::keys::name_hash("fading"));
    let mut client = etcd.client().await;
    api.must_acquire("fading", 2_000, "gone-soon").await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut held_seen = 0;
    loop {
        let seen = api.inspect("fading").await;
        assert_eq!(seen.status, 200, "{seen:?}");
        if seen.body["held"] == true {
            held_seen += 1;
        } else {
            let got = client.get(key.clone(), None).await.unwrap();
            assert!(
                got.kvs().is_empty(),
                "held: false while the lock key exists"
            );
            break;
        }
        assert!(Instant::now() < deadline, "never freed: {seen:?}");
        sleep_ms(50).await;
    }
    assert!(
        held_seen > 10,
        "the lock was seen held only {held_seen} times"
    );
}
