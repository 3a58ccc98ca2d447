//! Before each measured window, etcd is brought to rest and checked idle,
//! so a window pays for its own work only: the leases earlier scenarios
//! left behind (a router's session leases, leases a baseline did not
//! revoke) are revoked through etcd, rather than left to expire, and
//! revoke their keys, in the middle of a later window; then etcd counts
//! as idle once its raft proposals and lease keepalives stand still for a
//! short interval. The outcome is reported with the window it preceded; a
//! window whose check gave up runs anyway and says so.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use etcd_client::Client;
use futures::stream::{self, StreamExt};
use serde::Serialize;

use crate::scrape::EtcdCounters;
use crate::stack::Stack;

/// Lease revokes in flight at once per shard.
const REVOKES_IN_FLIGHT: usize = 64;

/// What the check before one window found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct IdleCheck {
    /// Leases found on the shards and revoked first.
    pub leases_revoked: u64,
    /// Whether etcd's proposals and keepalives stood still for `interval_ms`.
    pub idle: bool,
    pub interval_ms: u64,
    /// From the start of the check to its end (revoking included).
    pub waited_ms: u64,
    /// Proposals and keepalives in the last interval looked at (both 0
    /// when idle).
    pub proposals: f64,
    pub keepalives: f64,
}

/// What the router costs with nothing to do, measured once its shards are
/// up and before the first window: its timers, pings and probes, per shard.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RouterAtRest {
    pub seconds: f64,
    pub shards: usize,
    /// CPU the router used, in cores.
    pub cores: f64,
    pub context_switches_per_s: f64,
    pub context_switches_per_s_per_shard: f64,
}

/// Measures [`RouterAtRest`] over `window`, nothing sent to the router.
pub async fn router_at_rest(stack: &Stack, window: Duration) -> Option<RouterAtRest> {
    use lockrouter_testkit::procfs::{context_switches, cpu_seconds};
    let pid = stack.router.pid();
    let (switches, cpu, started) = (context_switches(pid)?, cpu_seconds(pid)?, Instant::now());
    tokio::time::sleep(window).await;
    let seconds = started.elapsed().as_secs_f64();
    let per_s = (context_switches(pid)?.saturating_sub(switches)) as f64 / seconds;
    let shards = stack.shards.len();
    Some(RouterAtRest {
        seconds,
        shards,
        cores: (cpu_seconds(pid)? - cpu) / seconds,
        context_switches_per_s: per_s,
        context_switches_per_s_per_shard: per_s / shards.max(1) as f64,
    })
}

/// How the check runs.
#[derive(Debug, Clone, Copy)]
pub struct Rest {
    /// Revoke every lease first (no: a warm-up's sessions must live on).
    pub revoke: bool,
    pub interval: Duration,
    /// Give up after this long and let the window start anyway.
    pub limit: Duration,
}

/// Revokes every lease (if asked), then waits until etcd's proposals and
/// keepalives stand still for `rest.interval`, or `rest.limit` passes.
pub async fn settle(stack: &Stack, rest: Rest) -> Result<IdleCheck> {
    let started = Instant::now();
    let leases_revoked = if rest.revoke {
        revoke_all(stack).await?
    } else {
        0
    };
    let mut last = EtcdCounters::read(stack)?;
    loop {
        tokio::time::sleep(rest.interval).await;
        let now = EtcdCounters::read(stack)?;
        let d = now.minus(&last);
        let idle = d.proposals == 0.0 && d.lease_renewals == 0.0;
        if idle || started.elapsed() >= rest.limit {
            let check = IdleCheck {
                leases_revoked,
                idle,
                interval_ms: rest.interval.as_millis() as u64,
                waited_ms: started.elapsed().as_millis() as u64,
                proposals: d.proposals,
                keepalives: d.lease_renewals,
            };
            eprintln!(
                "   idle check: {} after {} ms ({} leases revoked; {} proposals, {} keepalives in the last {} ms)",
                if idle { "idle" } else { "NOT idle" },
                check.waited_ms,
                check.leases_revoked,
                check.proposals,
                check.keepalives,
                check.interval_ms
            );
            return Ok(check);
        }
        last = now;
    }
}

/// Revokes every lease of every shard; returns how many were revoked.
async fn revoke_all(stack: &Stack) -> Result<u64> {
    let mut revoked = 0;
    for ep in stack.endpoints() {
        let mut c = Client::connect([ep.as_str()], None)
            .await
            .with_context(|| format!("connect to etcd at {ep}"))?;
        let ids: Vec<i64> = c.leases().await?.leases().iter().map(|l| l.id()).collect();
        // A lease that expires meanwhile answers "not found": gone either way.
        revoked += stream::iter(ids)
            .map(|id| {
                let mut c = c.clone();
                async move { c.lease_revoke(id).await.is_ok() }
            })
            .buffer_unordered(REVOKES_IN_FLIGHT)
            .filter(|ok| std::future::ready(*ok))
            .count()
            .await as u64;
    }
    Ok(revoked)
}
