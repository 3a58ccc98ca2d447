//! Idle sessions handed on: while new sessions start on a shard, the
//! leases of sessions gone idle with no lock on them become spares for the
//! new ones ([`spares`](super::spares)), instead of lapsing in etcd (a
//! revoke each) while the new sessions are granted leases of their own (a
//! grant each).
//!
//! Once a second, and only for the TTLs and lease tags whose sessions
//! started lately, a pass notes the idle sessions, waits for the lock-key
//! cache to apply a barrier written after that, and hands on those still
//! as noted with no lock key on their lease. The slot's rules (what
//! counts as a use, a pin, an ownership) are in
//! [`sessions`](super::sessions); why no lock can ride on a lease handed
//! on is docs/design.md, "Idle sessions handed on".

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::sessions::Idle;
use super::spares::{Key, Spare};
use super::Shard;

/// How often a shard looks for idle sessions to hand on.
const EVERY: Duration = Duration::from_secs(1);

/// A session is idle once its last acquire is half its TTL old: one whose
/// client comes back sooner keeps it (handed on, its client would start
/// another session on its return).
fn idle_for(ttl_secs: u32) -> Duration {
    Duration::from_millis(u64::from(ttl_secs) * 500)
}

/// The least a session's lease must have left, by its last confirmed
/// renewal, to be handed on: a quarter of its TTL.
fn least_left(ttl_secs: u32) -> Duration {
    Duration::from_millis(u64::from(ttl_secs) * 250)
}

/// Runs `shard`'s pass every [`EVERY`] until `cancel`, or until the shard
/// is dropped.
async fn hand_on_every(shard: Weak<Shard>, cancel: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(EVERY) => {}
            _ = cancel.cancelled() => return,
        }
        let Some(shard) = shard.upgrade() else {
            return;
        };
        shard.hand_on_idle_sessions().await;
    }
}

impl Shard {
    /// Starts the shard's passes, which end with it (or with `cancel`).
    pub(super) fn start_recycling(self: &Arc<Self>, cancel: CancellationToken) {
        let task = tokio::spawn(hand_on_every(Arc::downgrade(self), cancel.clone()));
        let guard = crate::task::TaskGuard::new(task, cancel);
        // Started once, by `Shard::start`.
        let _ = self.recycling.set(guard);
    }

    /// One pass: as many idle sessions' leases as each TTL and tag wants
    /// ([`Spares::wanted_recycled`]), those nearest their end first, become
    /// spares, each only if the cache, at a barrier written after the
    /// sessions were noted, shows no lock key on its lease and the session
    /// is still as noted ([`Sessions::retire`]).
    ///
    /// [`Spares::wanted_recycled`]: super::spares::Spares::wanted_recycled
    /// [`Sessions::retire`]: super::sessions::Sessions::retire
    pub(super) async fn hand_on_idle_sessions(&self) {
        if !self.is_up() {
            return;
        }
        let (epoch, wanted) = self.spares.wanted_recycled();
        if wanted.is_empty() {
            return;
        }
        let now = Instant::now();
        // Those nearest their lease's end first: with acquires that come
        // at random, the likeliest to lapse before their client is back.
        let mut idle: Vec<(Instant, Idle)> = (self.sessions.idle(now, idle_for))
            .into_iter()
            .filter_map(|i| {
                let end = self.keepalive.confirmed(i.lease.id)?.deadline();
                (end >= now + least_left(i.lease.ttl_secs)).then_some((end, i))
            })
            .collect();
        idle.sort_by_key(|(end, _)| *end);
        let mut left: HashMap<Key, usize> = wanted.into_iter().collect();
        let mut take = |i: &Idle| match left.get_mut(&(i.lease.ttl_secs, i.tag)) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        };
        let picked: Vec<Idle> = (idle.into_iter().map(|(_, i)| i))
            .filter(|i| take(i))
            .collect();
        if picked.is_empty() {
            return;
        }
        let leases: Vec<i64> = picked.iter().map(|i| i.lease.id).collect();
        let Ok(Some(locks)) = self.cache.locks_on(&leases).await else {
            return; // the cache cannot vouch: nothing is handed on
        };
        for (idle, locks) in picked.iter().zip(locks) {
            if locks > 0 || !self.sessions.retire(idle) {
                continue;
            }
            // Not known alive any more: not handed out (nothing rides on it).
            let Some(renewal) = self.keepalive.confirmed(idle.lease.id) else {
                continue;
            };
            let spare = Spare {
                id: idle.lease.id,
                granted: renewal,
            };
            (self.spares).recycled((idle.lease.ttl_secs, idle.tag), epoch, spare);
        }
    }
}
