//! Faults with real processes: an etcd leader paused (SIGSTOP) past its
//! election timeout and resumed, while clients hold, renew and release hot
//! names through two router replicas; a silent member; the torture test,
//! which mixes these with partitions (see `partitions`). Every grant is judged as a client
//! would judge it (its own monotonic clock, `expiresInMs` minus a margin)
//! and checked by the history checker: no two holders at once, tokens
//! strictly increasing per name, no 5xx but 503/504.

use std::time::{Duration, Instant};

use futures::future::join_all;
use serde_json::json;

use lockrouter_testkit::api::Api;
use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::history::{Grant, History};
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::sleep_ms;

/// What a client subtracts from `expiresInMs` before trusting a lock.
const MARGIN: Duration = Duration::from_millis(200);

/// A small xorshift generator, so runs are repeatable per worker.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn lock_of(body: &serde_json::Value) -> (String, u64) {
    (
        body["lockId"].as_str().unwrap().to_string(),
        body["fencingToken"].as_u64().unwrap(),
    )
}

/// The sum of a metric's series in a Prometheus text page.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn error_code(body: &serde_json::Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

/// One client: acquires a random hot name (TTL 2 to 4 s) through a random
/// replica, holds it for up to a few TTLs renewing every TTL/3 while its
/// own clock says it is valid, then releases it. Every grant and renewal
/// is recorded with the validity the client gives it.
pub(crate) async fn holder(id: usize, names: u64, apis: Vec<Api>, history: History, stop: Instant) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (id as u64 + 1).wrapping_mul(0x2545_f491));
    let client = format!("holder-{id}");
    while Instant::now() < stop {
        let name = format!("hot-{}", rng.below(names));
        let ttl_ms = 2_000 + 1_000 * rng.below(3);
        let api = &apis[rng.below(apis.len() as u64) as usize];
        history.attempt();
        let sent = Instant::now();
        let r = api
            .post(
                "/api/v1/locks/acquire",
                json!({"name": name, "ttlMs": ttl_ms, "clientId": client}),
            )
            .await;
        let received = Instant::now();
        if r.status != 200 {
            history.refused(r.status, error_code(&r.body), received);
            sleep_ms(50).await;
            continue;
        }
        if r.body["acquired"] != true {
            sleep_ms(rng.below(30)).await;
            continue;
        }
        let lock = lock_of(&r.body);
        let expires_in = Duration::from_millis(r.body["expiresInMs"].as_u64().unwrap());
        let grant = Grant {
            name: name.clone(),
            lock_id: lock.0.clone(),
            token: lock.1,
            sent,
            received,
            expires_in: expires_in.saturating_sub(MARGIN),
            released: None,
        };
        let mut valid_until = sent + grant.expires_in;
        let mut index = history.granted(grant.clone());
        let hold_until = Instant::now() + Duration::from_millis(rng.below(3 * ttl_ms));
        let mut lost = false;
        while Instant::now() < hold_until.min(stop) {
            sleep_ms((ttl_ms / 3).min(500)).await;
            if Instant::now() >= valid_until {
                lost = true;
                break;
            }
            let api = &apis[rng.below(apis.len() as u64) as usize];
            let sent = Instant::now();
            let r = api.renew(&lock).await;
            let received = Instant::now();
            match r.status {
                200 => {
                    let ms = r.body["expiresInMs"].as_u64().unwrap();
                    let expires_in = Duration::from_millis(ms).saturating_sub(MARGIN);
                    valid_until = valid_until.max(sent + expires_in);
                    index = history.granted(Grant {
                        sent,
                        received,
                        expires_in,
                        ..grant.clone()
                    });
                }
                409 => {
                    lost = true;
                    break;
                }
                _ => history.refused(r.status, error_code(&r.body), received),
            }
        }
        if !lost {
            history.released(index, Instant::now());
            let api = &apis[rng.below(apis.len() as u64) as usize];
            let r = api.release(&lock).await;
            if r.status != 204 {
                history.refused(r.status, error_code(&r.body), Instant::now());
            }
        } else {
            // The client stops acting as the holder; the lock's record
            // already ends at its validity.
            let _ = apis[0].release(&lock).await;
        }
    }
}

