//! `rebalance`: the router starts with one shard in its config file while
//! short-lived locks churn at a fixed rate; after a while the file is
//! rewritten to list every shard and `POST /admin/v1/reload` opens a
//! migration; churn goes on while `GET /admin/v1/ring` is polled until the
//! migration is closed, and a little longer. Every acquire's send and answer
//! instants and status are kept, so errors and latency can be split into
//! windows: before the reload, the fence window (from the reload until the
//! router grants again), the rest of the migration, and after it closed.
//! Closing the migration rewrites every shard's ring record, and the router
//! stops granting until it has confirmed the closed ring: that is a second
//! fence window, measured the same way.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use goose::prelude::*;
use lockrouter_testkit::loopback;
use serde_json::{json, Value};

use crate::api::{self, Held};
use crate::attack::transaction;
use crate::stack::Stack;
use crate::stats::{Latency, Percentiles, Stats};

/// One acquire: when it was sent and answered, and its status (0: no answer).
#[derive(Clone, Copy)]
struct Sample {
    sent: Instant,
    answered: Instant,
    status: u16,
}

pub struct Rebalance {
    pub stats: Stats,
    pub ttl_ms: u64,
    pub tag: String,
    seq: AtomicU64,
    samples: Mutex<Vec<Sample>>,
}

impl Rebalance {
    pub fn new(stats: Stats, ttl_ms: u64, tag: &str) -> Self {
        Self {
            stats,
            ttl_ms,
            tag: tag.to_string(),
            seq: AtomicU64::new(0),
            samples: Mutex::new(Vec::new()),
        }
    }

    fn sample(&self, s: Sample) {
        self.samples.lock().expect("samples").push(s);
    }
}

pub fn scenario(ctx: &Arc<Rebalance>) -> Scenario {
    scenario!("rebalance").register_transaction(transaction("acquire-release", ctx, |user, ctx| {
        Box::pin(async move {
            let n = ctx.seq.fetch_add(1, Relaxed);
            let name = format!("{}:{n}", ctx.tag);
            let client = format!("{}-u{}", ctx.tag, user.weighted_users_index);
            let body = json!({"name": name, "ttlMs": ctx.ttl_ms, "clientId": client});
            let asked = Instant::now();
            let answer = api::post(user, &ctx.stats, "/api/v1/locks/acquire", &body).await;
            let now = Instant::now();
            let Some((status, v, took)) = answer else {
                // Counted as an error by `post` unless the attack had ended.
                if goose::is_killswitch_triggered() {
                    return Ok(());
                }
                ctx.sample(Sample {
                    sent: asked.max(now - Duration::from_millis(1)),
                    answered: now,
                    status: 0,
                });
                return Ok(());
            };
            ctx.sample(Sample {
                sent: now - took,
                answered: now,
                status,
            });
            if status != 200 {
                ctx.stats.error();
                return Ok(());
            }
            match (
                v["acquired"].as_bool(),
                v["lockId"].as_str(),
                v["fencingToken"].as_u64(),
            ) {
                (Some(true), Some(id), Some(token)) => {
                    ctx.stats.granted(user.weighted_users_index, took);
                    let lock = Held {
                        lock_id: id.to_string(),
                        token,
                    };
                    api::release(user, &ctx.stats, &lock).await;
                }
                // A name nobody else uses cannot be held by another.
                _ => ctx.stats.error(),
            }
            Ok(())
        })
    }))
}

/// How the run is paced.
pub struct Phases {
    /// Churn before the reload.
    pub before: Duration,
    /// Give up waiting for the migration to close after this long.
    pub close_limit: Duration,
    /// Churn after the migration closed.
    pub after: Duration,
}

/// What the controller saw, on the load generator's monotonic clock.
pub struct Timeline {
    pub reload_sent: Instant,
    pub reload_answered: Instant,
    pub reload_status: u16,
    pub reload_body: String,
    /// First ring poll after the reload answered that showed `granting`.
    pub granting_again: Option<Instant>,
    /// Whether any poll after the reload showed `granting: false`.
    pub saw_not_granting: bool,
    /// First ring poll that showed `migration: null` again.
    pub closed: Option<Instant>,
    /// The close's own fence window: from the last poll that still showed
    /// the migration open to the first after the close showing `granting`.
    pub close_fence: Option<(Instant, Option<Instant>)>,
    pub ended: Instant,
}

/// `GET /admin/v1/ring` of the router on `port`, as JSON.
async fn ring(port: u16) -> Result<Value> {
    let answer = tokio::task::spawn_blocking(move || loopback::get(port, "/admin/v1/ring")).await?;
    let ring = answer.and_then(|r| Ok(serde_json::from_str(&r.body)?));
    ring.context("GET /admin/v1/ring")
}

/// Drives the run: churn, rewrite and reload, poll the ring until the
/// migration closes, churn a little more, then stop the users.
pub async fn control(stack: &Stack, phases: &Phases) -> Result<Timeline> {
    let result = control_inner(stack, phases).await;
    goose::trigger_killswitch("rebalance finished");
    result
}

