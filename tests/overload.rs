//! Overload: a replica serves at most `server.max_in_flight` lock API
//! requests at once and refuses the rest at once with 503 `overloaded` and
//! `Retry-After`; acquires may fill only half of the slots and releases
//! 90%, so the releases of admitted acquires and the renewals of
//! held locks go on.

use std::time::{Duration, Instant};

use serde_json::json;

use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::router_process::RouterProcess;
use lockrouter_testkit::sleep_ms;

/// `toml` (a [`config_toml`]) with `server.max_in_flight = n`.
fn with_max_in_flight(toml: String, n: usize) -> String {
    let listen = toml
        .lines()
        .find(|l| l.starts_with("listen = "))
        .expect("a listen line");
    toml.replacen(listen, &format!("{listen}\nmax_in_flight = {n}"), 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_bound_a_router_refuses_acquires_at_once_and_still_renews() {
    let etcd = EtcdCluster::single();
    let toml = with_max_in_flight(config_toml(&[&etcd], "127.0.0.1:0", ""), 8);
    let router = TestRouter::with_toml(&toml).await;
    let lock = router.api.must_acquire("busy", 30_000, "holder").await;
    // Four acquires wait in the name's queue: half of 8 slots.
    let waiters: Vec<_> = (0..4)
        .map(|i| {
            let api = router.api.clone();
            tokio::spawn(async move {
                let body = json!({"name": "busy", "ttlMs": 30_000, "clientId": format!("w{i}"), "waitMs": 3_000});
                // Until it is in: the probes below may take a slot first.
                loop {
                    let r = api.post("/api/v1/locks/acquire", body.clone()).await;
                    if r.status != 503 {
                        return r;
                    }
                    sleep_ms(5).await;
                }
            })
        })
        .collect();
    // Once the four are in, a fifth acquire is refused at once, with a
    // reason and Retry-After.
    let started = Instant::now();
    let (r, took) = loop {
        let sent = Instant::now();
        let r = router.api.acquire("other", 30_000, "late").await;
        if r.status != 200 {
            break (r, sent.elapsed());
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "never refused: {:?} {:?}",
            r.body,
            waiters.iter().map(|w| w.is_finished()).collect::<Vec<_>>()
        );
        sleep_ms(20).await;
    };
    assert_eq!(r.status, 503, "{:?}", r.body);
    assert_eq!(r.body["error"]["code"], "overloaded", "{:?}", r.body);
    assert_eq!(r.retry_after.as_deref(), Some("1"));
    assert!(took < Duration::from_secs(1), "refused after {took:?}");
    // Renewals still have their room.
    assert_eq!(router.api.renew(&lock).await.status, 200);
    // Health and metrics are never refused.
    assert_eq!(router.api.get("/healthz").await.status, 200);
    // Once the waits end, acquires are served again.
    for w in waiters {
        let r = w.await.unwrap();
        assert_eq!(r.status, 200, "{:?}", r.body);
        assert_eq!(r.body["acquired"], false, "{:?}", r.body);
    }
    assert_eq!(
        router.api.acquire("other", 30_000, "late").await.status,
        200
    );
}

/// The `field` count of each of the router's log lines that `is_line`.
fn counts(log: &str, is_line: impl Fn(&str) -> bool, field: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| is_line(l))
        .map(|l| {
            let (_, rest) = l
                .split_once(&format!("{field}="))
                .unwrap_or_else(|| panic!("no {field} count: {l}"));
            let n = rest.split(|c: char| !c.is_ascii_digit()).next().unwrap();
            n.parse()
                .unwrap_or_else(|e| panic!("{field}={n}: {e}\n{l}"))
        })
        .collect()
}

/// The `refused` counts of the router's `shedding load` lines.
fn shed_lines(log: &str) -> Vec<u64> {
    counts(log, |l| l.contains("shedding load"), "refused")
}

/// Requests shed as `overloaded` are not logged one by one (a line each
/// would spend the CPU that shedding saves): the first is logged at once,
/// then at most one line a second, each counting the refusals since the
/// last. Every refusal is counted once, and none is a `request failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shed_requests_are_logged_at_most_once_a_second_with_their_count() {
    let etcd = EtcdCluster::single();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    // Two acquire slots (half of 5, the least bound).
    let toml = with_max_in_flight(config_toml(&[&etcd], &listen, ""), 5);
    let router = RouterProcess::spawn(&toml, port);
    router.api.wait_ready().await;
    let api = router.api.clone();
    let holder = api.must_acquire("busy", 30_000, "holder").await;
    let mut refused = 0;
    // Two waiters take the acquire slots for as long as they wait.
    let waiters: Vec<_> = (0..2)
        .map(|i| {
            let api = api.clone();
            tokio::spawn(async move {
                let body = json!({"name": "busy", "ttlMs": 30_000, "clientId": format!("waiter-{i}"), "waitMs": 20_000});
                let mut refused = 0;
                loop {
                    let r = api.post("/api/v1/locks/acquire", body.clone()).await;
                    if r.status != 503 {
                        return (r, refused);
                    }
                    refused += 1;
                    sleep_ms(5).await;
                }
            })
        })
        .collect();
    // Until the waiters are in, the burst's acquires may be admitted.
    let started = Instant::now();
    while api.acquire("other", 30_000, "late").await.status != 503 {
        assert!(started.elapsed() < Duration::from_secs(10), "never refused");
        sleep_ms(20).await;
    }
    refused += 1;
    let burst = Instant::now();
    for i in 0..200 {
        let r = api.acquire(&format!("shed-{i}"), 30_000, "late").await;
        assert_eq!(r.status, 503, "{r:?}");
        assert_eq!(r.body["error"]["code"], "overloaded", "{r:?}");
        refused += 1;
    }
    let burst = burst.elapsed();
    // A second after the burst, one more refusal brings the line that
    // counts what the last one left out.
    sleep_ms(1_100).await;
    assert_eq!(api.acquire("late-one", 30_000, "late").await.status, 503);
    refused += 1;
    // The waiters (refused while the other took the slots) get the name in
    // turn once its holder lets it go.
    assert_eq!(api.release(&holder).await.status, 204);
    let mut waiters = waiters;
    while !waiters.is_empty() {
        let Some(i) = waiters.iter().position(|w| w.is_finished()) else {
            sleep_ms(10).await;
            continue;
        };
        let (r, waiter_refused) = waiters.swap_remove(i).await.unwrap();
        refused += waiter_refused;
        assert_eq!(api.release(&r.granted()).await.status, 204);
    }

    let deadline = Instant::now() + Duration::from_secs(10);
    let log = loop {
        let log = router.log_text();
        if shed_lines(&log).iter().sum::<u64>() >= refused || Instant::now() > deadline {
            break log;
        }
        sleep_ms(50).await;
    };
    let lines = shed_lines(&log);
    assert_eq!(lines.iter().sum::<u64>(), refused, "{lines:?}\n{log}");
    // The first is logged at once (with a second refusal that raced it).
    assert!(matches!(lines.first(), Some(1 | 2)), "{lines:?}\n{log}");
    // At once, then at most once a second through the burst, then the last.
    let most = 2 + burst.as_secs() as usize + 1;
    assert!(
        lines.len() <= most,
        "{} lines, most {most}:\n{log}",
        lines.len()
    );
    assert!(
        !log.lines()
            .any(|l| l.contains("request failed") && l.contains("overloaded")),
        "{log}"
    );
}

