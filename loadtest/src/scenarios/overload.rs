//! `overload`: lock lives offered open-loop at a multiple of the router's
//! capacity, against a router with a bound on requests in flight
//! (`server.max_in_flight`, docs/design.md "Overload"), while holders keep
//! their locks renewed.
//!
//! A closed loop cannot overload anything: a user that waits for its answer
//! slows down with the router. Here arrivals follow a fixed schedule
//! (arrival i is due at start + i / rate) and a pool of goose users sends
//! them, each taking the next arrival when it is free. An arrival that
//! finds no user free within [`SLACK`] of its due time is skipped and
//! counted: the generator stays bounded (at most `workers` requests
//! outstanding) and says so when it, not the router, held the load back.
//!
//! Every arrival is one lock life: an acquire of a name nobody else uses
//! and, if granted, its release. A refused acquire (503 `overloaded`, 429)
//! is not retried: a retry would be a new arrival. A release refused with
//! 503 is retried after its `Retry-After`, since the lock would otherwise
//! stay held until its TTL. Each holder holds a few locks and renews them
//! all with one renew-batch every TTL/3; a renew-batch refused with 503 is
//! counted and retried after its `Retry-After`. A held lock is lost when a
//! renewal answers it not renewed, or when a renewal confirms it more than
//! a TTL after the one before (by the holder's clock, from the confirming
//! call's send, so the count errs towards loss).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use goose::prelude::*;
use lockrouter_testkit::{loopback, metrics};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::api::{self, Answer, Held};
use crate::attack::transaction;
use crate::scenarios::clients::Clients;
use crate::scrape::{Delta, Snapshot};
use crate::stack::Stack;
use crate::stats::{Latency, Stats};

/// How late a free user may pick up an arrival before it counts as
/// skipped (the generator had no user free at its due time).
pub const SLACK: Duration = Duration::from_millis(5);

/// Attempts at a release refused with 503 before giving up on it.
const RELEASE_ATTEMPTS: usize = 4;

const ACQUIRE: &str = "/api/v1/locks/acquire";
const RELEASE: &str = "/api/v1/locks/release";
const RENEW_BATCH: &str = "/api/v1/locks/renew-batch";

/// What the users count besides [`Stats`]; serialized into the summary.
#[derive(Debug, Default, Serialize)]
pub struct Counts {
    /// Arrivals due in the window, and those skipped because no user of
    /// the pool was free.
    pub arrivals_due: AtomicU64,
    pub arrivals_skipped: AtomicU64,
    /// Acquires answered 503 `overloaded`.
    pub acquires_overloaded: AtomicU64,
    /// Acquires answered 429 (per-client rate limit).
    pub acquires_rate_limited: AtomicU64,
    /// 503s with a code other than `overloaded` (e.g. `shard_unavailable`).
    pub other_503: AtomicU64,
    /// 503 and 429 answers without a `Retry-After` header.
    pub refusals_without_retry_after: AtomicU64,
    /// Releases answered 503 (each retried), and releases given up.
    pub releases_refused: AtomicU64,
    pub releases_given_up: AtomicU64,
    /// Locks the holders hold, renew-batches sent and answered 503.
    pub holder_locks: AtomicU64,
    pub renew_batches: AtomicU64,
    pub renew_batches_refused: AtomicU64,
    /// Locks a renewal answered not renewed (lost on the router's word:
    /// `expired` or `stolen`).
    pub locks_not_renewed: AtomicU64,
    /// Locks a renewal could not check (`shard_unavailable`): not lost, they
    /// stay in the holder's list and go in its next renewal.
    pub locks_unavailable: AtomicU64,
    /// Locks confirmed more than a TTL after the confirmation before
    /// (lost by the holder's clock).
    pub locks_lapsed: AtomicU64,
    /// Lock renewals confirmed.
    pub locks_renewed: AtomicU64,
    /// Worst lateness of a scheduled renewal, in ms.
    pub renew_lag_max_ms: AtomicU64,
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Relaxed);
}

