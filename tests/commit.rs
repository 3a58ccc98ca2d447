//! Group commit on real etcd: grants and releases that queue up behind
//! each other share raft writes, together, and a batch never changes what
//! any one of them would have done alone (one winner per name, a dead
//! session lease fails only its own acquire, a stale release deletes
//! nothing, a ring or identity change grants nothing and still releases).
//!
//! Each test pauses the single etcd member (SIGSTOP) while its requests
//! arrive, so that they queue behind the batch in flight and go out
//! together when it resumes; the pause stays well under the router's etcd
//! deadline.

use std::collections::{BTreeMap, BTreeSet};

use futures::future::join_all;
use serde_json::Value;

use lockrouter::keys::Keys;
use lockrouter_testkit::api::{Api, Reply};
use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::sleep_ms;

/// How long etcd stays paused while requests queue (the test routers'
/// etcd deadline is 1 s).
const QUEUE_MS: u64 = 500;

/// Runs `calls` concurrently while etcd is paused, resumes it, and returns
/// the replies with the raft writes (committed proposals) they cost.
async fn while_paused<F>(etcd: &EtcdCluster, calls: Vec<F>) -> (Vec<Reply>, f64)
where
    F: std::future::Future<Output = Reply> + Send + 'static,
{
    let before = etcd.metric("etcd_server_proposals_committed_total");
    etcd.pause_member(0);
    let tasks: Vec<_> = calls.into_iter().map(tokio::spawn).collect();
    sleep_ms(QUEUE_MS).await;
    etcd.resume_member(0);
    let replies = join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.expect("request task"))
        .collect();
    let writes = etcd.metric("etcd_server_proposals_committed_total") - before;
    (replies, writes)
}

fn acquire(api: &Api, name: String, client: String) -> impl std::future::Future<Output = Reply> {
    let api = api.clone();
    async move { api.acquire(&name, 30_000, &client).await }
}

fn release(api: &Api, lock: (String, u64)) -> impl std::future::Future<Output = Reply> {
    let api = api.clone();
    async move { api.release(&lock).await }
}

/// For each lock of `held`, its release and an acquire by client B of a
/// new name (`new-<i>`), in that order: the calls of a mixed batch.
fn release_and_acquire_each(api: &Api, held: Vec<(String, u64)>) -> Vec<BoxedReply> {
    let mut calls: Vec<BoxedReply> = Vec::new();
    for (i, lock) in held.into_iter().enumerate() {
        calls.push(Box::pin(release(api, lock)));
        calls.push(Box::pin(acquire(api, format!("new-{i}"), "B".into())));
    }
    calls
}

type BoxedReply = std::pin::Pin<Box<dyn std::future::Future<Output = Reply> + Send>>;

/// How many lock keys there are under the router's prefix.
async fn lock_keys(etcd: &EtcdCluster) -> usize {
    let mut c = etcd.client().await;
    let opts = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    let resp = c.get("/lockrouter/locks/", Some(opts)).await.unwrap();
    resp.count() as usize
}

