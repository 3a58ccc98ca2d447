//! Rebalancing by config reload on real etcd, with several router replicas:
//! no double grant, monotonic tokens, holders on a moved name's previous
//! shard keep it until they let go, removed shards drain, replicas that
//! reload late or restart mid-migration stay safe.

use std::time::{Duration, Instant};

use futures::future::join_all;
use lockrouter::config::ShardSettings;
use lockrouter::ring::Ring;
use serde_json::json;

use lockrouter_testkit::api::Api;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::history::{Grant, History};
use lockrouter_testkit::router::FileRouter;
use lockrouter_testkit::sleep_ms;

/// A router config over `(name, cluster, weight)` shards.
pub(crate) fn toml(shards: &[(&str, &EtcdCluster, u32)]) -> String {
    let mut t = String::from(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[etcd]\nrequest_timeout_ms = 1000\n\
         connect_timeout_ms = 500\nhealth_interval_ms = 100\ncount_interval_ms = 200\n\n\
         [admin]\nreload_poll_ms = 200\n",
    );
    for (name, cluster, weight) in shards {
        let eps: Vec<String> = cluster
            .endpoints()
            .iter()
            .map(|e| format!("\"{e}\""))
            .collect();
        t.push_str(&format!(
            "\n[[shards]]\nname = \"{name}\"\nendpoints = [{}]\nweight = {weight}\n",
            eps.join(", ")
        ));
    }
    t
}

pub(crate) fn ring(shards: &[(&str, &EtcdCluster, u32)]) -> Ring {
    let settings: Vec<ShardSettings> = shards
        .iter()
        .map(|(name, c, weight)| ShardSettings {
            name: name.to_string(),
            endpoints: c.endpoints(),
            weight: *weight,
            ..ShardSettings::default()
        })
        .collect();
    Ring::new(&settings, 160)
}

/// The first name `from` places on shard `a` and `to` on shard `b`.
pub(crate) fn moving_name(from: &Ring, a: &str, to: &Ring, b: &str) -> String {
    (0..)
        .map(|i| format!("mover-{i}"))
        .find(|n| from.shard_name(n) == a && to.shard_name(n) == b)
        .unwrap()
}

pub(crate) async fn wait_granting(r: &FileRouter) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while r.ring().await["granting"] != true {
        assert!(
            Instant::now() < deadline,
            "router never grants: {}",
            r.ring().await
        );
        sleep_ms(50).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_name_moves_only_when_its_holder_lets_go() {
    let (ca, cb, cc) = (
        EtcdCluster::single(),
        EtcdCluster::single(),
        EtcdCluster::single(),
    );
    let before = [("a", &ca, 1), ("b", &cb, 1)];
    let after = [("a", &ca, 1), ("b", &cb, 1), ("c", &cc, 1)];
    let name = moving_name(&ring(&before), "a", &ring(&after), "c");
    let r1 = FileRouter::start(&toml(&before)).await;
    let held = r1.api.must_acquire(&name, 10_000, "holder").await;

    let r = r1.reload(&toml(&after)).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        (
            r.body["placementChanged"].as_bool(),
            r.body["migrationOpened"].as_bool()
        ),
        (Some(true), Some(true))
    );
    wait_granting(&r1).await;
    let state = r1.ring().await;
    assert_eq!(state["epoch"], 2, "{state}");
    assert!(state["migration"].is_object(), "{state}");

    // Not granted on its new shard while held on its previous one.
    let other = r1.api.acquire(&name, 5_000, "other").await;
    assert_eq!(other.body["acquired"], false, "{other:?}");
    assert_eq!(r1.api.renew(&held).await.status, 200);
    let seen = r1.api.inspect(&name).await;
    assert_eq!(
        (
            seen.body["shard"].as_str(),
            seen.body["fencingToken"].as_u64()
        ),
        (Some("a"), Some(held.1))
    );
    // The holder's re-acquire is answered from where it holds.
    assert_eq!(r1.api.must_acquire(&name, 10_000, "holder").await, held);

    // Another placement change waits for this migration to close.
    let refused = r1
        .reload(&toml(&[("a", &ca, 1), ("b", &cb, 2), ("c", &cc, 1)]))
        .await;
    assert_eq!(refused.status, 409, "{refused:?}");
    assert_eq!(refused.body["error"]["code"], "failed_precondition");
    assert!(refused.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("still open"));
    std::fs::write(&r1.path, toml(&after)).unwrap();

    // A replica started mid-migration picks the migration up from etcd.
    let r2 = FileRouter::start(&toml(&after)).await;
    wait_granting(&r2).await;
    assert_eq!(
        r2.api.acquire(&name, 5_000, "other").await.body["acquired"],
        false
    );
    let ring_after = ring(&after);
    let stays = (0..)
        .map(|i| format!("stay-{i}"))
        .find(|n| ring_after.shard_name(n) == "b")
        .unwrap();
    r2.api.must_acquire(&stays, 5_000, "other").await;

    // Released: granted on the new shard, with a larger token.
    assert_eq!(r2.api.release(&held).await.status, 204);
    let moved = r2.api.must_acquire(&name, 5_000, "other").await;
    assert!(moved.1 > held.1, "{} after {}", moved.1, held.1);
    assert_eq!(r1.api.inspect(&name).await.body["shard"], "c");
    r1.wait_migration_closed(Duration::from_secs(15)).await;
    r2.wait_migration_closed(Duration::from_secs(15)).await;
    assert_eq!(r1.api.renew(&moved).await.status, 200);
}

