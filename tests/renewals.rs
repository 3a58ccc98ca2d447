//! Renewals under pressure on real etcd: thousands of sessions expiring at
//! once while someone renews their stale lockIds in a tight loop must not
//! hold up live clients' renewals (etcd answers a keepalive of an expired,
//! not yet revoked lease only once the revoke is applied, and revokes at
//! most about a thousand leases a second).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use serde_json::json;

use lockrouter_testkit::api::Api;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::router::TestRouter;

const MARGIN: Duration = Duration::from_millis(200);

fn batch(locks: &[(String, u64)]) -> serde_json::Value {
    let items: Vec<_> = locks
        .iter()
        .map(|l| json!({"lockId": l.0, "fencingToken": l.1}))
        .collect();
    json!({ "locks": items })
}

/// A live client: renews its three locks as the SDKs do (TTL 2 s): 600 ms
/// after its last renewal, or sooner so that 600 ms of validity are left
/// when it sends (the router answers the time the session lease has, which
/// may be less than a TTL: `etcd.keepalive_below_pct`), until `stop`,
/// judging validity by its own clock. Returns its renewal latencies and
/// whether it ever lost a lock.
async fn live(api: Api, id: usize, stop: Instant) -> (Vec<Duration>, Option<String>) {
    let client = format!("live-{id}");
    let mut locks = Vec::new();
    let mut valid_until = Instant::now() + Duration::from_secs(10);
    for i in 0..3 {
        let sent = Instant::now();
        let r = api.acquire(&format!("live-{id}-{i}"), 2_000, &client).await;
        assert_eq!(r.body["acquired"], true, "{r:?}");
        let ms = r.body["expiresInMs"].as_u64().unwrap();
        valid_until = valid_until.min(sent + Duration::from_millis(ms) - MARGIN);
        locks.push((
            r.body["lockId"].as_str().unwrap().to_string(),
            r.body["fencingToken"].as_u64().unwrap(),
        ));
    }
    let mut latencies = Vec::new();
    let interval = Duration::from_millis(600);
    let mut last = Instant::now();
    while Instant::now() < stop {
        let due = (last + interval).min(valid_until.checked_sub(interval).unwrap_or(last));
        let due = due.max(last + Duration::from_millis(50));
        tokio::time::sleep_until(due.into()).await;
        let sent = Instant::now();
        last = sent;
        let r = api.post("/api/v1/locks/renew-batch", batch(&locks)).await;
        latencies.push(sent.elapsed());
        if Instant::now() >= valid_until {
            return (latencies, Some(format!("{client}: validity ran out")));
        }
        if r.status != 200 {
            continue; // retried at the next round while still valid
        }
        let mut until = None::<Instant>;
        for res in r.body["results"].as_array().unwrap() {
            match res["renewed"].as_bool() {
                Some(true) => {
                    let ms = res["expiresInMs"].as_u64().unwrap();
                    let end = sent + Duration::from_millis(ms) - MARGIN;
                    until = Some(until.map_or(end, |u| u.min(end)));
                }
                _ if res["reason"] == "shard_unavailable" => {}
                _ => return (latencies, Some(format!("{client}: {res}"))),
            }
        }
        if let Some(u) = until {
            valid_until = valid_until.max(u);
        }
    }
    (latencies, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mass_expiry_and_stale_renewals_never_stall_live_renewals() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let api = router.api.clone();
    // 2,000 sessions (one lock each) that nobody renews: they expire in the
    // next seconds, many at once.
    let mut stale = Vec::new();
    for chunk in (0..2_000).collect::<Vec<_>>().chunks(100) {
        let got = join_all(chunk.iter().map(|i| {
            let api = api.clone();
            async move {
                api.must_acquire(&format!("stale-{i}"), 2_000, &format!("stale-{i}"))
                    .await
            }
        }))
        .await;
        stale.extend(got);
    }
    let stop = Instant::now() + Duration::from_secs(8);
    let live_clients: Vec<_> = (0..16)
        .map(|id| tokio::spawn(live(api.clone(), id, stop)))
        .collect();
    // Someone renews the stale lockIds in a tight loop meanwhile.
    let stale_renewals = Arc::new(AtomicUsize::new(0));
    let hammers: Vec<_> = stale
        .chunks(500)
        .map(|part| {
            let (api, part, count) = (api.clone(), part.to_vec(), stale_renewals.clone());
            tokio::spawn(async move {
                while Instant::now() < stop {
                    let r = api.post("/api/v1/locks/renew-batch", batch(&part)).await;
                    assert!(r.status == 200 || r.status == 503, "{r:?}");
                    count.fetch_add(part.len(), Ordering::Relaxed);
                }
            })
        })
        .collect();
    let mut latencies = Vec::new();
    let mut lost = Vec::new();
    for c in live_clients {
        let (l, loss) = c.await.unwrap();
        latencies.extend(l);
        lost.extend(loss);
    }
    join_all(hammers).await;
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100];
    eprintln!(
        "{} live renewals, p99 {p99:?}, max {:?}; {} stale renewals",
        latencies.len(),
        latencies.last().unwrap(),
        stale_renewals.load(Ordering::Relaxed)
    );
    assert!(lost.is_empty(), "live locks lost: {lost:?}");
    // Bounded well below the TTL: a stalled stream would show seconds.
    assert!(p99 < Duration::from_millis(1_000), "live renew p99 {p99:?}");
}