/// The `suppressed` counts of the `request failed` lines about `outcome`.
fn failure_lines(log: &str, outcome: &str) -> Vec<u64> {
    let outcome = format!("outcome=\"{outcome}\"");
    counts(
        log,
        |l| l.contains("request failed") && l.contains(&outcome),
        "suppressed",
    )
}

/// A failed request (a 5xx other than shedding) is logged on a line of its
/// own, with its request id, while failures are few; in a storm (a shard
/// down, every request for it failing) each outcome gets at most 10 lines
/// a second, and the next line counts the failures left out. Every failure
/// is logged or counted, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_failures_is_logged_line_by_line_only_while_few() {
    let mut etcd = EtcdCluster::single();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let router = RouterProcess::spawn(&config_toml(&[&etcd], &listen, ""), port);
    router.api.wait_ready().await;
    let api = router.api.clone();
    etcd.kill();
    // The first may wait for the deadline; the storm comes after.
    fails(&api, "first").await;
    let mut failed = 1;
    let mut storms = Vec::new();
    let (log, lines) = loop {
        let storm = Instant::now();
        for i in 0..300 {
            fails(&api, &format!("storm-{}-{i}", storms.len())).await;
        }
        storms.push(storm.elapsed());
        // A second after the storm, one more failure brings the line that
        // counts what the storm's last second left out.
        sleep_ms(1_100).await;
        fails(&api, &format!("after-{}", storms.len())).await;
        failed += 301;
        let (log, lines) = logged_failures(&router, failed).await;
        // A storm whose last failure opened a second of its own left
        // nothing out (its line counted the second before, and the next
        // failure's line counts none): then storm again, at most thrice.
        if *lines.last().unwrap() > 0 || storms.len() == 3 {
            break (log, lines);
        }
    };
    let counted = lines.len() as u64 + lines.iter().sum::<u64>();
    assert_eq!(counted, failed, "{lines:?}\n{log}");
    eprintln!(
        "{failed} failures in storms of {storms:?}: {} lines {lines:?}",
        lines.len()
    );
    // The first ten at once, each alone; then ten a second at most
    // through each storm; then the one after it.
    assert!(lines.len() >= 10, "{lines:?}");
    assert!(lines[..10].iter().all(|&n| n == 0), "{lines:?}");
    let most: usize = 10
        + storms
            .iter()
            .map(|storm| 10 * (storm.as_millis() as usize / 1_000 + 1) + 1)
            .sum::<usize>();
    assert!(lines.len() <= most, "{} lines, most {most}", lines.len());
    assert!(
        *lines.last().unwrap() > 0,
        "the last line counts the rest: {lines:?}"
    );
    // Each line names its request.
    assert!(
        log.lines()
            .filter(|l| l.contains("request failed"))
            .all(|l| l.contains("request_id=")),
        "{log}"
    );
}