/// With thousands of locks held, the migration counts exactly the moved
/// ones still on their previous shard, in one pass of its scan (read in
/// slices of the hash space, as etcd 3.4 reads a whole range before it
/// applies a limit): a scan that missed keys would count fewer and could
/// close the migration while a moved name is still held there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_moved_locks_are_counted_exactly() {
    const HELD: usize = 3_000;
    let (ca, cb) = (EtcdCluster::single(), EtcdCluster::single());
    let before = [("a", &ca, 1)];
    let after = [("a", &ca, 1), ("b", &cb, 1)];
    let r1 = FileRouter::start(&toml(&before)).await;
    let names: Vec<String> = (0..HELD).map(|i| format!("many-{i}")).collect();
    let mut held = Vec::new();
    // A holder per chunk: one clientId may acquire at most
    // `limits.acquires_per_client_per_sec` (1,000) a second.
    for (c, chunk) in names.chunks(HELD / 8).enumerate() {
        let api = r1.api.clone();
        let chunk = chunk.to_vec();
        held.push(tokio::spawn(async move {
            let mut locks = Vec::new();
            for name in chunk {
                locks.push(
                    api.must_acquire(&name, 60_000, &format!("holder-{c}"))
                        .await,
                );
            }
            locks
        }));
    }
    let held: Vec<(String, u64)> = join_all(held)
        .await
        .into_iter()
        .flat_map(|r| r.unwrap())
        .collect();
    let new = ring(&after);
    let moved = names.iter().filter(|n| new.shard_name(n) == "b").count();
    assert!(moved > 1_000, "{moved} of {HELD} move");
    assert_eq!(r1.reload(&toml(&after)).await.status, 200);
    wait_granting(&r1).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let counted = r1.ring().await["migration"]["movedLocksHeld"]["a"].as_u64();
        if counted == Some(moved as u64) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "moved locks held on a: {counted:?}, {moved} are"
        );
        sleep_ms(100).await;
    }
    for chunk in held.chunks(100) {
        let released = join_all(chunk.iter().map(|l| r1.api.release(l))).await;
        let refused: Vec<_> = released.iter().filter(|r| r.status != 204).collect();
        assert!(refused.is_empty(), "{refused:?}");
    }
    r1.wait_migration_closed(Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_shard_drains_and_is_dropped() {
    let (ca, cb) = (EtcdCluster::single(), EtcdCluster::single());
    let before = [("a", &ca, 1), ("b", &cb, 1)];
    let r = FileRouter::start(&toml(&before)).await;
    let on_a = (0..)
        .map(|i| format!("n-{i}"))
        .find(|n| ring(&before).shard_name(n) == "a")
        .unwrap();
    let lock = r.api.must_acquire(&on_a, 10_000, "holder").await;
    assert_eq!(r.reload(&toml(&[("b", &cb, 1)])).await.status, 200);
    wait_granting(&r).await;
    let state = r.ring().await;
    let draining: Vec<_> = state["shards"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["state"] == "draining")
        .collect();
    assert_eq!(draining.len(), 1, "{state}");
    assert_eq!(draining[0]["name"], "a");
    // Counted at the monitor's next count (every 200 ms here).
    let deadline = Instant::now() + Duration::from_secs(10);
    while r.ring().await["migration"]["movedLocksHeld"]["a"] != 1 {
        assert!(Instant::now() < deadline, "{}", r.ring().await);
        sleep_ms(50).await;
    }
    assert_eq!(
        r.api.renew(&lock).await.status,
        200,
        "the holder keeps renewing on the draining shard"
    );
    assert_eq!(
        r.api.acquire(&on_a, 5_000, "other").await.body["acquired"],
        false
    );
    assert_eq!(r.api.release(&lock).await.status, 204);
    r.wait_migration_closed(Duration::from_secs(15)).await;
    let state = r.ring().await;
    assert_eq!(state["shards"].as_array().unwrap().len(), 1, "{state}");
    // The router cannot tell a removed shard from one it has not learned
    // of yet: unavailable, never a false "expired" or a release that did
    // nothing.
    let renew = r.api.renew(&lock).await;
    let code = renew.body["error"]["code"].as_str();
    assert_eq!((renew.status, code), (503, Some("shard_unavailable")));
    let again = r.api.must_acquire(&on_a, 5_000, "other").await;
    assert!(again.1 > lock.1);
    assert_eq!(r.api.inspect(&on_a).await.body["shard"], "b");
}

/// One worker: acquire a random hot name through a random replica, hold it
/// briefly, release; record everything.
async fn worker(id: usize, apis: Vec<Api>, history: History, stop: Instant) {
    let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ (id as u64 + 1);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let client = format!("worker-{id}");
    while Instant::now() < stop {
        let api = &apis[(next() % apis.len() as u64) as usize];
        let name = format!("hot-{}", next() % 6);
        history.attempt();
        let sent = Instant::now();
        let r = api.acquire(&name, 2_000, &client).await;
        let received = Instant::now();
        if r.status != 200 {
            history.refused(
                r.status,
                r.body["error"]["code"].as_str().unwrap_or(""),
                received,
            );
            sleep_ms(20).await;
            continue;
        }
        if r.body["acquired"] != true {
            sleep_ms(next() % 10).await;
            continue;
        }
        let lock = (
            r.body["lockId"].as_str().unwrap().to_string(),
            r.body["fencingToken"].as_u64().unwrap(),
        );
        let index = history.granted(Grant {
            name,
            lock_id: lock.0.clone(),
            token: lock.1,
            sent,
            received,
            expires_in: Duration::from_millis(r.body["expiresInMs"].as_u64().unwrap()),
            released: None,
        });
        sleep_ms(5 + next() % 25).await;
        let api = &apis[(next() % apis.len() as u64) as usize];
        history.released(index, Instant::now());
        let r = api.release(&lock).await;
        if r.status != 204 {
            history.refused(
                r.status,
                r.body["error"]["code"].as_str().unwrap_or(""),
                Instant::now(),
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_double_grant_while_shards_are_added_removed_and_reweighted() {
    let (ca, cb, cc) = (
        EtcdCluster::single(),
        EtcdCluster::single(),
        EtcdCluster::single(),
    );
    let steps = [
        vec![("a", &ca, 1), ("b", &cb, 1), ("c", &cc, 1)],
        vec![("b", &cb, 1), ("c", &cc, 1)],
        vec![("b", &cb, 2), ("c", &cc, 1)],
    ];
    let first = toml(&[("a", &ca, 1), ("b", &cb, 1)]);
    let (r1, r2) = (
        FileRouter::start(&first).await,
        FileRouter::start(&first).await,
    );
    let history = History::default();
    let stop = Instant::now() + Duration::from_secs(120);
    let stop_flag = tokio_util::sync::CancellationToken::new();
    let apis = vec![r1.api.clone(), r2.api.clone()];
    let workers: Vec<_> = (0..6)
        .map(|i| {
            let (apis, history, stop_flag) = (apis.clone(), history.clone(), stop_flag.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = worker(i, apis, history, stop) => {}
                    _ = stop_flag.cancelled() => {}
                }
            })
        })
        .collect();
    sleep_ms(500).await;
    for step in &steps {
        let text = toml(step);
        let fence_start = Instant::now();
        let r = r1.reload(&text).await;
        assert_eq!(r.status, 200, "{r:?}");
        // The second replica is late: it sees the new file only when it
        // polls it, after serving a while on the old ring.
        sleep_ms(700).await;
        std::fs::write(&r2.path, &text).unwrap();
        r1.wait_migration_closed(Duration::from_secs(30)).await;
        r2.wait_migration_closed(Duration::from_secs(30)).await;
        history.allow_unavailable(fence_start, Instant::now() + Duration::from_millis(500));
        sleep_ms(500).await;
    }
    stop_flag.cancel();
    join_all(workers).await;
    let (grants, attempts, refused) = history.check();
    assert!(grants >= 50, "only {grants} grants in {attempts} attempts");
    // The late replica refused while on the old ring (it did not grant).
    assert!(refused > 0, "no acquire was refused by the late replica");
    let state = r2.ring().await;
    assert_eq!(state["epoch"], 4, "{state}");
    assert_eq!(r1.ring().await["ring"], state["ring"]);
    assert_eq!(r1.api.post("/admin/v1/reload", json!({})).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_never_reloaded_follows_a_move_back_to_its_ring() {
    let (ca, cb, cc) = (
        EtcdCluster::single(),
        EtcdCluster::single(),
        EtcdCluster::single(),
    );
    let x = [("a", &ca, 1), ("b", &cb, 1)];
    let y = [("a", &ca, 1), ("b", &cb, 1), ("c", &cc, 1)];
    let mover = FileRouter::start(&toml(&x)).await;
    // The stayer never reloads and looks at the shards rarely, so the whole
    // X -> Y -> X round trip can happen between two of its looks; its first
    // acquire afterwards then finds its own ring recorded again, with an
    // open migration it has not attached yet.
    let slow = toml(&x).replace("health_interval_ms = 100", "health_interval_ms = 3000");
    let stayer = FileRouter::start(&slow).await;
    std::fs::write(&stayer.path, "not read again").unwrap();
    assert_eq!(mover.reload(&toml(&y)).await.status, 200);
    mover.wait_migration_closed(Duration::from_secs(15)).await;
    let name = moving_name(&ring(&y), "c", &ring(&x), "a");
    let held = mover.api.must_acquire(&name, 10_000, "holder").await;
    assert_eq!(mover.reload(&toml(&x)).await.status, 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = stayer.api.acquire(&name, 5_000, "other").await;
        assert!(
            r.body["acquired"] != true,
            "granted while held on its previous shard: {r:?}"
        );
        if r.status == 200 {
            break; // it follows the migration now: acquired false
        }
        assert!(Instant::now() < deadline, "{r:?}");
        sleep_ms(50).await;
    }
    assert_eq!(stayer.api.release(&held).await.status, 204);
    let moved = stayer.api.must_acquire(&name, 5_000, "other").await;
    assert!(moved.1 > held.1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_reload_is_retried_until_it_can_open() {
    let (ca, cb) = (EtcdCluster::single(), EtcdCluster::single());
    let mut cc = EtcdCluster::single();
    let before = [("a", &ca, 1), ("b", &cb, 1)];
    let r = FileRouter::start(&toml(&before)).await;
    cc.kill();
    let after = toml(&[("a", &ca, 1), ("b", &cb, 1), ("c", &cc, 1)]);
    let refused = r.reload(&after).await;
    assert_eq!(refused.status, 409, "{refused:?}");
    assert!(refused.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("reachable"));
    assert_eq!(r.ring().await["epoch"], 1, "nothing changed");
    r.api.must_acquire("still-served", 5_000, "A").await;
    // A prefix change is refused outright.
    let moved_prefix = r
        .reload(&toml(&before).replace("[etcd]", "[etcd]\nprefix = \"/elsewhere\""))
        .await;
    assert_eq!(moved_prefix.status, 409);
    assert!(moved_prefix.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("prefix"));
    // The file still asks for shard c: once c answers, a poll opens it.
    std::fs::write(&r.path, &after).unwrap();
    cc.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    while r.ring().await["epoch"] != 2 {
        assert!(Instant::now() < deadline, "{}", r.ring().await);
        sleep_ms(100).await;
    }
    r.wait_migration_closed(Duration::from_secs(15)).await;
}

/// A waiting acquire that outlives the router it started on. Each name is
/// held on `a`; a first waiter queues behind the holder through a second
/// router process, which then stops (SIGSTOP); a second waiter queues
/// behind it through `r`. `r` reloads (the names move from `a` to `c`), the
/// holders release, and the migration closes, while the second waiters
/// sleep (they wake only to renew, every ~1.7 s). When the stopped
/// waiters' entries expire, the second waiters wake first in line on `a`,
/// still on the old ring's router, and `a` now records the new ring,
/// closed: they must not be granted there, since routers on the new ring
/// grant these names on `c` without any handoff check. Four names, so that
/// some waiter sleeps through the whole migration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_left_on_the_old_ring_never_gets_a_moved_name() {
    use lockrouter_testkit::loopback::free_port;
    use lockrouter_testkit::router_process::RouterProcess;
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let (ca, cb, cc) = (
        EtcdCluster::single(),
        EtcdCluster::single(),
        EtcdCluster::single(),
    );
    let before = [("a", &ca, 1), ("b", &cb, 1)];
    let after = [("a", &ca, 1), ("b", &cb, 1), ("c", &cc, 1)];
    let (x, y) = (ring(&before), ring(&after));
    let names: Vec<String> = (0..)
        .map(|i| format!("left-{i}"))
        .filter(|n| x.shard_name(n) == "a" && y.shard_name(n) == "c")
        .take(4)
        .collect();
    let r = FileRouter::start(&toml(&before)).await;
    let port = free_port();
    let stopped = RouterProcess::spawn(
        &toml(&before).replace("127.0.0.1:0", &format!("127.0.0.1:{port}")),
        port,
    );
    stopped.api.wait_ready().await;
    let mut held = Vec::new();
    for n in &names {
        held.push(r.api.must_acquire(n, 30_000, "holder").await);
    }
    let wait = |api: &Api, name: &str, client: &str| {
        let (api, name, client) = (api.clone(), name.to_string(), client.to_string());
        tokio::spawn(async move {
            let body = json!({"name": name, "ttlMs": 30_000, "clientId": client, "waitMs": 30_000});
            let reply = api.post("/api/v1/locks/acquire", body).await;
            (reply, Instant::now())
        })
    };
    let blockers: Vec<_> = names
        .iter()
        .map(|n| wait(&stopped.api, n, "blocker"))
        .collect();
    sleep_ms(500).await;
    let late: Vec<_> = names.iter().map(|n| wait(&r.api, n, "late")).collect();
    sleep_ms(500).await;
    let pid = Pid::from_raw(stopped.pid() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    let stopped_now = || lockrouter_testkit::procfs::threads_stopped(stopped.pid());
    assert!(
        lockrouter_testkit::child::poll_until(Duration::from_secs(10), stopped_now),
        "the stopped replica did not stop"
    );

    assert_eq!(r.reload(&toml(&after)).await.status, 200);
    for lock in &held {
        assert_eq!(r.api.release(lock).await.status, 204);
    }
    r.wait_migration_closed(Duration::from_secs(15)).await;
    let closed = Instant::now();

    let mut exercised = 0;
    for (name, task) in names.iter().zip(late) {
        let (reply, at) = task.await.unwrap();
        let moved = r.api.acquire(name, 5_000, "newcomer").await;
        eprintln!(
            "{name}: the late waiter got {} {} ({} after the close); a newcomer got {} {}",
            reply.status,
            reply.body,
            if at > closed { "answered" } else { "not" },
            moved.status,
            moved.body
        );
        assert!(
            !(reply.body["acquired"] == true && moved.body["acquired"] == true),
            "{name} granted twice: on a to the late waiter ({:?}), on c to a newcomer ({:?})",
            reply.body,
            moved.body
        );
        assert_ne!(
            reply.body["acquired"], true,
            "{name} granted by a router of the old ring after its shard was fenced: {:?}",
            reply.body
        );
        if at > closed {
            exercised += 1;
        }
    }
    for b in blockers {
        b.abort(); // their router is stopped and about to be killed
    }
    kill(pid, Signal::SIGCONT).unwrap();
    drop(stopped);
    assert!(
        exercised > 0,
        "every late waiter woke while the migration was open: the interleaving was not reached"
    );
}
