//! Network partitions, with real packet loss: the members of a 3-member
//! shard each run in a network namespace of their own, joined by bridges
//! (`lockrouter_testkit::netns`), and cuts take links off their bridge so
//! packets are lost, not refused. The routers stay in the test's own
//! namespace and reach the members at their addresses there.
//!
//! - a router cut from one shard keeps serving the others, and the locks
//!   it held on the cut shard are still its own after the heal;
//! - a leader cut from its followers (a minority leader that clients still
//!   reach) never lets two clients hold one name, by the history checker;
//! - a member cut from everything and back rejoins, and renewals stay on
//!   schedule throughout;
//! - acquires whose grant txns a leader cut from its followers held past
//!   the router's deadline are answered with what the shard holds, and
//!   leave no grant their client does not know of, even when the
//!   router's monitor marked the shard down meanwhile;
//! - a grant txn that compared an older grant cut-off writes nothing, and
//!   the router learns the shard's cut-off from its refusal.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{GetOptions, Txn, TxnOp, TxnOpResponse};
use futures::future::join_all;
use serde_json::json;

use lockrouter::keys::{Keys, Stored};
use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::history::History;
use lockrouter_testkit::netns::Network;
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::sleep_ms;

use crate::faults::{holder, judge_renewers, renewer};

/// A 3-member shard whose members live in namespaces of `net`.
pub(crate) fn partitionable(net: &Arc<Network>) -> EtcdCluster {
    EtcdCluster::builder(net.size())
        .in_network(net.clone())
        .start()
        .unwrap_or_else(|e| panic!("{e}"))
}

pub(crate) fn network() -> Arc<Network> {
    Arc::new(
        Network::new(3).unwrap_or_else(|e| panic!("partition tests need network namespaces: {e}")),
    )
}

/// The first names `prefix-N` that the router places on `shard`.
fn names_on(router: &TestRouter, shard: usize, prefix: &str, n: usize) -> Vec<String> {
    let ring = lockrouter::ring::Ring::new(&router.settings.shards, router.settings.ring.vnodes);
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|name| ring.shard_index(name) == shard)
        .take(n)
        .collect()
}

/// Shard `a` is cut off from the router for 5 s (every packet lost), shard
/// `b` is not. Meanwhile `b` grants and renews as usual, `a` answers 503
/// with Retry-After within the router's deadline, and `/readyz` names `a`
/// unreachable. After the heal the lock held on `a` renews with its own
/// token (its lease outlived the cut) and `a` grants again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_cut_from_one_shard_serves_the_others_and_heals() {
    let net = network();
    let a = partitionable(&net);
    let b = EtcdCluster::single();
    let router = TestRouter::with_toml(&config_toml(&[&a, &b], "127.0.0.1:0", "")).await;
    let api = &router.api;
    let on_a = names_on(&router, 0, "cut-a", 8);
    let on_b = names_on(&router, 1, "cut-b", 16);
    let held_a = api.must_acquire(&on_a[0], 15_000, "cut").await;
    let held_b = api.must_acquire(&on_b[0], 15_000, "cut").await;

    net.cut_clients();
    let cut = Instant::now();
    // Shard a: refused with 503 and Retry-After, not left hanging.
    let refused_a = {
        let api = api.clone();
        let name = on_a[1].clone();
        tokio::spawn(async move { api.acquire(&name, 15_000, "cut").await })
    };
    let mut unreachable_seen = false;
    for name in &on_b[1..9] {
        let r = api.acquire(name, 15_000, "cut").await;
        assert_eq!(
            (r.status, &r.body["acquired"]),
            (200, &json!(true)),
            "{r:?}"
        );
        let r = api.renew(&held_b).await;
        assert_eq!(r.status, 200, "a renewal on the healthy shard: {r:?}");
        let ready = api.get("/readyz").await;
        unreachable_seen |= ready.body["unreachableShards"] == json!(["a"]);
        sleep_ms(500).await;
    }
    let r = refused_a.await.unwrap();
    assert_eq!(r.status, 503, "{r:?}");
    assert!(r.retry_after.is_some(), "a 503 without Retry-After: {r:?}");
    assert!(unreachable_seen, "/readyz never named shard a unreachable");
    eprintln!("cut for {:?}", cut.elapsed());
    net.heal_clients();

    // The lock held on a is still ours: renewed, and inspect shows its token.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = api.renew(&held_a).await;
        if r.status == 200 {
            assert_eq!(r.body["renewed"], true, "{r:?}");
            break;
        }
        assert_eq!(r.status, 503, "the lock on a was lost: {r:?}");
        assert!(Instant::now() < deadline, "a did not come back: {r:?}");
        sleep_ms(200).await;
    }
    // Inspect reads on a connection of its own, which may still be
    // reconnecting for a moment after the renewal's came back: a 503 with
    // Retry-After until then, never another holder.
    loop {
        let seen = api.inspect(&on_a[0]).await;
        if seen.status == 200 {
            assert_eq!(
                seen.body["fencingToken"].as_u64(),
                Some(held_a.1),
                "{seen:?}"
            );
            break;
        }
        assert_eq!(seen.status, 503, "{seen:?}");
        assert!(seen.retry_after.is_some(), "{seen:?}");
        assert!(
            Instant::now() < deadline,
            "inspect on a did not come back: {seen:?}"
        );
        sleep_ms(200).await;
    }
    // So may an acquire (its txn need not take the renewal's connection):
    // 503 with Retry-After until the router reaches a again, then a grant.
    let fresh = loop {
        let r = api.acquire(&on_a[2], 15_000, "cut").await;
        if r.status == 200 {
            assert_eq!(r.body["acquired"], true, "{r:?}");
            break r.body["fencingToken"].as_u64().unwrap();
        }
        assert_eq!(r.status, 503, "{r:?}");
        assert!(r.retry_after.is_some(), "{r:?}");
        assert!(
            Instant::now() < deadline,
            "acquires on a did not come back: {r:?}"
        );
        sleep_ms(200).await;
    };
    assert!(fresh > held_a.1, "token {fresh} after {}", held_a.1);
    assert_eq!(api.renew(&held_b).await.status, 200);
}