/// An acquire of `name` on a shard whose etcd is gone: 503
/// `shard_unavailable`.
async fn fails(api: &lockrouter_testkit::api::Api, name: &str) {
    let r = api.acquire(name, 30_000, "c").await;
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.body["error"]["code"], "shard_unavailable", "{r:?}");
}

/// The router's log and the counts of its `request failed` lines about
/// `shard_unavailable`, once they account for `failed` failures (or after
/// 10 s).
async fn logged_failures(router: &RouterProcess, failed: u64) -> (String, Vec<u64>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = router.log_text();
        let lines = failure_lines(&log, "shard_unavailable");
        let counted = lines.len() as u64 + lines.iter().sum::<u64>();
        if counted >= failed || Instant::now() > deadline {
            return (log, lines);
        }
        sleep_ms(50).await;
    }
}

/// A clientId past `limits.acquires_per_client_per_sec` gets 429
/// `rate_limited` with Retry-After; other clients and its own renewals
/// are not held back, and its rate comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runaway_client_is_rate_limited_alone_and_its_renewals_go_on() {
    let etcd = EtcdCluster::single();
    let toml = config_toml(
        &[&etcd],
        "127.0.0.1:0",
        "\n[limits]\nacquires_per_client_per_sec = 3\n",
    );
    let router = TestRouter::with_toml(&toml).await;
    let mut held = Vec::new();
    for i in 0..3 {
        held.push(
            router
                .api
                .must_acquire(&format!("run-{i}"), 30_000, "runaway")
                .await,
        );
    }
    let r = router.api.acquire("run-3", 30_000, "runaway").await;
    assert_eq!(r.status, 429, "{:?}", r.body);
    assert_eq!(r.body["error"]["code"], "rate_limited", "{:?}", r.body);
    let message = r.body["error"]["message"].as_str().unwrap();
    assert!(message.contains("past 3 acquires/s"), "{message}");
    let after: u64 = r.retry_after.as_deref().unwrap().parse().unwrap();
    assert!(after >= 1, "{after}");
    // Another client is not held back, nor are the runaway's renewals.
    router.api.must_acquire("calm-0", 30_000, "calm").await;
    for lock in &held {
        assert_eq!(router.api.renew(lock).await.status, 200);
    }
    // A third of a second later it may acquire again.
    sleep_ms(400).await;
    router.api.must_acquire("run-3", 30_000, "runaway").await;
}

