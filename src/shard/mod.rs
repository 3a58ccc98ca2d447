//! A shard: one etcd cluster, and every etcd txn lockrouter runs on it.
//!
//! Besides its connection, a shard owns the background helpers that make the
//! hot paths cheap (the multiplexed keepalive stream, batched verification,
//! the session-lease cache), the ring state it last read from etcd, and the
//! shard identity it verified (`P/shard`, see `keys.rs`). Every grant
//! compares both byte for byte, so a router whose ring differs from the
//! shard's, or whose endpoints for this shard reach another cluster, can
//! never grant here.

use std::sync::{Arc, RwLock};

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, LeaseTimeToLiveOptions, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use tokio_util::sync::CancellationToken;

pub mod conn;
pub mod keepalive;
pub mod keys;
pub mod sessions;
pub mod verify;

use conn::{EtcdConn, EtcdError};
use keepalive::Keepalive;
use keys::{HeldValue, Identity, Keys, LockValue, NameHash, Recorded, Reservation};
use sessions::Sessions;
use verify::Verifier;

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

/// The verified identity bytes, shared with the verifier (which checks them
/// on every batch of renewals).
pub type IdentityCell = Arc<RwLock<Option<Vec<u8>>>>;

/// What a grant compares: the ring and the identity the router verified.
#[derive(Debug, Clone)]
pub struct Grantable {
    pub ring: Recorded,
    pub identity: Vec<u8>,
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

/// The keys of one name on one shard.
#[derive(Debug, Clone)]
pub struct NameKeys {
    pub hash: NameHash,
    pub lock: Vec<u8>,
    pub held: Vec<u8>,
    pub delay: Vec<u8>,
    /// Prefix of the name's queue of waiters.
    pub waiters: Vec<u8>,
}

/// Outcome of a grant txn (plain or at the head of the queue).
#[derive(Debug)]
pub enum AcquireTxn {
    /// The key was created at this revision (the token's low bits).
    Granted { revision: i64 },
    /// Someone (maybe the caller itself) holds the name.
    Held(KeyValue),
    /// The name waits out a lost holder's lock-delay (this key's lease).
    Delayed(KeyValue),
    /// The holder was lost (its lease ended) and no lock-delay was set yet:
    /// this is its held record.
    Lost(KeyValue),
    /// Nobody holds it, but callers are queued for it (no barging).
    Queued,
    /// A waiter's own entry is gone (its lease ended).
    Gone,
    /// A waiter must wait for this key (the entry ahead of it) to go; the
    /// name's holder, if any, is given too.
    Behind(Vec<u8>, Option<KeyValue>),
    /// The shard's ring is not the one the router compared against.
    RingChanged(Option<Recorded>),
    /// The shard's identity is not the one the router verified.
    IdentityChanged,
}

/// What a lock name looks like on a shard (one read-only txn).
#[derive(Debug, Default)]
pub struct NameState {
    pub lock: Option<KeyValue>,
    pub held: Option<KeyValue>,
    pub delay: Option<KeyValue>,
    pub ring: Option<Recorded>,
    pub identity: Option<Vec<u8>>,
}

/// A waiter's queue entry, for the head-of-queue grant.
pub struct QueueHead<'a> {
    pub key: &'a [u8],
    pub revision: i64,
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

pub struct Shard {
    pub name: String,
    pub conn: EtcdConn,
    pub keys: Keys,
    pub keepalive: Keepalive,
    pub verifier: Verifier,
    pub sessions: Sessions,
    /// std `RwLock`: read on every acquire, written by the monitor, never
    /// held across an await.
    ring: RwLock<RingState>,
    /// The identity bytes the monitor verified (name and cluster id match).
    identity: IdentityCell,
}

impl Shard {
    pub fn new(conn: EtcdConn, prefix: &str, cancel: &CancellationToken) -> Self {
        let keys = Keys::new(prefix);
        let identity = IdentityCell::default();
        Self {
            name: conn.shard().to_string(),
            keepalive: Keepalive::start(conn.clone(), cancel.child_token()),
            verifier: Verifier::start(
                conn.clone(),
                keys.identity(),
                identity.clone(),
                cancel.child_token(),
            ),
            keys,
            sessions: Sessions::default(),
            ring: RwLock::new(RingState::Unknown),
            identity,
            conn,
        }
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
        NameKeys {
            hash: *hash,
            lock: self.keys.lock(hash),
            held: self.keys.held(hash),
            delay: self.keys.delay(hash),
            waiters: self.keys.waiters(hash),
        }
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, EtcdError> {
        let mut kv = self.conn.client().kv_client();
        self.conn.call("Txn", kv.txn(txn)).await
    }

    /// Grants the name to `lease` if nobody holds it, no lock-delay or lost
    /// holder is pending, nobody is queued, and the shard still records
    /// `g`'s ring and identity; otherwise reads why not. `replace_held`:
    /// the mod revision of a lost holder's held record to overwrite (only
    /// when lock-delay is off).
    pub async fn acquire_txn(
        &self,
        k: &NameKeys,
        value: &LockValue,
        lease: i64,
        g: &Grantable,
        replace_held: Option<i64>,
    ) -> Result<AcquireTxn, EtcdError> {
        let mut when = self.grant_compares(k, g, replace_held);
        // No queued waiter: an empty range compares as revision 0.
        when.push(Compare::create_revision(k.waiters.clone(), CompareOp::Equal, 0).with_prefix());
        let txn = Txn::new()
            .when(when)
            .and_then(grant_ops(k, value, lease))
            .or_else(self.name_reads(k));
        let resp = self.txn(txn).await?;
        if resp.succeeded() {
            return Ok(AcquireTxn::Granted {
                revision: revision(&resp),
            });
        }
        Ok(classify_refusal(read_name(resp), g).unwrap_or(AcquireTxn::Queued))
    }

    /// Grants the name to the waiter `mine` if it is first in the queue and
    /// the name is grantable (as [`acquire_txn`](Self::acquire_txn)),
    /// deleting its entry; otherwise says what it waits for.
    pub async fn head_grant_txn(
        &self,
        k: &NameKeys,
        value: &LockValue,
        lease: i64,
        g: &Grantable,
        mine: QueueHead<'_>,
        replace_held: Option<i64>,
    ) -> Result<AcquireTxn, EtcdError> {
        let mut when = self.grant_compares(k, g, replace_held);
        when.push(Compare::create_revision(
            mine.key,
            CompareOp::Equal,
            mine.revision,
        ));
        // Every queued key is as young as ours or younger: we are first.
        when.push(
            Compare::create_revision(k.waiters.clone(), CompareOp::Greater, mine.revision - 1)
                .with_prefix(),
        );
        let mut then = grant_ops(k, value, lease);
        then.push(TxnOp::delete(mine.key, None));
        let predecessor = GetOptions::new()
            .with_prefix()
            .with_max_create_revision(mine.revision - 1)
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1);
        let mut reads = self.name_reads(k);
        reads.push(TxnOp::get(mine.key, None));
        reads.push(TxnOp::get(k.waiters.clone(), Some(predecessor)));
        let txn = Txn::new().when(when).and_then(then).or_else(reads);
        let resp = self.txn(txn).await?;
        if resp.succeeded() {
            return Ok(AcquireTxn::Granted {
                revision: revision(&resp),
            });
        }
        let mut gets = gets(resp);
        let state = name_state(&mut gets);
        let (me, before) = (gets.next().flatten(), gets.next().flatten());
        let holder = state.lock.clone();
        Ok(match (classify_refusal(state, g), before) {
            (Some(r @ (AcquireTxn::RingChanged(_) | AcquireTxn::IdentityChanged)), _) => r,
            _ if me.is_none() => AcquireTxn::Gone,
            (_, Some(ahead)) => AcquireTxn::Behind(ahead.key().to_vec(), holder),
            (Some(other), None) => other,
            // Free and first, yet the txn failed: something changed; look again.
            (None, None) => AcquireTxn::Queued,
        })
    }