/// The leader is cut from its followers three times, 4 s each, while
/// clients still reach it: the followers elect another leader, the old
/// one can commit nothing, and on the heal it rejoins at a higher term.
/// Sixteen clients hold, renew and release six hot names through two
/// replicas; the history checker judges every grant by its client's
/// clock. Grants go on while the old leader is cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minority_leader_never_lets_two_clients_hold_one_name() {
    let net = network();
    let etcd = partitionable(&net);
    let toml = config_toml(&[&etcd], "127.0.0.1:0", "");
    let (r1, r2) = (
        TestRouter::with_toml(&toml).await,
        TestRouter::with_toml(&toml).await,
    );
    let apis = vec![r1.api.clone(), r2.api.clone()];
    let history = History::default();
    let started = Instant::now();
    let stop = started + Duration::from_secs(30);
    history.allow_unavailable(started, stop + Duration::from_secs(10));
    let workers: Vec<_> = (0..16)
        .map(|i| tokio::spawn(holder(i, 6, apis.clone(), history.clone(), stop)))
        .collect();
    let mut cuts = Vec::new();
    while Instant::now() + Duration::from_secs(9) < stop {
        sleep_ms(4_000).await;
        let Some(leader) = etcd.leader().await else {
            continue;
        };
        let at = Instant::now();
        net.cut_peers(leader);
        sleep_ms(4_000).await;
        net.heal_peers(leader);
        eprintln!(
            "member {leader} led, cut from its followers for {:?}",
            at.elapsed()
        );
        cuts.push((at, Instant::now()));
    }
    join_all(workers).await;
    let during = history.grants_received_within(&cuts);
    let (grants, attempts, refused) = history.check();
    eprintln!(
        "{} cuts, {grants} grants, {attempts} attempts, {refused} refusals",
        cuts.len()
    );
    assert!(cuts.len() >= 2, "only {} cuts", cuts.len());
    assert!(grants >= 20, "only {grants} grants in {attempts} attempts");
    // The majority kept serving: grants were answered while a cut lasted.
    assert!(during > 0, "no grant while the old leader was cut off");
}