pub struct Overload {
    /// The lock lives: acquires granted, releases, errors, requests, and
    /// the latency of admitted acquires (answered other than 503 or 429).
    pub stats: Stats,
    /// The holders' requests and errors.
    pub hold_stats: Stats,
    pub counts: Counts,
    /// Latency of admitted releases, of the 503 answers to acquires, and
    /// of admitted renew-batches.
    pub release_latency: Latency,
    pub refusal_latency: Latency,
    pub renew_latency: Latency,
    /// TTL of the lock lives' locks, and of the holders' locks.
    pub ttl_ms: u64,
    pub holder_ttl_ms: u64,
    pub holders: usize,
    pub locks_per_holder: usize,
    /// Arrivals per second.
    pub rate: f64,
    pub tag: String,
    /// Whom each lock life is acquired for, in turn.
    pub clients: Clients,
    /// The window's start and end, set by the controller. std `Mutex`:
    /// held for a copy, never across an await.
    window: Mutex<Option<(Instant, Instant)>>,
    next_arrival: AtomicU64,
    next_holder: AtomicUsize,
    /// Lock lives begun and not yet finished.
    lives_open: AtomicU64,
    stop: AtomicBool,
}

/// The sizes of one run.
pub struct Sizes {
    pub ttl_ms: u64,
    pub holder_ttl_ms: u64,
    pub holders: usize,
    pub locks_per_holder: usize,
    pub rate: f64,
}

impl Overload {
    pub fn new(sizes: Sizes, tag: &str, clients: Clients) -> Self {
        Self {
            stats: Stats::new(),
            hold_stats: Stats::new(),
            counts: Counts::default(),
            release_latency: Latency::new(),
            refusal_latency: Latency::new(),
            renew_latency: Latency::new(),
            ttl_ms: sizes.ttl_ms,
            holder_ttl_ms: sizes.holder_ttl_ms,
            holders: sizes.holders,
            locks_per_holder: sizes.locks_per_holder,
            rate: sizes.rate.max(1.0),
            tag: tag.to_string(),
            clients,
            window: Mutex::new(None),
            next_arrival: AtomicU64::new(0),
            next_holder: AtomicUsize::new(0),
            lives_open: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        }
    }

    fn window(&self) -> Option<(Instant, Instant)> {
        *self.window.lock().expect("window")
    }

    fn stopped(&self) -> bool {
        self.stop.load(Relaxed) || goose::is_killswitch_triggered()
    }

    /// Counts a 503 or 429 answer; true if it was an acquire's `overloaded`.
    fn refused(&self, a: &Answer) -> bool {
        #[derive(Deserialize)]
        struct Body {
            error: Detail,
        }
        #[derive(Deserialize)]
        struct Detail {
            code: String,
        }
        if a.retry_after.is_none() {
            add(&self.counts.refusals_without_retry_after, 1);
        }
        let code = serde_json::from_str::<Body>(&a.text).map(|b| b.error.code);
        let overloaded = a.status == 503 && code.is_ok_and(|c| c == "overloaded");
        if a.status == 503 && !overloaded {
            add(&self.counts.other_503, 1);
        }
        overloaded
    }
}

/// A status the scenario does not expect: an error, and a server error
/// if 5xx (503 is counted apart, as a refusal).
fn unexpected(stats: &Stats, status: u16) {
    stats.error();
    if status >= 500 {
        stats.status(status);
    }
}

/// The wait a refusal asks for (1 s if its header is missing or unreadable).
fn retry_after(a: &Answer) -> Duration {
    let secs = a.retry_after.as_deref().and_then(|v| v.trim().parse().ok());
    Duration::from_secs(secs.unwrap_or(1))
}

/// Counts a lock life open until dropped.
struct Open<'a>(&'a AtomicU64);