    /// The compares every grant makes (the queue's are added by the caller).
    fn grant_compares(
        &self,
        k: &NameKeys,
        g: &Grantable,
        replace_held: Option<i64>,
    ) -> Vec<Compare> {
        let held = match replace_held {
            None => Compare::create_revision(k.held.clone(), CompareOp::Equal, 0),
            Some(rev) => Compare::mod_revision(k.held.clone(), CompareOp::Equal, rev),
        };
        vec![
            Compare::create_revision(k.lock.clone(), CompareOp::Equal, 0),
            held,
            Compare::create_revision(k.delay.clone(), CompareOp::Equal, 0),
            Compare::value(self.keys.ring(), CompareOp::Equal, g.ring.bytes.clone()),
            Compare::value(self.keys.identity(), CompareOp::Equal, g.identity.clone()),
        ]
    }

    /// Reads of everything that decides whether a name is grantable, in
    /// the order [`name_state`] takes them.
    fn name_reads(&self, k: &NameKeys) -> Vec<TxnOp> {
        vec![
            TxnOp::get(k.lock.clone(), None),
            TxnOp::get(k.held.clone(), None),
            TxnOp::get(k.delay.clone(), None),
            TxnOp::get(self.keys.ring(), None),
            TxnOp::get(self.keys.identity(), None),
        ]
    }