/// The leader is cut from everything for 6 s, then let back. Eight clients
/// hold three locks each (TTL 5 s) and renew them every 1.25 s through one
/// router: not one lapses by its client's clock. Losing the leader stops
/// every lease renewal until the others elect one (up to two election
/// timeouts, 1 s here; etcd's default is 1 s, so up to 2 s): a TTL must
/// leave room for that, which 2 s would not. A key written while the
/// member was away is read from that member alone after the heal: it
/// rejoined and caught up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_cut_off_and_back_rejoins_while_renewals_stay_on_schedule() {
    let net = network();
    let etcd = partitionable(&net);
    let router = TestRouter::with_toml(&config_toml(&[&etcd], "127.0.0.1:0", "")).await;
    let started = Instant::now();
    let stop = started + Duration::from_secs(16);
    let renewers: Vec<_> = (0..8)
        .map(|c| {
            tokio::spawn(renewer(
                router.api.clone(),
                format!("rejoin-{c}"),
                3,
                5_000,
                stop,
            ))
        })
        .collect();
    sleep_ms(2_000).await;
    let gone = etcd.leader().await.expect("a leader");
    net.isolate(gone);
    eprintln!("member {gone} (the leader) cut off");
    sleep_ms(2_000).await;
    let others: Vec<String> = (0..3)
        .filter(|&i| i != gone)
        .map(|i| etcd.endpoints()[i].clone())
        .collect();
    let mut majority = etcd_client::Client::connect(others, None).await.unwrap();
    majority
        .put("rejoin-probe", "written-while-away", None)
        .await
        .unwrap();
    sleep_ms(4_000).await;
    net.heal(gone);
    eprintln!("member {gone} back");
    judge_renewers(renewers).await;
    // The member that was away serves the key written without it.
    let mut alone = etcd_client::Client::connect([&etcd.endpoints()[gone]], None)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let got = alone
            .get(
                "rejoin-probe",
                Some(etcd_client::GetOptions::new().with_serializable()),
            )
            .await;
        if let Ok(got) = got {
            if got.kvs().first().map(|kv| kv.value()) == Some(&b"written-while-away"[..]) {
                break;
            }
        }
        assert!(Instant::now() < deadline, "member {gone} did not catch up");
        sleep_ms(200).await;
    }
}

/// docs/design.md, "An acquire that was not answered". The leader is cut
/// from its followers, and keeps its leadership (an election timeout of
/// 5 s): grant txns sent meanwhile are neither applied nor refused until
/// the heal, and the router's etcd deadline (1 s) passes first. The heal
/// comes right after, and the txns, held in the leader's log or on their
/// way from a follower, are then applied. Without the grant cut-off the
/// acquires were answered 503 and their names stayed held by grants their
/// client never learned of, kept alive by its other lock on the same
/// session. With it, the router moves the cut-off once the shard answers
/// again and asks again: every acquire is answered with what the shard
/// holds for it, and once the client releases what it was granted, every
/// name is free for another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_txn_a_cut_off_leader_held_is_answered_and_leaves_no_unknown_grant() {
    unanswered_acquires("unanswered", 0, 1_100).await;
}

/// The same, with the acquires sent 300 ms into the cut and the heal at
/// 1.5 s: the monitor's probes (every 200 ms, each waiting out the 1 s
/// deadline) have marked the shard down by the time the txns go
/// unanswered. The router still waits for its move of the cut-off, hedged
/// to every member, which the heal lets through, and reads what the txn
/// did from every member at once: the followers, back from the cut, may
/// answer no linearizable read for seconds (etcd 3.4 waits out its
/// read-index timeout), and a read hedged to them alone left an acquire
/// whose txn had granted answered 503 now and then (before, a shard
/// marked down was not even waited for). Every acquire is answered with
/// what the shard holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_unanswered_while_the_shard_is_marked_down_is_still_answered() {
    let down = unanswered_acquires("unanswered-down", 300, 1_500).await;
    assert!(down, "the shard was not marked down before the heal");
}