/// One slow shard cannot take every slot: with several shards, each may
/// have at most half of a replica's acquire slots in flight. Acquires of
/// its names past that are refused at once with 503 `overloaded`, and the
/// other shard's names are still granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_shard_takes_at_most_half_the_acquire_slots() {
    let (slow, fast) = (EtcdCluster::single(), EtcdCluster::single());
    // 16 slots: acquires may take 8, one shard 4.
    let toml = with_max_in_flight(config_toml(&[&slow, &fast], "127.0.0.1:0", ""), 16);
    let router = TestRouter::with_toml(&toml).await;
    let mut on_slow = Vec::new();
    let mut on_fast = None;
    for i in 0..200 {
        let name = format!("slot-{i}");
        let r = router.api.inspect(&name).await;
        match r.body["shard"].as_str() {
            Some("a") if on_slow.len() < 6 => on_slow.push(name),
            Some("b") if on_fast.is_none() => on_fast = Some(name),
            _ => {}
        }
    }
    let on_fast = on_fast.expect("a name on shard b");
    assert_eq!(on_slow.len(), 6);
    // Shard a stops answering: its acquires hang until the etcd deadline.
    slow.pause_member(0);
    let sent = Instant::now();
    let attempts = on_slow.iter().map(|name| {
        let api = router.api.clone();
        let name = name.clone();
        async move { api.acquire(&name, 10_000, "slow-client").await }
    });
    let (answers, fast_answer) = tokio::join!(futures::future::join_all(attempts), async {
        sleep_ms(100).await;
        router.api.acquire(&on_fast, 10_000, "fast-client").await
    });
    slow.resume_member(0);
    // Shard b kept granting while shard a held its four slots.
    assert_eq!(fast_answer.status, 200, "{:?}", fast_answer.body);
    assert_eq!(fast_answer.body["acquired"], true);
    let overloaded: Vec<_> = answers
        .iter()
        .filter(|r| r.status == 503 && r.body["error"]["code"] == "overloaded")
        .collect();
    assert_eq!(
        overloaded.len(),
        2,
        "{:?}",
        answers
            .iter()
            .map(|r| (r.status, &r.body))
            .collect::<Vec<_>>()
    );
    for r in overloaded {
        assert_eq!(r.retry_after.as_deref(), Some("1"));
    }
    assert!(sent.elapsed() < Duration::from_secs(10));
}

