//! `hold` and `per-lock-renew`: ramp to L active leases held by C clients,
//! then hold them. 1M leases are not 1M goose users: each user simulates
//! C / users clients, each owning L / C locks, and renews each client's
//! locks every TTL/3 — with one `renew-batch` per client (`hold`), or one
//! `renew` per lock (`per-lock-renew`, the v1 per-lock API).
//!
//! A [`Controller`] running beside the attack drives the phases: every
//! client ramps in step to its full count of locks while the router's RSS
//! is sampled against the locks held (all sessions exist after the first
//! C × shards acquires, so the slope after that is the router's memory per
//! held lock). The ramp stops
//! early when renewals fall behind by more than a sixth of the TTL: past
//! that this machine cannot hold more, and the hold goes on with what was
//! reached. Then a window in which etcd's keepalives are counted, optionally
//! `churn` on top, and the users stop through goose's killswitch.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use goose::prelude::*;
use lockrouter_testkit::procfs::{peak_rss_bytes, reset_peak_rss, rss_bytes};
use serde::Serialize;
use tokio::sync::Notify;

use crate::api::{self, Acquire, Held, RenewBodies};
use crate::attack::transaction;
use crate::scenarios::clients::Clients;
use crate::scrape::{Delta, Snapshot};
use crate::stack::Stack;
use crate::stats::Stats;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// One `renew-batch` call per client (up to `max_batch` locks a call).
    Batch,
    /// One `renew` call per lock.
    PerLock,
}

pub struct Hold {
    pub stats: Stats,
    pub ttl_ms: u64,
    pub clients: usize,
    pub users: usize,
    pub renewal: Renewal,
    pub max_batch: usize,
    pub tag: String,
    /// Locks each client should hold now; the controller raises it.
    target_per_client: AtomicU64,
    /// Worst renewal lateness since the controller last looked, in ms.
    recent_lag_ms: AtomicU64,
    /// Set by the controller while renewals run late: users make no new
    /// acquires until they catch up (renewals are what is being measured).
    acquires_paused: AtomicBool,
    /// Set by the controller: users stop renewing and return.
    stop: AtomicBool,
    /// Wakes the users that wait for their next renewal when the
    /// controller changes the target, the pause or the stop.
    changed: Notify,
    next_user: AtomicUsize,
}

impl Hold {
    pub fn new(
        stats: Stats,
        ttl_ms: u64,
        clients: usize,
        users: usize,
        renewal: Renewal,
        tag: &str,
    ) -> Self {
        Self {
            stats,
            ttl_ms,
            clients,
            users,
            renewal,
            max_batch: 1000,
            tag: tag.to_string(),
            target_per_client: AtomicU64::new(0),
            recent_lag_ms: AtomicU64::new(0),
            acquires_paused: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            changed: Notify::new(),
            next_user: AtomicUsize::new(0),
        }
    }

    /// The holding clients' ids (churn on hold acquires for them too).
    pub fn client_ids(&self) -> Clients {
        Clients::new(&self.tag, self.clients)
    }

    fn period(&self) -> Duration {
        Duration::from_millis(self.ttl_ms / 3)
    }

    /// Locks each client should hold now: none while acquires are paused.
    fn target(&self) -> usize {
        if self.acquires_paused.load(Relaxed) {
            0
        } else {
            self.target_per_client.load(Relaxed) as usize
        }
    }

    /// Wakes every user waiting for its next renewal, after the
    /// controller changed the target, the pause or the stop.
    fn announce(&self) {
        self.changed.notify_waiters();
    }

    fn stopped(&self) -> bool {
        self.stop.load(Relaxed) || goose::is_killswitch_triggered()
    }
}

/// One simulated client of a hold user.
struct Client {
    id: String,
    locks: Vec<Held>,
    /// Its renew-batch bodies, written again only when `locks` grows.
    bodies: RenewBodies,
    next_renew: Option<Instant>,
}

pub fn scenario(name: &str, ctx: &Arc<Hold>) -> Scenario {
    scenario!(name).register_transaction(transaction("hold", ctx, |user, ctx| {
        Box::pin(async move {
            run_user(user, &ctx).await;
            Ok(())
        })
    }))
}

