//! Session warm-up, before the measured window of an acquire scenario:
//! each client of the pool acquires (and releases) fresh names until it has
//! been granted a lock on every shard (the shard is read from the lockId),
//! so every (client, shard) session lease exists, as it does for clients
//! that have been running for a while. The window that follows then pays
//! what a steady state pays per acquire, not the first acquires' grants.
//! What the warm-up itself cost is reported apart.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use goose::prelude::*;
use lockrouter::token::lock_id::LockId;
use serde::Serialize;

use crate::api::{self, Acquire};
use crate::attack::transaction;
use crate::scenarios::clients::Clients;
use crate::stats::Stats;

/// Acquires one client may make before it gives up covering every shard
/// (with 3 shards, it takes 5.5 on average).
const MAX_TRIES_PER_SHARD: usize = 10;

/// How long a warm-up may take at most (it ends as soon as every client
/// is done).
pub const WARMUP_LIMIT: Duration = Duration::from_secs(600);

pub struct Warmup {
    pub stats: Stats,
    pub clients: Clients,
    pub shards: usize,
    pub ttl_ms: u64,
    /// Prefix of the names it acquires.
    pub tag: String,
    /// Next client to warm, and clients done (covered or given up).
    next: AtomicUsize,
    pub done: AtomicUsize,
    /// Clients that got a lock on every shard.
    pub covered: AtomicUsize,
}

/// What a warm-up did, for the report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WarmupOutcome {
    pub clients: usize,
    /// Clients granted a lock on every shard.
    pub covered: usize,
    pub acquires: u64,
    pub errors: u64,
    pub seconds: f64,
    /// Session leases etcd granted meanwhile (clients × shards when all
    /// were new).
    pub lease_grants: f64,
}

impl Warmup {
    pub fn new(clients: Clients, shards: usize, ttl_ms: u64, tag: &str) -> Self {
        Self {
            stats: Stats::new(),
            clients,
            shards,
            ttl_ms,
            tag: tag.to_string(),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            covered: AtomicUsize::new(0),
        }
    }

    pub fn finished(&self) -> bool {
        self.done.load(Relaxed) >= self.clients.count()
    }
}

pub fn scenario(ctx: &Arc<Warmup>) -> Scenario {
    scenario!("warm-up").register_transaction(transaction("warm", ctx, |user, ctx| {
        Box::pin(async move {
            let c = ctx.next.fetch_add(1, Relaxed);
            if c >= ctx.clients.count() {
                // Every client is taken: wait for the controller to stop goose.
                tokio::time::sleep(Duration::from_millis(50)).await;
                return Ok(());
            }
            warm(user, &ctx, c).await;
            ctx.done.fetch_add(1, Relaxed);
            Ok(())
        })
    }))
}

/// Acquires and releases fresh names for client `c` until it was granted
/// on every shard.
async fn warm(user: &mut GooseUser, ctx: &Warmup, c: usize) {
    let client = ctx.clients.id(c as u64);
    let mut seen = HashSet::new();
    for j in 0..MAX_TRIES_PER_SHARD * ctx.shards {
        let name = format!("{}:{c}:{j}", ctx.tag);
        if let Acquire::Granted(lock) =
            api::acquire(user, &ctx.stats, &name, &client, ctx.ttl_ms).await
        {
            if let Ok(id) = LockId::decode(&lock.lock_id) {
                seen.insert(id.shard);
            }
            api::release(user, &ctx.stats, &lock).await;
        }
        if seen.len() >= ctx.shards {
            ctx.covered.fetch_add(1, Relaxed);
            return;
        }
    }
}
