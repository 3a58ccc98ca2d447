//! `uncontested` and `churn`: each user acquires a name nobody else uses,
//! optionally holds it a moment, and releases it, over and over, each lock
//! for the next client of a pool. Uncontested runs as fast as it goes
//! (throughput) or at a fixed rate (latency); churn is the same lock life at
//! a target rate set with goose's throttle, alone or on top of `hold` (then
//! it waits for the hold to reach its steady state, and its locks are the
//! holding clients' own).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use goose::prelude::*;

use crate::api::{self, Acquire};
use crate::attack::transaction;
use crate::scenarios::clients::Clients;
use crate::stats::Stats;

pub struct Lifecycle {
    pub stats: Stats,
    pub ttl_ms: u64,
    /// How long a lock is held between acquire and release.
    pub hold: Duration,
    /// Prefix of names, unique per scenario run.
    pub tag: String,
    /// Whom each lock is acquired for, in turn.
    pub clients: Clients,
    seq: AtomicU64,
    /// When set, users send nothing until it turns true (churn on hold).
    pub gate: Option<Arc<AtomicBool>>,
}

impl Lifecycle {
    pub fn new(stats: Stats, ttl_ms: u64, hold: Duration, tag: &str, clients: Clients) -> Self {
        Self {
            stats,
            ttl_ms,
            hold,
            tag: tag.to_string(),
            clients,
            seq: AtomicU64::new(0),
            gate: None,
        }
    }
}

pub fn scenario(name: &str, ctx: &Arc<Lifecycle>) -> Scenario {
    scenario!(name).register_transaction(transaction("acquire-release", ctx, |user, ctx| {
        Box::pin(async move {
            if let Some(gate) = &ctx.gate {
                if !gate.load(Relaxed) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    return Ok(());
                }
            }
            let n = ctx.seq.fetch_add(1, Relaxed);
            let name = format!("{}:{n}", ctx.tag);
            let client = ctx.clients.id(n);
            match api::acquire(user, &ctx.stats, &name, &client, ctx.ttl_ms).await {
                Acquire::Granted(lock) => {
                    api::pause(ctx.hold).await;
                    api::release(user, &ctx.stats, &lock).await;
                }
                // A name nobody else uses cannot be held by another.
                Acquire::Held => ctx.stats.error(),
                Acquire::Failed => {}
            }
            Ok(())
        })
    }))
}
