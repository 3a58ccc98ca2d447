//! The state every [`Lock`](crate::Lock) of one grant shares: its identity
//! (name, lockId, fencing token), its validity as the client's own clock
//! judges it, why it was lost, and where its release stands.
//!
//! The identity an extend moves (lockId, TTL, margin) sits behind a std
//! `Mutex` with a generation count: an extend to another TTL gives the grant
//! a new lockId, and a renewal sent under the old one must not be applied
//! once its answer comes back (the old lockId then answers `stolen`), so the
//! renewal task keeps the generation it sent and drops answers of an older
//! one. `moving` serializes an extend with the releases of the grant: a
//! release sent with the old lockId while the extend moves the lock would
//! free nothing and leave the name held under the new one.
//!
//! Status lives in a `watch` channel shared by every `Lock` of one grant
//! (one per acquire of a name the client already holds; see `registry`),
//! their handles and the client's renewal task: the task moves
//! `valid_until` forward on each confirmed renewal and records why a lock
//! was lost; readers also compare `valid_until` with the clock themselves,
//! so a lock is lost on time even if the renewal task is starved or the
//! router is unreachable. Validity only moves forward, and the first reason
//! a lock was lost is the one that stays.
//!
//! This module uses only the error and transport types below it. The
//! registry that keeps each grant's state sits above it and is told when a
//! state goes through the [`Forget`] trait it implements, so the two do not
//! import each other.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::error::LostReason;
use crate::transport::LockRef;

/// Validity as last confirmed, why the lock was lost once it is, and where
/// its release stands.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Status {
    pub valid_until: Instant,
    pub lost: Option<LostReason>,
    pub release: Release,
}

/// Where a grant's release at the router stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Release {
    NotStarted,
    /// Under way, in [`Lock::release`](crate::Lock::release) or in the
    /// renewal task.
    Pending,
    /// The router answered 204.
    Done,
    /// The router refused it (a 4xx other than 429): retrying cannot help.
    GaveUp,
}

/// The grant's identity at the router as of its last extend.
#[derive(Clone)]
pub(crate) struct Grant {
    pub lock_ref: LockRef,
    pub ttl: Duration,
    /// The safety margin for `ttl`.
    pub margin: Duration,
    /// Counts extends that moved the grant: a renewal answer is applied only
    /// under the generation it was sent with.
    pub generation: u64,
}

/// What every view of one grant shares.
pub(crate) struct Shared {
    /// Identifies the lock within its client's renewal task.
    pub key: u64,
    pub name: String,
    /// Never changes, not even by an extend.
    pub fencing_token: u64,
    /// std `Mutex`: held only to read or switch it, never across an await.
    grant: Mutex<Grant>,
    /// Held by an extend for its whole request, and by each release
    /// attempt: the two never cross on the wire.
    pub moving: tokio::sync::Mutex<()>,
    pub status: watch::Sender<Status>,
    /// Wakes a pending release from its backoff: an acquire that raced the
    /// release wants it settled now.
    pub retry_now: Notify,
    /// Where the client keeps its grants, so that this state can leave it
    /// when it goes.
    kept_in: Arc<dyn Forget>,
}

/// Where a client keeps the state of each grant it holds (its registry),
/// told when the router confirms a grant's release and when a state goes,
/// so that its entry goes too. A trait, so that the state does not depend
/// on the registry that holds it.
pub(crate) trait Forget: Send + Sync {
    /// The router confirmed that the grant `lock_id` is released: any
    /// acquire answer naming it from now on was made before, and is stale.
    fn released(&self, lock_id: &str);
    /// The state of the grant `lock_id` is being dropped.
    fn forget(&self, lock_id: &str);
}

impl Drop for Shared {
    fn drop(&mut self) {
        let lock_id = std::mem::take(&mut self.grant_mut().lock_ref.lock_id);
        self.kept_in.forget(&lock_id);
    }
}

