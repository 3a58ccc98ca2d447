//! A shard: one etcd cluster, and every etcd call lockrouter makes to it.
//!
//! The layers above see a [`Shard`] only through its methods, which speak
//! locks: grant a name on a client's session, keep a session alive or
//! forget it, check and renew locks, release, queue and wait, read and
//! write the shard's own records. Its fields are private to this module,
//! so no layer above names its connection, its keys, its caches or its
//! background helpers, and none makes an etcd call of its own; what to do
//! with an answer (retry, wait, refuse, which quota applies) is theirs.
//!
//! Besides its connection ([`conn`], with the TLS and etcd user of
//! [`access`], whose tokens [`login`] keeps, over the HTTP/2 transport of
//! `wire.rs`: one connection per member), a shard owns the background
//! helpers that make the hot paths cheap (the multiplexed keepalive stream
//! in [`keepalive`], the lock-key cache renewals consult in [`cache`], batched
//! verification for when the cache cannot vouch in [`verify`], the
//! session-lease cache in [`sessions`] and the leases granted ahead of
//! new sessions in [`spares`], which idle sessions' leases join in
//! [`recycle`], the group commit of grants and
//! releases in [`commit`], the grant cut-off in [`cutoff`], the renewal latency that sheds acquires first in
//! [`pressure`]), the ring state it last read from etcd, and the
//! shard identity it verified (`P/shard`, see [`keys`]). Every grant
//! compares both byte for byte, so a router whose ring differs from the
//! shard's, or whose endpoints for this shard reach another cluster, can
//! never grant here.
//!
//! The calls themselves: [`name`] builds the txns of one lock name as
//! values and says how their answers read, `txn.rs` holds the calls on one
//! lock name (the grant on a client's session, releases, lost holders),
//! [`leases`] those on leases (a client's session lease, got or granted
//! with a quota's hook, kept alive, forgotten; a keepalive of any lease),
//! [`renewal`] what a renewal asks (that lock keys are still theirs, the
//! keepalive of the sessions they ride on), `records.rs` the calls on the
//! shard's own records (ring, identity, epoch reservation) and the identity
//! check, `scan.rs` the paged range reads (counts, moved names, the sweep
//! of lost holders) on the paging of `pages.rs` (which also keeps where the
//! paced sweep is), and [`queue`] the queue of waiting acquires of a name
//! (a waiter's entry, the grant at its head, the watch a waiter sleeps on).
//!
//! [`ops`] is what the lock layer's decisions ask of a shard, as a trait
//! ([`LockShard`](ops::LockShard)) that [`Shard`] implements over etcd and
//! the unit tests' in-memory shard (`fake.rs`) over a map.

use std::sync::RwLock;
use std::time::Duration;

use etcd_client::{LeaseTimeToLiveOptions, Txn, TxnResponse};
use tokio_util::sync::CancellationToken;

pub mod access;
mod cache;
mod commit;
pub mod conn;
mod cutoff;
#[cfg(test)]
pub(crate) mod fake;
mod keepalive;
pub mod keys;
mod leases;
pub mod login;
pub mod name;
pub mod ops;
mod pages;
mod pressure;
pub mod queue;
mod records;
mod recycle;
mod renewal;
mod scan;
mod sessions;
mod spares;
mod txn;
mod verify;
mod wire;

use crate::token::lease_tag::LeaseTag;
use cache::LockCache;
pub use cache::{Entry, Held};
use commit::Committer;
use conn::{EtcdConn, EtcdError};
use keepalive::Keepalive;
pub use keepalive::{KeepaliveSettings, Renewal};
use keys::{Identity, Keys, NameHash, Recorded, Reservation, Stored};
pub use name::{AcquireTxn, Grantable, NameKeys, NameState, ReleaseTxn, SessionGrant};
pub use pressure::{AcquireSlot, Busy};
use sessions::Sessions;
pub use sessions::{SessionLease, SessionUse};
use verify::{IdentityCell, Verifier};

/// What this router knows of the ring recorded on the shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingState {
    /// Not read yet (the shard has not answered).
    Unknown,
    /// The shard has no ring recorded yet.
    Absent,
    /// The shard records this router's ring: grants allowed.
    Ready(Recorded),
    /// The shard records another ring: grants refused.
    Mismatch(Recorded),
    /// The cluster behind this shard's endpoints is not this shard as it
    /// was verified: grants, renewals and releases refused.
    Identity(IdentityProblem),
}

