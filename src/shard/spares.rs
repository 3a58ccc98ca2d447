//! Spare session leases: while new sessions start often on a shard (many
//! clients that acquire less often than their TTL, so that their sessions
//! lapse between acquires), a few leases are granted ahead of need, and a
//! client with no live session takes one at once instead of waiting for a
//! `LeaseGrant` (a raft write) before its grant txn can go.
//!
//! A spare carries no key until an acquire puts its lock key on it, and is
//! handed to one session only (taken under a lock), so it protects nothing
//! and holds nothing while it waits: one never used expires in etcd by
//! itself. Its expiry counts from when its grant was sent, as a session's
//! does, and a spare older than [`max_age`] is not handed out, so a session
//! started on one has at least nine tenths of its TTL left, and its
//! acquire answers what is left (docs/design.md, "Spare session leases").
//!
//! How many to keep ready follows the need: the sessions started in the
//! last [`WINDOW`] for the same TTL and lease tag, at most [`MOST`], so a
//! lone new session now and then gets none (and wastes none), and a stream
//! of them rarely waits.
//!
//! Spares also come from sessions gone idle with no lock on them
//! ([`recycle`](super::recycle)): those are taken first, and fewer grants
//! are sent while they last. Such a lease is as old as its last confirmed
//! renewal, so it is handed out only while it has at least a sixth of
//! its TTL left ([`min_left`]).
//!
//! The leases of waiters' queue entries that a grant txn emptied are kept
//! apart ([`EmptiedLeases`]), for the shard's next waiters (queue.rs).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::conn::EtcdConn;
use super::keepalive::Renewal;
use super::sessions::grant_lease;
use crate::token::lease_tag::LeaseTag;

/// How far back new sessions count towards the spares kept ready.
pub const WINDOW: Duration = Duration::from_millis(100);

/// The most spares kept ready per TTL and tag.
pub const MOST: usize = 16;

/// The oldest a spare may be when it is handed out: a second, or a tenth
/// of its TTL if that is less.
pub fn max_age(ttl_secs: u32) -> Duration {
    Duration::from_secs(1).min(Duration::from_millis(u64::from(ttl_secs) * 100))
}

/// How far back new sessions count towards the idle sessions' leases
/// handed on to the spares.
pub const RECYCLE_WINDOW: Duration = Duration::from_secs(1);

/// The most leases of idle sessions kept ready per TTL and tag.
pub const MOST_RECYCLED: usize = 256;

/// The least a lease handed on from an idle session must have left when
/// it is handed out: a sixth of its TTL (5 s of 30, above the etcd
/// deadline, so the acquire's txn goes beside its keepalive).
pub fn min_left(ttl_secs: u32) -> Duration {
    Duration::from_millis(u64::from(ttl_secs) * 1000 / 6)
}

/// A lease granted ahead of need, as its grant left it, or an idle
/// session's, as its last confirmed renewal left it.
#[derive(Debug, Clone, Copy)]
pub struct Spare {
    pub id: i64,
    /// Its grant or last renewal: sent when, and the TTL etcd answered.
    pub granted: Renewal,
}

/// What sessions of one TTL and tag started lately, and their spares.
#[derive(Default)]
struct Pool {
    ready: VecDeque<Spare>,
    /// Grants sent for this pool and not answered yet.
    pending: usize,
    /// Idle sessions' leases handed on, oldest first.
    recycled: VecDeque<Spare>,
    /// When the sessions of the last [`RECYCLE_WINDOW`] started (the
    /// latest [`MOST_RECYCLED`]); those of the last [`WINDOW`] are the
    /// spares wanted.
    starts: VecDeque<Instant>,
}

impl Pool {
    /// Drops the spares too old to hand out at `now` and the session starts
    /// older than [`RECYCLE_WINDOW`]; returns how many spares it dropped.
    fn age(&mut self, ttl_secs: u32, now: Instant) -> usize {
        let oldest = max_age(ttl_secs);
        let before = self.ready.len();
        self.ready
            .retain(|s| now.saturating_duration_since(s.granted.sent_at) <= oldest);
        let recycled = self.recycled.len();
        let least = now + min_left(ttl_secs);
        self.recycled.retain(|s| s.granted.deadline() >= least);
        self.starts
            .retain(|t| now.saturating_duration_since(*t) <= RECYCLE_WINDOW);
        before - self.ready.len() + recycled - self.recycled.len()
    }

    fn is_idle(&self) -> bool {
        self.ready.is_empty()
            && self.pending == 0
            && self.recycled.is_empty()
            && self.starts.is_empty()
    }
}

