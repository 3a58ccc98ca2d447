//! `contended`: every user fights over a few hot names. A user picks one at
//! random, for the next client of a pool, and if it is granted holds it
//! briefly and releases it. Measures the grant rate, the raft writes per
//! grant, how evenly grants spread over users, and errors (there must be no
//! 5xx: losing a race is an answer, not a failure).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use goose::prelude::*;
use rand::Rng;

use crate::api::{self, Acquire};
use crate::attack::transaction;
use crate::scenarios::clients::Clients;
use crate::stats::Stats;

pub struct Contended {
    pub stats: Stats,
    pub ttl_ms: u64,
    pub names: Vec<String>,
    pub hold: Duration,
    pub clients: Clients,
    pub seq: AtomicU64,
}

pub fn scenario(ctx: &Arc<Contended>) -> Scenario {
    scenario!("contended").register_transaction(transaction("fight", ctx, |user, ctx| {
        Box::pin(async move {
            let name = &ctx.names[rand::rng().random_range(0..ctx.names.len())];
            let client = ctx.clients.id(ctx.seq.fetch_add(1, Relaxed));
            if let Acquire::Granted(lock) =
                api::acquire(user, &ctx.stats, name, &client, ctx.ttl_ms).await
            {
                api::pause(ctx.hold).await;
                api::release(user, &ctx.stats, &lock).await;
            }
            Ok(())
        })
    }))
}