/// The whole life of one hold user, as one long transaction: its
/// renewals come first, then acquires up to the current target.
async fn run_user(user: &mut GooseUser, ctx: &Hold) {
    if ctx.stopped() {
        // Goose calls the transaction again until the killswitch lands.
        tokio::time::sleep(Duration::from_millis(50)).await;
        return;
    }
    // Renewals keep their own schedule: when churn runs on top, goose's
    // throttle is for the churn users only.
    user.is_throttled = false;
    let me = ctx.next_user.fetch_add(1, Relaxed);
    if me >= ctx.users {
        tokio::time::sleep(Duration::from_millis(50)).await;
        return;
    }
    let ids = ctx.client_ids();
    let mut clients: Vec<Client> = (me * ctx.clients / ctx.users
        ..(me + 1) * ctx.clients / ctx.users)
        .map(|c| Client {
            id: ids.id(c as u64),
            locks: Vec::new(),
            bodies: RenewBodies::default(),
            next_renew: None,
        })
        .collect();
    let period = ctx.period();
    let mut cursor = 0;
    while !ctx.stopped() {
        let now = Instant::now();
        let due = clients
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.next_renew.map(|t| (t, i)))
            .min();
        if let Some((at, i)) = due.filter(|(at, _)| *at <= now) {
            ctx.stats.renew_lag(now - at);
            ctx.recent_lag_ms
                .fetch_max((now - at).as_millis() as u64, Relaxed);
            let retry = renew(user, ctx, &mut clients[i]).await;
            // Keep the cadence; more than a period late, count it from now.
            // A renewal that failed for now is retried soon, as the SDKs
            // do, not a period later (then its lateness counts from `at`).
            let next = at + period;
            clients[i].next_renew = Some(if retry {
                now + RETRY_AFTER
            } else if next > now {
                next
            } else {
                now + period
            });
            continue;
        }
        let target = ctx.target();
        let n = clients.len();
        // Round-robin: every client ramps in step, so none sits without
        // an acquire for long (the router forgets idle sessions).
        if let Some(i) = (0..n)
            .map(|k| (cursor + k) % n)
            .find(|&i| clients[i].locks.len() < target)
        {
            cursor = i + 1;
            let c = &mut clients[i];
            let name = format!("{}:{}", c.id, c.locks.len());
            let sent = Instant::now();
            if let Acquire::Granted(lock) =
                api::acquire(user, &ctx.stats, &name, &c.id, ctx.ttl_ms).await
            {
                let c = &mut clients[i];
                c.locks.push(lock);
                // Real clients are not in step: the first renewal falls
                // anywhere in the period, so renewals spread evenly.
                c.next_renew
                    .get_or_insert_with(|| sent + period.mul_f64(rand::random_range(0.2..1.0)));
            } else {
                // A unique name can't be held by another; back off so a
                // failing router is not hammered.
                ctx.stats.error();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            continue;
        }
        // Nothing to acquire: sleep until the next renewal is due or the
        // controller announces a change (looked at again once listening,
        // so none is missed), a second at most (goose's own killswitch is
        // not announced). Waking every 50 ms instead cost 200 users 4,000
        // wake-ups a second on hold, four times their renewals.
        let changed = ctx.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if ctx.stopped() || ctx.target() != target {
            continue;
        }
        let wake = due.map_or(now + IDLE_WAKE, |(t, _)| t.min(now + IDLE_WAKE));
        tokio::select! {
            () = tokio::time::sleep_until(wake.into()) => {}
            () = changed => {}
        }
    }
}

/// Renews a client's locks; true if some renewal failed for now and is
/// to be retried soon.
async fn renew(user: &mut GooseUser, ctx: &Hold, client: &mut Client) -> bool {
    let before = client.locks.len();
    let retry = match ctx.renewal {
        Renewal::Batch => {
            let (locks, bodies) = (&client.locks, &mut client.bodies);
            api::renew_batch(user, &ctx.stats, locks, bodies, ctx.max_batch).await > 0
        }
        Renewal::PerLock => {
            for i in 0..client.locks.len() {
                let lock = client.locks[i].clone();
                api::renew(user, &ctx.stats, &lock).await;
            }
            false
        }
    };
    // Lost locks are counted as errors; they stay in the list (renewing
    // them again only repeats the count), so the target is not re-ramped.
    debug_assert_eq!(before, client.locks.len());
    retry
}

/// How soon a renewal that failed for now is tried again (the SDKs back
/// off from 100 ms to 2 s; one step in between).
const RETRY_AFTER: Duration = Duration::from_millis(500);

/// The longest a user with nothing to acquire sleeps between renewals.
const IDLE_WAKE: Duration = Duration::from_secs(1);

