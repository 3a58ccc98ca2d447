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

/// A lease granted ahead of need, as its grant left it.
#[derive(Debug, Clone, Copy)]
pub struct Spare {
    pub id: i64,
    /// Its grant: sent when, and the TTL etcd granted.
    pub granted: Renewal,
}

/// What sessions of one TTL and tag started lately, and their spares.
#[derive(Default)]
struct Pool {
    ready: VecDeque<Spare>,
    /// Grants sent for this pool and not answered yet.
    pending: usize,
    /// When the sessions of the last [`WINDOW`] started.
    needs: VecDeque<Instant>,
}

impl Pool {
    /// Drops the spares too old to hand out at `now` and the session starts
    /// older than [`WINDOW`]; returns how many spares it dropped.
    fn age(&mut self, ttl_secs: u32, now: Instant) -> usize {
        let oldest = max_age(ttl_secs);
        let before = self.ready.len();
        self.ready
            .retain(|s| now.saturating_duration_since(s.granted.sent_at) <= oldest);
        self.needs
            .retain(|t| now.saturating_duration_since(*t) <= WINDOW);
        before - self.ready.len()
    }
}

type Key = (u32, Option<LeaseTag>);

/// Pure bookkeeping of the spares (no I/O): which to hand out, how many
/// to grant.
#[derive(Default)]
pub struct Ledger {
    pools: HashMap<Key, Pool>,
    /// Counts flushes: a grant sent before the last one is not kept.
    epoch: u64,
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
        // The oldest fresh one first: the rest stay fresh the longest.
        let spare = pool.ready.pop_front();
        let want = pool.needs.len().min(MOST);
        pool.needs.push_back(now);
        let grant = want.saturating_sub(pool.ready.len() + pool.pending);
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

    /// Drops every spare ready, and those whose grants are still on their
    /// way: a lease the router believed alive was found gone, and leases
    /// granted before that moment may be gone with it (etcd's lease bugs,
    /// an operator's revoke). Returns how many were dropped.
    pub fn flush(&mut self) -> usize {
        self.epoch += 1;
        self.pools
            .values_mut()
            .map(|pool| std::mem::take(&mut pool.ready).len())
            .sum()
    }

    /// Forgets pools with nothing ready, pending or needed lately; returns
    /// the spares dropped as too old.
    pub fn sweep(&mut self, now: Instant) -> usize {
        let mut dropped = 0;
        self.pools.retain(|(ttl, _), pool| {
            dropped += pool.age(*ttl, now);
            !(pool.ready.is_empty() && pool.pending == 0 && pool.needs.is_empty())
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

    /// A lease believed alive was found gone: no spare granted before now
    /// is handed out ([`Ledger::flush`]).
    pub fn flush(&self) {
        let dropped = self.ledger().flush();
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
        assert_eq!(ledger.flush(), 1);
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
}
