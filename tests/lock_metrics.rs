//! The series of waiting and holding (`docs/metrics.md`), read from a
//! router process of their own (so no other test's locks count):
//! `lockrouter_waiters` counts a waiter while it waits and falls back to 0
//! however the wait ends (granted, `waitMs` run out, its client gone);
//! `lockrouter_wait_seconds` counts each wait by outcome, with its length;
//! `lockrouter_hold_seconds` counts a holder's release with how long it
//! held, and neither a repeated release nor a force-release;
//! `lockrouter_shard_request_duration_seconds` counts each acquire and
//! renew once on its shard (a waiting acquire with its wait) and a
//! renew-batch once on each shard it has locks on, and no invalid request.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use lockrouter_testkit::api::Api;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::metrics::sum;
use lockrouter_testkit::router_process::RouterProcess;

const ACQUIRE: &str = "/api/v1/locks/acquire";

fn waiting(name: &str, client: &str, wait_ms: u64) -> Value {
    json!({"name": name, "ttlMs": 10_000, "clientId": client, "waitMs": wait_ms})
}

/// Polls the router's metrics until `done` holds of them; panics with the
/// last text.
async fn metrics_until(api: &Api, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = api.metrics().await;
        if done(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "{what}:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn waiters(text: &str) -> f64 {
    sum(text, "lockrouter_waiters", &[("shard", "a")])
}

/// `_count` and `_sum` of a histogram's samples with `labels`.
fn histogram(text: &str, name: &str, labels: &[(&str, &str)]) -> (f64, f64) {
    (
        sum(text, &format!("{name}_count"), labels),
        sum(text, &format!("{name}_sum"), labels),
    )
}

fn waits(text: &str, outcome: &str) -> (f64, f64) {
    let labels = [("shard", "a"), ("outcome", outcome)];
    histogram(text, "lockrouter_wait_seconds", &labels)
}

fn holds(text: &str) -> (f64, f64) {
    histogram(text, "lockrouter_hold_seconds", &[("shard", "a")])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_and_holds_are_counted_however_they_end() {
    let etcd = EtcdCluster::single();
    let router = RouterProcess::start(&[&etcd], free_port()).await;
    let api = &router.api;
    let first = api.must_acquire("m", 10_000, "holder").await;

    // A waiter counts while it waits, and gets the lock when it is released.
    let granted = {
        let api = api.clone();
        tokio::spawn(async move { api.post(ACQUIRE, waiting("m", "w1", 5_000)).await })
    };
    metrics_until(api, "no waiter counted", |t| waiters(t) == 1.0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(api.release(&first).await.status, 204);
    let second = granted.await.unwrap().granted();
    let text = metrics_until(api, "the waiter still counted", |t| waiters(t) == 0.0).await;
    let (n, secs) = waits(&text, "acquired");
    assert!(n == 1.0 && secs >= 0.3, "{n} waits, {secs} s:\n{text}");
    let (n, secs) = holds(&text);
    assert!(n == 1.0 && secs >= 0.3, "{n} holds, {secs} s:\n{text}");
    // Released again: nothing more was held.
    assert_eq!(api.release(&first).await.status, 204);
    assert_eq!(holds(&api.metrics().await).0, 1.0);

    // A waiter whose waitMs runs out.
    let r = api.post(ACQUIRE, waiting("m", "w2", 300)).await;
    assert_eq!(
        (r.status, &r.body["acquired"]),
        (200, &json!(false)),
        "{r:?}"
    );
    let text = api.metrics().await;
    assert_eq!(waiters(&text), 0.0, "{text}");
    // Counted from the first answer that the name is held, one etcd round
    // trip after the request began: a little under its waitMs.
    let (n, secs) = waits(&text, "not_acquired");
    assert!(n == 1.0 && secs > 0.0, "{n} waits, {secs} s:\n{text}");

    // A waiter whose client goes away: its request is dropped, and with it
    // the count.
    let gone = api
        .http
        .post(format!("{}{ACQUIRE}", api.base))
        .json(&waiting("m", "w3", 20_000))
        .timeout(Duration::from_millis(500))
        .send()
        .await;
    assert!(gone.is_err(), "{gone:?}");
    let text = metrics_until(api, "the dropped waiter still counted", |t| {
        waiters(t) == 0.0 && waits(t, "error").0 == 1.0
    })
    .await;
    assert_eq!(waits(&text, "acquired").0, 1.0, "{text}");
    assert_eq!(waits(&text, "not_acquired").0, 1.0, "{text}");

    // An operator's force-release is counted as one, not as a hold.
    let r = api
        .post(
            "/admin/v1/locks/m/force-release",
            json!({"reason": "metrics test"}),
        )
        .await;
    assert_eq!(
        (r.status, &r.body["released"]),
        (200, &json!(true)),
        "{r:?}"
    );
    let text = api.metrics().await;
    assert_eq!(sum(&text, "lockrouter_force_releases_total", &[]), 1.0);
    assert_eq!(holds(&text).0, 1.0, "{text}");
    // Its former holder's release finds nothing to release.
    assert_eq!(api.release(&second).await.status, 204);
    let third = api.must_acquire("m", 10_000, "holder").await;
    assert_eq!(api.release(&third).await.status, 204);
    assert_eq!(holds(&api.metrics().await).0, 2.0);
}

/// `_count` and `_sum` of `lockrouter_shard_request_duration_seconds` for
/// `op` on `shard`.
fn shard_latency(text: &str, shard: &str, op: &str) -> (f64, f64) {
    let labels = [("shard", shard), ("op", op)];
    histogram(text, "lockrouter_shard_request_duration_seconds", &labels)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_and_renewals_are_timed_once_on_each_shard_they_touch() {
    let (a, b) = (EtcdCluster::single(), EtcdCluster::single());
    let router = RouterProcess::start(&[&a, &b], free_port()).await;
    let api = &router.api;
    // Two names on shard a, one on b.
    let (mut on_a, mut on_b) = (Vec::new(), Vec::new());
    for i in 0.. {
        let name = format!("timed-{i}");
        let shard = api.inspect(&name).await.body["shard"].clone();
        match shard.as_str() {
            Some("a") if on_a.len() < 2 => on_a.push(name),
            Some("b") if on_b.is_empty() => on_b.push(name),
            _ => {}
        }
        if on_a.len() == 2 && on_b.len() == 1 {
            break;
        }
    }
    let a1 = api.must_acquire(&on_a[0], 10_000, "timed").await;
    let a2 = api.must_acquire(&on_a[1], 10_000, "timed").await;
    let b1 = api.must_acquire(&on_b[0], 10_000, "timed").await;
    // Invalid: not counted.
    assert_eq!(api.acquire(&on_a[0], 1, "timed").await.status, 400);
    let text = api.metrics().await;
    assert_eq!(shard_latency(&text, "a", "acquire").0, 2.0, "{text}");
    assert_eq!(shard_latency(&text, "b", "acquire").0, 1.0, "{text}");

    assert_eq!(api.renew(&a1).await.status, 200);
    let locks: Vec<Value> = [&a1, &a2, &b1]
        .iter()
        .map(|(id, token)| json!({"lockId": id, "fencingToken": token}))
        .collect();
    let r = api
        .post("/api/v1/locks/renew-batch", json!({ "locks": locks }))
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    let text = api.metrics().await;
    // The renew, then the batch once on a (two locks) and once on b.
    assert_eq!(shard_latency(&text, "a", "renew").0, 2.0, "{text}");
    assert_eq!(shard_latency(&text, "b", "renew").0, 1.0, "{text}");

    // A waiting acquire counts with its wait.
    let before = shard_latency(&text, "b", "acquire");
    let r = api.post(ACQUIRE, waiting(&on_b[0], "other", 300)).await;
    assert_eq!(r.body["acquired"], false, "{r:?}");
    let after = shard_latency(&api.metrics().await, "b", "acquire");
    assert_eq!(after.0, before.0 + 1.0);
    assert!(after.1 - before.1 >= 0.3, "{before:?} then {after:?}");
}
