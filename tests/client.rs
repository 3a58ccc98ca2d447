//! The client SDK (`lockrouter-client`) against real routers and etcd:
//! background renewal (one batched request per interval for many locks),
//! release and release on drop, losing locks by the client's own clock when
//! the router or a shard is gone, losing them at once when the router says
//! so, renewing lock by lock when the router refuses a whole batch, and
//! `with_lock`; releases retried while the router is away; one holder per
//! name within a client (re-entrant only when asked); waits longer than the
//! router's cap; metadata, inspect and extend.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use lockrouter_client::{AcquireOptions, Client, Error, Lock, LostReason};
use serde_json::json;

use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::router_process::RouterProcess;
use lockrouter_testkit::sleep_ms;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Sum of one counter's series whose labels contain `labels`, from a
/// router's `/metrics`.
async fn metric(base: &str, name: &str, labels: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_is_renewed_past_its_ttl_and_released_for_the_next_holder() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let a = Client::new(&router.api.base, Some("sdk-A")).unwrap();
    let b = Client::new(&router.api.base, Some("sdk-B")).unwrap();

    let lock = a.acquire("sdk:basic", secs(2)).await.unwrap().unwrap();
    assert_eq!(lock.name(), "sdk:basic");
    assert!(lock.is_held());
    assert!(b.acquire("sdk:basic", secs(2)).await.unwrap().is_none());

    // Three TTLs later it is still held, by the router's account too.
    sleep_ms(6_000).await;
    assert!(lock.is_held());
    assert!(lock.lost().now_or_never().is_none());
    let seen = router.api.inspect_up("sdk:basic").await;
    assert_eq!(seen.body["held"], true);
    assert_eq!(seen.body["fencingToken"], lock.fencing_token());

    let first = lock.fencing_token();
    let lost = lock.lost();
    lock.release().await.unwrap();
    assert_eq!(lost.await, LostReason::Released);
    let next = b.acquire("sdk:basic", secs(2)).await.unwrap().unwrap();
    assert!(next.fencing_token() > first);
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_lock_is_released_without_waiting_for_its_ttl() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let a = Client::new(&router.api.base, None).unwrap();
    let b = Client::new(&router.api.base, None).unwrap();
    assert_ne!(a.client_id(), b.client_id(), "random ids differ");

    let lock = a.acquire("sdk:drop", secs(60)).await.unwrap().unwrap();
    drop(lock);
    // Far less than the 60 s TTL: the drop handed the release to the task.
    let next = b
        .acquire_wait("sdk:drop", secs(60), secs(15))
        .await
        .unwrap();
    assert!(next.is_some(), "the dropped lock was not released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_wait_queues_first_come_first_served_and_confirms_a_late_grant() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let holder = router.api.must_acquire("sdk:queue", 30_000, "holder").await;
    let b = Client::new(&router.api.base, Some("queue-B")).unwrap();
    let c = Client::new(&router.api.base, Some("queue-C")).unwrap();
    let b_waits = tokio::spawn(async move { b.acquire_wait("sdk:queue", secs(2), secs(30)).await });
    sleep_ms(1_000).await; // B is queued before C
    let c_waits = tokio::spawn(async move { c.acquire_wait("sdk:queue", secs(2), secs(30)).await });
    // Longer than B's 2 s TTL: validity counted from B's request would be
    // gone by the grant; the client confirms the grant instead.
    sleep_ms(3_000).await;
    assert_eq!(router.api.release(&holder).await.status, 204);
    let lock_b = b_waits.await.unwrap().unwrap().expect("B is first in line");
    assert!(lock_b.is_held(), "a grant after a long wait is confirmed");
    assert!(lock_b.fencing_token() > holder.1);
    // B keeps it past its TTL while C waits behind it.
    sleep_ms(3_000).await;
    assert!(lock_b.is_held());
    assert!(
        !c_waits.is_finished(),
        "C must not be granted while B holds"
    );
    let token_b = lock_b.fencing_token();
    lock_b.release().await.unwrap();
    let lock_c = c_waits.await.unwrap().unwrap().expect("C is next");
    assert!(lock_c.fencing_token() > token_b);
    assert!(lock_c.is_held());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_locks_are_renewed_with_one_request_per_interval() {
    let shards = [EtcdCluster::single(), EtcdCluster::single()];
    // A router of its own (a separate process), so its metrics count only
    // this client's requests.
    let router = RouterProcess::start(&[&shards[0], &shards[1]], free_port()).await;
    let base = router.api.base.clone();
    let client = Client::new(&base, Some("batcher")).unwrap();
    let mut locks = Vec::new();
    for i in 0..40 {
        let name = format!("sdk:batch-{i}");
        locks.push(client.acquire(&name, secs(3)).await.unwrap().unwrap());
    }
    let batches = || metric(&base, "lockrouter_requests_total", "op=\"renew_batch\"");
    let singles = || metric(&base, "lockrouter_requests_total", "op=\"renew\"");
    let (b0, s0) = (batches().await, singles().await);
    // Six 1 s intervals.
    sleep_ms(6_000).await;
    let (b1, s1) = (batches().await, singles().await);
    let sent = b1 - b0;
    // One per interval is 6; renewing each lock alone would be 240.
    assert!(
        (3.0..=12.0).contains(&sent),
        "{sent} renew-batch requests for 40 locks over 6 intervals"
    );
    assert_eq!(s1 - s0, 0.0, "no single renewals");
    assert!(locks.iter().all(|l| l.is_held()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_router_a_lock_is_lost_by_the_client_clock_before_its_lease_ends() {
    let etcd = EtcdCluster::single();
    let mut doomed = RouterProcess::start(&[&etcd], free_port()).await;
    let witness = TestRouter::start(&[&etcd]).await;
    let client = Client::builder(&doomed.api.base)
        .safety_margin(secs(2))
        .build()
        .unwrap();
    let lock = client
        .acquire("sdk:orphan", secs(6))
        .await
        .unwrap()
        .unwrap();
    sleep_ms(2_500).await; // at least one renewal confirmed

    doomed.child.kill().unwrap();
    doomed.child.wait().unwrap();
    // Renewals now fail; the lock stays valid until its validity runs out.
    assert!(lock.is_held());
    let reason = tokio::time::timeout(secs(20), lock.lost())
        .await
        .expect("lost fires once validity runs out");
    assert_eq!(reason, LostReason::Unconfirmed);
    // The client gave up while the lease still stood (the 2 s margin): it
    // never trusts a lock longer than the router could vouch for.
    let seen = witness.api.inspect("sdk:orphan").await;
    assert_eq!(seen.body["held"], true, "{seen:?}");
    assert_eq!(seen.body["fencingToken"], lock.fencing_token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_outage_loses_only_the_locks_on_that_shard() {
    let mut shards = [EtcdCluster::single(), EtcdCluster::single()];
    let router = TestRouter::start(&[&shards[0], &shards[1]]).await;
    let mut on_shard = [None, None];
    for i in 0..100 {
        let name = format!("sdk:shard-{i}");
        let shard = router.api.inspect(&name).await.body["shard"].clone();
        let idx = usize::from(shard != "a");
        on_shard[idx].get_or_insert(name);
        if on_shard.iter().all(Option::is_some) {
            break;
        }
    }
    let [Some(name_a), Some(name_b)] = on_shard else {
        panic!("no names on both shards");
    };
    let client = Client::new(&router.api.base, None).unwrap();
    let lock_a = client.acquire(&name_a, secs(3)).await.unwrap().unwrap();
    let lock_b = client.acquire(&name_b, secs(3)).await.unwrap().unwrap();

    shards[1].kill();
    let reason = tokio::time::timeout(secs(20), lock_b.lost())
        .await
        .expect("the lock on the dead shard is lost");
    assert_eq!(reason, LostReason::Unconfirmed, "retried, never refused");
    assert!(lock_a.is_held());
    // Well past lock_b's loss, lock_a is still renewed.
    sleep_ms(4_000).await;
    assert!(lock_a.is_held());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_lock_runs_the_work_and_cuts_it_short_when_the_lock_is_taken() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let a = Client::new(&router.api.base, Some("wl-A")).unwrap();
    let b = Client::new(&router.api.base, Some("wl-B")).unwrap();

    let token = a
        .with_lock("sdk:with", secs(6), |lock| async move {
            assert!(lock.is_held());
            lock.fencing_token()
        })
        .await
        .unwrap();
    assert!(token > 0);
    // Released on the way out: B gets it at once.
    let held = b.acquire("sdk:with", secs(6)).await.unwrap().unwrap();
    let busy = a.with_lock("sdk:with", secs(6), |_| async {}).await;
    assert_eq!(
        busy,
        Err(Error::NotAcquired {
            name: "sdk:with".into()
        })
    );
    held.release().await.unwrap();

    // The work never finishes on its own; the lock is released behind the
    // client's back and taken by B, and the next renewal reports it.
    let dropped = Arc::new(AtomicBool::new(false));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let work = {
        let dropped = dropped.clone();
        a.with_lock("sdk:with", secs(6), move |lock| async move {
            let _guard = SetOnDrop(dropped);
            let _ = tx.send((lock.lock_id().to_string(), lock.fencing_token()));
            std::future::pending::<()>().await
        })
    };
    let thief = async {
        let stolen = rx.await.unwrap();
        assert_eq!(router.api.release(&stolen).await.status, 204);
        b.acquire("sdk:with", secs(6)).await.unwrap().unwrap()
    };
    let (outcome, _b_lock) = tokio::join!(tokio::time::timeout(secs(20), work), thief);
    match outcome.expect("with_lock returns once the lock is lost") {
        Err(Error::Lost { reason, .. }) => assert!(
            matches!(reason, LostReason::Stolen | LostReason::Expired),
            "the router's answer, not the clock, ended it: {reason:?}"
        ),
        other => panic!("expected Lost, got {other:?}"),
    }
    assert!(dropped.load(Ordering::SeqCst), "the work was cancelled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_batch_falls_back_to_renewing_lock_by_lock() {
    let etcd = EtcdCluster::single();
    // A router that takes at most two locks per renew-batch: the client's
    // batch of three is refused (400) as a whole.
    let toml = config_toml(&[&etcd], "127.0.0.1:0", "")
        .replace("\n[[shards]]", "\n[limits]\nmax_batch = 2\n\n[[shards]]");
    let router = TestRouter::with_toml(&toml).await;
    let client = Client::new(&router.api.base, None).unwrap();
    let mut locks = Vec::new();
    for i in 0..3 {
        let name = format!("sdk:refused-{i}");
        locks.push(client.acquire(&name, secs(2)).await.unwrap().unwrap());
    }
    let all: Vec<_> = locks
        .iter()
        .map(|l| json!({"lockId": l.lock_id(), "fencingToken": l.fencing_token()}))
        .collect();
    let refused = router
        .api
        .post("/api/v1/locks/renew-batch", json!({ "locks": all }))
        .await;
    assert_eq!(
        refused.status, 400,
        "the batch itself is refused: {refused:?}"
    );
    // Three TTLs: without the fallback every lock would be lost by now.
    sleep_ms(6_000).await;
    for lock in &locks {
        assert!(lock.is_held(), "{lock:?}");
        let seen = router.api.inspect_up(lock.name()).await;
        assert_eq!(seen.body["fencingToken"], lock.fencing_token());
    }
}

struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The router goes away and comes back on the same port while a client
/// holds three locks of one TTL on one shard (one session lease). Returns
/// (router, client, lock kept, lock to release) with the router down.
async fn lose_the_router(
    etcd: &EtcdCluster,
    port: u16,
    id: &str,
) -> (RouterProcess, Client, Lock, Lock) {
    let router = RouterProcess::start(&[etcd], port).await;
    let client = Client::builder(&router.api.base)
        .client_id(id)
        .request_timeout(secs(1))
        .build()
        .unwrap();
    let keep = client.acquire("sdk:keep", secs(10)).await.unwrap().unwrap();
    let gone = client.acquire("sdk:gone", secs(10)).await.unwrap().unwrap();
    (router, client, keep, gone)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_sent_while_the_router_is_down_is_retried_until_it_frees_the_name() {
    let etcd = EtcdCluster::single();
    let witness = TestRouter::start(&[&etcd]).await;
    let port = free_port();
    let (router, _client, keep, gone) = lose_the_router(&etcd, port, "retry-explicit").await;
    drop(router); // killed: connections refused from now on
    let lost = gone.lost();
    let releasing = tokio::spawn(gone.release());
    assert_eq!(lost.await, LostReason::Released, "lost as release starts");
    sleep_ms(2_000).await;
    assert!(!releasing.is_finished(), "still retrying");
    let _router = RouterProcess::start(&[&etcd], port).await;
    let released = tokio::time::timeout(secs(8), releasing)
        .await
        .expect("the release gets through within the lock's validity")
        .unwrap();
    assert_eq!(released, Ok(()));
    // Freed at once, although the client's other lock kept the session
    // lease (and so the released lock's key) alive all along.
    let b = Client::new(&witness.api.base, Some("retry-B")).unwrap();
    assert!(b.acquire("sdk:gone", secs(10)).await.unwrap().is_some());
    assert!(keep.is_held());
    let seen = witness.api.inspect("sdk:keep").await;
    assert_eq!(seen.body["fencingToken"], keep.fencing_token());
}

/// docs/client.md, "A release that was not answered": a name whose release
/// is unanswered (the router is away) is acquired again, by the same
/// client, only once that release is answered, so the acquire is a new
/// grant and the old one is gone (a late release could end only the old).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_is_acquired_again_only_after_its_unanswered_release_is_answered() {
    let etcd = EtcdCluster::single();
    let witness = TestRouter::start(&[&etcd]).await;
    let port = free_port();
    let (router, client, keep, gone) = lose_the_router(&etcd, port, "late-release").await;
    let old = (gone.lock_id().to_string(), gone.fencing_token());
    drop(router);
    drop(gone); // released in the background, unanswered while the router is away
    sleep_ms(500).await;
    let _router = RouterProcess::start(&[&etcd], port).await;
    let again = client.acquire("sdk:gone", secs(10)).await.unwrap().unwrap();
    assert!(again.fencing_token() > old.1, "a new grant");
    assert_eq!(
        witness.api.renew(&old).await.status,
        409,
        "the old grant is gone"
    );
    assert!(again.is_held() && keep.is_held());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_dropped_while_the_router_is_down_is_freed_once_it_is_back() {
    let etcd = EtcdCluster::single();
    let witness = TestRouter::start(&[&etcd]).await;
    let port = free_port();
    let (router, _client, keep, gone) = lose_the_router(&etcd, port, "retry-drop").await;
    drop(router);
    drop(gone);
    sleep_ms(2_000).await;
    let seen = witness.api.inspect("sdk:gone").await;
    assert_eq!(seen.body["held"], true, "not released yet: {seen:?}");
    let _router = RouterProcess::start(&[&etcd], port).await;
    // Within a few seconds (retries back off to at most 2 s). Waiting past
    // the TTL would not help: while `keep` is renewed, the shared session
    // lease keeps the dropped lock's key alive too.
    let b = Client::new(&witness.api.base, Some("retry-B")).unwrap();
    let next = b
        .acquire_wait("sdk:gone", secs(10), secs(12))
        .await
        .unwrap();
    assert!(next.is_some(), "the dropped lock was never released");
    assert!(keep.is_held());
}

/// One client, one holder per name: a second task of the same client
/// waits for the first's release (or gets nothing without a wait), and
/// then gets a new grant; only a re-entrant acquire joins the hold,
/// counted, and the grant goes with the last hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_excludes_its_own_tasks_from_a_name_unless_reentrant_is_asked() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let a = Client::new(&router.api.base, Some("twice-A")).unwrap();
    let first = a.acquire("sdk:twice", secs(10)).await.unwrap().unwrap();
    assert!(a.acquire("sdk:twice", secs(10)).await.unwrap().is_none());
    let waiting = {
        let a = a.clone();
        tokio::spawn(async move { a.acquire_wait("sdk:twice", secs(10), secs(5)).await })
    };
    sleep_ms(500).await;
    assert!(!waiting.is_finished(), "the second task waits its turn");
    let token = first.fencing_token();
    first.release().await.unwrap();
    let second = waiting.await.unwrap().unwrap().expect("its turn came");
    assert!(second.fencing_token() > token, "a new grant, never the old");
    drop(second);

    let again = AcquireOptions::new(secs(10)).reentrant();
    let outer = a
        .acquire_with("sdk:twice", again.clone())
        .await
        .unwrap()
        .unwrap();
    let inner = a.acquire_with("sdk:twice", again).await.unwrap().unwrap();
    assert_eq!(inner.fencing_token(), outer.fencing_token());
    inner.release().await.unwrap();
    assert!(outer.is_held(), "the outer hold keeps the lock");
    let seen = router.api.inspect_up("sdk:twice").await;
    assert_eq!(seen.status, 200, "{}", seen.body);
    assert_eq!(seen.body["fencingToken"], outer.fencing_token());
    outer.release().await.unwrap();
    let seen = router.api.inspect_up("sdk:twice").await;
    assert_eq!(seen.status, 200, "{}", seen.body);
    assert_eq!(
        seen.body["held"], false,
        "released with the last hold: {}",
        seen.body
    );
}

/// The hostile interleaving of a release and the next task in line of the
/// same client: if the name's turn passed on before the release began, the
/// waiter (on the other worker thread) would ask the router while the grant
/// still stands and be handed that very grant as it is released. Many
/// rounds, by `release` and by drop alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_waiting_on_its_own_clients_release_gets_a_new_grant_every_time() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let a = Client::new(&router.api.base, Some("handoff-A")).unwrap();
    let mut held = a.acquire("sdk:handoff", secs(10)).await.unwrap().unwrap();
    for round in 0..150 {
        let waiting = {
            let a = a.clone();
            tokio::spawn(async move { a.acquire_wait("sdk:handoff", secs(10), secs(5)).await })
        };
        sleep_ms(2).await;
        let token = held.fencing_token();
        if round % 2 == 0 {
            held.release().await.unwrap();
        } else {
            drop(held);
        }
        let next = waiting.await.unwrap().unwrap().expect("its turn came");
        assert!(
            next.fencing_token() > token,
            "round {round}: a new grant, never the one being released"
        );
        assert!(next.is_held(), "round {round}: the new grant is held");
        held = next;
    }
}

/// A wait longer than the router's `limits.max_wait_ms` (1 s here) queues
/// again until granted; a wait without end is cancelled by dropping it,
/// and leaves the router's queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_longer_than_the_routers_cap_queues_again_and_cancels_on_drop() {
    let etcd = EtcdCluster::single();
    let toml = config_toml(&[&etcd], "127.0.0.1:0", "\n[limits]\nmax_wait_ms = 1000\n");
    let router = TestRouter::with_toml(&toml).await;
    let holder = router.api.must_acquire("sdk:long", 30_000, "holder").await;
    let b = Client::new(&router.api.base, Some("long-B")).unwrap();
    let waiting = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire_wait("sdk:long", secs(2), secs(30)).await })
    };
    sleep_ms(2_500).await;
    assert!(!waiting.is_finished(), "still queued past the router's cap");
    assert_eq!(router.api.release(&holder).await.status, 204);
    let lock = tokio::time::timeout(secs(3), waiting)
        .await
        .expect("granted within a wait of the release")
        .unwrap()
        .unwrap()
        .expect("B was queued");
    assert!(lock.fencing_token() > holder.1);

    let c = Client::new(&router.api.base, Some("long-C")).unwrap();
    let forever =
        tokio::spawn(async move { c.acquire_wait("sdk:long", secs(2), Duration::MAX).await });
    sleep_ms(1_500).await;
    assert_eq!(router.api.inspect_up("sdk:long").await.body["waiters"], 1);
    forever.abort();
    sleep_ms(300).await;
    assert!(router
        .api
        .inspect("sdk:long")
        .await
        .body
        .get("waiters")
        .is_none());
    lock.release().await.unwrap();
    let d = Client::new(&router.api.base, Some("long-D")).unwrap();
    assert!(
        d.acquire("sdk:long", secs(2)).await.unwrap().is_some(),
        "no cancelled waiter is queued ahead"
    );
}

/// Metadata goes with the acquire; inspect shows holder, metadata, waiters
/// and time left, and whether the lock is this client's; extend renews at
/// once and moves validity forward.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_to_a_longer_ttl_keeps_the_token_and_renews_and_releases_under_the_new_lock_id() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let a = Client::new(&router.api.base, Some("extend-A")).unwrap();
    let b = Client::new(&router.api.base, Some("extend-B")).unwrap();
    let lock = a.acquire("sdk:extend-to", secs(2)).await.unwrap().unwrap();
    let (old_id, token) = (lock.lock_id(), lock.fencing_token());

    let left = lock.extend_to(secs(6)).await.unwrap();
    assert!(left > secs(4) && left <= secs(6), "{left:?}");
    assert_eq!(lock.fencing_token(), token, "the same grant");
    assert_ne!(lock.lock_id(), old_id, "on the new TTL's lease");
    assert_eq!(lock.ttl(), secs(6));
    assert_eq!(lock.handle().lock_id(), lock.lock_id(), "every view moved");

    // Past the old TTL three times over and past the new one: only
    // renewals under the new lockId keep it (the old one is `stolen`).
    sleep_ms(7_000).await;
    assert!(lock.is_held());
    assert!(lock.lost().now_or_never().is_none());
    let seen = a.inspect("sdk:extend-to").await.unwrap();
    assert!(seen.held && seen.mine);
    assert_eq!(seen.fencing_token, Some(token));
    assert!(b.acquire("sdk:extend-to", secs(2)).await.unwrap().is_none());

    lock.release().await.unwrap();
    let next = b.acquire("sdk:extend-to", secs(2)).await.unwrap();
    let next = next.expect("the release under the new lockId freed the name");
    assert!(next.fencing_token() > token);
}

/// Extending to a shorter TTL: validity is set from the new lease (not
/// kept from the longer one), renewals follow the new TTL's pace, and an
/// extend the router cannot carry out (its shard stopped) fails and
/// leaves the lock under its lockId, renewed again once the shard is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_to_a_shorter_ttl_sets_validity_and_a_failed_extend_keeps_the_lock_id() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let a = Client::new(&router.api.base, Some("shorter-A")).unwrap();
    let lock = a
        .acquire("sdk:extend-shorter", secs(8))
        .await
        .unwrap()
        .unwrap();
    let token = lock.fencing_token();
    let left = lock.extend_to(secs(3)).await.unwrap();
    assert!(left <= secs(3), "validity set from the 3 s lease: {left:?}");
    assert_eq!((lock.fencing_token(), lock.ttl()), (token, secs(3)));
    // Past the new TTL twice over: renewed at its pace.
    sleep_ms(6_000).await;
    assert!(lock.is_held(), "renewed at the new TTL's pace");
    let seen = a.inspect("sdk:extend-shorter").await.unwrap();
    assert_eq!((seen.held, seen.fencing_token), (true, Some(token)));

    lock.release().await.unwrap();

    // A TTL with room for the stopped shard's deadline.
    let lock = a
        .acquire("sdk:extend-failed", secs(10))
        .await
        .unwrap()
        .unwrap();
    let before = lock.lock_id();
    etcd.pause_member(0);
    let failed = lock.extend_to(secs(20)).await;
    etcd.resume_member(0);
    assert!(failed.is_err(), "{failed:?}");
    assert_eq!(lock.lock_id(), before, "a failed extend keeps the lockId");
    assert_eq!(lock.ttl(), secs(10));
    // Once the router sees the shard again, it renews under that lockId.
    let mut renewed = None;
    for _ in 0..50 {
        if let Ok(left) = lock.extend_to(secs(10)).await {
            renewed = Some(left);
            break;
        }
        sleep_ms(200).await;
    }
    let left = renewed.expect("renewed once the shard is back");
    assert!(left > secs(8), "renewed under its lockId again: {left:?}");
    assert_eq!(lock.lock_id(), before);
    lock.release().await.unwrap();
    let seen = a.inspect("sdk:extend-failed").await.unwrap();
    assert!(!seen.held, "released under the lockId it has");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_inspect_and_extend() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let a = Client::new(&router.api.base, Some("meta-A")).unwrap();
    let b = Client::new(&router.api.base, Some("meta-B")).unwrap();
    let options = AcquireOptions::new(secs(10)).metadata(json!({"job": "report"}));
    let lock = a.acquire_with("sdk:meta", options).await.unwrap().unwrap();

    let mine = a.inspect("sdk:meta").await.unwrap();
    assert!(mine.held && mine.mine);
    assert_eq!(mine.fencing_token, Some(lock.fencing_token()));
    assert_eq!(mine.metadata, Some(json!({"job": "report"})));
    assert_eq!(
        mine.holder.as_deref(),
        Some("meta-A"),
        "loopback sees the holder"
    );
    assert_eq!(mine.waiters, 0);
    let left = mine.time_left();
    assert!(left > secs(5) && left <= secs(11), "{left:?}");
    let theirs = b.inspect("sdk:meta").await.unwrap();
    assert!(theirs.held && !theirs.mine);
    assert!(!b.inspect("sdk:free").await.unwrap().held);

    sleep_ms(1_500).await;
    let before = lock.time_left();
    let after = lock.extend().await.unwrap();
    assert!(
        after > before + Duration::from_millis(500),
        "{before:?} -> {after:?}"
    );
    assert!(after <= secs(10));
    let grant = (lock.lock_id().to_string(), lock.fencing_token());
    assert_eq!(
        router.api.release(&grant).await.status,
        204,
        "behind its back"
    );
    let gone = lock.extend().await;
    assert!(
        matches!(
            gone,
            Err(Error::Lost {
                reason: LostReason::Expired,
                ..
            })
        ),
        "{gone:?}"
    );
    assert!(!lock.is_held());
}