/// The lease each lock key under the router's prefix rides on, by the
/// `client` recorded in its value.
async fn leases_by_client(etcd: &EtcdCluster) -> BTreeMap<String, BTreeSet<i64>> {
    let mut c = etcd.client().await;
    let opts = etcd_client::GetOptions::new().with_prefix();
    let resp = c.get("/lockrouter/locks/", Some(opts)).await.unwrap();
    let mut out: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
    for kv in resp.kvs() {
        let v: Value = serde_json::from_slice(kv.value()).unwrap();
        let client = v["client"].as_str().unwrap().to_string();
        out.entry(client).or_default().insert(kv.lease());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_that_queue_up_share_raft_writes_and_each_name_has_one_winner() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    // Session leases first, so that only grants are counted.
    for c in 0..5 {
        api.must_acquire(&format!("warm-up-{c}"), 30_000, &format!("client-{c}"))
            .await;
    }
    // 40 names, each wanted by 5 clients at once: 200 acquires.
    let calls: Vec<_> = (0..40)
        .flat_map(|n| (0..5).map(move |c| (n, c)))
        .map(|(n, c)| acquire(api, format!("batched-{n}"), format!("client-{c}")))
        .collect();
    let (replies, writes) = while_paused(&etcd, calls).await;
    assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
    let mut winners: BTreeMap<String, usize> = BTreeMap::new();
    let mut tokens = BTreeSet::new();
    for (i, r) in replies.iter().enumerate() {
        if r.body["acquired"] == true {
            *winners.entry(format!("batched-{}", i / 5)).or_default() += 1;
            tokens.insert(r.body["fencingToken"].as_u64().unwrap());
        }
    }
    assert_eq!(winners.len(), 40, "every name granted: {winners:?}");
    assert!(
        winners.values().all(|&n| n == 1),
        "one winner each: {winners:?}"
    );
    // Grants in one txn share its revision: tokens are per name, and a
    // name's token is still above every earlier one of that name.
    assert!(!tokens.is_empty());
    // Without group commit these are 200 txns (etcd 3.4 proposes a txn
    // whose compare fails too); queued behind the batch in flight
    // they go out in a few.
    assert!(writes < 50.0, "{writes} raft writes for 200 acquires");
    let metrics = api.metrics().await;
    assert!(
        metrics.contains("lockrouter_commit_batch_size_count{shard=\"a\",kind=\"acquire\"}"),
        "{metrics}"
    );
    // Each winner holds its name, and the losers see it held.
    for n in 0..40 {
        let r = api.inspect(&format!("batched-{n}")).await;
        assert_eq!(r.body["held"], true, "{r:?}");
    }
}

/// A router on `etcd` whose one shard is named `shard`, with the session
/// lease of "client" granted, and what the shard had sent by then (see
/// [`commits`]). The metrics recorder is the test process's, shared by
/// every router in it, so a test that counts a shard's batches gives it a
/// name of its own. Its etcd deadline is 5 s, so that a paused member may
/// stay paused a while.
async fn router_named(etcd: &EtcdCluster, shard: &str) -> (TestRouter, (f64, f64)) {
    let toml = config_toml(&[etcd], "127.0.0.1:0", "")
        .replace("name = \"a\"", &format!("name = \"{shard}\""))
        .replace("request_timeout_ms = 1000", "request_timeout_ms = 5000");
    assert!(toml.contains("request_timeout_ms = 5000"), "{toml}");
    let router = TestRouter::with_toml(&toml).await;
    router.api.must_acquire("warm-up", 30_000, "client").await;
    let sent = commits(&router.api.metrics().await, shard);
    (router, sent)
}

fn all_granted(replies: &[Reply]) {
    for r in replies {
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.body["acquired"], true, "{r:?}");
    }
}