/// A request's deadline bounds every etcd call made for it: with the
/// shard's member paused and the shard's own etcd deadline at 3 s, an
/// acquire answers 504 `timeout` with Retry-After near the request's
/// deadline (the server's `request_timeout_ms`, or the caller's shorter
/// `X-Request-Timeout-Ms`), not after the shard's, and the calls cut short
/// are counted as `deadline`, not as the shard failing. A malformed header,
/// or a `waitMs` the caller's deadline cannot hold, is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_deadline_bounds_the_etcd_calls_made_for_it() {
    let etcd = EtcdCluster::single();
    let toml = config_toml(&[&etcd], "127.0.0.1:0", "")
        .replace("request_timeout_ms = 1000", "request_timeout_ms = 3000")
        .replace(
            "listen = \"127.0.0.1:0\"\n",
            "listen = \"127.0.0.1:0\"\nrequest_timeout_ms = 800\n",
        );
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    api.must_acquire("warm", 30_000, "c").await;
    let acquire = |name: &str, header: Option<&str>, wait_ms: u64| {
        let mut req = api
            .http
            .post(format!("{}/api/v1/locks/acquire", api.base))
            .json(&json!({"name": name, "ttlMs": 30_000, "clientId": "c", "waitMs": wait_ms}));
        if let Some(h) = header {
            req = req.header("X-Request-Timeout-Ms", h);
        }
        api.send(req)
    };
    for bad in ["abc", "0", "-5"] {
        let r = acquire("bad", Some(bad), 0).await;
        assert_eq!(r.status, 400, "{bad}: {r:?}");
    }
    let r = acquire("long-wait", Some("500"), 1_000).await;
    assert_eq!(r.status, 400, "{r:?}");

    etcd.pause_member(0);
    for (header, within) in [(None, 800), (Some("300"), 300)] {
        let sent = Instant::now();
        let r = acquire("paused", header, 0).await;
        let took = sent.elapsed();
        assert_eq!(r.status, 504, "{header:?}: {r:?}");
        assert_eq!(r.body["error"]["code"], "timeout", "{r:?}");
        assert!(r.retry_after.is_some(), "a 504 without Retry-After: {r:?}");
        // Well under the shard's 3 s: the request's deadline bounded it.
        assert!(
            took < Duration::from_millis(within + 1_500),
            "{header:?}: answered after {took:?}"
        );
    }
    etcd.resume_member(0);
    let text = api.metrics().await;
    let cut: f64 = text
        .lines()
        .filter(|l| {
            l.starts_with("lockrouter_etcd_requests_total{") && l.contains("outcome=\"deadline\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        cut > 0.0,
        "no etcd call was cut short by a request's deadline"
    );
    api.must_acquire("after", 30_000, "c").await;
}

/// Renewals first: once a shard's renewals take longer than
/// `server.renewal_budget_ms` (here its etcd stalls for 700 ms under four
/// renewals), the shard refuses acquires with 503 `overloaded` for a
/// second, while renewals and releases of held locks are still answered;
/// then acquires are admitted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_renewals_slow_down_acquires_are_refused_and_renewals_answered() {
    let etcd = EtcdCluster::single();
    let listen = "listen = \"127.0.0.1:0\"\n";
    let toml = config_toml(&[&etcd], "127.0.0.1:0", "")
        .replace(listen, &format!("{listen}renewal_budget_ms = 300\n"));
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let mut held = Vec::new();
    for i in 0..4 {
        held.push(
            api.must_acquire(&format!("held-{i}"), 20_000, "holder")
                .await,
        );
    }
    etcd.pause_member(0);
    let renewals = futures::future::join_all(held.iter().map(|l| api.renew(l)));
    let (renewed, ()) = tokio::join!(renewals, async {
        sleep_ms(700).await;
        etcd.resume_member(0);
    });
    assert!(renewed.iter().all(|r| r.status == 200), "{renewed:?}");
    // Shedding: an acquire is refused at once, a renewal is answered.
    let refused = api.acquire("new-name", 20_000, "newcomer").await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.body["error"]["code"], "overloaded", "{refused:?}");
    assert!(
        refused.body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("renewals")),
        "{refused:?}"
    );
    assert_eq!(refused.retry_after.as_deref(), Some("1"));
    assert_eq!(api.renew(&held[0]).await.status, 200);
    assert_eq!(api.release(&held[1]).await.status, 204);
    // A second after the last slow renewal, acquires are admitted again.
    sleep_ms(1_200).await;
    let granted = api.acquire("new-name", 20_000, "newcomer").await;
    assert_eq!(granted.body["acquired"], true, "{granted:?}");
}
