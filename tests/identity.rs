//! Shard identity and ring epochs on real etcd: a replica whose endpoints
//! reach the wrong cluster (a typo, a swapped pair, a migration's recorded
//! previous shards) never grants there and is not ready; a shard copied to
//! another cluster or restored from a snapshot refuses until its epoch is
//! bumped; and no interleaving of bumps, migrations, crashes and wiped
//! shards ever reuses an epoch, so fencing tokens never go back.

use std::time::{Duration, Instant};

use lockrouter::config::ShardSettings;
use lockrouter::keys::{Keys, PreviousRing, Reservation, RingMeta};
use serde_json::json;

use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router::{FileRouter, TestRouter};
use lockrouter_testkit::router_process::RouterProcess;
use lockrouter_testkit::sleep_ms;

use crate::rebalance::{moving_name, ring, toml, wait_granting};

/// Polls `/readyz` until it shows the first shard `cluster_changed` (its
/// cluster id moved: copied or restored), and checks the replica stays
/// ready: every replica shares that problem.
async fn wait_cluster_changed(api: &lockrouter_testkit::api::Api) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ready = api.get("/readyz").await;
        if ready.body["shards"][0]["state"] == "cluster_changed" {
            assert_eq!(ready.status, 200, "{ready:?}");
            return;
        }
        assert!(Instant::now() < deadline, "{ready:?}");
        sleep_ms(50).await;
    }
}