/// Why a shard's identity does not match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityProblem {
    /// The cluster at this replica's endpoints is another shard (or its
    /// identity record is unreadable): this replica's config is wrong.
    OtherShard(String),
    /// This shard's data, answering from another etcd cluster (restored
    /// from a snapshot, copied): the same for every replica, until the
    /// epoch is bumped.
    OtherCluster(String),
}

impl IdentityProblem {
    pub fn detail(&self) -> &str {
        match self {
            Self::OtherShard(d) | Self::OtherCluster(d) => d,
        }
    }
}

/// An identity record as read: parsed with its bytes, or unreadable bytes.
pub type ReadIdentity = Result<(Identity, Vec<u8>), Vec<u8>>;

/// One read of the shard-level keys, with the cluster id that answered.
#[derive(Debug, Clone)]
pub struct Probe {
    pub ring: Option<Recorded>,
    /// The identity record and its bytes; `Err` holds unreadable bytes.
    pub identity: Option<ReadIdentity>,
    pub reservation: Option<(Reservation, Vec<u8>)>,
    pub cluster_id: u64,
}

impl Probe {
    /// The highest epoch this shard says may have been used.
    pub fn top_epoch(&self) -> u64 {
        let ring = self.ring.as_ref().map_or(0, |r| r.meta.epoch);
        let reserved = self.reservation.as_ref().map_or(0, |(r, _)| r.epoch);
        ring.max(reserved)
    }
}

/// What a ring replacement must also hold for.
pub struct RingGuard {
    /// `P/epoch` must still hold these bytes (the writer's reservation).
    pub reservation: Option<Vec<u8>>,
    pub identity: IdentityGuard,
}

pub enum IdentityGuard {
    /// `P/shard` must hold these bytes.
    Verified(Vec<u8>),
    /// `P/shard` must not exist; it is written with the ring.
    Create(Vec<u8>),
    /// `P/shard` must hold the first bytes; the second replace them (a
    /// shard restored into another etcd cluster: the bump records the
    /// cluster that now answers).
    Replace(Vec<u8>, Vec<u8>),
}

impl IdentityGuard {
    /// The identity bytes the shard records once the change went through.
    pub fn new_bytes(&self) -> Vec<u8> {
        match self {
            IdentityGuard::Verified(b)
            | IdentityGuard::Create(b)
            | IdentityGuard::Replace(_, b) => b.clone(),
        }
    }
}

/// One etcd cluster, as the layers above see it: the lock-level calls on
/// it (grants, renewals, releases, the waiting queue, its records), never
/// its parts. Every field is private to this module.
pub struct Shard {
    /// The shard's name in the ring.
    name: String,
    /// Every etcd call goes through it (deadlines, error classes, health).
    conn: EtcdConn,
    /// Where lockrouter's keys live under the configured prefix.
    keys: Keys,
    /// Coalesced keepalives of every lease the router renews here.
    keepalive: Keepalive,
    /// Batched reads of lock keys, for when `cache` cannot vouch.
    verifier: Verifier,
    /// The lock keys, for renewals (falls back to `verifier`).
    cache: LockCache,
    /// Group commit of grants and releases.
    committer: Committer,
    /// Each client's session lease per TTL, shared by its acquires.
    sessions: Sessions,
    /// Leases granted ahead of need while new sessions come often.
    spares: spares::Spares,
    /// Queue entries' leases that a grant emptied, for the next waiters.
    entry_leases: spares::EmptiedLeases,
    /// std `RwLock`: read on every acquire, written by the monitor, never
    /// held across an await.
    ring: RwLock<RingState>,
    /// The identity bytes the monitor verified (name and cluster id match).
    identity: IdentityCell,
    /// Acquires (and inspects) of this shard's names in flight in this
    /// replica: bounded, so one slow shard cannot take every slot.
    acquiring: std::sync::atomic::AtomicUsize,
    /// Its renewals' recent latency: acquires are shed first.
    pressure: pressure::Pressure,
    /// Where the paced sweep of lost holders is.
    sweep: std::sync::Mutex<pages::Sweep>,
    /// The grant cut-off this replica last saw, and the turn to move it.
    cutoff: std::sync::Arc<cutoff::Cutoff>,
    /// The passes that hand idle sessions' leases on to new sessions, once
    /// started ([`recycle`]).
    recycling: std::sync::OnceLock<crate::task::TaskGuard>,
}