pub type Key = (u32, Option<LeaseTag>);

/// Pure bookkeeping of the spares (no I/O): which to hand out, how many
/// to grant.
#[derive(Default)]
pub struct Ledger {
    pools: HashMap<Key, Pool>,
    /// Counts flushes: a grant sent before the last one is not kept.
    epoch: u64,
    /// When the last flush came: an idle session's lease last confirmed
    /// by a keepalive sent before then may be gone with the rest, and is
    /// never handed on.
    flushed_at: Option<Instant>,
}

/// What a session start gets from the ledger: a spare, if a fresh one was
/// ready, how many more to grant now, and how many were dropped as too old.
#[derive(Debug)]
pub struct Take {
    pub spare: Option<Spare>,
    pub grant: usize,
    pub dropped: usize,
    /// What the grants sent now report back with ([`Ledger::granted`]).
    pub epoch: u64,
}

impl Ledger {
    /// A session of `ttl_secs` and `tag` starts at `now`.
    pub fn take(&mut self, ttl_secs: u32, tag: Option<LeaseTag>, now: Instant) -> Take {
        let pool = self.pools.entry((ttl_secs, tag)).or_default();
        let dropped = pool.age(ttl_secs, now);
        // An idle session's lease first (it would lapse unused), then the
        // oldest fresh one: the rest stay fresh the longest.
        let spare = (pool.recycled.pop_front()).or_else(|| pool.ready.pop_front());
        let recent = |t: &&Instant| now.saturating_duration_since(**t) <= WINDOW;
        let want = pool
            .starts
            .iter()
            .rev()
            .take_while(recent)
            .count()
            .min(MOST);
        pool.starts.push_back(now);
        if pool.starts.len() > MOST_RECYCLED {
            pool.starts.pop_front();
        }
        let ready = pool.ready.len() + pool.pending + pool.recycled.len();
        let grant = want.saturating_sub(ready);
        pool.pending += grant;
        Take {
            spare,
            grant,
            dropped,
            epoch: self.epoch,
        }
    }

    /// A grant sent for the pool in `epoch` was answered: `spare`, or
    /// nothing if it failed. One sent before the last flush is not kept.
    pub fn granted(
        &mut self,
        ttl_secs: u32,
        tag: Option<LeaseTag>,
        epoch: u64,
        spare: Option<Spare>,
    ) {
        let pool = self.pools.entry((ttl_secs, tag)).or_default();
        pool.pending = pool.pending.saturating_sub(1);
        if epoch == self.epoch {
            pool.ready.extend(spare);
        }
    }

    /// How many idle sessions' leases each TTL and tag would take now: as
    /// many as sessions started in the last [`RECYCLE_WINDOW`], less those
    /// ready. Only pools that want some.
    pub fn wanted_recycled(&mut self, now: Instant) -> Vec<(Key, usize)> {
        let mut wanted = Vec::new();
        for (key, pool) in &mut self.pools {
            pool.age(key.0, now);
            let want = pool.starts.len().saturating_sub(pool.recycled.len());
            if want > 0 {
                wanted.push((*key, want));
            }
        }
        wanted
    }

    /// An idle session's lease handed on in `epoch` (noted before its
    /// session was looked at): kept unless a flush came since, or came
    /// after the keepalive that last confirmed it was sent.
    pub fn recycled(&mut self, ttl_secs: u32, tag: Option<LeaseTag>, epoch: u64, spare: Spare) {
        let confirmed_since = (self.flushed_at).is_none_or(|at| spare.granted.sent_at > at);
        if epoch == self.epoch && confirmed_since {
            let pool = self.pools.entry((ttl_secs, tag)).or_default();
            pool.recycled.push_back(spare);
        }
    }

    /// The flush count, for [`Ledger::recycled`].
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Drops every spare ready, and those whose grants are still on their
    /// way: a lease the router believed alive was found gone at `now`, and
    /// leases granted or renewed before that moment may be gone with it
    /// (etcd's lease bugs, an operator's revoke). Returns how many were
    /// dropped.
    pub fn flush(&mut self, now: Instant) -> usize {
        self.epoch += 1;
        self.flushed_at = Some(now);
        self.pools
            .values_mut()
            .map(|pool| {
                let recycled = std::mem::take(&mut pool.recycled).len();
                std::mem::take(&mut pool.ready).len() + recycled
            })
            .sum()
    }

