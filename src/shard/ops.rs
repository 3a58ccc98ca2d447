//! What the lock layer asks of a shard, as a trait: the lock-level
//! operations its decisions are made over (a session got or granted, a
//! grant on it, a look at a name, a lost holder's lock-delay, a check of
//! lock keys and a keepalive of their leases, a lock moved onto another
//! session, a release, a place in a name's queue as a [`QueueWaiter`] and
//! a count of the queue). [`Shard`]
//! implements it over etcd; the in-memory shard of the unit tests
//! (`fake.rs`) implements it over a map, so that every decision of
//! `locks/` can be tested without etcd.
//!
//! The lock layer is generic over it, never `dyn`: the real path compiles
//! to direct calls on [`Shard`], with no dispatch or allocation added per
//! request. The trait holds only what those decisions call; what only the
//! real shard does (its records, scans, caches' upkeep, the sweep of lost
//! holders) stays on [`Shard`] alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cache::{Entry, Held};
use super::conn::EtcdError;
use super::keepalive::Renewal;
use super::keys::{LockValue, NameHash, Stored};
use super::name::{AcquireTxn, Grantable, NameKeys, NameState, ReleaseTxn, SessionGrant};
use super::queue::{Awaited, Kept, Waiter, Woke};
use super::sessions::{SessionLease, SessionUse};
use super::Shard;
use crate::token::lease_tag::LeaseTag;

/// What a shard's lock-key cache counts for quotas: whether it counts a
/// grant yet, what a quota reservation waits for
/// ([`Shard::cache_has_seen`]), and what a principal holds on the shard
/// ([`Shard::held_by`]). Object-safe, so a reservation keeps its shard as
/// `Arc<dyn CacheCounts>` (a clone of the shard's `Arc`, no allocation).
pub trait CacheCounts: Send + Sync {
    fn cache_has_seen(&self, revision: i64) -> bool;

    fn held_by(&self, tag: LeaseTag) -> Option<Held>;
}

/// A shard as the lock layer's decisions use it. Each method is the
/// [`Shard`] method of the same name, which documents what it promises.
pub trait LockShard: CacheCounts + 'static {
    /// A place in a name's queue, held while a caller waits.
    type Waiter: QueueWaiter;

    fn name(&self) -> &str;

    /// Its series counted per request, by handle.
    fn metrics(&self) -> &crate::metrics::ShardMetrics;

    fn name_keys(&self, hash: &NameHash) -> NameKeys;

    fn verified_identity(&self) -> Option<Vec<u8>>;

    /// A hint that `hash`'s name is held ([`Shard::cache_shows_held`]).
    fn cache_shows_held(&self, hash: &NameHash) -> bool;

    /// [`Shard::grant_settled`].
    async fn grant_settled(&self, hash: &NameHash);

    /// [`Shard::grant_pending`].
    fn grant_pending(&self, hash: &NameHash) -> bool;

    async fn read_name(&self, k: &NameKeys) -> Result<NameState, EtcdError>;

    /// A read of what a grant txn cut off did ([`Shard::read_name_settled`]).
    async fn read_name_settled(&self, k: &NameKeys) -> Result<NameState, EtcdError>;

    fn cutoff(&self) -> i64;

    fn learn_cutoff(&self, mark: i64);

    async fn move_cutoff_past(&self, compared: i64) -> Result<(), EtcdError>;

    async fn session<E: From<EtcdError>>(
        &self,
        holder: &str,
        ttl_secs: u32,
        tag: Option<LeaseTag>,
        usage: SessionUse,
        admit: impl Fn() -> Result<(), E>,
    ) -> Result<SessionLease, E>;

    async fn grant_on_session(
        &self,
        k: &NameKeys,
        value: &LockValue,
        session: &SessionLease,
        window: Duration,
        g: &Grantable,
        replace_held: Option<i64>,
    ) -> Result<SessionGrant, EtcdError>;

    async fn renew_lease(
        &self,
        lease: i64,
        window: Duration,
        ttl_secs: u32,
    ) -> Result<Renewal, EtcdError>;

    async fn time_to_live(&self, lease: i64) -> Result<i64, EtcdError>;

    /// [`Shard::confirmed_renewal`].
    fn confirmed_renewal(&self, lease: i64) -> Option<Renewal>;

    async fn set_lock_delay(
        &self,
        k: &NameKeys,
        held: &Stored,
        identity: &[u8],
    ) -> Result<(Instant, bool), EtcdError>;

    async fn lock_entries(&self, hashes: &[NameHash]) -> Vec<Result<Option<Entry>, EtcdError>>;

    async fn renew_session(
        &self,
        lease: i64,
        window: Duration,
        ttl_secs: u32,
    ) -> Result<Renewal, EtcdError>;

    fn note_renewal(&self, took: Duration, budget: Duration, now: Instant) -> bool;

    async fn move_lock(
        &self,
        k: &NameKeys,
        was: (&Stored, Option<&Stored>),
        value: &LockValue,
        lease: i64,
        shard_was: (&[u8], i64),
    ) -> Result<bool, EtcdError>;

    async fn release_txn(
        &self,
        k: &NameKeys,
        revision: i64,
        lease: i64,
    ) -> Result<ReleaseTxn, EtcdError>;

    async fn session_gone(&self, holder: &str, session: &SessionLease, vouched: bool);

    async fn keep_session(
        &self,
        holder: &str,
        session: &SessionLease,
        window: Duration,
    ) -> Result<Option<Renewal>, EtcdError>;

    async fn enqueue(
        self: &Arc<Self>,
        k: NameKeys,
        holder: &str,
        session: SessionLease,
    ) -> Result<Self::Waiter, EtcdError>;

    async fn queue_len(&self, k: &NameKeys) -> Result<u64, EtcdError>;
}

