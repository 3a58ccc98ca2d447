//! `contended`: every user fights over a few hot names. A user picks one at
//! random, and if it is granted holds it briefly and releases it. Measures
//! the grant rate, how evenly grants spread over users, and errors (there
//! must be no 5xx: losing a race is an answer, not a failure).

use std::sync::Arc;
use std::time::Duration;

use goose::prelude::*;
use rand::Rng;

use crate::api::{self, Acquire};
use crate::attack::transaction;
use crate::stats::Stats;

pub struct Contended {
    pub stats: Stats,
    pub ttl_ms: u64,
    pub names: Vec<String>,
    pub hold: Duration,
    pub tag: String,
}

pub fn scenario(ctx: &Arc<Contended>) -> Scenario {
    scenario!("contended").register_transaction(transaction("fight", ctx, |user, ctx| {
        Box::pin(async move {
            let name = &ctx.names[rand::rng().random_range(0..ctx.names.len())];
            let client = format!("{}-u{}", ctx.tag, user.weighted_users_index);
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