    /// One linearizable read of a name's keys and the shard's ring and
    /// identity (the handoff check of a migration, and inspect).
    pub async fn read_name(&self, k: &NameKeys) -> Result<NameState, EtcdError> {
        let resp = self.txn(Txn::new().and_then(self.name_reads(k))).await?;
        Ok(read_name(resp))
    }

    /// Turns a lost holder's held record into a lock-delay on `delay_lease`
    /// if the name is still not held and the record unchanged. Returns
    /// whether it did.
    pub async fn lost_to_delay(
        &self,
        k: &NameKeys,
        held: &KeyValue,
        delay_lease: i64,
        identity: &[u8],
    ) -> Result<bool, EtcdError> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(k.lock.clone(), CompareOp::Equal, 0),
                Compare::mod_revision(k.held.clone(), CompareOp::Equal, held.mod_revision()),
                Compare::value(self.keys.identity(), CompareOp::Equal, identity.to_vec()),
            ])
            .and_then([
                TxnOp::delete(k.held.clone(), None),
                TxnOp::put(
                    k.delay.clone(),
                    held.value().to_vec(),
                    Some(PutOptions::new().with_lease(delay_lease)),
                ),
            ]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Forgets a lost holder's held record (lock-delay off) if the name is
    /// still not held and the record unchanged.
    pub async fn forget_lost(&self, k: &NameKeys, held: &KeyValue) -> Result<bool, EtcdError> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(k.lock.clone(), CompareOp::Equal, 0),
                Compare::mod_revision(k.held.clone(), CompareOp::Equal, held.mod_revision()),
            ])
            .and_then([TxnOp::delete(k.held.clone(), None)]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Deletes the lock key (and its held record) only if the key still has
    /// this create revision and lease. Returns whether it deleted.
    pub async fn release_txn(
        &self,
        k: &NameKeys,
        revision: i64,
        lease: i64,
    ) -> Result<bool, EtcdError> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(k.lock.clone(), CompareOp::Equal, revision),
                Compare::lease(k.lock.clone(), CompareOp::Equal, lease),
            ])
            .and_then([
                TxnOp::delete(k.lock.clone(), None),
                TxnOp::delete(k.held.clone(), None),
            ]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Linearizable read of one key.
    pub async fn get(&self, key: &[u8]) -> Result<Option<KeyValue>, EtcdError> {
        let mut kv = self.conn.client().kv_client();
        let mut resp = self.conn.call("Range", kv.get(key, None)).await?;
        Ok(resp.take_kvs().into_iter().next())
    }

    /// Grants a lease; returns its id and the TTL etcd granted (which may
    /// be above the one asked for: etcd raises TTLs to its minimum).
    pub async fn grant(&self, ttl_secs: u32) -> Result<(i64, i64), EtcdError> {
        let mut lease = self.conn.client().lease_client();
        let resp = self
            .conn
            .call("LeaseGrant", lease.grant(ttl_secs.into(), None))
            .await?;
        Ok((resp.id(), resp.ttl()))
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
    pub async fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        let mut client = self.conn.client().lease_client();
        match self.conn.call("LeaseRevoke", client.revoke(lease)).await {
            Ok(_) | Err(EtcdError::LeaseNotFound) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Reads the shard-level keys (also the health probe).
    pub async fn probe(&self) -> Result<Probe, EtcdError> {
        let k = &self.keys;
        let resp = self
            .txn(Txn::new().and_then([
                TxnOp::get(k.ring(), None),
                TxnOp::get(k.identity(), None),
                TxnOp::get(k.epoch(), None),
            ]))
            .await?;
        let cluster_id = resp.header().map_or(0, |h| h.cluster_id());
        let mut gets = gets(resp);
        let ring = gets.next().flatten().map(|kv| Recorded::parse(kv.value()));
        let identity = gets.next().flatten().map(|kv| {
            let bytes = kv.value().to_vec();
            serde_json::from_slice::<Identity>(&bytes)
                .map(|id| (id, bytes.clone()))
                .map_err(|_| bytes)
        });
        let reservation = gets.next().flatten().map(|kv| {
            let bytes = kv.value().to_vec();
            // An unreadable reservation counts as the highest epoch there is,
            // so nothing ever reuses an epoch because of it.
            let r = serde_json::from_slice(&bytes).unwrap_or(Reservation {
                epoch: u64::MAX,
                by: String::new(),
            });
            (r, bytes)
        });
        Ok(Probe {
            ring,
            identity,
            reservation,
            cluster_id,
        })
    }

    /// Reads the recorded ring.
    pub async fn read_ring(&self) -> Result<Option<Recorded>, EtcdError> {
        Ok(self.probe().await?.ring)
    }

    /// Initialises a shard that has never been used (no ring, identity or
    /// reservation): records `ring`, `identity` and `reservation` at once.
    /// Returns whether this call did (a record found equal to `ring` may
    /// have come with another replica's identity for this cluster).
    pub async fn initialise(
        &self,
        ring: &Recorded,
        identity: &Identity,
        reservation: &Reservation,
    ) -> Result<bool, EtcdError> {
        let k = &self.keys;
        let txn = Txn::new()
            .when([
                Compare::create_revision(k.ring(), CompareOp::Equal, 0),
                Compare::create_revision(k.identity(), CompareOp::Equal, 0),
                Compare::create_revision(k.epoch(), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(k.ring(), ring.bytes.clone(), None),
                TxnOp::put(k.identity(), identity.to_bytes(), None),
                TxnOp::put(k.epoch(), reservation.to_bytes(), None),
            ]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Records `identity` on a shard initialised before shards had one,
    /// only while it records none and still records the ring `ring`.
    pub async fn adopt_identity(
        &self,
        identity: &Identity,
        ring: &[u8],
    ) -> Result<bool, EtcdError> {
        let k = &self.keys;
        let txn = Txn::new()
            .when([
                Compare::create_revision(k.identity(), CompareOp::Equal, 0),
                Compare::value(k.ring(), CompareOp::Equal, ring.to_vec()),
            ])
            .and_then([TxnOp::put(k.identity(), identity.to_bytes(), None)]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Reserves `new` if `P/epoch` still holds `seen` (`None`: nothing).
    pub async fn reserve_epoch(
        &self,
        seen: Option<&[u8]>,
        new: &Reservation,
    ) -> Result<bool, EtcdError> {
        let key = self.keys.epoch();
        let guard = match seen {
            None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
            Some(bytes) => Compare::value(key.clone(), CompareOp::Equal, bytes.to_vec()),
        };
        let txn = Txn::new()
            .when([guard])
            .and_then([TxnOp::put(key, new.to_bytes(), None)]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Replaces the recorded ring with `new` if it is still `expected`
    /// (`None`: no ring recorded) and `guard` holds. Returns what the shard
    /// records after.
    pub async fn swap_ring(
        &self,
        expected: Option<&[u8]>,
        new: &Recorded,
        guard: &RingGuard,
    ) -> Result<Option<Recorded>, EtcdError> {
        let k = &self.keys;
        let mut when = vec![match expected {
            None => Compare::create_revision(k.ring(), CompareOp::Equal, 0),
            Some(bytes) => Compare::value(k.ring(), CompareOp::Equal, bytes.to_vec()),
        }];
        let mut then = vec![TxnOp::put(k.ring(), new.bytes.clone(), None)];
        if let Some(bytes) = &guard.reservation {
            when.push(Compare::value(k.epoch(), CompareOp::Equal, bytes.clone()));
        }
        match &guard.identity {
            IdentityGuard::Verified(bytes) => when.push(Compare::value(
                k.identity(),
                CompareOp::Equal,
                bytes.clone(),
            )),
            IdentityGuard::Create(bytes) => {
                when.push(Compare::create_revision(k.identity(), CompareOp::Equal, 0));
                then.push(TxnOp::put(k.identity(), bytes.clone(), None));
            }
            IdentityGuard::Replace(old, new) => {
                when.push(Compare::value(k.identity(), CompareOp::Equal, old.clone()));
                then.push(TxnOp::put(k.identity(), new.clone(), None));
            }
        }
        let txn = Txn::new()
            .when(when)
            .and_then(then)
            .or_else([TxnOp::get(k.ring(), None)]);
        let resp = self.txn(txn).await?;
        if resp.succeeded() {
            return Ok(Some(new.clone()));
        }
        Ok(gets(resp)
            .next()
            .flatten()
            .map(|kv| Recorded::parse(kv.value())))
    }

    /// The hex name hashes of the keys in `[start, end)` (lock keys, held
    /// records or lock-delays) whose names satisfy `wanted`, reading every
    /// key at one revision, a page at a time (no raft writes).
    pub async fn hashes_where(
        &self,
        (start, end): (Vec<u8>, Vec<u8>),
        wanted: &mut impl FnMut(&str) -> bool,
    ) -> Result<Vec<Vec<u8>>, EtcdError> {
        let mut found = Vec::new();
        let prefix = start.len();
        self.scan((start, end), |kvs| {
            for kv in kvs {
                if name_of(kv.value()).is_some_and(|n| wanted(&n)) {
                    found.push(kv.key()[prefix.min(kv.key().len())..].to_vec());
                }
            }
        })
        .await?;
        Ok(found)
    }

    /// Reads every key in `[start, end)` at one revision, a page at a time,
    /// handing each page to `page`. Returns the revision read at.
    pub async fn scan(
        &self,
        range: (Vec<u8>, Vec<u8>),
        mut page: impl FnMut(&[KeyValue]),
    ) -> Result<i64, EtcdError> {
        let mut pages = Pages::new(range, false);
        while let Some(kvs) = pages.next(self).await? {
            page(&kvs);
        }
        Ok(pages.revision)
    }

    /// Held records without their lock key: holders lost (their lease
    /// ended) whose names nobody asked for since. Reads keys only, a page of
    /// held records and the lock keys of the same span at one revision, so
    /// a sweep costs two key-only ranges per thousand held locks.
    pub async fn orphaned_held(&self) -> Result<Vec<KeyValue>, EtcdError> {
        let prefix = self.keys.held_range().0.len();
        let locks_prefix = self.keys.locks_range().0.len();
        let mut pages = Pages::new(self.keys.held_range(), true);
        let mut orphans = Vec::new();
        while let Some(page) = pages.next(self).await? {
            let (Some(first), Some(last)) = (page.first(), page.last()) else {
                continue;
            };
            // The lock keys of this page's span, at the same revision.
            let mut end = self.lock_key_of_held(last.key());
            end.push(0);
            let opts = GetOptions::new()
                .with_range(end)
                .with_keys_only()
                .with_revision(pages.revision);
            let mut kv = self.conn.client().kv_client();
            let start = self.lock_key_of_held(first.key());
            let locks = self
                .conn
                .call("Range", kv.get(start, Some(opts)))
                .await?
                .take_kvs();
            let held: std::collections::HashSet<&[u8]> =
                locks.iter().map(|l| &l.key()[locks_prefix..]).collect();
            orphans.extend(
                page.iter()
                    .filter(|h| !held.contains(&h.key()[prefix..]))
                    .cloned(),
            );
        }
        Ok(orphans)
    }

    fn lock_key_of_held(&self, held: &[u8]) -> Vec<u8> {
        let (start, _) = self.keys.held_range();
        let (locks, _) = self.keys.locks_range();
        let mut key = locks;
        key.extend_from_slice(&held[start.len().min(held.len())..]);
        key
    }

    /// The name keys of the name a held record belongs to.
    pub fn keys_of_held(&self, held: &KeyValue) -> NameKeys {
        let (start, _) = self.keys.held_range();
        let hex = &held.key()[start.len().min(held.key().len())..];
        let mut hash = [0u8; 16];
        for (i, byte) in hash.iter_mut().enumerate() {
            let pair = hex
                .get(2 * i..2 * i + 2)
                .and_then(|p| std::str::from_utf8(p).ok());
            *byte = pair
                .and_then(|p| u8::from_str_radix(p, 16).ok())
                .unwrap_or(0);
        }
        self.name_keys(&hash)
    }

    /// Number of lock keys on the shard (a count-only range: no values read).
    pub async fn count_locks(&self) -> Result<i64, EtcdError> {
        let (start, end) = self.keys.locks_range();
        let mut kv = self.conn.client().kv_client();
        let opts = GetOptions::new().with_range(end).with_count_only();
        Ok(self
            .conn
            .call("Range", kv.get(start, Some(opts)))
            .await?
            .count())
    }
}

/// A range read a page of 1,000 keys at a time, every page at the revision
/// of the first.
struct Pages {
    from: Vec<u8>,
    end: Vec<u8>,
    keys_only: bool,
    /// 0 until the first page is read.
    revision: i64,
    done: bool,
}

impl Pages {
    fn new((start, end): (Vec<u8>, Vec<u8>), keys_only: bool) -> Self {
        Self {
            from: start,
            end,
            keys_only,
            revision: 0,
            done: false,
        }
    }

    async fn next(&mut self, shard: &Shard) -> Result<Option<Vec<KeyValue>>, EtcdError> {
        if self.done {
            return Ok(None);
        }
        let mut opts = GetOptions::new()
            .with_range(self.end.clone())
            .with_limit(1_000);
        if self.keys_only {
            opts = opts.with_keys_only();
        }
        if self.revision > 0 {
            opts = opts.with_revision(self.revision);
        }
        let mut kv = shard.conn.client().kv_client();
        let call = kv.get(self.from.clone(), Some(opts));
        let mut resp = shard.conn.call("Range", call).await?;
        if self.revision == 0 {
            self.revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        }
        let more = resp.more();
        let kvs = resp.take_kvs();
        match kvs.last() {
            Some(last) if more => {
                self.from = last.key().to_vec();
                self.from.push(0);
            }
            _ => self.done = true,
        }
        Ok(Some(kvs))
    }
}

/// The ops of a grant: the lock key on the session lease, and its held
/// record (no lease) that only a release deletes.
fn grant_ops(k: &NameKeys, value: &LockValue, lease: i64) -> Vec<TxnOp> {
    let held = HeldValue {
        name: value.name.clone(),
        ttl: value.ttl,
    };
    vec![
        TxnOp::put(
            k.lock.clone(),
            serde_json::to_vec(value).expect("LockValue serialises"),
            Some(PutOptions::new().with_lease(lease)),
        ),
        TxnOp::put(
            k.held.clone(),
            serde_json::to_vec(&held).expect("HeldValue serialises"),
            None,
        ),
    ]
}

/// Why a grant txn did not grant, from what its `Else` read; `None` when
/// the name is free of holders, delays and lost holders (so queued, or
/// changed meanwhile).
fn classify_refusal(state: NameState, g: &Grantable) -> Option<AcquireTxn> {
    if state.identity.as_deref() != Some(g.identity.as_slice()) {
        return Some(AcquireTxn::IdentityChanged);
    }
    if state.ring.as_ref() != Some(&g.ring) {
        return Some(AcquireTxn::RingChanged(state.ring));
    }
    if let Some(kv) = state.lock {
        return Some(AcquireTxn::Held(kv));
    }
    if let Some(kv) = state.delay {
        return Some(AcquireTxn::Delayed(kv));
    }
    state.held.map(AcquireTxn::Lost)
}

fn revision(resp: &TxnResponse) -> i64 {
    resp.header().map(|h| h.revision()).unwrap_or(0)
}

/// The first key of each get in a txn's answers, in order.
fn gets(resp: TxnResponse) -> impl Iterator<Item = Option<KeyValue>> {
    resp.op_responses().into_iter().map(|op| match op {
        TxnOpResponse::Get(mut g) => g.take_kvs().into_iter().next(),
        _ => None,
    })
}

fn read_name(resp: TxnResponse) -> NameState {
    name_state(&mut gets(resp))
}

/// Takes the answers of [`Shard::name_reads`] off `gets`.
fn name_state(gets: &mut impl Iterator<Item = Option<KeyValue>>) -> NameState {
    let mut next = || gets.next().flatten();
    NameState {
        lock: next(),
        held: next(),
        delay: next(),
        ring: next().map(|kv| Recorded::parse(kv.value())),
        identity: next().map(|kv| kv.value().to_vec()),
    }
}

/// The name recorded in a lock key, held record or lock-delay.
fn name_of(value: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        name: String,
    }
    serde_json::from_slice::<Named>(value).ok().map(|n| n.name)
}