/// `metric` (a counter, or a summary's `_sum`) of `shard`, summed over
/// every kind of batch.
fn on_shard(metrics: &str, shard: &str, metric: &str) -> f64 {
    let prefix = format!("{metric}{{shard=\"{shard}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

/// The txns `shard` has sent so far, and the jobs in them.
fn commits(metrics: &str, shard: &str) -> (f64, f64) {
    (
        on_shard(metrics, shard, "lockrouter_commits_total"),
        on_shard(metrics, shard, "lockrouter_commit_batch_size_sum"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_queues_behind_the_batch_in_flight_leaves_as_one_batch() {
    let etcd = EtcdCluster::single();
    let (router, before) = router_named(&etcd, "one-behind").await;
    let api = &router.api;
    // 101 names: the first to arrive leaves alone (nothing is in flight)
    // and waits on the paused member; the other 100 queue behind it. With
    // one batch in flight they leave together when it is answered: two
    // txns. A second batch in flight would have taken whatever came next
    // alone, and the rest a third.
    let calls: Vec<_> = (0..101)
        .map(|n| acquire(api, format!("queued-{n}"), "client".into()))
        .collect();
    let (replies, _) = while_paused(&etcd, calls).await;
    all_granted(&replies);
    let after = commits(&api.metrics().await, "one-behind");
    let (txns, jobs) = (after.0 - before.0, after.1 - before.1);
    assert_eq!(jobs, 101.0, "each acquire sent once");
    assert!(
        txns <= 2.0,
        "{txns} txns for 101 acquires queued behind one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_batch_waiting_leaves_beside_the_one_in_flight_and_no_more() {
    let etcd = EtcdCluster::single();
    let (router, before) = router_named(&etcd, "two-behind").await;
    let api = &router.api;
    etcd.pause_member(0);
    // One acquire, alone in flight on the paused member; then 250 behind
    // it: enough for a full batch (100) to leave beside it, and for
    // another full one to wait, since no more than two are ever in flight.
    let first = tokio::spawn(acquire(api, "first".into(), "client".into()));
    sleep_ms(100).await;
    let rest: Vec<_> = (0..250)
        .map(|n| tokio::spawn(acquire(api, format!("queued-{n}"), "client".into())))
        .collect();
    // Until the second has left (the requests take a while to arrive on a
    // busy machine), then a little longer, for a third that must not.
    let sent = || async {
        let now = commits(&api.metrics().await, "two-behind");
        (now.0 - before.0, now.1 - before.1)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while sent().await.0 < 2.0 && std::time::Instant::now() < deadline {
        sleep_ms(20).await;
    }
    sleep_ms(200).await;
    let paused = sent().await;
    etcd.resume_member(0);
    let mut replies = vec![first.await.expect("request task")];
    for r in join_all(rest).await {
        replies.push(r.expect("request task"));
    }
    all_granted(&replies);
    assert_eq!(
        paused,
        (2.0, 101.0),
        "sent while the member was paused: (txns, acquires)"
    );
    // The other 150 after it resumed, each acquire in one batch only.
    let after = commits(&api.metrics().await, "two-behind");
    assert_eq!(after.1 - before.1, 251.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_session_lease_in_a_batch_fails_only_its_own_acquires() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    for client in ["doomed", "steady-1", "steady-2"] {
        api.must_acquire(&format!("warm-up-{client}"), 30_000, client)
            .await;
    }
    let before = leases_by_client(&etcd).await;
    // The router still has the doomed client's session lease cached: its
    // next grant names a lease etcd no longer has.
    let doomed = *before["doomed"].iter().next().unwrap();
    etcd.client().await.lease_revoke(doomed).await.unwrap();
    let calls: Vec<_> = (0..30)
        .map(|i| {
            let client = ["doomed", "steady-1", "steady-2"][i % 3];
            acquire(api, format!("mixed-{i}"), client.to_string())
        })
        .collect();
    let (replies, _) = while_paused(&etcd, calls).await;
    for r in &replies {
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.body["acquired"], true, "{r:?}");
    }
    let after = leases_by_client(&etcd).await;
    // The doomed client's acquires found their lease gone and were granted
    // on a new one; the others were never told their live lease was gone
    // (they kept it), though the batch they shared failed as a whole.
    assert!(!after["doomed"].contains(&doomed), "{after:?}");
    assert_eq!(after["doomed"].len(), 1, "{after:?}");
    for steady in ["steady-1", "steady-2"] {
        assert_eq!(
            after[steady], before[steady],
            "{steady}: {before:?} -> {after:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_that_queue_up_share_raft_writes_and_a_stale_one_deletes_nothing() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let mut locks = Vec::new();
    for i in 0..60 {
        locks.push(api.must_acquire(&format!("rel-{i}"), 30_000, "A").await);
    }
    // A stale lockId: B holds "rel-0" now, under a new grant.
    let stale = locks[0].clone();
    assert_eq!(api.release(&stale).await.status, 204);
    let b = api.must_acquire("rel-0", 30_000, "B").await;
    let calls: Vec<_> = locks
        .iter()
        .cloned()
        .map(|lock| {
            let api = api.clone();
            async move { api.release(&lock).await }
        })
        .collect();
    let (replies, writes) = while_paused(&etcd, calls).await;
    assert!(replies.iter().all(|r| r.status == 204), "{replies:?}");
    assert!(writes < 20.0, "{writes} raft writes for 60 releases");
    for i in 1..60 {
        let r = api.inspect(&format!("rel-{i}")).await;
        assert_eq!(r.body["held"], false, "rel-{i}: {r:?}");
    }
    // The stale release rode in a batch and deleted nothing.
    let r = api.inspect("rel-0").await;
    assert_eq!(r.body["held"], true, "{r:?}");
    assert_eq!(r.body["fencingToken"].as_u64(), Some(b.1), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_and_releases_that_queue_up_share_one_txn() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let held = api.must_acquire_each("old", 40, 30_000).await;
    api.must_acquire("warm-up-b", 30_000, "B").await;
    // 40 releases and 40 acquires of other names, all at once.
    let calls = release_and_acquire_each(api, held);
    let (replies, writes) = while_paused(&etcd, calls).await;
    for pair in replies.chunks(2) {
        let (released, acquired) = (&pair[0], &pair[1]);
        assert_eq!(released.status, 204, "release: {released:?}");
        assert_eq!(acquired.status, 200, "acquire: {acquired:?}");
        assert_eq!(acquired.body["acquired"], true, "{acquired:?}");
    }
    // 80 txns one by one; apart, at least two batches of each kind; queued
    // together behind the batch in flight they share txns.
    assert!(
        writes < 10.0,
        "{writes} raft writes for 40 grants and 40 releases"
    );
    let metrics = api.metrics().await;
    assert!(
        metrics.contains("lockrouter_commits_total{shard=\"a\",kind=\"mixed\"}"),
        "{metrics}"
    );
    for i in 0..40 {
        assert_eq!(api.inspect(&format!("old-{i}")).await.body["held"], false);
        assert_eq!(api.inspect(&format!("new-{i}")).await.body["held"], true);
    }
    assert_eq!(lock_keys(&etcd).await, 41);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_identity_compare_fails_grants_nothing_and_still_releases() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    let held = api.must_acquire_each("old", 30, 30_000).await;
    api.must_acquire("warm-up-b", 30_000, "B").await;
    assert_eq!(lock_keys(&etcd).await, 31);
    // The shard's identity record changes under the router (the endpoints
    // now reach a cluster recorded as another shard): its cached identity
    // is stale, and the next batch's outer compare fails.
    let keys = Keys::new("/lockrouter");
    let mut c = etcd.client().await;
    let recorded = c.get(keys.identity(), None).await.unwrap().kvs()[0]
        .value()
        .to_vec();
    let other = String::from_utf8(recorded)
        .unwrap()
        .replace("\"shard\":\"a\"", "\"shard\":\"elsewhere\"");
    assert!(other.contains("elsewhere"), "{other}");
    c.put(keys.identity(), other, None).await.unwrap();
    let calls = release_and_acquire_each(api, held);
    let (replies, _) = while_paused(&etcd, calls).await;
    for pair in replies.chunks(2) {
        let (released, refused) = (&pair[0], &pair[1]);
        assert_eq!(released.status, 204, "release: {released:?}");
        assert_ne!(
            refused.status, 200,
            "granted on a shard of another identity: {refused:?}"
        );
        assert_eq!(
            refused.body["error"]["code"], "shard_unavailable",
            "{refused:?}"
        );
    }
    let metrics = api.metrics().await;
    assert!(
        metrics.contains("lockrouter_commits_total{shard=\"a\",kind=\"mixed\"}"),
        "{metrics}"
    );
    // Every release applied, and no grant: only B's warm-up key is left.
    assert_eq!(lock_keys(&etcd).await, 1);
}