/// What the controller measured during a hold.
#[derive(Debug, Clone, Serialize)]
pub struct HoldOutcome {
    pub locks_target: u64,
    pub locks_reached: u64,
    pub clients: usize,
    pub ramp_s: f64,
    /// Seconds of the ramp in which acquires waited for renewals to catch up.
    pub ramp_paused_s: f64,
    pub ramp_acquires_per_s: f64,
    pub rss_before_bytes: u64,
    /// What the ramp stopped on: "target", "renewals behind", "ramp limit"
    /// or "no progress".
    pub ramp_stopped_by: String,
    /// `(locks held, router RSS)` sampled during the ramp.
    pub rss_samples: Vec<(u64, u64)>,
    pub rss_full_bytes: u64,
    pub rss_peak_bytes: u64,
    pub rss_after_bytes: u64,
    /// Router memory per held lock: least-squares slope of RSS over locks
    /// held, once every session exists (None if too few samples).
    pub bytes_per_lock: Option<f64>,
    /// Router memory per session lease (client × shard): the fit's
    /// intercept above the RSS before the hold, per session.
    pub bytes_per_session: Option<f64>,
    pub sessions: f64,
    /// Counters over the ramp (acquires, session grants).
    pub ramp: Delta,
    /// Counters over the steady hold window (no acquires, only renewals).
    pub window: Delta,
    /// Lock renewals the load generator saw confirmed in that window.
    pub window_renewed: u64,
    /// Worst lateness of a scheduled renewal in that window, in ms.
    pub window_renew_lag_max_ms: u64,
    /// Counters over the window with churn on top, if it ran.
    pub churn_window: Option<Delta>,
}

/// How the controller paces a hold.
pub struct Phases {
    pub locks: u64,
    /// Give up ramping after this long and hold what was reached.
    pub ramp_limit: Duration,
    pub settle: Duration,
    pub hold: Duration,
    /// Run churn on top for this long (its users wait on `churn_gate`).
    pub churn: Option<(Duration, Arc<AtomicBool>)>,
}

pub struct Controller<'a> {
    pub ctx: Arc<Hold>,
    pub stack: &'a Stack,
    pub phases: Phases,
}