impl Shared {
    pub fn new(
        key: u64,
        name: &str,
        lock_ref: LockRef,
        ttl: Duration,
        margin: Duration,
        valid_until: Instant,
        kept_in: Arc<dyn Forget>,
    ) -> Arc<Self> {
        let (status, _) = watch::channel(Status {
            valid_until,
            lost: None,
            release: Release::NotStarted,
        });
        Arc::new(Self {
            key,
            name: name.to_string(),
            fencing_token: lock_ref.fencing_token,
            grant: Mutex::new(Grant {
                lock_ref,
                ttl,
                margin,
                generation: 0,
            }),
            moving: tokio::sync::Mutex::new(()),
            status,
            retry_now: Notify::new(),
            kept_in,
        })
    }

    /// The grant as of now (cloned: the lock may be extended meanwhile).
    pub fn grant(&self) -> Grant {
        self.grant_lock().clone()
    }

    pub fn lock_id(&self) -> String {
        self.grant_lock().lock_ref.lock_id.clone()
    }

    pub fn ttl(&self) -> Duration {
        self.grant_lock().ttl
    }

    pub fn margin(&self) -> Duration {
        self.grant_lock().margin
    }

    fn grant_lock(&self) -> MutexGuard<'_, Grant> {
        // Each update is one assignment: a panic cannot leave it half made.
        self.grant.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn grant_mut(&mut self) -> &mut Grant {
        self.grant.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    /// Moves the grant to the lockId and TTL an extend answered, valid
    /// until `valid_until` (set, not only moved forward: the lock now rides
    /// the new TTL's lease, which may end before the old one). A lock lost
    /// meanwhile (released, or its validity out) moves too but stays lost,
    /// with no new validity: the router holds it under the new lockId now,
    /// and its release must name that one (the old one frees nothing).
    /// Returns the lockId it replaced and whether the lock is still live.
    /// Only the registry calls this, under its own lock, so its entry moves
    /// in the same step.
    pub fn switch(
        &self,
        lock_id: String,
        ttl: Duration,
        margin: Duration,
        valid_until: Instant,
    ) -> (String, bool) {
        let mut grant = self.grant_lock();
        let now = Instant::now();
        let mut live = false;
        self.status.send_if_modified(|s| {
            if s.lost.is_some() {
                return false;
            }
            if now >= s.valid_until {
                s.lost = Some(LostReason::Unconfirmed);
                return true;
            }
            live = true;
            s.valid_until = valid_until;
            true
        });
        let old = std::mem::replace(&mut grant.lock_ref.lock_id, lock_id);
        grant.ttl = ttl;
        grant.margin = margin;
        grant.generation += 1;
        (old, live)
    }

    /// What the renewal task does with a renewal answer: applied only if the
    /// grant is still the `generation` it was sent under, checked under the
    /// grant's lock so that a switch cannot come in between. Some(true) when
    /// it confirms validity, Some(false) when it marks the lock lost with
    /// `lost`, None for a stale answer (nothing applied).
    pub fn apply_renewal(
        &self,
        generation: u64,
        answer: Result<Instant, LostReason>,
    ) -> Option<bool> {
        let grant = self.grant_lock();
        if grant.generation != generation {
            return None;
        }
        match answer {
            Ok(valid_until) => {
                self.confirm(valid_until);
                Some(true)
            }
            Err(reason) => {
                self.mark_lost(reason);
                Some(false)
            }
        }
    }

    /// Marks the lock lost (`Released`, unless it was lost already) and its
    /// release pending; true for the one call that started the release
    /// (only the registry's `begin_release` calls this).
    pub fn begin_release(&self) -> bool {
        let mut started = false;
        self.status.send_if_modified(|s| {
            let lost = s.lost.is_none();
            s.lost.get_or_insert(LostReason::Released);
            if s.release == Release::NotStarted {
                s.release = Release::Pending;
                started = true;
            }
            lost || started
        });
        started
    }

    /// Records how the release ended. A 204 counts whoever got it, and is
    /// told to the registry at once (an acquire answer may be on its way).
    pub fn end_release(&self, outcome: Release) {
        let changed = self.status.send_if_modified(|s| {
            let change =
                s.release != outcome && (outcome == Release::Done || s.release == Release::Pending);
            if change {
                s.release = outcome;
            }
            change
        });
        if changed && outcome == Release::Done {
            self.kept_in.released(&self.lock_id());
        }
    }

    /// Records that the lock is lost; the first reason wins.
    pub fn mark_lost(&self, reason: LostReason) -> bool {
        self.status.send_if_modified(|s| {
            if s.lost.is_some() {
                return false;
            }
            s.lost = Some(reason);
            true
        })
    }

    /// Moves validity forward (never back) after a confirmed renewal. A lock
    /// already lost stays lost: a late answer cannot revive it.
    pub fn confirm(&self, valid_until: Instant) {
        let now = Instant::now();
        self.status.send_if_modified(|s| {
            if s.lost.is_some() {
                return false;
            }
            if now >= s.valid_until {
                // Validity ran out before this answer arrived: the lock
                // already counted as lost, even if nobody looked.
                s.lost = Some(LostReason::Unconfirmed);
                return true;
            }
            if valid_until <= s.valid_until {
                return false;
            }
            s.valid_until = valid_until;
            true
        });
    }

    pub fn current(&self) -> Status {
        *self.status.borrow()
    }

    /// Lost by a recorded reason, or by the clock.
    pub fn lost_now(&self) -> Option<LostReason> {
        let s = self.current();
        match s.lost {
            Some(r) => Some(r),
            None if Instant::now() >= s.valid_until => {
                self.mark_lost(LostReason::Unconfirmed);
                self.current().lost
            }
            None => None,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Keeps nothing: for a state in no registry.
    struct Nowhere;

    impl Forget for Nowhere {
        fn released(&self, _lock_id: &str) {}
        fn forget(&self, _lock_id: &str) {}
    }

    /// State for a grant kept in `kept_in` (not yet its entry).
    pub(crate) fn shared_in(
        kept_in: Arc<dyn Forget>,
        key: u64,
        ttl: Duration,
        valid_for: Duration,
    ) -> Arc<Shared> {
        Shared::new(
            key,
            &format!("lock-{key}"),
            LockRef {
                lock_id: format!("id-{key}"),
                fencing_token: key + 1,
            },
            ttl,
            Duration::from_millis(100),
            Instant::now() + valid_for,
            kept_in,
        )
    }

    /// State for a grant not in any registry (nobody can release it).
    pub(crate) fn shared(key: u64, ttl: Duration, valid_for: Duration) -> Arc<Shared> {
        shared_in(Arc::new(Nowhere), key, ttl, valid_for)
    }

    /// A release asked for while an extend was on the wire: the extend's
    /// answer still moves the grant to the new lockId (the router holds it
    /// there), so the release names it; the lock stays lost, with no new
    /// validity.
    #[test]
    fn a_lock_released_during_an_extend_moves_to_the_new_lock_id_and_stays_lost() {
        let secs = Duration::from_secs;
        let lock = shared(1, secs(2), secs(2));
        let valid_before = lock.current().valid_until;
        assert!(lock.begin_release());
        let (old, live) = lock.switch(
            "id-1-moved".into(),
            secs(6),
            secs(1),
            Instant::now() + secs(5),
        );
        assert_eq!((old.as_str(), live), ("id-1", false));
        assert_eq!(
            lock.grant().lock_ref.lock_id,
            "id-1-moved",
            "released under it"
        );
        assert_eq!(lock.current().lost, Some(LostReason::Released));
        assert_eq!(lock.current().valid_until, valid_before, "no new validity");
        // A live lock moves and gets the new validity.
        let live_lock = shared(2, secs(2), secs(2));
        let until = Instant::now() + secs(5);
        let (_, live) = live_lock.switch("id-2-moved".into(), secs(6), secs(1), until);
        assert!(live);
        assert_eq!(live_lock.current().valid_until, until);
    }
}
