//! `contended-wait`: every user asks for one of a few hot names with
//! `waitMs`, so instead of losing the race it queues (FIFO, in etcd) and is
//! granted when the holder releases; it holds the lock briefly and releases
//! it. Measures the handover latency: per name, from the moment the
//! holder's release was sent to the moment the next waiter's grant answer
//! arrived, both on this process's monotonic clock, in an HDR histogram
//! (µs). Only grants asked for before that release was sent count as
//! handovers. A wait that runs out, an error or a 5xx is a failure here.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use goose::prelude::*;
use rand::Rng;

use crate::api::{self, Acquire};
use crate::attack::transaction;
use crate::stats::{Latency, Stats};

pub struct ContendedWait {
    pub stats: Stats,
    pub ttl_ms: u64,
    pub wait_ms: u64,
    pub names: Vec<String>,
    pub hold: Duration,
    pub tag: String,
    /// Per name: when its holder's release was sent, until a waiter's
    /// grant answer claims it.
    released_at: Vec<Mutex<Option<Instant>>>,
    pub handover: Latency,
    /// Grants that were no handover: the first grant of a name, or one
    /// asked for after the previous holder's release was sent (the name was
    /// free, nobody was waiting).
    pub cold_grants: AtomicU64,
}

impl ContendedWait {
    pub fn new(
        stats: Stats,
        ttl_ms: u64,
        wait_ms: u64,
        names: Vec<String>,
        hold: Duration,
        tag: String,
    ) -> Self {
        let released_at = names.iter().map(|_| Mutex::new(None)).collect();
        Self {
            stats,
            ttl_ms,
            wait_ms,
            names,
            hold,
            tag,
            released_at,
            handover: Latency::new(),
            cold_grants: AtomicU64::new(0),
        }
    }

    fn granted(&self, i: usize, asked: Instant, at: Instant) {
        let released = self.released_at[i].lock().expect("handover").take();
        match released {
            Some(r) if asked <= r => self.handover.record(at.saturating_duration_since(r)),
            _ => {
                self.cold_grants.fetch_add(1, Relaxed);
            }
        }
    }

    fn releasing(&self, i: usize) {
        *self.released_at[i].lock().expect("handover") = Some(Instant::now());
    }
}

pub fn scenario(ctx: &Arc<ContendedWait>) -> Scenario {
    scenario!("contended-wait").register_transaction(transaction("wait", ctx, |user, ctx| {
        Box::pin(async move {
            let i = rand::rng().random_range(0..ctx.names.len());
            let client = format!("{}-u{}", ctx.tag, user.weighted_users_index);
            let asked = Instant::now();
            let answer = api::acquire_waiting(
                user,
                &ctx.stats,
                &ctx.names[i],
                &client,
                ctx.ttl_ms,
                ctx.wait_ms,
            )
            .await;
            match answer {
                Acquire::Granted(lock) => {
                    ctx.granted(i, asked, Instant::now());
                    api::pause(ctx.hold).await;
                    ctx.releasing(i);
                    api::release(user, &ctx.stats, &lock).await;
                }
                // The wait ran out: the queue did not hand the name over.
                Acquire::Held => ctx.stats.error(),
                Acquire::Failed => {}
            }
            Ok(())
        })
    }))
}