/// The same on a shard of one endpoint: its etcd paused (SIGSTOP, as by a
/// long GC or a stalled disk) with six acquires of one client in its
/// socket, and resumed 1.5 s later. The router's 1 s deadline passes
/// first and marks the shard down (its only endpoint failed); the txns are
/// applied once etcd resumes (or, when the pause outlasted the
/// connection's pings and the router dropped it, maybe not). Before, such
/// a shard was not waited for: each acquire was answered 503 at once, and
/// its grant landed after it, held by a client that did not know of it.
/// Now the move of the cut-off is waited for (sent again on a fresh
/// connection if the old one was dropped), and every acquire is answered
/// with what the shard holds for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_txn_a_paused_etcd_of_one_endpoint_held_is_answered() {
    let shard = "paused-one";
    let (etcd, router, keeper) = one_endpoint_shard(shard).await;
    let names: Vec<String> = (0..6).map(|i| format!("paused-{i}")).collect();
    etcd.pause_member(0);
    let acquires = join_all(names.iter().map(|name| {
        let api = router.api.clone();
        async move { api.acquire(name, 10_000, "X").await }
    }));
    let resume = async {
        sleep_ms(1_500).await;
        etcd.resume_member(0);
    };
    let (answers, ()) = futures::join!(acquires, resume);
    let mut granted = Vec::new();
    for (name, r) in names.iter().zip(&answers) {
        eprintln!("{name}: {} after the pause: {}", r.status, r.body);
        assert_eq!(r.status, 200, "{name}: {r:?}");
        assert_eq!(r.body["acquired"], true, "{name}: {r:?}");
        granted.push(r.granted());
    }
    every_name_is_free_once_released(&router, &granted, &keeper, &names).await;
    let moved = cutoff_moves(&router, shard, "moved").await;
    assert!(
        moved >= 1.0,
        "no grant txn went unanswered: the pause did not bite"
    );
}

/// A shard of one endpoint whose etcd stays paused with six acquires of
/// one client in its socket: each acquire waits for its move of the grant
/// cut-off, which cannot be made, and no longer. The first move gives up
/// after one deadline, and the moves queued behind it fail at once, so
/// all six are answered 503 about two deadlines after they were sent,
/// while etcd is still paused (moved one after another, the last would
/// be answered six deadlines later, after etcd resumed). Their outcome is
/// then unknown (design.md section 7), and learnt as docs/client.md says:
/// once the shard answers, the client acquiring each name again is
/// answered its grant (the one made, or a new one), and once it releases
/// them every name is free for another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_on_a_paused_etcd_of_one_endpoint_fail_after_one_move_and_are_learnt_again() {
    let shard = "paused-long";
    let (etcd, router, keeper) = one_endpoint_shard(shard).await;
    let names: Vec<String> = (0..6).map(|i| format!("paused-long-{i}")).collect();
    etcd.pause_member(0);
    let sent = Instant::now();
    let answers = join_all(
        names
            .iter()
            .map(|name| router.api.acquire(name, 10_000, "X")),
    )
    .await;
    let took = sent.elapsed();
    etcd.resume_member(0);
    for (name, r) in names.iter().zip(&answers) {
        eprintln!("{name}: {} after {took:?}: {}", r.status, r.body);
        assert_eq!(r.status, 503, "{name}: {r:?}");
    }
    // Two deadlines of 1 s, and room for a slow machine; six moves one
    // after another would take seven.
    assert!(
        took < Duration::from_millis(5_500),
        "answered after {took:?}"
    );
    // The outcome, learnt by acquiring again once the shard answers.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut granted = Vec::new();
    for name in &names {
        let again = loop {
            let again = router.api.acquire(name, 10_000, "X").await;
            if again.status != 503 || Instant::now() > deadline {
                break again;
            }
            sleep_ms(200).await;
        };
        assert_eq!(again.status, 200, "{name}: {again:?}");
        assert_eq!(again.body["acquired"], true, "{name}: {again:?}");
        granted.push(again.granted());
    }
    every_name_is_free_once_released(&router, &granted, &keeper, &names).await;
    let failed = cutoff_moves(&router, shard, "failed").await;
    assert!(failed >= 1.0, "no move failed: the pause did not bite");
}

/// A router in front of one etcd reached through one endpoint, its shard
/// named `shard` (the metrics recorder is shared by every test in this
/// process), and client X's lock `keeper`: another lock on the session
/// lease X's acquires of the same TTL ride on.
async fn one_endpoint_shard(shard: &str) -> (EtcdCluster, TestRouter, (String, u64)) {
    let etcd = EtcdCluster::single();
    let toml = config_toml(&[&etcd], "127.0.0.1:0", "")
        .replace("name = \"a\"", &format!("name = \"{shard}\""));
    let router = TestRouter::with_toml(&toml).await;
    let keeper = router.api.must_acquire("keeper", 10_000, "X").await;
    (etcd, router, keeper)
}

