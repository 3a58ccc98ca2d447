//! Per-principal quotas (`max_held_locks`, `max_sessions`) as one replica
//! enforces them: what its lock-key caches count, plus what this replica
//! has in flight or has granted but its cache has not counted yet.
//!
//! The caches follow etcd by a watch, so a count read from them alone
//! misses every acquire still in flight and every grant whose event has
//! not arrived: a burst of parallel acquires would all read the same
//! count and all pass. So each acquire of a principal with a quota
//! *reserves* its lock (and, when it grants a session lease, its session)
//! here, under one lock, before its grant txn. The reservation is given
//! back when the acquire ends without a grant, and kept after a grant
//! until the shard's cache has applied the grant's revision (from then on
//! the cache counts it). One replica alone therefore never passes a quota.
//!
//! Across replicas each sees only its own reservations: the fleet-wide
//! slack is what the other replicas have in flight and not yet counted
//! (`docs/security.md`, "Quotas"). A count only ever refuses; it is never
//! the basis of a grant.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::shard::ops::CacheCounts;
use crate::shard::Held;
use crate::token::lease_tag::LeaseTag;

/// Longest a granted reservation waits for its cache (a cache that stops
/// counting makes quotas unenforced anyway, and says so).
const SEEN_BOUND: Duration = Duration::from_secs(30);

/// The reservations of every principal on this replica; kept across
/// reloads.
#[derive(Default)]
pub struct Quotas {
    /// std `Mutex`: held only to count and reserve, never across an await.
    pending: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    by_tag: HashMap<LeaseTag, Vec<Slot>>,
    next_id: u64,
}

/// One acquire's reservation.
struct Slot {
    id: u64,
    /// Whether it also reserved a new session lease.
    session: bool,
    /// Once granted: the shard and revision its cache must apply.
    granted: Option<(Arc<dyn CacheCounts>, i64, Instant)>,
}

impl Slot {
    /// Counted by the shard's cache by now (or given up on).
    fn counted(&self) -> bool {
        self.granted.as_ref().is_some_and(|(shard, revision, at)| {
            shard.cache_has_seen(*revision) || at.elapsed() > SEEN_BOUND
        })
    }
}

/// A principal's bounds, as a reservation needs them (0: no bound).
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub tag: LeaseTag,
    pub max_locks: u64,
    pub max_sessions: u64,
}

/// Why a reservation was refused: the quota reached, what the caches
/// count and what this replica has reserved besides.
#[derive(Debug)]
pub struct Refused {
    pub quota: &'static str,
    pub counted: u64,
    pub reserved: u64,
}

/// An acquire's place in its principal's quota; given back when dropped,
/// unless [`Reservation::granted`] keeps it until the cache counts it.
pub struct Reservation {
    quotas: Arc<Quotas>,
    bounds: Bounds,
    id: u64,
    /// Granted: the slot stays until the cache counts the lock.
    kept: bool,
}

impl Quotas {
    /// Reserves one more lock within `bounds`, unless what the principal
    /// holds (`held`: the caches' count, `None` while they cannot count)
    /// plus what this replica has reserved for it reaches `max_locks`.
    pub fn reserve_lock(
        self: &Arc<Self>,
        bounds: Bounds,
        held: impl FnOnce() -> Option<Held>,
    ) -> Result<Reservation, Refused> {
        let mut pending = self.pending.lock().expect("quota lock");
        // Counted after pruning: a slot is pruned only once its cache's
        // counts include it (they are updated before its revision).
        let (locks, _) = pending.count(bounds.tag);
        if bounds.max_locks > 0 {
            if let Some(held) = held() {
                if held.locks + locks >= bounds.max_locks {
                    return Err(Refused {
                        quota: "max_held_locks",
                        counted: held.locks,
                        reserved: locks,
                    });
                }
            }
        }
        pending.next_id += 1;
        let id = pending.next_id;
        pending.by_tag.entry(bounds.tag).or_default().push(Slot {
            id,
            session: false,
            granted: None,
        });
        Ok(Reservation {
            quotas: self.clone(),
            bounds,
            id,
            kept: false,
        })
    }
}

impl Pending {
    /// Drops the slots of `tag` the cache counts by now; returns the locks
    /// and sessions still reserved.
    fn count(&mut self, tag: LeaseTag) -> (u64, u64) {
        let Some(slots) = self.by_tag.get_mut(&tag) else {
            return (0, 0);
        };
        slots.retain(|s| !s.counted());
        let sessions = slots.iter().filter(|s| s.session).count() as u64;
        let locks = slots.len() as u64;
        if slots.is_empty() {
            self.by_tag.remove(&tag);
        }
        (locks, sessions)
    }

    fn slot(&mut self, tag: LeaseTag, id: u64) -> Option<&mut Slot> {
        self.by_tag.get_mut(&tag)?.iter_mut().find(|s| s.id == id)
    }
}

impl Reservation {
    /// Reserves a new session lease too, unless the principal's sessions
    /// (as the caches count them, plus those reserved here) reach its
    /// `max_sessions`.
    pub fn add_session(&self, held: impl FnOnce() -> Option<Held>) -> Result<(), Refused> {
        let tag = self.bounds.tag;
        let mut pending = self.quotas.pending.lock().expect("quota lock");
        let (_, sessions) = pending.count(tag);
        if self.bounds.max_sessions > 0 {
            if let Some(held) = held() {
                if held.sessions + sessions >= self.bounds.max_sessions {
                    return Err(Refused {
                        quota: "max_sessions",
                        counted: held.sessions,
                        reserved: sessions,
                    });
                }
            }
        }
        if let Some(slot) = pending.slot(tag, self.id) {
            slot.session = true;
        }
        Ok(())
    }

    /// The acquire's txn created the lock on `shard` at `revision`: the
    /// reservation stays until that shard's cache has applied it.
    pub fn granted(mut self, shard: Arc<dyn CacheCounts>, revision: i64) {
        let mut pending = self.quotas.pending.lock().expect("quota lock");
        if let Some(slot) = pending.slot(self.bounds.tag, self.id) {
            slot.granted = Some((shard, revision, Instant::now()));
            self.kept = true;
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        let mut pending = self.quotas.pending.lock().expect("quota lock");
        if let Some(slots) = pending.by_tag.get_mut(&self.bounds.tag) {
            slots.retain(|s| s.id != self.id);
            if slots.is_empty() {
                pending.by_tag.remove(&self.bounds.tag);
            }
        }
    }
}