    /// Forgets pools with nothing ready, pending or needed lately; returns
    /// the spares dropped as too old.
    pub fn sweep(&mut self, now: Instant) -> usize {
        let mut dropped = 0;
        self.pools.retain(|(ttl, _), pool| {
            dropped += pool.age(*ttl, now);
            !pool.is_idle()
        });
        dropped
    }
}

/// A shard's spares: the ledger, and the grants it asks for.
pub struct Spares {
    ledger: Arc<Mutex<Ledger>>,
    conn: EtcdConn,
    cancel: CancellationToken,
}

impl Spares {
    pub fn new(conn: EtcdConn, cancel: CancellationToken) -> Self {
        Self {
            ledger: Default::default(),
            conn,
            cancel,
        }
    }

    /// A fresh spare for a session of `ttl_secs` and `tag` starting now, if
    /// one is ready; sends the grants the pool then wants, in the
    /// background.
    pub fn take(&self, ttl_secs: u32, tag: Option<LeaseTag>) -> Option<Spare> {
        let now = Instant::now();
        let take = self.ledger().take(ttl_secs, tag, now);
        let shard = self.conn.shard();
        crate::metrics::spare_leases(shard, "expired", take.dropped);
        crate::metrics::spare_leases(shard, "used", usize::from(take.spare.is_some()));
        let epoch = take.epoch;
        for _ in 0..take.grant {
            let (conn, ledger) = (self.conn.clone(), self.ledger.clone());
            let cancel = self.cancel.clone();
            tokio::spawn(async move {
                let grant = tokio::select! {
                    granted = grant_lease(&conn, ttl_secs, tag) => granted.ok(),
                    _ = cancel.cancelled() => None,
                };
                if grant.is_some() {
                    crate::metrics::spare_leases(conn.shard(), "granted", 1);
                }
                let mut ledger = ledger.lock().expect("spares lock");
                let spare = grant.map(|(id, granted)| Spare { id, granted });
                ledger.granted(ttl_secs, tag, epoch, spare);
            });
        }
        take.spare
    }

    /// What each TTL and tag would take of idle sessions' leases now
    /// ([`Ledger::wanted_recycled`]), and the flush count to hand them on
    /// under.
    pub fn wanted_recycled(&self) -> (u64, Vec<(Key, usize)>) {
        let mut ledger = self.ledger();
        let epoch = ledger.epoch();
        (epoch, ledger.wanted_recycled(Instant::now()))
    }

    /// An idle session's lease, handed on ([`Ledger::recycled`]).
    pub fn recycled(&self, (ttl_secs, tag): Key, epoch: u64, spare: Spare) {
        self.ledger().recycled(ttl_secs, tag, epoch, spare);
        crate::metrics::spare_leases(self.conn.shard(), "recycled", 1);
    }

    /// A lease believed alive was found gone: no spare granted before now,
    /// nor idle session's lease last confirmed before now, is handed out
    /// ([`Ledger::flush`], [`Ledger::recycled`]).
    pub fn flush(&self) {
        let dropped = self.ledger().flush(Instant::now());
        crate::metrics::spare_leases(self.conn.shard(), "expired", dropped);
    }

    /// Forgets what is no longer needed (with the session sweep).
    pub fn sweep(&self) {
        let dropped = self.ledger().sweep(Instant::now());
        crate::metrics::spare_leases(self.conn.shard(), "expired", dropped);
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().expect("spares lock")
    }
}

/// The most emptied entry leases a shard keeps for its next waiters.
const MOST_KEPT: usize = 64;

/// Entry leases that a grant txn emptied, kept for the shard's next
/// waiters. Nothing renews them here: one that no waiter takes lapses in
/// etcd within its TTL, and one is handed out only while at least half
/// its TTL is left by its last confirmed renewal, from which its waiter
/// goes on renewing it.
#[derive(Default)]
pub struct EmptiedLeases(Mutex<VecDeque<Spare>>);

impl EmptiedLeases {
    /// Keeps `lease`, whose one key a granted txn deleted (the newest
    /// [`MOST_KEPT`] only).
    pub fn keep(&self, lease: Spare) {
        let mut kept = self.kept();
        if kept.len() == MOST_KEPT {
            kept.pop_front();
        }
        kept.push_back(lease);
    }

    /// The most recently kept lease with at least half its TTL left at
    /// `now`; those with less are dropped.
    pub fn take(&self, now: Instant) -> Option<Spare> {
        let mut kept = self.kept();
        kept.retain(|l| {
            let half = Duration::from_millis(l.granted.ttl_secs.max(0) as u64 * 500);
            l.granted.deadline() >= now + half
        });
        kept.pop_back()
    }