/// Renews and releases client X's `granted` locks, checks that its
/// `keeper` still renews, and that every one of `names` is then granted to
/// another client: none is held by a grant X was never told of.
async fn every_name_is_free_once_released(
    router: &TestRouter,
    granted: &[(String, u64)],
    keeper: &(String, u64),
    names: &[String],
) {
    for lock in granted {
        assert_eq!(router.api.renew(lock).await.status, 200);
        assert_eq!(router.api.release(lock).await.status, 204);
    }
    assert_eq!(router.api.renew(keeper).await.status, 200);
    for name in names {
        let other = router.api.acquire(name, 10_000, "C").await;
        assert_eq!(
            other.body["acquired"], true,
            "{name} is held by a grant its client was never told of: {other:?}"
        );
    }
}

/// `lockrouter_grant_cutoffs_total` of `shard` with `outcome`.
async fn cutoff_moves(router: &TestRouter, shard: &str, outcome: &str) -> f64 {
    let text = router.api.metrics().await;
    let labels = [("shard", shard), ("outcome", outcome)];
    lockrouter_testkit::metrics::sum(&text, "lockrouter_grant_cutoffs_total", &labels)
}

/// Cuts the leader of a fresh 3-member shard (named `shard`) from its
/// followers, sends six acquires of one client `delay_ms` later and heals
/// `heal_ms` after the cut (resetting the raft connections:
/// [`Network::heal_peers_resetting`]); checks that every acquire was answered with a
/// grant the shard holds, that no name is left held by a grant nobody
/// knows of, and that the router moved the cut-off once. Returns whether
/// the shard was marked down just before the heal.
async fn unanswered_acquires(shard: &str, delay_ms: u64, heal_ms: u64) -> bool {
    let net = network();
    let etcd = EtcdCluster::builder(net.size())
        .in_network(net.clone())
        .args(&["--election-timeout", "5000"])
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    // A shard name of its own: the metrics recorder is shared by every
    // test in this process.
    let toml = config_toml(&[&etcd], "127.0.0.1:0", "")
        .replace("name = \"a\"", &format!("name = \"{shard}\""));
    // Earlier moves of the cut-off (by another replica): the router learns
    // mark 7 from its first grant txn's refusal, and its own move puts 8
    // and deletes the marks below.
    let keys = Keys::new("/lockrouter");
    let mut c = etcd.client().await;
    for mark in [3, 7] {
        c.put(keys.cutoff_mark(mark), "", None).await.unwrap();
    }
    let router = TestRouter::with_toml(&toml).await;
    // The client's other lock, on the same session lease (same TTL).
    let keeper = router.api.must_acquire("keeper", 10_000, "X").await;
    let names: Vec<String> = (0..6).map(|i| format!("unanswered-{i}")).collect();
    let leader = etcd.leader().await.expect("a leader");
    net.cut_peers(leader);
    let cut = Instant::now();
    let acquires = join_all(names.iter().map(|name| {
        let api = router.api.clone();
        async move {
            sleep_ms(delay_ms).await;
            api.acquire(name, 10_000, "X").await
        }
    }));
    let heal = async {
        sleep_ms(heal_ms).await;
        let up = lockrouter_testkit::metrics::sum(
            &router.api.metrics().await,
            "lockrouter_shard_up",
            &[("shard", shard)],
        );
        // Reset: the move of the cut-off that the heal lets through has
        // what is left of one deadline, and TCP's backoff could keep the
        // members apart for longer than that.
        let reset = net.heal_peers_resetting(leader);
        eprintln!(
            "member {leader} (the leader) cut from its followers for {:?}; shard up before the heal: {up}; {reset} raft connections reset",
            cut.elapsed()
        );
        assert!(reset > 0, "no raft connection of member {leader} to reset");
        up == 0.0
    };
    let (answers, down) = futures::join!(acquires, heal);
    let (mut granted, mut unknown) = (Vec::new(), Vec::new());
    for (name, r) in names.iter().zip(&answers) {
        eprintln!("{name}: {} after the cut: {}", r.status, r.body);
        if r.status == 503 {
            unknown.push(name);
            continue;
        }
        assert_eq!(r.status, 200, "{name}: {r:?}");
        assert_eq!(r.body["acquired"], true, "{name}: {r:?}");
        granted.push(r.granted());
    }
    // Whatever landed late grants nothing more: the client's grants are
    // what the shard holds, and once they are released every name is free
    // (a name answered 503 too: a grant made for it would be one its
    // client was never told of).
    sleep_ms(1_500).await;
    every_name_is_free_once_released(&router, &granted, &keeper, &names).await;
    // No acquire was left with an unknown outcome, and the cut bit.
    assert!(unknown.is_empty(), "answered 503: {unknown:?}");
    let moved = cutoff_moves(&router, shard, "moved").await;
    assert!(
        moved >= 1.0,
        "no grant txn went unanswered: the cut did not bite"
    );
    // One move (the txns compared one cut-off), one mark left.
    let (start, end) = keys.cutoff_marks();
    let marks = c
        .get(start, Some(GetOptions::new().with_range(end)))
        .await
        .unwrap();
    let marks: Vec<_> = marks.kvs().iter().map(|kv| kv.key().to_vec()).collect();
    assert_eq!(marks, [keys.cutoff_mark(8)], "the marks left");
    down
}

