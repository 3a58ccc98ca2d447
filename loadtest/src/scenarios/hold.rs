//! `hold` and `per-lock-renew`: ramp to L active leases held by C clients,
//! then hold them. 1M leases are not 1M goose users: each user simulates
//! C / users clients, each owning L / C locks, and renews each client's
//! locks every TTL/3 — with one `renew-batch` per client (`hold`), or one
//! `renew` per lock (`per-lock-renew`, the v1 per-lock API).
//!
//! A [`Controller`] running beside the attack drives the phases: ramp to
//! half the locks, let memory settle and sample it, ramp to all, sample
//! again (the slope between the two is the router's memory per held lock),
//! hold for a window in which etcd's keepalives are counted, optionally let
//! `churn` run on top, then stop the users through goose's killswitch.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use goose::prelude::*;
use serde::Serialize;

use crate::api::{self, Acquire, Held};
use crate::attack::transaction;
use crate::procs::{peak_rss_bytes, reset_peak_rss, rss_bytes, Stack};
use crate::scrape::{Delta, Snapshot};
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
    /// Set by the controller: users stop renewing and return.
    stop: AtomicBool,
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
            stop: AtomicBool::new(false),
            next_user: AtomicUsize::new(0),
        }
    }

    fn period(&self) -> Duration {
        Duration::from_millis(self.ttl_ms / 3)
    }

    fn stopped(&self) -> bool {
        self.stop.load(Relaxed) || goose::is_killswitch_triggered()
    }
}

/// One simulated client of a hold user.
struct Client {
    id: String,
    locks: Vec<Held>,
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
    let mut clients: Vec<Client> = (me * ctx.clients / ctx.users
        ..(me + 1) * ctx.clients / ctx.users)
        .map(|c| Client {
            id: format!("{}-c{c}", ctx.tag),
            locks: Vec::new(),
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
            renew(user, ctx, &mut clients[i]).await;
            // Keep the cadence; after a long stall, start again from now.
            clients[i].next_renew = Some((at + period).max(now));
            continue;
        }
        let target = ctx.target_per_client.load(Relaxed) as usize;
        let n = clients.len();
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
                c.next_renew.get_or_insert(sent + period);
            } else {
                // A unique name can't be held by another; back off so a
                // failing router is not hammered.
                ctx.stats.error();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            continue;
        }
        let wake = due
            .map(|(t, _)| t)
            .unwrap_or(now + Duration::from_millis(50));
        let wake = wake.min(now + Duration::from_millis(50));
        tokio::time::sleep_until(wake.into()).await;
    }
}

async fn renew(user: &mut GooseUser, ctx: &Hold, client: &mut Client) {
    let before = client.locks.len();
    match ctx.renewal {
        Renewal::Batch => {
            api::renew_batch(user, &ctx.stats, &client.locks, ctx.max_batch).await;
        }
        Renewal::PerLock => {
            for i in 0..client.locks.len() {
                let lock = client.locks[i].clone();
                api::renew(user, &ctx.stats, &lock).await;
            }
        }
    }
    // Lost locks are counted as errors; they stay in the list (renewing
    // them again only repeats the count), so the target is not re-ramped.
    debug_assert_eq!(before, client.locks.len());
}

/// What the controller measured during a hold.
#[derive(Debug, Clone, Serialize)]
pub struct HoldOutcome {
    pub locks_target: u64,
    pub locks_reached: u64,
    pub clients: usize,
    pub ramp_s: f64,
    pub ramp_acquires_per_s: f64,
    pub rss_before_bytes: u64,
    pub rss_half_bytes: u64,
    pub locks_half: u64,
    pub rss_full_bytes: u64,
    pub rss_peak_bytes: u64,
    pub rss_after_bytes: u64,
    /// Router memory per held lock: the RSS slope between half and all locks.
    pub bytes_per_lock: f64,
    /// Router memory per session lease (client × shard) beyond the locks.
    pub bytes_per_session: f64,
    pub sessions: f64,
    /// Counters over the steady hold window (no acquires, only renewals).
    pub window: Delta,
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

        let half = (per_client / 2).max(1);
        ctx.target_per_client.store(half, Relaxed);
        self.wait_held(half * ctx.clients as u64, started).await;
        tokio::time::sleep(self.phases.settle).await;
        let locks_half = ctx.stats.active.load(Relaxed);
        let rss_half = settled_rss(pid, Duration::from_secs(1)).await;

        ctx.target_per_client.store(per_client, Relaxed);
        self.wait_held(per_client * ctx.clients as u64, started)
            .await;
        let ramp_s = started.elapsed().as_secs_f64();
        let locks_reached = ctx.stats.active.load(Relaxed);
        tokio::time::sleep(self.phases.settle).await;
        let rss_full = settled_rss(pid, Duration::from_secs(1)).await;

        let s0 = Snapshot::take(self.stack)?;
        tokio::time::sleep(self.phases.hold).await;
        let s1 = Snapshot::take(self.stack)?;
        let window = s1.since(&s0);

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
        tokio::time::sleep(Duration::from_millis(ctx.ttl_ms + 3000)).await;
        let rss_after = settled_rss(pid, Duration::from_secs(1)).await;

        let sessions = window.router.session_leases;
        let added = locks_reached.saturating_sub(locks_half) as f64;
        let bytes_per_lock = if added > 0.0 {
            (rss_full as f64 - rss_half as f64) / added
        } else {
            0.0
        };
        let bytes_per_session = if sessions > 0.0 {
            (rss_half as f64 - rss_before as f64 - bytes_per_lock * locks_half as f64) / sessions
        } else {
            0.0
        };
        Ok(HoldOutcome {
            locks_target: per_client * ctx.clients as u64,
            locks_reached,
            clients: ctx.clients,
            ramp_s,
            ramp_acquires_per_s: locks_reached as f64 / ramp_s.max(1e-9),
            rss_before_bytes: rss_before,
            rss_half_bytes: rss_half,
            locks_half,
            rss_full_bytes: rss_full,
            rss_peak_bytes: rss_peak,
            rss_after_bytes: rss_after,
            bytes_per_lock,
            bytes_per_session,
            sessions,
            window,
            churn_window,
        })
    }

    /// Waits until `locks` are held, the ramp limit passes, or acquires stop
    /// making progress for a while (the router or etcd gave out).
    async fn wait_held(&self, locks: u64, started: Instant) {
        let mut last = (0, Instant::now());
        loop {
            let held = self.ctx.stats.active.load(Relaxed);
            if held >= locks || started.elapsed() > self.phases.ramp_limit {
                return;
            }
            if held != last.0 {
                last = (held, Instant::now());
            } else if last.1.elapsed() > Duration::from_secs(30) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
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