/// Polls `/readyz` until it shows `state` for every shard, or panics.
async fn wait_states(api: &lockrouter_testkit::api::Api, state: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let sent = api.http.get(format!("{}/readyz", api.base)).send().await;
        let Ok(resp) = sent else {
            assert!(Instant::now() < deadline, "the router never listened");
            sleep_ms(50).await;
            continue; // not listening yet
        };
        let r = api.send(api.http.get(format!("{}/readyz", api.base))).await;
        drop(resp);
        let shards = r.body["shards"].as_array().cloned().unwrap_or_default();
        if !shards.is_empty() && shards.iter().all(|s| s["state"] == state) {
            assert_eq!(
                r.status, 503,
                "a replica with {state} shards is not ready: {r:?}"
            );
            return r.body;
        }
        assert!(Instant::now() < deadline, "never all {state}: {r:?}");
        sleep_ms(50).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapped_endpoints_never_grant_a_name_twice_and_are_not_ready() {
    let (c1, c2) = (EtcdCluster::single(), EtcdCluster::single());
    let good = TestRouter::with_toml(&toml(&[("a", &c1, 1), ("b", &c2, 1)])).await;
    let port = free_port();
    let bad_toml =
        toml(&[("a", &c2, 1), ("b", &c1, 1)]).replace("127.0.0.1:0", &format!("127.0.0.1:{port}"));
    let bad = RouterProcess::spawn(&bad_toml, port);
    let body = wait_states(&bad.api, "identity_mismatch").await;
    assert_eq!(body["ready"], false, "{body}");
    for i in 0..40 {
        let name = format!("order:{i}");
        good.api.must_acquire(&name, 10_000, "X").await;
        let r = bad.api.acquire(&name, 10_000, "Y").await;
        assert_eq!(
            r.status, 503,
            "{name} granted through the miswired replica: {r:?}"
        );
        assert_eq!(r.body["error"]["code"], "shard_unavailable");
    }
    let log = bad.log_text();
    assert!(
        log.contains("the etcd cluster at these endpoints is shard"),
        "the log names the mismatch:\n{log}"
    );
    // Renew and release through the miswired replica touch nothing either.
    let lock = good.api.must_acquire("kept", 10_000, "X").await;
    assert_eq!(bad.api.renew(&lock).await.status, 503);
    assert_eq!(bad.api.release(&lock).await.status, 503);
    assert_eq!(good.api.renew(&lock).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_with_swapped_endpoints_racing_on_fresh_shards_never_both_grant() {
    for _ in 0..3 {
        let (c1, c2) = (EtcdCluster::single(), EtcdCluster::single());
        let (t1, t2) = (
            toml(&[("a", &c1, 1), ("b", &c2, 1)]),
            toml(&[("a", &c2, 1), ("b", &c1, 1)]),
        );
        let (one, two) = tokio::join!(TestRouter::spawn(&t1), TestRouter::spawn(&t2));
        let deadline = Instant::now() + Duration::from_secs(4);
        let mut i = 0;
        while Instant::now() < deadline {
            i += 1;
            let name = format!("race-{i}");
            let (x, y) = tokio::join!(
                one.api.acquire(&name, 10_000, "X"),
                two.api.acquire(&name, 10_000, "Y")
            );
            assert!(
                !(x.body["acquired"] == true && y.body["acquired"] == true),
                "{name} granted by both: {x:?} {y:?}"
            );
            sleep_ms(20).await;
        }
    }
}

/// Writes `meta` as the ring record of `cluster`.
async fn write_ring(cluster: &EtcdCluster, meta: &RingMeta) {
    let keys = Keys::new("/lockrouter");
    let mut c = cluster.client().await;
    c.put(keys.ring(), meta.to_bytes(), None).await.unwrap();
}

async fn read_ring(cluster: &EtcdCluster) -> RingMeta {
    let keys = Keys::new("/lockrouter");
    let mut c = cluster.client().await;
    let got = c.get(keys.ring(), None).await.unwrap();
    serde_json::from_slice(got.kvs()[0].value()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_whose_previous_shards_reach_the_wrong_cluster_hands_nothing_off() {
    let (c1, c2, c3) = (
        EtcdCluster::single(),
        EtcdCluster::single(),
        EtcdCluster::single(),
    );
    let before = [("a", &c1, 1), ("b", &c2, 1)];
    let after = [("a", &c1, 1), ("b", &c2, 1), ("c", &c3, 1)];
    let r = FileRouter::start(&toml(&before)).await;
    let name = moving_name(&ring(&before), "a", &ring(&after), "c");
    let held = r.api.must_acquire(&name, 30_000, "X").await;
    assert_eq!(r.reload(&toml(&after)).await.status, 200);
    wait_granting(&r).await;
    // Now the recorded previous ring says shard "a" is at c2 (shard b's
    // cluster): a replica following it would look for the holder there.
    let open = read_ring(&c1).await;
    let mut wrong = open.clone();
    let previous = wrong.previous.as_mut().unwrap();
    let swapped: Vec<ShardSettings> = previous
        .shards
        .iter()
        .map(|s| ShardSettings {
            endpoints: if s.name == "a" {
                c2.endpoints()
            } else {
                c1.endpoints()
            },
            ..s.clone()
        })
        .collect();
    *previous = PreviousRing {
        shards: swapped,
        ..previous.clone()
    };
    for c in [&c1, &c2, &c3] {
        write_ring(c, &wrong).await;
    }
    let until = Instant::now() + Duration::from_secs(3);
    let mut refused = 0;
    while Instant::now() < until {
        let r2 = r.api.acquire(&name, 10_000, "Y").await;
        assert_ne!(
            r2.body["acquired"], true,
            "{name} handed off while held: {r2:?}"
        );
        refused += usize::from(r2.status == 503);
        sleep_ms(50).await;
    }
    assert!(refused > 0, "the wrong previous shard was never noticed");
    assert_eq!(
        r.api.renew(&held).await.status,
        200,
        "the holder keeps its lock"
    );
    // Put the record right: the handoff works again.
    for c in [&c1, &c2, &c3] {
        write_ring(c, &open).await;
    }
    assert_eq!(r.api.release(&held).await.status, 204);
    let deadline = Instant::now() + Duration::from_secs(10);
    let moved = loop {
        let got = r.api.acquire(&name, 10_000, "Y").await;
        if got.body["acquired"] == true {
            break got.body["fencingToken"].as_u64().unwrap();
        }
        assert!(Instant::now() < deadline, "{got:?}");
        sleep_ms(100).await;
    };
    assert!(moved > held.1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_copied_to_another_cluster_refuses_until_the_epoch_is_bumped() {
    let (c1, c2, copy) = (
        EtcdCluster::single(),
        EtcdCluster::single(),
        EtcdCluster::single(),
    );
    let shards = [("a", &c1, 1), ("b", &c2, 1)];
    let r = FileRouter::start(&toml(&shards)).await;
    let on_a: Vec<String> = (0..)
        .map(|i| format!("copied-{i}"))
        .filter(|n| ring(&shards).shard_name(n) == "a")
        .take(5)
        .collect();
    let mut last = 0;
    for n in &on_a {
        last = last.max(r.api.must_acquire(n, 30_000, "X").await.1);
    }
    // Copy every key of shard a into another cluster (as a restore from a
    // snapshot into new members, or a mirror, would): revisions restart.
    let (mut from, mut to) = (c1.client().await, copy.client().await);
    let all = from
        .get(
            "/lockrouter",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    for kv in all.kvs() {
        to.put(kv.key(), kv.value(), None).await.unwrap();
    }
    assert!(
        r.reload(&toml(&[("a", &copy, 1), ("b", &c2, 1)]))
            .await
            .status
            == 200
    );
    wait_cluster_changed(&r.api).await;
    let fresh = (0..)
        .map(|i| format!("after-copy-{i}"))
        .find(|n| ring(&shards).shard_name(n) == "a")
        .unwrap();
    assert_eq!(r.api.acquire(&fresh, 5_000, "Y").await.status, 503);
    let bumped = r.api.post("/admin/v1/bump-epoch", json!({})).await;
    assert_eq!(bumped.status, 200, "{bumped:?}");
    wait_granting(&r).await;
    let token = r.api.must_acquire(&fresh, 5_000, "Y").await.1;
    assert!(token > last, "token {token} after {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_never_reuses_an_epoch_a_bump_has_used() {
    let (c1, c2, c3) = (
        EtcdCluster::single(),
        EtcdCluster::single(),
        EtcdCluster::single(),
    );
    let before = [("a", &c1, 1), ("b", &c2, 1)];
    let after = [("a", &c1, 1), ("b", &c2, 1), ("c", &c3, 1)];
    let r = FileRouter::start(&toml(&before)).await;
    let name = moving_name(&ring(&before), "a", &ring(&after), "c");
    // What an opening interrupted after it reached the joining shard left
    // behind (an opening at the next epoch, 2, recorded on c only) ...
    let (x, y) = (ring(&before), ring(&after));
    let settings = |s: &[(&str, &EtcdCluster, u32)]| -> Vec<ShardSettings> {
        s.iter()
            .map(|(n, c, w)| ShardSettings {
                name: n.to_string(),
                endpoints: c.endpoints(),
                weight: *w,
                ..ShardSettings::default()
            })
            .collect()
    };
    write_ring(
        &c3,
        &RingMeta {
            epoch: 2,
            ring: y.fingerprint().to_string(),
            previous: Some(PreviousRing {
                ring: x.fingerprint().to_string(),
                vnodes: 160,
                shards: settings(&before),
            }),
        },
    )
    .await;
    // ... then a bump by a replica still on the old ring: epoch 2 on a, b.
    let bumped = r.api.post("/admin/v1/bump-epoch", json!({})).await;
    assert_eq!(bumped.body["epoch"], 2, "{bumped:?}");
    wait_granting(&r).await;
    let mut last = 0;
    for _ in 0..10 {
        let lock = r.api.must_acquire(&name, 30_000, "X").await;
        last = last.max(lock.1);
        assert_eq!(r.api.release(&lock).await.status, 204);
    }
    // Now the reload to the new ring opens the migration: the name moves to
    // c, whose revisions are far below a's. Its tokens must still grow.
    assert_eq!(
        r.reload(&toml(&after)).await.status,
        200,
        "{}",
        r.ring().await
    );
    wait_granting(&r).await;
    let moved = acquire_once_attached(&r, &name, "Y").await;
    assert_eq!(r.api.inspect(&name).await.body["shard"], "c");
    assert!(moved.1 > last, "token {} after {last}", moved.1);
    assert!(r.ring().await["epoch"].as_u64().unwrap() >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bump_after_a_crashed_bump_and_a_wiped_shard_goes_past_its_epoch() {
    let (mut c1, c2) = (EtcdCluster::single(), EtcdCluster::single());
    let shards = [("a", &c1, 1), ("b", &c2, 1)];
    let placed = ring(&shards);
    let r = FileRouter::start(&toml(&shards)).await;
    let on_a = |i: usize| {
        (0..)
            .map(|j| format!("w{i}-{j}"))
            .find(|n| placed.shard_name(n) == "a")
            .unwrap()
    };
    // A bump that crashed after reserving epoch 2 everywhere and recording
    // it on shard a only.
    let keys = Keys::new("/lockrouter");
    let reservation = Reservation {
        epoch: 2,
        by: "crashed".into(),
    };
    for c in [&c1, &c2] {
        let mut client = c.client().await;
        client
            .put(keys.epoch(), reservation.to_bytes(), None)
            .await
            .unwrap();
    }
    let mut at_two = read_ring(&c1).await;
    at_two.epoch = 2;
    write_ring(&c1, &at_two).await;
    // Shard a grants at epoch 2 ...
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = 0;
    let mut i = 0;
    while last >> 47 != 2 {
        assert!(
            Instant::now() < deadline,
            "shard a never granted at epoch 2"
        );
        let got = r.api.acquire(&on_a(i), 30_000, "X").await;
        if got.body["acquired"] == true {
            last = last.max(got.body["fencingToken"].as_u64().unwrap());
        }
        i += 1;
        sleep_ms(20).await;
    }
    for j in i..i + 20 {
        last = last.max(r.api.must_acquire(&on_a(j), 30_000, "X").await.1);
    }
    // ... then loses its data. The next bump must not record epoch 2 again.
    c1.wipe();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let bumped = r
            .api
            .post("/admin/v1/bump-epoch", json!({"reinitialize": ["a"]}))
            .await;
        if bumped.status == 200 {
            assert_eq!(bumped.body["epoch"], 3, "{bumped:?}");
            break;
        }
        assert!(Instant::now() < deadline, "{bumped:?}");
        sleep_ms(100).await;
    }
    wait_granting(&r).await;
    for j in 1000..1005 {
        let token = r.api.must_acquire(&on_a(j), 30_000, "Y").await.1;
        assert!(token > last, "token {token} after {last}");
    }
}

/// The snapshot restore runbook (docs/operations.md), end to end with
/// etcd's own tools: shard `a` is backed up with `etcdctl snapshot save`,
/// grants go on (its revisions, so tokens, grow past the snapshot's), then
/// its member is restored from the snapshot with a new cluster token, as
/// the runbook asks. Every replica sees `cluster_changed` and refuses to
/// grant there (a grant could hand out a token below ones already given);
/// the other shard keeps serving. After `bump-epoch` with no body, every
/// new grant exceeds every earlier token, and a lock the snapshot brought
/// back keeps its name until its lease and lock-delay have passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_restored_from_a_snapshot_refuses_until_the_epoch_is_bumped() {
    let (mut c1, c2) = (EtcdCluster::single(), EtcdCluster::single());
    let (placed, config) = {
        let shards = [("a", &c1, 1), ("b", &c2, 1)];
        (ring(&shards), toml(&shards))
    };
    let names = |prefix: &str, shard: &str, n: usize| -> Vec<String> {
        (0..)
            .map(|i| format!("{prefix}-{i}"))
            .filter(|name| placed.shard_name(name) == shard)
            .take(n)
            .collect()
    };
    let r = FileRouter::start(&config).await;
    wait_granting(&r).await;
    // Held when the snapshot is taken: it comes back with the restore.
    let revived = names("revived", "a", 1).remove(0);
    let old = r.api.must_acquire(&revived, 3_000, "old").await;
    let dir = tempfile::tempdir().unwrap();
    let snapshot = dir.path().join("a.db");
    c1.snapshot(&snapshot);
    let mut last = old.1;
    for n in names("after", "a", 20) {
        let lock = r.api.must_acquire(&n, 30_000, "X").await;
        last = last.max(lock.1);
        assert_eq!(r.api.release(&lock).await.status, 204);
    }
    let on_b = names("b", "b", 1).remove(0);

    c1.restore(&snapshot, "restored-1");
    wait_cluster_changed(&r.api).await;
    let fresh = names("fresh", "a", 3);
    let refused = r.api.acquire(&fresh[0], 5_000, "Y").await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert!(refused.retry_after.is_some(), "{refused:?}");
    let elsewhere = r.api.must_acquire(&on_b, 5_000, "Y").await;

    let bumped = r.api.post("/admin/v1/bump-epoch", json!({})).await;
    assert_eq!(bumped.status, 200, "{bumped:?}");
    wait_granting(&r).await;
    for n in &fresh {
        let token = r.api.must_acquire(n, 5_000, "Y").await.1;
        assert!(token > last, "token {token} after {last}");
    }
    assert!(
        r.api
            .must_acquire(&names("b2", "b", 1)[0], 5_000, "Y")
            .await
            .1
            > elsewhere.1
    );
    // The lock the snapshot brought back holds its name, then the name is
    // granted again, above every earlier token.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut attempts = 0;
    let token = loop {
        let r = r.api.acquire(&revived, 5_000, "Y").await;
        assert_eq!(r.status, 200, "{r:?}");
        attempts += 1;
        if r.body["acquired"] == true {
            assert!(
                attempts > 1,
                "the lock from the snapshot did not hold its name"
            );
            break r.body["fencingToken"].as_u64().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "the revived lock never let go: {r:?}"
        );
        sleep_ms(250).await;
    };
    assert!(token > last, "token {token} after {last}");
}

/// `name` acquired for `client` (TTL 30 s) once the router grants it on
/// the shard it moved to: right after a reload, a shard whose ring record
/// the router's monitor has not read again since (here c's, the opening
/// left there before the bump) refuses grants with a 503 and Retry-After
/// ("the shard records a migration this router has not attached yet")
/// until the monitor's next read. Retried as a client would, for up to
/// 10 s; any other answer must be the grant.
async fn acquire_once_attached(r: &FileRouter, name: &str, client: &str) -> (String, u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = r.api.acquire(name, 30_000, client).await;
        let unattached = reply.status == 503
            && reply.retry_after.is_some()
            && (reply.body["error"]["message"].as_str())
                .is_some_and(|m| m.contains("has not attached yet"));
        if unattached && Instant::now() < deadline {
            sleep_ms(100).await;
            continue;
        }
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.body["acquired"], true, "{reply:?}");
        return (
            reply.body["lockId"].as_str().unwrap().to_string(),
            reply.body["fencingToken"].as_u64().unwrap(),
        );
    }
}