/// A waiter in a name's queue as the lock layer's wait uses it. Each
/// method is the [`Waiter`] method of the same name. Dropping it leaves
/// the queue.
pub trait QueueWaiter: Send {
    fn keys(&self) -> &NameKeys;

    fn session(&self) -> &SessionLease;

    async fn keep_alive(
        &mut self,
        holder: &str,
        window: impl Fn(u32) -> Duration,
    ) -> Result<Kept, EtcdError>;

    fn set_session(&mut self, session: SessionLease);

    /// [`Waiter::found_ahead`].
    fn found_ahead(&mut self) -> Option<(Stored, Option<Stored>)>;

    async fn grant(
        &mut self,
        value: &LockValue,
        g: &Grantable,
        replace_held: Option<i64>,
        look_first: bool,
    ) -> Result<AcquireTxn, EtcdError>;

    async fn sleep(&mut self, awaited: Awaited, deadline: Instant) -> Result<Woke, EtcdError>;
}

impl QueueWaiter for Waiter {
    fn keys(&self) -> &NameKeys {
        Waiter::keys(self)
    }

    fn session(&self) -> &SessionLease {
        Waiter::session(self)
    }

    async fn keep_alive(
        &mut self,
        holder: &str,
        window: impl Fn(u32) -> Duration,
    ) -> Result<Kept, EtcdError> {
        Waiter::keep_alive(self, holder, window).await
    }

    fn set_session(&mut self, session: SessionLease) {
        Waiter::set_session(self, session)
    }

    fn found_ahead(&mut self) -> Option<(Stored, Option<Stored>)> {
        Waiter::found_ahead(self)
    }

    async fn grant(
        &mut self,
        value: &LockValue,
        g: &Grantable,
        replace_held: Option<i64>,
        look_first: bool,
    ) -> Result<AcquireTxn, EtcdError> {
        Waiter::grant(self, value, g, replace_held, look_first).await
    }

    async fn sleep(&mut self, awaited: Awaited, deadline: Instant) -> Result<Woke, EtcdError> {
        Waiter::sleep(self, awaited, deadline).await
    }
}

impl CacheCounts for Shard {
    fn cache_has_seen(&self, revision: i64) -> bool {
        Shard::cache_has_seen(self, revision)
    }

    fn held_by(&self, tag: LeaseTag) -> Option<Held> {
        Shard::held_by(self, tag)
    }
}

impl LockShard for Shard {
    type Waiter = Waiter;

    fn name(&self) -> &str {
        Shard::name(self)
    }

    fn metrics(&self) -> &crate::metrics::ShardMetrics {
        Shard::metrics(self)
    }

    fn name_keys(&self, hash: &NameHash) -> NameKeys {
        Shard::name_keys(self, hash)
    }

    fn verified_identity(&self) -> Option<Vec<u8>> {
        Shard::verified_identity(self)
    }