/// Keepalives received by etcd member `i` so far (its own gRPC metrics).
fn keepalives_at(etcd: &EtcdCluster, i: usize) -> f64 {
    let text = etcd.metrics_text(i).expect("member metrics");
    lockrouter_testkit::metrics::sum(
        &text,
        "grpc_server_msg_received_total",
        &[("grpc_method", "LeaseKeepAlive")],
    )
}

/// Renews `locks` until `rounds` renewals of each have been answered 200,
/// and returns how many keepalives each member received meanwhile.
async fn renew_rounds(
    api: &Api,
    etcd: &EtcdCluster,
    locks: &[(String, u64)],
    rounds: usize,
) -> Vec<f64> {
    let before: Vec<f64> = (0..3).map(|i| keepalives_at(etcd, i)).collect();
    for round in 0..rounds {
        let renewed = join_all(locks.iter().map(|l| api.renew(l))).await;
        assert!(
            renewed.iter().all(|r| r.status == 200),
            "round {round}: {renewed:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (0..3).map(|i| keepalives_at(etcd, i) - before[i]).collect()
}

/// A follower forwards every keepalive to the leader in an HTTP request of
/// its own (tens of times the leader's CPU per keepalive), so the main
/// keepalive streams go to the leader, and follow it when leadership
/// moves: with three streams and a three-member shard, the renewals'
/// keepalives reach the leader, not the followers, before and after etcd
/// is asked to move its leadership.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_streams_go_to_the_leader_and_follow_it() {
    let etcd = EtcdCluster::start(3);
    let extra = "keepalive_streams = 3\nkeepalive_coalesce_ms = 0\nkeepalive_below_pct = 100\n";
    let router = TestRouter::with_toml(&lockrouter_testkit::config::config_toml(
        &[&etcd],
        "127.0.0.1:0",
        extra,
    ))
    .await;
    let api = &router.api;
    let locks = api.must_acquire_each("led", 60, 10_000).await;
    // The member probes (every 250 ms) find the leader; a stream opened
    // before that moves once nothing is in flight on it.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    renew_rounds(api, &etcd, &locks, 3).await;
    for leadership in 0..2 {
        let leader = etcd.leader().await.expect("a leader");
        let got = renew_rounds(api, &etcd, &locks, 5).await;
        let total: f64 = got.iter().sum();
        assert!(total >= 300.0, "{got:?}: fewer keepalives than renewals");
        let at_followers = total - got[leader];
        assert!(
            at_followers <= total * 0.05,
            "leadership {leadership}, leader {leader}: keepalives per member {got:?}"
        );
        // Move the leadership to the next member and wait for the router's
        // probes to see it.
        let target = (leader + 1) % 3;
        let mut to = etcd.member_client(target).await;
        // (status answers with the member's own id in its header)
        let id = to.status().await.unwrap().header().unwrap().member_id();
        let mut from = etcd.member_client(leader).await;
        from.move_leader(id).await.expect("leadership moved");
        assert_eq!(etcd.leader().await, Some(target));
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        renew_rounds(api, &etcd, &locks, 2).await;
    }
}