/// docs/design.md, "An acquire that was not answered", on real etcd: the
/// grant cut-off's compare and read as the router builds them, and a
/// router meeting moves another replica made. A txn that compared a
/// cut-off below the shard's highest mark writes nothing and reads that
/// mark; one that compared the highest mark (or above) is applied. The
/// router, which saw none of the marks put under it, has its acquire, an
/// extend's move and a waiter's grant each refused by a move, learns the
/// mark, and grants on the next txn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_txn_that_compared_an_older_cut_off_writes_nothing_and_the_router_learns_the_mark()
{
    let etcd = EtcdCluster::single();
    let keys = Keys::new("/lockrouter");
    let mut c = etcd.client().await;
    let probe = |seen: i64| {
        Txn::new()
            .when([keys.cutoff_compare(seen)])
            .and_then([TxnOp::put("probe", format!("compared {seen}"), None)])
            .or_else([keys.cutoff_read()])
    };
    // No mark yet: the compare holds.
    assert!(c.txn(probe(0)).await.unwrap().succeeded());
    for mark in [1, 9, 12] {
        c.put(keys.cutoff_mark(mark), "", None).await.unwrap();
    }
    for seen in [0, 1, 9, 11] {
        let resp = c.txn(probe(seen)).await.unwrap();
        assert!(!resp.succeeded(), "compared {seen}, below mark 12");
        let read = match &resp.op_responses()[..] {
            [TxnOpResponse::Get(get)] => get.kvs().first().cloned().map(Stored::from),
            other => panic!("{other:?}"),
        };
        assert_eq!(keys.cutoff_of(read), 12, "the highest mark is read");
    }
    for seen in [12, 13] {
        assert!(c.txn(probe(seen)).await.unwrap().succeeded(), "{seen}");
    }
    let probed = c.get("probe", None).await.unwrap().kvs()[0]
        .value_str()
        .unwrap()
        .to_string();
    assert_eq!(probed, "compared 13", "a refused txn wrote nothing");

    let router = TestRouter::start(&[&etcd]).await;
    let api = &router.api;
    // An acquire: refused by mark 12 (the router has seen none), granted.
    let lock = api.must_acquire("marks/acquire", 5_000, "X").await;
    // An extend's move, after another replica's move to mark 13.
    c.put(keys.cutoff_mark(13), "", None).await.unwrap();
    let body = json!({"lockId": lock.0, "fencingToken": lock.1, "ttlMs": 8_000});
    let extended = api.post("/api/v1/locks/extend", body).await;
    assert_eq!(extended.status, 200, "{extended:?}");
    assert_eq!(extended.body["fencingToken"], lock.1, "{extended:?}");
    // A waiter's grant at the head of the queue, after a move to mark 20.
    let held = api.must_acquire("marks/wait", 5_000, "X").await;
    let waiting = {
        let api = api.clone();
        let body = json!({"name": "marks/wait", "ttlMs": 5_000, "clientId": "Y", "waitMs": 10_000});
        tokio::spawn(async move { api.post("/api/v1/locks/acquire", body).await })
    };
    sleep_ms(300).await;
    c.put(keys.cutoff_mark(20), "", None).await.unwrap();
    assert_eq!(api.release(&held).await.status, 204);
    let granted = waiting.await.unwrap();
    assert_eq!(granted.status, 200, "{granted:?}");
    assert_eq!(granted.body["acquired"], true, "{granted:?}");
    assert!(
        granted.body["fencingToken"].as_u64().unwrap() > held.1,
        "{granted:?}"
    );
}