    fn cache_shows_held(&self, hash: &NameHash) -> bool {
        Shard::cache_shows_held(self, hash)
    }

    async fn grant_settled(&self, hash: &NameHash) {
        Shard::grant_settled(self, hash).await
    }

    fn grant_pending(&self, hash: &NameHash) -> bool {
        Shard::grant_pending(self, hash)
    }

    async fn read_name(&self, k: &NameKeys) -> Result<NameState, EtcdError> {
        Shard::read_name(self, k).await
    }

    async fn read_name_settled(&self, k: &NameKeys) -> Result<NameState, EtcdError> {
        Shard::read_name_settled(self, k).await
    }

    fn cutoff(&self) -> i64 {
        Shard::cutoff(self)
    }

    fn learn_cutoff(&self, mark: i64) {
        Shard::learn_cutoff(self, mark)
    }

    async fn move_cutoff_past(&self, compared: i64) -> Result<(), EtcdError> {
        Shard::move_cutoff_past(self, compared).await
    }

    async fn session<E: From<EtcdError>>(
        &self,
        holder: &str,
        ttl_secs: u32,
        tag: Option<LeaseTag>,
        usage: SessionUse,
        admit: impl Fn() -> Result<(), E>,
    ) -> Result<SessionLease, E> {
        Shard::session(self, holder, ttl_secs, tag, usage, admit).await
    }

    async fn grant_on_session(
        &self,
        k: &NameKeys,
        value: &LockValue,
        session: &SessionLease,
        window: Duration,
        g: &Grantable,
        replace_held: Option<i64>,
    ) -> Result<SessionGrant, EtcdError> {
        Shard::grant_on_session(self, k, value, session, window, g, replace_held).await
    }

    async fn renew_lease(
        &self,
        lease: i64,
        window: Duration,
        ttl_secs: u32,
    ) -> Result<Renewal, EtcdError> {
        Shard::renew_lease(self, lease, window, ttl_secs).await
    }

    async fn time_to_live(&self, lease: i64) -> Result<i64, EtcdError> {
        Shard::time_to_live(self, lease).await
    }

    fn confirmed_renewal(&self, lease: i64) -> Option<Renewal> {
        Shard::confirmed_renewal(self, lease)
    }

    async fn set_lock_delay(
        &self,
        k: &NameKeys,
        held: &Stored,
        identity: &[u8],
    ) -> Result<(Instant, bool), EtcdError> {
        Shard::set_lock_delay(self, k, held, identity).await
    }

    async fn lock_entries(&self, hashes: &[NameHash]) -> Vec<Result<Option<Entry>, EtcdError>> {
        Shard::lock_entries(self, hashes).await
    }

    async fn renew_session(
        &self,
        lease: i64,
        window: Duration,
        ttl_secs: u32,
    ) -> Result<Renewal, EtcdError> {
        Shard::renew_session(self, lease, window, ttl_secs).await
    }

    fn note_renewal(&self, took: Duration, budget: Duration, now: Instant) -> bool {
        Shard::note_renewal(self, took, budget, now)
    }

    async fn move_lock(
        &self,
        k: &NameKeys,
        was: (&Stored, Option<&Stored>),
        value: &LockValue,
        lease: i64,
        shard_was: (&[u8], i64),
    ) -> Result<bool, EtcdError> {
        Shard::move_lock(self, k, was, value, lease, shard_was).await
    }

    async fn release_txn(
        &self,
        k: &NameKeys,
        revision: i64,
        lease: i64,
    ) -> Result<ReleaseTxn, EtcdError> {
        Shard::release_txn(self, k, revision, lease).await
    }

    async fn session_gone(&self, holder: &str, session: &SessionLease, vouched: bool) {
        Shard::session_gone(self, holder, session, vouched).await
    }

    async fn keep_session(
        &self,
        holder: &str,
        session: &SessionLease,
        window: Duration,
    ) -> Result<Option<Renewal>, EtcdError> {
        Shard::keep_session(self, holder, session, window).await
    }

    async fn enqueue(
        self: &Arc<Self>,
        k: NameKeys,
        holder: &str,
        session: SessionLease,
    ) -> Result<Waiter, EtcdError> {
        Shard::enqueue(self, k, holder, session).await
    }

    async fn queue_len(&self, k: &NameKeys) -> Result<u64, EtcdError> {
        Shard::queue_len(self, k).await
    }
}