    /// Drops every lease kept: one of this shard's leases ended early, and
    /// the rest may have gone with it.
    pub fn drop_all(&self) {
        self.kept().clear();
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, VecDeque<Spare>> {
        self.0.lock().expect("emptied entry leases lock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spare(id: i64, sent_at: Instant) -> Option<Spare> {
        Some(Spare {
            id,
            granted: Renewal {
                sent_at,
                ttl_secs: 30,
            },
        })
    }

    #[test]
    fn an_emptied_lease_goes_out_newest_first_and_only_with_half_its_ttl_left() {
        let kept = EmptiedLeases::default();
        let now = Instant::now();
        let lease = |id, ago_ms| Spare {
            id,
            granted: Renewal {
                sent_at: now - Duration::from_millis(ago_ms),
                ttl_secs: 5,
            },
        };
        kept.keep(lease(1, 0));
        kept.keep(lease(2, 2_000)); // 3 s of 5 left
        kept.keep(lease(3, 2_600)); // 2.4 s left: dropped, not handed out
        assert_eq!(kept.take(now).map(|l| l.id), Some(2));
        assert_eq!(kept.take(now).map(|l| l.id), Some(1));
        assert!(kept.take(now).is_none());
        // At most MOST_KEPT, the oldest dropped first.
        for id in 0..=MOST_KEPT as i64 {
            kept.keep(lease(id, 0));
        }
        let mut out = Vec::new();
        while let Some(l) = kept.take(now) {
            out.push(l.id);
        }
        assert_eq!(out.len(), MOST_KEPT);
        assert!(!out.contains(&0), "the oldest went first");
        // A lease found gone early drops every one kept.
        kept.keep(lease(7, 0));
        kept.drop_all();
        assert!(kept.take(now).is_none());
    }

    #[test]
    fn a_lone_session_gets_no_spare_and_wastes_none() {
        let mut ledger = Ledger::default();
        let t0 = Instant::now();
        for i in 0..5 {
            let take = ledger.take(30, None, t0 + WINDOW * 2 * i);
            assert!(take.spare.is_none(), "session {i}");
            assert_eq!((take.grant, take.dropped), (0, 0), "session {i}");
        }
    }

    #[test]
    fn a_stream_of_sessions_keeps_spares_ready_and_takes_them_in_order() {
        let mut ledger = Ledger::default();
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        assert_eq!(ledger.take(30, None, ms(0)).grant, 0);
        // A second within the window: one spare wanted.
        let take = ledger.take(30, None, ms(10));
        assert!(take.spare.is_none());
        assert_eq!(take.grant, 1);
        // While it is pending, a third wants two: one more.
        assert_eq!(ledger.take(30, None, ms(20)).grant, 1);
        ledger.granted(30, None, 0, spare(7, ms(21)));
        ledger.granted(30, None, 0, spare(8, ms(22)));
        // The fourth takes the older, and the pool wants three ready.
        let take = ledger.take(30, None, ms(30));
        assert_eq!(take.spare.map(|s| s.id), Some(7));
        assert_eq!(take.grant, 2, "three wanted, one ready");
        let take = ledger.take(30, None, ms(31));
        assert_eq!(take.spare.map(|s| s.id), Some(8));
        // Other TTLs and tags have pools of their own.
        assert!(ledger.take(10, None, ms(32)).spare.is_none());
        let tag = Some(LeaseTag::of("payments"));
        assert!(ledger.take(30, tag, ms(33)).spare.is_none());
    }

    #[test]
    fn spares_past_their_age_are_dropped_not_handed_out() {
        let mut ledger = Ledger::default();
        let t0 = Instant::now();
        ledger.take(30, None, t0);
        ledger.take(30, None, t0);
        ledger.granted(30, None, 0, spare(7, t0));
        let late = t0 + max_age(30) + Duration::from_millis(1);
        let take = ledger.take(30, None, late);
        assert!(take.spare.is_none());
        assert_eq!(take.dropped, 1);
        // A 2 s TTL keeps spares a fifth of a second at most.
        assert_eq!(max_age(2), Duration::from_millis(200));
        assert_eq!(max_age(30), Duration::from_secs(1));
    }

    #[test]
    fn a_failed_grant_frees_its_place_and_the_pool_is_capped() {
        let mut ledger = Ledger::default();
        let t0 = Instant::now();
        let mut asked = 0;
        for i in 0..100 {
            asked += ledger.take(30, None, t0 + Duration::from_micros(i)).grant;
        }
        assert_eq!(asked, MOST, "never more than MOST in flight or ready");
        for _ in 0..MOST {
            ledger.granted(30, None, 0, None);
        }
        assert_eq!(
            ledger.take(30, None, t0 + Duration::from_micros(100)).grant,
            MOST
        );
    }

    #[test]
    fn a_flush_drops_the_ready_spares_and_those_on_their_way() {
        let mut ledger = Ledger::default();
        let t0 = Instant::now();
        for _ in 0..4 {
            ledger.take(30, None, t0);
        }
        let sent = ledger.take(10, None, t0).epoch;
        ledger.granted(30, None, sent, spare(7, t0));
        assert_eq!(ledger.flush(t0), 1);
        // Granted before the flush, answered after it: not kept.
        ledger.granted(30, None, sent, spare(8, t0));
        let take = ledger.take(30, None, t0);
        assert!(take.spare.is_none());
        assert_eq!(take.epoch, sent + 1);
        // Grants sent after it are kept.
        ledger.granted(30, None, take.epoch, spare(9, t0));
        assert_eq!(ledger.take(30, None, t0).spare.map(|s| s.id), Some(9));
    }

    #[test]
    fn idle_pools_are_swept_and_their_old_spares_counted() {
        let mut ledger = Ledger::default();
        let t0 = Instant::now();
        ledger.take(30, None, t0);
        ledger.take(30, None, t0);
        ledger.granted(30, None, 0, spare(7, t0));
        assert_eq!(ledger.sweep(t0), 0);
        assert_eq!(ledger.pools.len(), 1);
        assert_eq!(ledger.sweep(t0 + Duration::from_secs(2)), 1);
        assert!(ledger.pools.is_empty());
    }

    #[test]
    fn idle_sessions_leases_are_wanted_as_sessions_start_and_taken_first() {
        let mut ledger = Ledger::default();
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        assert!(ledger.wanted_recycled(t0).is_empty(), "no session started");
        for i in 0..3 {
            ledger.take(30, None, ms(i * 300));
        }
        assert_eq!(ledger.wanted_recycled(ms(700)), [((30, None), 3)]);
        // Three started in the last second: two handed on, one more wanted.
        let epoch = ledger.epoch();
        ledger.recycled(30, None, epoch, spare(7, ms(700)).unwrap());
        ledger.recycled(30, None, epoch, spare(8, ms(700)).unwrap());
        assert_eq!(ledger.wanted_recycled(ms(700)), [((30, None), 1)]);
        // Taken before the fresh spares, and no grant sent while they last.
        ledger.granted(30, None, epoch, spare(9, ms(700)));
        let take = ledger.take(30, None, ms(701));
        assert_eq!((take.spare.map(|s| s.id), take.grant), (Some(7), 0));
        assert_eq!(ledger.take(30, None, ms(702)).spare.map(|s| s.id), Some(8));
        assert_eq!(ledger.take(30, None, ms(703)).spare.map(|s| s.id), Some(9));
    }

    #[test]
    fn idle_sessions_leases_too_close_to_their_end_or_older_than_a_flush_are_dropped() {
        let mut ledger = Ledger::default();
        let t0 = Instant::now();
        ledger.take(30, None, t0);
        let epoch = ledger.epoch();
        // Renewed 20 s before: 10 s left, a sixth of the TTL is 5 s.
        let renewed = t0.checked_sub(Duration::from_secs(20)).unwrap();
        ledger.recycled(30, None, epoch, spare(7, renewed).unwrap());
        assert_eq!(ledger.take(30, None, t0).spare.map(|s| s.id), Some(7));
        ledger.recycled(30, None, epoch, spare(8, renewed).unwrap());
        let late = t0 + Duration::from_secs(6);
        let take = ledger.take(30, None, late);
        assert!(take.spare.is_none());
        assert_eq!(take.dropped, 1, "4 s left: below a sixth");
        // Noted before a flush, handed on after it: not kept.
        ledger.flush(late);
        ledger.recycled(30, None, epoch, spare(9, late).unwrap());
        assert!(ledger.take(30, None, late).spare.is_none());
        // Noted after it, but last confirmed by a keepalive sent before it:
        // not kept; confirmed since: kept.
        let epoch = ledger.epoch();
        let after = late + Duration::from_millis(1);
        ledger.recycled(30, None, epoch, spare(10, late).unwrap());
        assert!(ledger.take(30, None, after).spare.is_none());
        ledger.recycled(30, None, epoch, spare(11, after).unwrap());
        assert_eq!(ledger.take(30, None, after).spare.map(|s| s.id), Some(11));
    }
}
