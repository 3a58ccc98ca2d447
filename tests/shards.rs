//! Sharding on real etcd: placement, lease coalescing, shard outages, and
//! refusal to grant under a ring the shards did not record.

use std::time::{Duration, Instant};

use futures::future::join_all;
use lockrouter::keys::{name_hash, Keys};
use serde_json::json;

use lockrouter_testkit::config::{config_toml, shard_name};
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::sleep_ms;

fn three() -> [EtcdCluster; 3] {
    [
        EtcdCluster::single(),
        EtcdCluster::single(),
        EtcdCluster::single(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_land_on_the_shard_the_ring_says() {
    let shards = three();
    let router = TestRouter::start(&[&shards[0], &shards[1], &shards[2]]).await;
    let ring = lockrouter::ring::Ring::new(&router.settings.shards, router.settings.ring.vnodes);
    let keys = Keys::new("/lockrouter");
    let mut per_shard = [0; 3];
    for i in 0..30 {
        let name = format!("placed-{i}");
        router.api.must_acquire(&name, 5_000, "A").await;
        let expected = ring.shard_index(&name);
        per_shard[expected] += 1;
        assert_eq!(
            router.api.inspect(&name).await.body["shard"],
            shard_name(expected)
        );
        for (i, etcd) in shards.iter().enumerate() {
            let mut c = etcd.client().await;
            let found = c
                .get(keys.lock(&name_hash(&name)), None)
                .await
                .unwrap()
                .count();
            assert_eq!(found, i64::from(i == expected), "{name} on shard {i}");
        }
    }
    assert!(per_shard.iter().all(|&n| n > 0), "{per_shard:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_uses_one_lease_per_shard_and_few_keepalives() {
    let shards = three();
    let router = TestRouter::start(&[&shards[0], &shards[1], &shards[2]]).await;
    let api = &router.api;
    let mut locks = Vec::new();
    for i in 0..100 {
        locks.push(
            api.must_acquire(&format!("many-{i}"), 30_000, "one-client")
                .await,
        );
    }
    let mut leases = 0;
    for etcd in &shards {
        leases += etcd.client().await.leases().await.unwrap().leases().len();
    }
    assert_eq!(leases, 3, "100 locks of one client on 3 shards");

    let renewed_before: f64 = shards
        .iter()
        .map(|s| s.metric("etcd_debugging_lease_renewed_total"))
        .sum();
    let replies = join_all(locks.iter().map(|l| api.renew(l))).await;
    assert!(replies.iter().all(|r| r.status == 200));
    let body = json!({"locks": locks.iter().map(|l| json!({"lockId": l.0, "fencingToken": l.1})).collect::<Vec<_>>()});
    let batch = api.post("/api/v1/locks/renew-batch", body).await;
    assert_eq!(batch.status, 200);
    let renewed_after: f64 = shards
        .iter()
        .map(|s| s.metric("etcd_debugging_lease_renewed_total"))
        .sum();
    // 200 lock renewals: at most one keepalive per lease per coalescing window.
    let keepalives = renewed_after - renewed_before;
    assert!(
        keepalives <= 12.0,
        "{keepalives} keepalives for 200 renewals"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_outage_stays_local_and_heals() {
    let mut shards = three();
    let toml = config_toml(&[&shards[0], &shards[1], &shards[2]], "127.0.0.1:0", "");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let ring = lockrouter::ring::Ring::new(&router.settings.shards, router.settings.ring.vnodes);
    let name_on = |shard: usize, tag: &str| {
        (0..)
            .map(|i| format!("{tag}-{i}"))
            .find(|n| ring.shard_index(n) == shard)
            .unwrap()
    };
    let held_on_b = api.must_acquire(&name_on(1, "held"), 30_000, "A").await;

    shards[1].kill();
    // The first call may wait for the deadline; later ones fail fast.
    for i in 0..5 {
        let started = Instant::now();
        let r = api
            .acquire(&name_on(1, &format!("down{i}")), 5_000, "A")
            .await;
        assert_eq!(r.status, 503, "{r:?}");
        assert_eq!(r.body["error"]["code"], "shard_unavailable");
        assert!(r.retry_after.is_some());
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "took {:?}",
            started.elapsed()
        );
        for other in [0, 2] {
            api.must_acquire(&name_on(other, &format!("up{i}")), 5_000, "A")
                .await;
        }
    }
    let r = api.renew(&held_on_b).await;
    assert_eq!(r.status, 503);
    // One unreachable shard does not take the replica out of a load
    // balancer (every replica would go at once); the body names it.
    let ready = api.get("/readyz").await;
    assert_eq!(ready.status, 200, "{ready:?}");
    assert_eq!(ready.body["unreachableShards"], json!(["b"]));
    assert_eq!(
        ready.body["shards"],
        json!([
            {"name": "a", "state": "up"},
            {"name": "b", "state": "unreachable"},
            {"name": "c", "state": "up"}
        ])
    );

    shards[1].restart();
    let healed = Instant::now();
    loop {
        let r = api.acquire(&name_on(1, "back"), 5_000, "A").await;
        if r.body["acquired"] == true {
            break;
        }
        assert!(
            healed.elapsed() < Duration::from_secs(15),
            "shard b never came back: {r:?}"
        );
        sleep_ms(100).await;
    }
    assert_eq!(api.renew(&held_on_b).await.status, 200);
    assert_eq!(api.get("/readyz").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_with_another_ring_refuses_to_grant() {
    let shards = three();
    let first = TestRouter::start(&[&shards[0], &shards[1]]).await;
    let lock = first.api.must_acquire("moving", 30_000, "A").await;
    // Same shards plus a third, without a rebalance: placement would differ,
    // so this router must not grant anywhere.
    let toml = config_toml(&[&shards[0], &shards[1], &shards[2]], "127.0.0.1:0", "");
    let settings = lockrouter::Settings::from_toml(&toml).unwrap();
    let app = lockrouter::Application::build(settings).await.unwrap();
    let api = lockrouter_testkit::api::Api::new(app.local_addr());
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(app.run(stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ready = api.get("/readyz").await;
        if ready.status == 503
            && ready.body["refusingShards"]
                .as_array()
                .is_some_and(|a| a.len() == 3)
        {
            break;
        }
        assert!(Instant::now() < deadline, "{ready:?}");
        sleep_ms(100).await;
    }
    for i in 0..20 {
        let r = api.acquire(&format!("n{i}"), 5_000, "B").await;
        assert_eq!(r.status, 503, "{r:?}");
    }
    let r = api.acquire("moving", 5_000, "B").await;
    assert_eq!(r.status, 503);
    // The lockId names its shard: the holder can still renew and release.
    assert_eq!(api.renew(&lock).await.status, 200);
    assert_eq!(api.release(&lock).await.status, 204);
    stop.cancel();
}

/// A shard of three members that all stop answering (paused: their
/// connections stay open, nothing comes back) is marked down by the
/// router's member probes and its monitor's probe (hedged over the
/// members), since no member answers them, not by a call's failure (with
/// several members that says only that its member failed; without both
/// probes marking it, it is never marked down):
/// within about a second `/readyz` names it unreachable and its names
/// answer 503 `shard_unavailable` at once, not after the etcd deadline.
/// Resumed, it serves again and the lock held on it renews.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_member_shard_none_of_whose_members_answers_fails_fast_and_heals() {
    let cluster = EtcdCluster::start(3);
    // An etcd deadline of 5 s, so an answer well within it is not a wait.
    let toml = lockrouter_testkit::config::one_named_shard(&cluster, "mute", "")
        .replace("request_timeout_ms = 1000", "request_timeout_ms = 5000");
    assert!(toml.contains("request_timeout_ms = 5000"));
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let held = api.must_acquire("mute-held", 30_000, "A").await;
    for i in 0..3 {
        cluster.pause_member(i);
    }
    let paused = Instant::now();
    let deadline = paused + Duration::from_secs(5);
    while api.get("/readyz").await.body["unreachableShards"] != json!(["mute"]) {
        assert!(Instant::now() < deadline, "never marked unreachable");
        sleep_ms(50).await;
    }
    eprintln!("marked unreachable after {:?}", paused.elapsed());
    for i in 0..3 {
        let started = Instant::now();
        let r = api.acquire(&format!("mute-{i}"), 5_000, "A").await;
        assert_eq!(r.status, 503, "{r:?}");
        assert_eq!(r.body["error"]["code"], "shard_unavailable", "{r:?}");
        assert!(r.retry_after.is_some(), "{r:?}");
        let took = started.elapsed();
        assert!(took < Duration::from_millis(2_500), "took {took:?}");
    }
    assert_eq!(api.renew(&held).await.status, 503);
    for i in 0..3 {
        cluster.resume_member(i);
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = api.renew(&held).await;
        if r.status == 200 {
            break;
        }
        assert!(r.status == 503 && Instant::now() < deadline, "{r:?}");
        sleep_ms(100).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_member_shard_survives_losing_a_member() {
    let mut cluster = EtcdCluster::start(3);
    // A shard name of its own: every router in this process reports its
    // gauges to one recorder, and other tests' shard `a` would overwrite them.
    let toml =
        lockrouter_testkit::config::one_named_shard(&cluster, "three", "count_interval_ms = 200");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let mut locks = Vec::new();
    for i in 0..5 {
        locks.push(api.must_acquire(&format!("m{i}"), 10_000, "A").await);
    }
    cluster.kill_member(0);
    // After at most an election, grants, renewals and releases go on.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut i = 0;
    while i < 5 {
        let r = api.acquire(&format!("after-{i}"), 10_000, "A").await;
        if r.body["acquired"] == true {
            i += 1;
            continue;
        }
        assert!(r.status == 503 && Instant::now() < deadline, "{r:?}");
        sleep_ms(100).await;
    }
    // Calls routed to the dead member may fail until the router's next
    // member probe takes it out of rotation; then everything succeeds.
    for lock in &locks {
        loop {
            let r = api.renew(lock).await;
            if r.status == 200 {
                break;
            }
            assert!(r.status == 503 && Instant::now() < deadline, "{r:?}");
            sleep_ms(100).await;
        }
    }
    let r = api.release(&locks[0]).await;
    assert_eq!(r.status, 204, "{r:?}");
    // The active-lock gauge counts what etcd holds: 4 + 5.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = api.metrics().await;
        if text
            .lines()
            .any(|l| l.starts_with("lockrouter_active_locks{shard=\"three\"} 9"))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no active-lock gauge of 9 in:\n{text}"
        );
        sleep_ms(200).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_that_lost_its_data_refuses_until_the_epoch_is_bumped() {
    let mut shards = [EtcdCluster::single(), EtcdCluster::single()];
    let router = TestRouter::start(&[&shards[0], &shards[1]]).await;
    let api = &router.api;
    let ring = lockrouter::ring::Ring::new(&router.settings.shards, router.settings.ring.vnodes);
    let on_b = |i: usize| {
        (0..)
            .map(|j| format!("w{i}-{j}"))
            .find(|n| ring.shard_index(n) == 1)
            .unwrap()
    };
    let mut last = 0;
    for i in 0..20 {
        last = last.max(api.must_acquire(&on_b(i), 5_000, "A").await.1);
    }
    // Shard b comes back empty: its revisions restart, so granting there at
    // the same epoch could hand out smaller tokens. It must refuse.
    shards[1].wipe();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ready = api.get("/readyz").await;
        if ready.body["refusingShards"] == json!(["b"]) {
            break;
        }
        assert!(Instant::now() < deadline, "{ready:?}");
        sleep_ms(100).await;
    }
    assert_eq!(api.acquire(&on_b(100), 5_000, "A").await.status, 503);
    // A shard that records nothing at all is initialised by a bump only
    // when the operator names it: the router cannot tell a shard that lost
    // its data from endpoints that reach the wrong, empty cluster.
    let refused = api.post("/admin/v1/bump-epoch", json!({})).await;
    assert_eq!(refused.status, 409, "{refused:?}");
    let message = refused.body["error"]["message"].as_str().unwrap();
    assert!(message.contains("reinitialize"), "{message}");
    let bumped = api
        .post("/admin/v1/bump-epoch", json!({"reinitialize": ["b"]}))
        .await;
    assert_eq!(
        (bumped.status, bumped.body["epoch"].as_u64()),
        (200, Some(2)),
        "{bumped:?}"
    );
    for i in 200..205 {
        let lock = api.must_acquire(&on_b(i), 5_000, "A").await;
        assert!(lock.1 > last, "token {} after {last}", lock.1);
    }
    let on_a = (0..)
        .map(|j| format!("a{j}"))
        .find(|n| ring.shard_index(n) == 0)
        .unwrap();
    assert!(api.must_acquire(&on_a, 5_000, "A").await.1 > last);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_started_with_different_shard_sets_never_both_grant() {
    for _ in 0..3 {
        let shards = three();
        let two = config_toml(&[&shards[0], &shards[1]], "127.0.0.1:0", "");
        let all = config_toml(&[&shards[0], &shards[1], &shards[2]], "127.0.0.1:0", "");
        let build = |toml: String| async move {
            let settings = lockrouter::Settings::from_toml(&toml).unwrap();
            let app = lockrouter::Application::build(settings).await.unwrap();
            let api = lockrouter_testkit::api::Api::new(app.local_addr());
            let stop = tokio_util::sync::CancellationToken::new();
            tokio::spawn(app.run(stop.clone()));
            (api, stop)
        };
        // Both start at once on empty shards, racing to initialise them.
        let ((a, stop_a), (b, stop_b)) = tokio::join!(build(two), build(all));
        // Keep trying until one of them grants (how soon depends on the
        // machine's load), checking all along that never both do.
        let mut granted = [0, 0];
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut i = 0;
        while granted[0] + granted[1] < 20 && Instant::now() < deadline {
            i += 1;
            for (k, api) in [&a, &b].into_iter().enumerate() {
                let r = api
                    .acquire(&format!("race-{i}"), 5_000, &format!("c{k}"))
                    .await;
                assert!(r.status == 200 || r.status == 503, "{r:?}");
                granted[k] += usize::from(r.body["acquired"] == true);
            }
            assert!(
                granted[0] == 0 || granted[1] == 0,
                "both replicas granted: {granted:?}"
            );
            sleep_ms(20).await;
        }
        assert!(granted[0] + granted[1] > 0, "neither granted");
        stop_a.cancel();
        stop_b.cancel();
    }
}