impl Shard {
    /// `keepalive`: how its keepalives go out (bursts, streams);
    /// `barrier_spacing`: the least time between its cache's barriers;
    /// `hand_on`: whether idle sessions' leases go to new sessions
    /// ([`recycle`]).
    pub fn start(
        conn: EtcdConn,
        prefix: &str,
        keepalive: KeepaliveSettings,
        barrier_spacing: Duration,
        hand_on: bool,
        cancel: &CancellationToken,
    ) -> std::sync::Arc<Self> {
        let shard =
            std::sync::Arc::new(Self::new(conn, prefix, keepalive, barrier_spacing, cancel));
        if hand_on {
            shard.start_recycling(cancel.child_token());
        }
        shard
    }

    fn new(
        conn: EtcdConn,
        prefix: &str,
        keepalive: KeepaliveSettings,
        barrier_spacing: Duration,
        cancel: &CancellationToken,
    ) -> Self {
        let keys = Keys::new(prefix);
        let identity = IdentityCell::default();
        Self {
            name: conn.shard().to_string(),
            keepalive: Keepalive::start(conn.clone(), keepalive, cancel.child_token()),
            verifier: Verifier::start(
                conn.clone(),
                keys.identity(),
                identity.clone(),
                cancel.child_token(),
            ),
            cache: LockCache::start(
                conn.clone(),
                keys.clone(),
                identity.clone(),
                barrier_spacing,
                cancel,
            ),
            committer: Committer::start(conn.clone(), keys.clone(), cancel),
            keys,
            sessions: Sessions::default(),
            spares: spares::Spares::new(conn.clone(), cancel.child_token()),
            entry_leases: Default::default(),
            ring: RwLock::new(RingState::Unknown),
            identity,
            conn,
            acquiring: std::sync::atomic::AtomicUsize::new(0),
            pressure: Default::default(),
            sweep: Default::default(),
            cutoff: Default::default(),
            recycling: Default::default(),
        }
    }

    /// The shard's name in the ring.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the shard answered its last call.
    pub fn is_up(&self) -> bool {
        self.conn.is_up()
    }

    /// The shard's hot metric series.
    pub fn metrics(&self) -> &crate::metrics::ShardMetrics {
        self.conn.metrics()
    }

    /// Once per connection: logs the etcd release that answers, and warns
    /// of one with known bugs (see [`conn::release_risk`]).
    pub async fn check_version(&self) {
        self.conn.check_version().await
    }