async fn control_inner(stack: &Stack, phases: &Phases) -> Result<Timeline> {
    tokio::time::sleep(phases.before).await;
    stack.route_all_shards()?;
    let reload_sent = Instant::now();
    let port = stack.router.port;
    // Loopback needs no admin token.
    let reload =
        tokio::task::spawn_blocking(move || loopback::post(port, "/admin/v1/reload")).await??;
    let (reload_status, reload_body) = (reload.status, reload.body);
    let reload_answered = Instant::now();
    let mut granting_again = None;
    let mut saw_not_granting = false;
    let mut closed = None;
    let mut last_open = reload_answered;
    let deadline = reload_answered + phases.close_limit;
    while Instant::now() < deadline && closed.is_none() {
        let ring = ring(port).await?;
        let at = Instant::now();
        if ring["granting"] == true {
            granting_again.get_or_insert(at);
        } else if granting_again.is_none() {
            saw_not_granting = true;
        }
        if granting_again.is_some() && ring["migration"].is_null() {
            closed = Some(at);
        } else {
            last_open = at;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut close_fence: Option<(Instant, Option<Instant>)> = None;
    if closed.is_some() {
        // The close began after the last poll that still showed it open.
        close_fence = Some((last_open, None));
        // Keep polling: closing the migration rewrites every shard's ring
        // record, and the router may stop granting for a moment again.
        let end = Instant::now() + phases.after;
        while Instant::now() < end {
            let ring = ring(port).await?;
            let at = Instant::now();
            if let Some((_, resumed @ None)) = &mut close_fence {
                if ring["granting"] == true {
                    *resumed = Some(at);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(Timeline {
        reload_sent,
        reload_answered,
        reload_status,
        reload_body,
        granting_again,
        saw_not_granting,
        closed,
        close_fence,
        ended: Instant::now(),
    })
}

/// Errors and latency of the acquires, window by window.
pub fn windows(ctx: &Rebalance, t: &Timeline, before: Duration) -> Value {
    let samples = ctx.samples.lock().expect("samples").clone();
    let fence_end = t.granting_again.unwrap_or(t.ended);
    let closed = t.closed.unwrap_or(t.ended);
    // Overlaps a fence window: [reload sent, granting again], or the
    // close's [last poll still open, granting again].
    let close_fence = t.close_fence.map(|(a, b)| (a, b.unwrap_or(t.ended)));
    let in_fence = |s: &Sample| {
        (s.answered >= t.reload_sent && s.sent <= fence_end)
            || close_fence.is_some_and(|(a, b)| s.answered >= a && s.sent <= b)
    };
    let window = |from: Instant, to: Instant| {
        let lat = Latency::new();
        let (mut n, mut errors, mut s503, mut s5xx) = (0u64, 0u64, 0u64, 0u64);
        for s in samples.iter().filter(|s| s.sent >= from && s.sent < to) {
            n += 1;
            match s.status {
                200 => lat.record(s.answered - s.sent),
                503 => s503 += 1,
                _ => {}
            }
            if s.status != 200 {
                errors += 1;
            }
            if s.status >= 500 {
                s5xx += 1;
            }
        }
        let p: Percentiles = lat.percentiles();
        json!({
            "seconds": crate::stats::round(to.saturating_duration_since(from).as_secs_f64(), 3),
            "acquires": n,
            "errors": errors,
            "status_503": s503,
            "status_5xx": s5xx,
            "ok_p50_ms": p.p50_ms,
            "ok_p99_ms": p.p99_ms,
            "ok_max_ms": p.max_ms,
        })
    };
    let start = t.reload_sent.checked_sub(before).unwrap_or(t.reload_sent);
    let outside: Vec<&Sample> = samples.iter().filter(|s| !in_fence(s)).collect();
    let ms = |a: Instant, b: Instant| {
        crate::stats::round(b.saturating_duration_since(a).as_secs_f64() * 1000.0, 1)
    };
    let since_reload = |i: Instant| {
        if i >= t.reload_sent {
            ms(t.reload_sent, i)
        } else {
            -ms(i, t.reload_sent)
        }
    };
    let failed: Vec<&Sample> = samples.iter().filter(|s| s.status != 200).collect();
    json!({
        "first_failure_ms_after_reload": failed.iter().map(|s| since_reload(s.answered)).reduce(f64::min),
        "last_failure_ms_after_reload": failed.iter().map(|s| since_reload(s.answered)).reduce(f64::max),
        "close_fence_window_ms": t.close_fence.and_then(|(a, b)| b.map(|b| ms(a, b))),
        "close_fence_from_ms": t.close_fence.map(|(a, _)| since_reload(a)),
        "close_fence_to_ms": t.close_fence.and_then(|(_, b)| b).map(since_reload),
        "reload_status": t.reload_status,
        "reload_answer": serde_json::from_str::<Value>(&t.reload_body).unwrap_or(Value::String(t.reload_body.clone())),
        "reload_call_ms": ms(t.reload_sent, t.reload_answered),
        "fence_window_ms": t.granting_again.map(|g| ms(t.reload_sent, g)),
        "saw_not_granting": t.saw_not_granting,
        "migration_open_ms": t.closed.map(|c| ms(t.reload_sent, c)),
        "migration_closed": t.closed.is_some(),
        "acquires": samples.len(),
        "errors": samples.iter().filter(|s| s.status != 200).count(),
        "status_503": samples.iter().filter(|s| s.status == 503).count(),
        "errors_outside_fence": outside.iter().filter(|s| s.status != 200).count(),
        "server_errors_outside_fence": outside.iter().filter(|s| s.status >= 500).count(),
        "before": window(start, t.reload_sent),
        "fence": window(t.reload_sent, fence_end),
        "migration_after_fence": window(fence_end, closed),
        "after_close": window(closed, t.ended + Duration::from_millis(1)),
    })
}