/// Pauses the current leader of `etcd` for `pause` every `every` until
/// `stop`; returns how many pauses were made.
async fn pause_leaders(
    etcd: &EtcdCluster,
    pause: Duration,
    every: Duration,
    stop: Instant,
) -> usize {
    let mut pauses = 0;
    while Instant::now() + every < stop {
        tokio::time::sleep(every - pause).await;
        let Some(leader) = etcd.leader().await else {
            continue;
        };
        let at = Instant::now();
        etcd.pause_member(leader);
        tokio::time::sleep(pause).await;
        etcd.resume_member(leader);
        eprintln!("paused member {leader} for {:?}", at.elapsed());
        pauses += 1;
    }
    pauses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_never_lets_two_clients_hold_one_name() {
    let secs = secs_from_env("LOCKROUTER_FAULT_SECS", 40);
    let etcd = EtcdCluster::start(3);
    let extra = std::env::var("LOCKROUTER_FAULT_EXTRA_TOML").unwrap_or_default();
    let toml = config_toml(&[&etcd], "127.0.0.1:0", &extra);
    let (r1, r2) = (
        TestRouter::with_toml(&toml).await,
        TestRouter::with_toml(&toml).await,
    );
    let apis = vec![r1.api.clone(), r2.api.clone()];
    let history = History::default();
    let started = Instant::now();
    let stop = started + Duration::from_secs(secs);
    // Every 503 is acceptable under these faults; 500s and overlaps are not.
    history.allow_unavailable(started, stop + Duration::from_secs(10));
    let workers: Vec<_> = (0..16)
        .map(|i| tokio::spawn(holder(i, 6, apis.clone(), history.clone(), stop)))
        .collect();
    let pauses = pause_leaders(&etcd, Duration::from_secs(5), Duration::from_secs(12), stop).await;
    join_all(workers).await;
    let (grants, attempts, refused) = history.check();
    let mut delays = 0.0;
    for api in &apis {
        delays += metric_sum(&api.metrics().await, "lockrouter_lock_delays_total");
    }
    eprintln!("{pauses} pauses, {grants} grants, {attempts} attempts, {refused} refusals, {delays} lock-delays");
    assert!(pauses >= 2, "only {pauses} leader pauses");
    assert!(grants >= 30, "only {grants} grants in {attempts} attempts");
    // The pauses reached the clients: requests were refused while the
    // leader was paused, or holders were lost (their leases revoked by the
    // resumed old leader, or unrenewable) and the lock-delay defense ran.
    // Routers that leave a member behind on the raft term out of rotation
    // lose fewer holders, so either counts.
    assert!(
        refused > 0 || delays > 0.0,
        "no request refused and no lock-delay set: the faults did not bite"
    );
}

/// Seconds from the environment variable `var`, else `default`.
fn secs_from_env(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A silent-able proxy in front of each member of `etcd`.
async fn proxies_for(etcd: &EtcdCluster) -> Vec<lockrouter_testkit::proxy::SilentProxy> {
    let mut proxies = Vec::new();
    for ep in etcd.endpoints() {
        proxies.push(lockrouter_testkit::proxy::SilentProxy::start(&ep).await);
    }
    proxies
}

/// A router config listening on `listen`, with one shard `a` reached
/// through `proxies`, and an etcd deadline of `deadline_ms`.
fn proxied_toml(
    listen: &str,
    proxies: &[lockrouter_testkit::proxy::SilentProxy],
    deadline_ms: u64,
) -> String {
    let endpoints: Vec<String> = proxies.iter().map(|p| format!("\"{}\"", p.url())).collect();
    format!(
        "[server]\nlisten = \"{listen}\"\n\n[etcd]\nprefix = \"/lockrouter\"\n\
         request_timeout_ms = {deadline_ms}\nconnect_timeout_ms = 500\nhealth_interval_ms = 200\n\n\
         [[shards]]\nname = \"a\"\nendpoints = [{}]\n",
        endpoints.join(", ")
    )
}

/// One client of [`a_silent_member_costs_renewals_little`]: holds `locks`
/// names with TTL `ttl_ms` and renews them all with one `renew-batch`
/// every quarter TTL, judging each by its own clock. Returns the renewal latencies
/// and the worst moment it would have had to stop trusting a lock (None:
/// never).
pub(crate) async fn renewer(
    api: Api,
    client: String,
    locks: usize,
    ttl_ms: u64,
    stop: Instant,
) -> (Vec<Duration>, Option<String>) {
    let mut held = Vec::new();
    let mut valid_until = Vec::new();
    for i in 0..locks {
        let sent = Instant::now();
        let r = api
            .post(
                "/api/v1/locks/acquire",
                json!({"name": format!("{client}-{i}"), "ttlMs": ttl_ms, "clientId": client}),
            )
            .await;
        assert_eq!(r.status, 200, "{:?}", r.body);
        assert_eq!(r.body["acquired"], true, "{:?}", r.body);
        held.push(lock_of(&r.body));
        let ms = r.body["expiresInMs"].as_u64().unwrap();
        valid_until.push(sent + Duration::from_millis(ms).saturating_sub(MARGIN));
    }
    let mut latencies = Vec::new();
    let mut lost = None;
    while Instant::now() < stop && lost.is_none() {
        sleep_ms(ttl_ms / 4).await;
        let body = json!({"locks": held
            .iter()
            .map(|(id, token)| json!({"lockId": id, "fencingToken": token}))
            .collect::<Vec<_>>()});
        let sent = Instant::now();
        let r = api.post("/api/v1/locks/renew-batch", body).await;
        let received = Instant::now();
        latencies.push(received - sent);
        if received - sent > Duration::from_millis(300) {
            eprintln!(
                "{client}: renew-batch took {:?} ({}): {}",
                received - sent,
                r.status,
                r.body
            );
        }
        if r.status != 200 {
            assert_eq!(r.status, 503, "{client}: {:?}", r.body);
            continue;
        }
        for (i, result) in r.body["results"].as_array().unwrap().iter().enumerate() {
            if received > valid_until[i] {
                lost = Some(format!(
                    "{client}: lock {i} lapsed by {:?} before its renewal came back",
                    received - valid_until[i]
                ));
            }
            match result["renewed"].as_bool() {
                Some(true) => {
                    let ms = result["expiresInMs"].as_u64().unwrap();
                    let until = sent + Duration::from_millis(ms).saturating_sub(MARGIN);
                    valid_until[i] = valid_until[i].max(until);
                }
                _ if result["reason"] == "shard_unavailable" => {}
                _ => lost = Some(format!("{client}: lock {i} refused: {result}")),
            }
        }
    }
    (latencies, lost)
}

/// A member that goes silent (its connections held open, nothing
/// forwarded either way, as when packets are lost on a dead link) must not
/// cost clients their locks: reads, barriers and keepalive streams go to
/// another member after a short delay, and the member leaves the rotation
/// within about a second. The router's etcd deadline is the default 3 s,
/// longer than the TTL, so waiting it out on the silent member would lose
/// every lock renewed through it. A follower is silenced, then the leader
/// (seen from the router only: the members still reach each other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_member_costs_renewals_little() {
    let etcd = EtcdCluster::start(3);
    let proxies = proxies_for(&etcd).await;
    let toml = proxied_toml("127.0.0.1:0", &proxies, 3_000);
    let router = TestRouter::with_toml(&toml).await;
    let leader = etcd.leader().await.expect("a leader");
    let follower = (leader + 1) % 3;
    let started = Instant::now();
    let stop = started + Duration::from_secs(14);
    let renewers: Vec<_> = (0..8)
        .map(|c| {
            tokio::spawn(renewer(
                router.api.clone(),
                format!("silent-{c}"),
                3,
                2_000,
                stop,
            ))
        })
        .collect();
    for (member, role) in [(follower, "follower"), (leader, "leader")] {
        sleep_ms(2_000).await;
        eprintln!("silencing the {role} (member {member}) for 4 s");
        proxies[member].set_silent(true);
        sleep_ms(4_000).await;
        proxies[member].set_silent(false);
    }
    judge_renewers(renewers).await;
    // The faults bit: requests or keepalive streams were hedged.
    let hedged = metric_sum(
        &router.api.metrics().await,
        "lockrouter_etcd_hedged_requests_total",
    );
    assert!(hedged > 0.0, "nothing was hedged: the silence did not bite");
}

/// Waits for [`renewer`]s: none may have lost a lock by its own clock.
/// Prints their renew-batch latencies.
pub(crate) async fn judge_renewers(
    renewers: Vec<tokio::task::JoinHandle<(Vec<Duration>, Option<String>)>>,
) {
    let mut latencies = Vec::new();
    for r in join_all(renewers).await {
        let (l, lost) = r.unwrap();
        assert!(lost.is_none(), "{}", lost.unwrap());
        latencies.extend(l);
    }
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    eprintln!(
        "{} renew-batches: p50 {:?}, p99 {:?}, max {:?}",
        latencies.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
}

/// The faults the torture test mixes, in turn.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// A member's client traffic is held (connections open, nothing sent).
    SilentMember,
    /// The leader is SIGSTOPped past its election timeout, then resumed.
    PausedLeader,
    /// A member is SIGKILLed and started again on its data.
    KilledMember,
    /// The router process is SIGSTOPped mid-requests, then resumed.
    PausedRouter,
    /// Every member is SIGKILLed and started again on its data.
    ShardRestart,
    /// The leader's link to its followers is cut (packets lost); clients
    /// still reach it.
    MinorityLeader,
    /// A member is cut from the others and from the routers, then let back.
    IsolatedMember,
    /// Both routers are cut from the shard (every packet lost).
    RoutersCut,
}

/// The torture test: many clients on few hot names through two replicas
/// (one in-process, one the real binary) of one 3-member shard whose
/// members run in network namespaces, while a schedule of faults runs: a
/// silent member, a paused leader, a killed and restarted member, a paused
/// router replica, a minority leader, the whole shard restarted, a member
/// cut off and let back, the routers cut from the shard.
/// The history checker judges every grant by its client's clock: no two
/// holders at once, tokens strictly increasing per name, no 5xx but 503. About 60 s;
/// `LOCKROUTER_TORTURE_SECS` makes it longer. A failed check writes the
/// whole history to a file and names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torture_mixed_faults_never_break_mutual_exclusion_or_fencing() {
    use lockrouter_testkit::loopback::free_port;
    use lockrouter_testkit::router_process::RouterProcess;
    let secs = secs_from_env("LOCKROUTER_TORTURE_SECS", 60);
    let net = crate::partitions::network();
    let mut etcd = crate::partitions::partitionable(&net);
    let proxies = proxies_for(&etcd).await;
    let toml = |listen: &str| proxied_toml(listen, &proxies, 1_500);
    let inside = TestRouter::with_toml(&toml("127.0.0.1:0")).await;
    let port = free_port();
    let process = RouterProcess::spawn(&toml(&format!("127.0.0.1:{port}")), port);
    process.api.wait_ready().await;
    let apis = vec![inside.api.clone(), process.api.clone()];
    let history = History::default();
    let started = Instant::now();
    let stop = started + Duration::from_secs(secs);
    // Every 503 is acceptable under these faults; 500s and overlaps are not.
    history.allow_unavailable(started, stop + Duration::from_secs(30));
    let workers: Vec<_> = (0..16)
        .map(|i| tokio::spawn(holder(i, 8, apis.clone(), history.clone(), stop)))
        .collect();
    let schedule = [
        Fault::SilentMember,
        Fault::PausedLeader,
        Fault::KilledMember,
        Fault::PausedRouter,
        Fault::MinorityLeader,
        Fault::ShardRestart,
        Fault::IsolatedMember,
        Fault::RoutersCut,
    ];
    let mut done = Vec::new();
    let mut rng = Rng(0x5eed);
    for fault in schedule.iter().cycle() {
        if Instant::now() + Duration::from_secs(6) > stop {
            break;
        }
        sleep_ms(2_000).await;
        let member = rng.below(3) as usize;
        let at = Instant::now();
        match fault {
            Fault::SilentMember => {
                proxies[member].set_silent(true);
                sleep_ms(3_000).await;
                proxies[member].set_silent(false);
            }
            Fault::PausedLeader => {
                let Some(leader) = etcd.leader().await else {
                    continue;
                };
                etcd.pause_member(leader);
                sleep_ms(3_000).await;
                etcd.resume_member(leader);
            }
            Fault::KilledMember => {
                etcd.kill_member(member);
                sleep_ms(3_000).await;
                tokio::task::block_in_place(|| etcd.restart_member(member));
            }
            Fault::ShardRestart => {
                tokio::task::block_in_place(|| etcd.restart());
            }
            Fault::MinorityLeader => {
                let Some(leader) = etcd.leader().await else {
                    continue;
                };
                net.cut_peers(leader);
                sleep_ms(3_000).await;
                net.heal_peers(leader);
            }
            Fault::IsolatedMember => {
                net.isolate(member);
                sleep_ms(3_000).await;
                net.heal(member);
            }
            Fault::RoutersCut => {
                net.cut_clients();
                sleep_ms(3_000).await;
                net.heal_clients();
            }
            Fault::PausedRouter => {
                let pid = nix::unistd::Pid::from_raw(process.pid() as i32);
                nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
                sleep_ms(2_000).await;
                nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
            }
        }
        eprintln!("{fault:?} (member {member}) for {:?}", at.elapsed());
        done.push(*fault);
    }
    for w in join_all(workers).await {
        w.unwrap();
    }
    let (grants, attempts, refused) = history.check();
    eprintln!(
        "{} faults, {grants} grants, {attempts} attempts, {refused} refusals",
        done.len()
    );
    assert!(
        done.len() >= schedule.len(),
        "only {} faults ran",
        done.len()
    );
    // Hot names stay held for seconds: a grant every two seconds or so.
    let least = secs as usize / 2;
    assert!(
        grants >= least,
        "only {grants} grants in {attempts} attempts"
    );
}