    /// A place for one more acquire of this shard's names, unless the
    /// shard sheds acquires at `now` (its renewals are slow) or `bound`
    /// acquires are in flight on it already.
    pub fn admit_acquire(
        &self,
        bound: usize,
        now: std::time::Instant,
    ) -> Result<AcquireSlot<'_>, Busy> {
        if self.pressure.shedding(now) {
            return Err(Busy::Shedding);
        }
        AcquireSlot::take(&self.acquiring, bound).map_err(Busy::Full)
    }

    /// Whether the cache shows `hash`'s name held now, or this router
    /// granted it since what the cache has applied: a hint with no barrier,
    /// which may be stale either way (an acquire reads such a name before
    /// it writes; the txn decides).
    pub fn cache_shows_held(&self, hash: &NameHash) -> bool {
        self.cache.shows_held(hash)
    }

    /// Returns once no grant txn of `hash`'s name that this router had in
    /// flight is in flight any more (then the name looks held if it was
    /// granted): acquires of a contended name wait for the one in flight
    /// instead of each sending a txn that would fail.
    pub async fn grant_settled(&self, hash: &NameHash) {
        self.cache.grant_settled(hash).await
    }

    /// Whether this router has a grant of `hash`'s name in flight, or made
    /// one the cache has not applied yet: a name read as free a moment ago
    /// may be taken by now.
    pub fn grant_pending(&self, hash: &NameHash) -> bool {
        self.cache.grant_pending(hash)
    }

    /// Whether the cache has applied every change up to `revision` (its
    /// counts included).
    pub fn cache_has_seen(&self, revision: i64) -> bool {
        self.cache.applied() >= revision
    }

    /// What the principal of `tag` holds on the shard, as the cache counts
    /// it now; `None` while it cannot (loading, or its watch broke).
    pub fn held_by(&self, tag: LeaseTag) -> Option<Held> {
        self.cache.held(tag)
    }

    /// Lock keys on the shard as the cache counts them, while it vouches.
    pub fn cached_locks(&self) -> Option<usize> {
        self.cache.len()
    }

    pub fn ring_state(&self) -> RingState {
        self.ring.read().expect("ring lock").clone()
    }

    pub fn set_ring_state(&self, state: RingState) {
        *self.ring.write().expect("ring lock") = state;
    }

    /// The identity bytes verified on this shard, if any.
    pub fn verified_identity(&self) -> Option<Vec<u8>> {
        self.identity.read().expect("identity lock").clone()
    }

    pub fn set_verified_identity(&self, bytes: Option<Vec<u8>>) {
        *self.identity.write().expect("identity lock") = bytes;
    }

    pub fn name_keys(&self, hash: &NameHash) -> NameKeys {
        NameKeys::new(&self.keys, hash)
    }

    /// Linearizable read of one key.
    async fn get(&self, key: &[u8]) -> Result<Option<Stored>, EtcdError> {
        let mut kv = self.conn.client().kv_client();
        let mut resp = self.conn.call("Range", kv.get(key, None)).await?;
        Ok(resp.take_kvs().into_iter().next().map(Stored::from))
    }

    /// Seconds the lease has left (rounded down by etcd); 0 if it is gone.
    pub async fn time_to_live(&self, lease: i64) -> Result<i64, EtcdError> {
        let mut client = self.conn.client().lease_client();
        let call = client.time_to_live(lease, Some(LeaseTimeToLiveOptions::new()));
        match self.conn.call("LeaseTimeToLive", call).await {
            Ok(resp) => Ok(resp.ttl().max(0)),
            Err(EtcdError::LeaseNotFound) => Ok(0),
            Err(e) => Err(e),
        }
    }

    /// Revokes a lease (a waiter's own lease when its wait ends).
    async fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        let mut client = self.conn.client().lease_client();
        match self.conn.call("LeaseRevoke", client.revoke(lease)).await {
            Ok(_) | Err(EtcdError::LeaseNotFound) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, EtcdError> {
        let mut kv = self.conn.client().kv_client();
        self.conn.call("Txn", kv.txn(txn)).await
    }
}

/// What a shard's recorded ring means to a router serving `fingerprint`.
pub fn classify(found: Option<Recorded>, fingerprint: &str) -> RingState {
    match found {
        None => RingState::Absent,
        Some(r) if r.meta.ring == fingerprint => RingState::Ready(r),
        Some(r) => RingState::Mismatch(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keys::{Reservation, RingMeta};

    fn recorded(epoch: u64, fingerprint: &str) -> Recorded {
        Recorded::new(RingMeta {
            epoch,
            ring: fingerprint.into(),
            previous: None,
        })
    }

    #[test]
    fn only_a_recorded_ring_with_our_fingerprint_is_ready() {
        assert_eq!(classify(None, "r1"), RingState::Absent);
        assert!(
            matches!(classify(Some(recorded(3, "r1")), "r1"), RingState::Ready(r) if r.meta.epoch == 3)
        );
        assert!(matches!(
            classify(Some(recorded(3, "r2")), "r1"),
            RingState::Mismatch(_)
        ));
    }

    #[test]
    fn the_top_epoch_counts_reservations_never_used() {
        let probe = |ring: Option<u64>, reserved: Option<u64>| Probe {
            ring: ring.map(|e| recorded(e, "r")),
            identity: None,
            reservation: reserved.map(|epoch| {
                (
                    Reservation {
                        epoch,
                        by: "x".into(),
                    },
                    Vec::new(),
                )
            }),
            cluster_id: 1,
        };
        assert_eq!(probe(None, None).top_epoch(), 0);
        assert_eq!(probe(Some(4), None).top_epoch(), 4);
        // A reservation above the ring: an opening that crashed before its
        // ring write; its epoch may have been used elsewhere.
        assert_eq!(probe(Some(4), Some(7)).top_epoch(), 7);
        assert_eq!(probe(Some(9), Some(7)).top_epoch(), 9);
    }
}
