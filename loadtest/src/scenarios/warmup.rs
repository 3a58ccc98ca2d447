//! Session warm-up, before the measured window of an acquire scenario:
//! each client of the pool acquires (and releases) one fresh name on each
//! shard, picked with the router's own placement (the suite's shards under
//! the default ring), so every (client, shard) session lease exists, as it
//! does for clients that have been running for a while. The shard of each
//! grant is read back from its lockId, so a placement that disagreed with
//! the router's would show as clients not covered. The window that follows then pays
//! what a steady state pays per acquire, not the first acquires' grants.
//! What the warm-up itself cost is reported apart.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use goose::prelude::*;
use lockrouter::config::{RingSettings, ShardSettings};
use lockrouter::ring::Ring;
use lockrouter::token::lock_id::LockId;
use serde::Serialize;

use crate::api::{self, Acquire};
use crate::attack::transaction;
use crate::scenarios::clients::Clients;
use crate::stats::Stats;

/// Candidate names looked at (locally) per shard before giving up on it.
const MAX_CANDIDATES_PER_SHARD: usize = 1_000;

/// How long a warm-up may take at most (it ends as soon as every client
/// is done).
pub const WARMUP_LIMIT: Duration = Duration::from_secs(600);

pub struct Warmup {
    pub stats: Stats,
    pub clients: Clients,
    pub shards: usize,
    /// The placement the router uses for the suite's shards.
    ring: Ring,
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
        let settings: Vec<ShardSettings> = (0..shards)
            .map(|i| ShardSettings {
                name: lockrouter_testkit::config::shard_name(i),
                endpoints: Vec::new(),
                weight: 1,
                ..ShardSettings::default()
            })
            .collect();
        Self {
            stats: Stats::new(),
            clients,
            shards,
            ring: Ring::new(&settings, RingSettings::default().vnodes),
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

/// Acquires and releases one fresh name per shard for client `c`.
async fn warm(user: &mut GooseUser, ctx: &Warmup, c: usize) {
    let client = ctx.clients.id(c as u64);
    let mut seen = HashSet::new();
    let mut j = 0;
    for shard in 0..ctx.shards {
        let name = loop {
            let name = format!("{}:{c}:{j}", ctx.tag);
            j += 1;
            if ctx.ring.shard_index(&name) == shard {
                break Some(name);
            }
            if j >= MAX_CANDIDATES_PER_SHARD * ctx.shards {
                break None;
            }
        };
        let Some(name) = name else { break };
        if let Acquire::Granted(lock) =
            api::acquire(user, &ctx.stats, &name, &client, ctx.ttl_ms).await
        {
            if let Ok(id) = LockId::decode(&lock.lock_id) {
                seen.insert(id.shard);
            }
            api::release(user, &ctx.stats, &lock).await;
        }
    }
    if seen.len() >= ctx.shards {
        ctx.covered.fetch_add(1, Relaxed);
    }
}