impl<'a> Open<'a> {
    fn new(n: &'a AtomicU64) -> Self {
        n.fetch_add(1, Relaxed);
        Self(n)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// The arrivals' users, and the holders' (`holders` users, one each).
pub fn scenarios(ctx: &Arc<Overload>, workers: usize) -> Result<Vec<Scenario>> {
    let arrivals =
        scenario!("overload").register_transaction(transaction("lock-life", ctx, |user, ctx| {
            Box::pin(async move {
                arrival(user, &ctx).await;
                Ok(())
            })
        }));
    let holders = scenario!("overload-holders").register_transaction(transaction(
        "hold",
        ctx,
        |user, ctx| {
            Box::pin(async move {
                holder(user, &ctx).await;
                Ok(())
            })
        },
    ));
    Ok(vec![
        arrivals.set_weight(workers)?,
        holders.set_weight(ctx.holders)?,
    ])
}

/// Takes the next arrival, waits for its due time and sends it; skips it
/// if it is already past due.
async fn arrival(user: &mut GooseUser, ctx: &Overload) {
    let window = ctx.window();
    let Some((start, end)) = window.filter(|_| !ctx.stopped()) else {
        tokio::time::sleep(Duration::from_millis(10)).await;
        return;
    };
    let i = ctx.next_arrival.fetch_add(1, Relaxed);
    let due = start + Duration::from_secs_f64(i as f64 / ctx.rate);
    if due >= end {
        // The schedule is over; the controller ends the attack.
        tokio::time::sleep(Duration::from_millis(50)).await;
        return;
    }
    add(&ctx.counts.arrivals_due, 1);
    if Instant::now() > due + SLACK {
        add(&ctx.counts.arrivals_skipped, 1);
        return;
    }
    let _open = Open::new(&ctx.lives_open);
    tokio::time::sleep_until(due.into()).await;
    lock_life(user, ctx, i).await;
}

async fn lock_life(user: &mut GooseUser, ctx: &Overload, n: u64) {
    let body = json!({
        "name": format!("{}:{n}", ctx.tag),
        "ttlMs": ctx.ttl_ms,
        "clientId": ctx.clients.id(n),
    });
    let Some(a) = api::send(user, &ctx.stats, ACQUIRE, &body).await else {
        return;
    };
    match a.status {
        200 => {}
        503 | 429 => {
            if ctx.refused(&a) {
                add(&ctx.counts.acquires_overloaded, 1);
                ctx.refusal_latency.record(a.took);
            } else if a.status == 429 {
                add(&ctx.counts.acquires_rate_limited, 1);
            }
            return;
        }
        status => return unexpected(&ctx.stats, status),
    }
    let Some(lock) = granted(&a.text) else {
        // A name nobody else uses cannot be held by another.
        return ctx.stats.error();
    };
    ctx.stats.granted(user.weighted_users_index, a.took);
    release(user, ctx, &lock).await;
}

/// The lock an acquire's answer grants, if it does.
fn granted(text: &str) -> Option<Held> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Granted {
        acquired: bool,
        lock_id: Option<String>,
        fencing_token: Option<u64>,
    }
    let g: Granted = serde_json::from_str(text).ok()?;
    match (g.acquired, g.lock_id, g.fencing_token) {
        (true, Some(lock_id), Some(token)) => Some(Held { lock_id, token }),
        _ => None,
    }
}

async fn release(user: &mut GooseUser, ctx: &Overload, lock: &Held) {
    let body = json!({"lockId": lock.lock_id, "fencingToken": lock.token});
    for _ in 0..RELEASE_ATTEMPTS {
        let Some(a) = api::send(user, &ctx.stats, RELEASE, &body).await else {
            return;
        };
        match a.status {
            204 => {
                ctx.release_latency.record(a.took);
                return ctx.stats.released_one();
            }
            503 => {
                ctx.refused(&a);
                add(&ctx.counts.releases_refused, 1);
                tokio::time::sleep(retry_after(&a)).await;
            }
            status => return unexpected(&ctx.stats, status),
        }
    }
    // Refused every time, each with Retry-After: the router shedding load
    // as designed, not an error; the lock goes at its TTL. Reported.
    add(&ctx.counts.releases_given_up, 1);
}

/// One holder for the whole attack: acquires its locks, then renews them
/// on schedule until the controller stops it.
async fn holder(user: &mut GooseUser, ctx: &Overload) {
    let me = ctx.next_holder.fetch_add(1, Relaxed);
    if me >= ctx.holders || ctx.stopped() {
        // Goose calls the transaction again until the killswitch lands.
        tokio::time::sleep(Duration::from_millis(50)).await;
        return;
    }
    let client = format!("{}-h{me}", ctx.tag);
    let ttl = Duration::from_millis(ctx.holder_ttl_ms);
    let period = ttl / 3;
    let Some((mut locks, mut confirmed)) = take_locks(user, ctx, me, &client, period).await else {
        return;
    };
    add(&ctx.counts.holder_locks, locks.len() as u64);
    // Real clients are not in step: the first renewal falls anywhere in
    // the period, and no later than a period after the last confirmation
    // (the first acquire, or a renewal while the holder took its locks).
    let mut next =
        (Instant::now() + period.mul_f64(rand::random_range(0.2..1.0))).min(confirmed + period);
    while !ctx.stopped() && !locks.is_empty() {
        let now = Instant::now();
        if now < next {
            let wake = next.min(now + Duration::from_millis(50));
            tokio::time::sleep_until(wake.into()).await;
            continue;
        }
        ctx.counts
            .renew_lag_max_ms
            .fetch_max((now - next).as_millis() as u64, Relaxed);
        next = match renew_counted(user, ctx, &mut locks, &mut confirmed, now).await {
            Renewal::Confirmed => {
                // Keep the cadence; more than a period late, count it from now.
                let n = next + period;
                if n > now {
                    n
                } else {
                    now + period
                }
            }
            Renewal::Refused(wait) => now + wait,
            Renewal::Failed => next + period,
        };
    }
    if !locks.is_empty() && confirmed.elapsed() > ttl {
        add(&ctx.counts.locks_lapsed, locks.len() as u64);
    }
}

/// Acquires the holder's locks (retrying what fails), renewing those it
/// already holds every `period` meanwhile, as a client must (taking a
/// hundred locks one by one can outlast their TTL when the router is
/// busy); returns them and when the holder last had them all confirmed:
/// its last renewal's send, or its first acquire's.
async fn take_locks(
    user: &mut GooseUser,
    ctx: &Overload,
    me: usize,
    client: &str,
    period: Duration,
) -> Option<(Vec<Held>, Instant)> {
    let mut locks = Vec::with_capacity(ctx.locks_per_holder);
    let mut confirmed: Option<Instant> = None;
    // A renewal answered 503 waits for its Retry-After, as in `holder`.
    let mut renew_after = Instant::now();
    for j in 0..ctx.locks_per_holder {
        let body = json!({
            "name": format!("{}:h{me}:{j}", ctx.tag),
            "ttlMs": ctx.holder_ttl_ms,
            "clientId": client,
        });
        loop {
            if ctx.stopped() {
                return None;
            }
            // Before every attempt, retries included: an acquire refused
            // for longer than a TTL must not let the others lapse.
            let now = Instant::now();
            let due = confirmed
                .as_mut()
                .filter(|at| now - **at >= period && now >= renew_after && !locks.is_empty());
            if let Some(at) = due {
                let renewal = renew_counted(user, ctx, &mut locks, at, now).await;
                if let Renewal::Refused(wait) = renewal {
                    renew_after = now + wait;
                }
            }
            let sent = Instant::now();
            let a = api::send(user, &ctx.hold_stats, ACQUIRE, &body).await;
            match a.as_ref().map(|a| (a.status, granted(&a.text))) {
                Some((200, Some(lock))) => {
                    confirmed.get_or_insert(sent);
                    locks.push(lock);
                    break;
                }
                Some((503 | 429, _)) => {
                    if let Some(a) = &a {
                        ctx.refused(a);
                    }
                }
                Some((status, _)) => unexpected(&ctx.hold_stats, status),
                None => {}
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Some((locks, confirmed.unwrap_or_else(Instant::now)))
}

/// Renews `locks` at `now`; when confirmed, counts them lapsed if that
/// came more than a TTL after the last confirmation, `confirmed`, and
/// moves it to `now`.
async fn renew_counted(
    user: &mut GooseUser,
    ctx: &Overload,
    locks: &mut Vec<Held>,
    confirmed: &mut Instant,
    now: Instant,
) -> Renewal {
    let renewal = renew(user, ctx, locks).await;
    if let Renewal::Confirmed = renewal {
        if now - *confirmed > Duration::from_millis(ctx.holder_ttl_ms) {
            add(&ctx.counts.locks_lapsed, locks.len() as u64);
        }
        *confirmed = now;
    }
    renewal
}

enum Renewal {
    /// Answered 200: every lock still in the list was renewed (those not
    /// renewed were counted and taken out).
    Confirmed,
    /// Answered 503: try again after this long.
    Refused(Duration),
    Failed,
}

async fn renew(user: &mut GooseUser, ctx: &Overload, locks: &mut Vec<Held>) -> Renewal {
    #[derive(Deserialize)]
    struct Answer {
        results: Vec<Entry>,
    }
    #[derive(Deserialize)]
    struct Entry {
        renewed: bool,
        #[serde(default)]
        reason: Option<String>,
    }
    let items: Vec<_> = locks
        .iter()
        .map(|l| json!({"lockId": l.lock_id, "fencingToken": l.token}))
        .collect();
    add(&ctx.counts.renew_batches, 1);
    let body = json!({ "locks": items });
    let Some(a) = api::send(user, &ctx.hold_stats, RENEW_BATCH, &body).await else {
        return Renewal::Failed;
    };
    match a.status {
        200 => {}
        503 => {
            ctx.refused(&a);
            add(&ctx.counts.renew_batches_refused, 1);
            return Renewal::Refused(retry_after(&a));
        }
        status => {
            unexpected(&ctx.hold_stats, status);
            return Renewal::Failed;
        }
    }
    let results = serde_json::from_str::<Answer>(&a.text).map(|a| a.results);
    let Some(results) = results.ok().filter(|r| r.len() == locks.len()) else {
        ctx.hold_stats.error();
        return Renewal::Failed;
    };
    ctx.renew_latency.record(a.took);
    let unchecked = |r: &Entry| !r.renewed && r.reason.as_deref() == Some("shard_unavailable");
    let unavailable = results.iter().filter(|r| unchecked(r)).count();
    // Kept: renewed, or not checked this time (retried with the next).
    let mut kept = results.iter().map(|r| r.renewed || unchecked(r));
    locks.retain(|_| kept.next().unwrap_or(false));
    let lost = results.len() - locks.len();
    add(&ctx.counts.locks_not_renewed, lost as u64);
    add(&ctx.counts.locks_unavailable, unavailable as u64);
    add(
        &ctx.counts.locks_renewed,
        (locks.len() - unavailable) as u64,
    );
    if lost > 0 {
        ctx.hold_stats.error();
    }
    Renewal::Confirmed
}

/// What the controller measured.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// Seconds until every holder held its locks, and the locks held.
    pub holders_ready_s: f64,
    pub holder_locks: u64,
    /// The arrival schedule's length.
    pub window_s: f64,
    /// Counters from the window's start until its lock lives finished.
    pub window: Delta,
    /// Whether every lock life begun in the window finished in time.
    pub drained: bool,
    /// The router's `lockrouter_requests_in_flight`, highest of samples
    /// every 100 ms (a lower bound of the true peak).
    pub router_in_flight_sampled_max: f64,
}

pub struct Controller<'a> {
    pub ctx: Arc<Overload>,
    pub stack: &'a Stack,
    pub window: Duration,
    /// How long the holders may take to get their locks.
    pub ramp_limit: Duration,
}

impl Controller<'_> {
    pub async fn run(self) -> Result<Outcome> {
        let result = self.drive().await;
        // Whatever happened, the users stop and the attack ends.
        self.ctx.stop.store(true, Relaxed);
        goose::trigger_killswitch("overload finished");
        result
    }

    async fn drive(&self) -> Result<Outcome> {
        let ctx = &self.ctx;
        let want = (ctx.holders * ctx.locks_per_holder) as u64;
        let started = Instant::now();
        while ctx.counts.holder_locks.load(Relaxed) < want && started.elapsed() < self.ramp_limit {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let holders_ready_s = started.elapsed().as_secs_f64();
        // A renewal period with nothing else: every holder renews once
        // before the window.
        let period = Duration::from_millis(ctx.holder_ttl_ms / 3);
        tokio::time::sleep(period).await;

        let s0 = Snapshot::take(self.stack)?;
        let start = Instant::now() + Duration::from_millis(20);
        let end = start + self.window;
        *ctx.window.lock().expect("window") = Some((start, end));
        let sampler = InFlightSampler::start(self.stack.router.port);
        tokio::time::sleep_until(end.into()).await;
        // Lock lives begun in the window finish: a refused release waits
        // its Retry-After.
        let drain_by = Instant::now() + Duration::from_secs(RELEASE_ATTEMPTS as u64 + 2);
        while ctx.lives_open.load(Relaxed) > 0 && Instant::now() < drain_by {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let drained = ctx.lives_open.load(Relaxed) == 0;
        let window = Snapshot::take(self.stack)?.since(&s0);
        let router_in_flight_sampled_max = sampler.stop();
        // The holders go on for a period and a half with nothing else, so
        // a lock that lapsed in the window shows at its next confirmation.
        tokio::time::sleep(period.mul_f64(1.5)).await;
        Ok(Outcome {
            holders_ready_s: crate::stats::round(holders_ready_s, 2),
            holder_locks: ctx.counts.holder_locks.load(Relaxed),
            window_s: self.window.as_secs_f64(),
            window,
            drained,
            router_in_flight_sampled_max,
        })
    }
}

/// Reads the router's in-flight gauge every 100 ms and keeps the highest.
struct InFlightSampler {
    peak: Arc<Mutex<f64>>,
    task: tokio::task::JoinHandle<()>,
}

impl InFlightSampler {
    fn start(port: u16) -> Self {
        let peak = Arc::new(Mutex::new(0.0f64));
        let p = peak.clone();
        let task = tokio::spawn(async move {
            loop {
                let got =
                    tokio::task::spawn_blocking(move || loopback::get(port, "/metrics")).await;
                if let Ok(Ok(r)) = got {
                    let n = metrics::sum(&r.body, "lockrouter_requests_in_flight", &[]);
                    let mut peak = p.lock().expect("peak");
                    *peak = peak.max(n);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Self { peak, task }
    }

    fn stop(&self) -> f64 {
        self.task.abort();
        *self.peak.lock().expect("peak")
    }
}

impl Drop for InFlightSampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_grant_and_a_refusal() {
        let g = granted(r#"{"acquired":true,"lockId":"x","fencingToken":7}"#).unwrap();
        assert_eq!((g.lock_id.as_str(), g.token), ("x", 7));
        assert!(granted(r#"{"acquired":false}"#).is_none());
        let a = Answer {
            status: 503,
            retry_after: Some("2".into()),
            text: r#"{"error":{"code":"overloaded","message":"m"}}"#.into(),
            took: Duration::ZERO,
        };
        assert_eq!(retry_after(&a), Duration::from_secs(2));
        let o = Overload::new(
            Sizes {
                ttl_ms: 1,
                holder_ttl_ms: 1,
                holders: 1,
                locks_per_holder: 1,
                rate: 1.0,
            },
            "t",
            Clients::new("c", 1),
        );
        assert!(o.refused(&a));
        let other = Answer {
            retry_after: None,
            text: r#"{"error":{"code":"shard_unavailable","message":"m"}}"#.into(),
            ..a
        };
        assert!(!o.refused(&other));
        assert_eq!(o.counts.other_503.load(Relaxed), 1);
        assert_eq!(o.counts.refusals_without_retry_after.load(Relaxed), 1);
    }
}