impl Controller<'_> {
    pub async fn run(self) -> Result<HoldOutcome> {
        let result = self.drive().await;
        // Whatever happened, the users stop and the attack ends.
        self.ctx.stop.store(true, Relaxed);
        self.ctx.announce();
        goose::trigger_killswitch("hold finished");
        result
    }

    async fn drive(&self) -> Result<HoldOutcome> {
        let pid = self.stack.router.pid();
        let ctx = &self.ctx;
        let per_client = (self.phases.locks / ctx.clients as u64).max(1);
        let rss_before = settled_rss(pid, Duration::from_millis(500)).await;
        reset_peak_rss(pid);
        let sampler = PeakSampler::start(pid);
        let started = Instant::now();

        let ramp_start = Snapshot::take(self.stack)?;
        ctx.target_per_client.store(per_client, Relaxed);
        ctx.announce();
        let mut paused = Duration::ZERO;
        let (stopped_by, mut rss_samples) = self
            .ramp(per_client * ctx.clients as u64, started, pid, &mut paused)
            .await;
        // Hold what was reached: no more acquires.
        ctx.target_per_client.store(0, Relaxed);
        ctx.acquires_paused.store(false, Relaxed);
        ctx.announce();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ramp_s = started.elapsed().as_secs_f64();
        let locks_reached = ctx.stats.active.load(Relaxed);
        let ramp = Snapshot::take(self.stack)?.since(&ramp_start);
        tokio::time::sleep(self.phases.settle).await;
        let rss_full = settled_rss(pid, Duration::from_secs(1)).await;
        rss_samples.push((locks_reached, rss_full));

        let renewed_before = Stats::get(&ctx.stats.renewed);
        ctx.recent_lag_ms.store(0, Relaxed);
        let s0 = Snapshot::take(self.stack)?;
        tokio::time::sleep(self.phases.hold).await;
        let s1 = Snapshot::take(self.stack)?;
        let window = s1.since(&s0);
        let window_renewed = Stats::get(&ctx.stats.renewed) - renewed_before;
        let window_renew_lag_max_ms = ctx.recent_lag_ms.load(Relaxed);

        let churn_window = match &self.phases.churn {
            Some((length, gate)) => {
                gate.store(true, Relaxed);
                tokio::time::sleep(*length).await;
                gate.store(false, Relaxed);
                Some(Snapshot::take(self.stack)?.since(&s1))
            }
            None => None,
        };
        let rss_peak = sampler.stop().max(peak_rss_bytes(pid).unwrap_or(0));

        // Stop renewing and let the leases run out, then see what memory
        // the router gives back.
        ctx.stop.store(true, Relaxed);
        ctx.announce();
        tokio::time::sleep(Duration::from_millis(ctx.ttl_ms + 3000)).await;
        let rss_after = settled_rss(pid, Duration::from_secs(1)).await;

        let sessions = window.router.session_leases;
        // Fit only where every session exists and locks alone grow.
        let from = (3 * ctx.clients as u64).max(locks_reached / 10);
        let fit = fit_line(rss_samples.iter().filter(|(l, _)| *l >= from));
        let bytes_per_lock = fit.map(|(slope, _)| slope);
        let bytes_per_session = fit
            .filter(|_| sessions > 0.0)
            .map(|(_, intercept)| (intercept - rss_before as f64) / sessions);
        Ok(HoldOutcome {
            locks_target: per_client * ctx.clients as u64,
            locks_reached,
            clients: ctx.clients,
            ramp_s,
            ramp_paused_s: paused.as_secs_f64(),
            ramp_acquires_per_s: locks_reached as f64 / ramp_s.max(1e-9),
            ramp_stopped_by: stopped_by.to_string(),
            rss_before_bytes: rss_before,
            rss_samples,
            rss_full_bytes: rss_full,
            rss_peak_bytes: rss_peak,
            rss_after_bytes: rss_after,
            bytes_per_lock,
            bytes_per_session,
            sessions,
            ramp,
            window,
            window_renewed,
            window_renew_lag_max_ms,
            churn_window,
        })
    }

    /// Waits until `locks` are held (returns "target"), renewals fall
    /// behind, the ramp limit passes, or acquires stop making progress;
    /// samples the router's RSS against locks held every two seconds.
    async fn ramp(
        &self,
        locks: u64,
        started: Instant,
        pid: u32,
        paused: &mut Duration,
    ) -> (&'static str, Vec<(u64, u64)>) {
        let mut samples = Vec::new();
        let mut last = (0, Instant::now());
        let behind = Duration::from_millis(self.ctx.ttl_ms / 6);
        for tick in 0u64.. {
            let held = self.ctx.stats.active.load(Relaxed);
            if tick % 4 == 0 {
                samples.extend(rss_bytes(pid).map(|r| (held, r)));
            }
            if held >= locks {
                return ("target", samples);
            }
            if started.elapsed() > self.phases.ramp_limit {
                return ("ramp limit", samples);
            }
            let lag = Duration::from_millis(self.ctx.recent_lag_ms.swap(0, Relaxed));
            if lag > behind {
                return ("renewals behind", samples);
            }
            // Acquires yield to renewals: past a third of the allowed
            // lateness, no new acquires until renewals are on time again.
            let pause = lag > behind / 3;
            if self.ctx.acquires_paused.swap(pause, Relaxed) != pause {
                self.ctx.announce();
            }
            if pause {
                *paused += Duration::from_millis(500);
            }
            if held != last.0 {
                last = (held, Instant::now());
            } else if last.1.elapsed() > Duration::from_secs(30) {
                return ("no progress", samples);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        unreachable!("the loop above only returns")
    }
}

/// Least-squares line through `(x, y)` points: `(slope, intercept)`, or
/// None with fewer than 3 points or no spread in x.
fn fit_line<'a>(points: impl Iterator<Item = &'a (u64, u64)>) -> Option<(f64, f64)> {
    let pts: Vec<(f64, f64)> = points.map(|&(x, y)| (x as f64, y as f64)).collect();
    let n = pts.len() as f64;
    if pts.len() < 3 {
        return None;
    }
    let (sx, sy) = pts.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = pts.iter().map(|(x, _)| (x - mx).powi(2)).sum();
    if sxx == 0.0 {
        return None;
    }
    let sxy: f64 = pts.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let slope = sxy / sxx;
    Some((slope, my - slope * mx))
}

/// The median of a few RSS samples over `over`: one sample can catch a
/// transient allocation.
async fn settled_rss(pid: u32, over: Duration) -> u64 {
    let mut samples = Vec::new();
    for _ in 0..5 {
        samples.extend(rss_bytes(pid));
        tokio::time::sleep(over / 5).await;
    }
    samples.sort_unstable();
    samples.get(samples.len() / 2).copied().unwrap_or(0)
}

/// Samples a process's RSS every 100 ms in the background and keeps the
/// highest; the kernel's own peak mark is used too where it can be reset.
struct PeakSampler {
    peak: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl PeakSampler {
    fn start(pid: u32) -> Self {
        let peak = Arc::new(AtomicU64::new(0));
        let p = peak.clone();
        let task = tokio::spawn(async move {
            loop {
                if let Some(r) = rss_bytes(pid) {
                    p.fetch_max(r, Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Self { peak, task }
    }

    fn stop(&self) -> u64 {
        self.task.abort();
        self.peak.load(Relaxed)
    }
}

impl Drop for PeakSampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn fits_a_line() {
        let pts = [(0, 100), (10, 120), (20, 140), (30, 160)];
        let (slope, intercept) = super::fit_line(pts.iter()).unwrap();
        assert!((slope - 2.0).abs() < 1e-9 && (intercept - 100.0).abs() < 1e-9);
        assert!(super::fit_line(pts[..2].iter()).is_none());
    }
}
