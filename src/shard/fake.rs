//! An in-memory shard for the unit tests of the lock layer's decisions: it
//! answers [`LockShard`] as one etcd cluster would, from a map of keys and
//! a set of live leases, with no etcd and no time passing unless a test
//! says so. Its txns compare and write what the real ones do (`name.rs`):
//! a grant needs the ring and identity compared, no holder, no lock-delay,
//! no lost holder (unless replaced) and no queued waiter; a release needs
//! the lockId's create revision and lease. Its cache is exact: it has seen
//! every revision it committed (unless a test holds it back, as a lagging
//! watch would: [`FakeShard::hold_cache`]), and counts for quotas what the real one
//! counts (`cache.rs`): per lease tag, the lock keys and the distinct
//! leases they ride on. A release or an expiry uncounts a lock at once,
//! and a quota's reservation of a grant is given back at its next count.
//!
//! A test moves the world by hand: [`FakeShard::expire`] ends a lease (and
//! with it the keys on it, leaving a lost holder's record),
//! [`FakeShard::set_ring`] records another ring and
//! [`FakeShard::set_identity`] another identity (the router verified
//! [`IDENTITY`]).
//!
//! Its queue of waiters is the real one's: entries ordered by their create
//! revisions, the head granted only if the name is grantable, a waiter
//! sleeping until something is deleted (any key: it then looks again) or
//! its deadline, and leaving the queue when dropped.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use super::cache::{Entry, Held};
use super::conn::EtcdError;
use super::keepalive::Renewal;
use super::keys::{HeldValue, Keys, LockValue, NameHash, Recorded, RingMeta, Stored};
use super::name::{AcquireTxn, Grantable, NameKeys, NameState, ReleaseTxn, SessionGrant};
use super::ops::{CacheCounts, LockShard, QueueWaiter};
use super::queue::{Awaited, Kept, Woke};
use super::sessions::{SessionLease, SessionUse};
use crate::token::lease_tag::LeaseTag;

/// The ring a fake shard records at first.
pub const RING: &str = "fake-ring";
/// Its identity record.
pub const IDENTITY: &[u8] = b"fake-identity";

/// One in-memory shard.
pub struct FakeShard {
    name: String,
    keys: Keys,
    /// std `Mutex`: never held across an await.
    state: Mutex<State>,
    /// Woken at every deletion, for the waiters.
    deleted: tokio::sync::Notify,
    metrics: crate::metrics::ShardMetrics,
}

#[derive(Default)]
struct State {
    revision: i64,
    next_lease: i64,
    /// Live leases and their TTLs.
    leases: HashMap<i64, i64>,
    kv: BTreeMap<Vec<u8>, Stored>,
    ring: Option<Recorded>,
    identity: Option<Vec<u8>>,
    /// Each (holder, TTL)'s session lease.
    sessions: HashMap<(String, u32), SessionLease>,
    /// Grant txns sent (each would be a raft write).
    grant_txns: u32,
    /// Keepalives asked for, by lease.
    keepalives: HashMap<i64, u32>,
    /// Deletions so far (what a sleeping waiter wakes for).
    deletions: u64,
    /// Set while the cache lags: the last revision it has seen.
    cache_held_at: Option<i64>,
    /// The grant cut-off, the highest mark (0: never moved), and the one
    /// the router last saw.
    cutoff_key: i64,
    cutoff_seen: i64,
    /// Moves of the cut-off put so far; whether the next ones fail.
    cutoff_moves: u32,
    cutoff_unreachable: bool,
    /// The next grant's answer is lost: applied first or not at all.
    lose_next_answer: Option<Lost>,
    /// A grant txn held on its way (its answer lost), to land later.
    held_txn: Option<HeldTxn>,
    /// Each lease's last confirmed renewal (its grant or a keepalive).
    confirmed: HashMap<i64, Renewal>,
    /// Whether keepalives go unanswered.
    keepalives_unanswered: bool,
    /// How many of the next plain reads of a name go unanswered, and how
    /// many will once a grant's answer is lost.
    reads_unanswered: u32,
    reads_lost_with_answer: u32,
}

/// What becomes of a grant txn whose answer is lost.
#[derive(Clone, Copy, Debug)]
pub enum Lost {
    /// Applied before its answer was lost.
    Applied,
    /// Held on its way: [`FakeShard::land_held_txn`] applies it later.
    Held,
}

/// A grant txn held on its way, as it was sent.
struct HeldTxn {
    k: NameKeys,
    value: LockValue,
    lease: i64,
    g: Grantable,
}

impl FakeShard {
    /// A shard recording [`RING`] at epoch 1 and [`IDENTITY`].
    pub fn new(name: &str) -> Self {
        let ring = Recorded::new(RingMeta {
            epoch: 1,
            ring: RING.into(),
            previous: None,
        });
        let state = State {
            ring: Some(ring),
            identity: Some(IDENTITY.to_vec()),
            next_lease: 1_000,
            ..State::default()
        };
        Self {
            name: name.into(),
            keys: Keys::new("/fake"),
            state: Mutex::new(state),
            deleted: tokio::sync::Notify::new(),
            metrics: crate::metrics::ShardMetrics::new(name),
        }
    }

    /// What a grant compares here now.
    pub fn grantable(&self) -> Grantable {
        let s = self.lock();
        Grantable {
            ring: s.ring.clone().expect("a recorded ring"),
            identity: s.identity.clone().expect("an identity"),
            cutoff: s.cutoff_seen,
        }
    }

    /// Records another ring (a migration opened, or another router's).
    pub fn set_ring(&self, ring: Recorded) {
        self.lock().ring = Some(ring);
    }

    /// Records another identity (the endpoints reach another cluster).
    pub fn set_identity(&self, identity: &[u8]) {
        self.lock().identity = Some(identity.to_vec());
    }

    /// Ends `lease` as etcd's expiry would: the keys on it go, a lock's
    /// held record stays (its holder is lost).
    pub fn expire(&self, lease: i64) {
        let mut s = self.lock();
        s.leases.remove(&lease);
        s.kv.retain(|_, kv| kv.lease != lease);
        s.deletions += 1;
        drop(s);
        self.deleted.notify_waiters();
    }

    /// Waiters in `name`'s queue.
    pub fn queued(&self, name: &str) -> usize {
        let k = self.name_keys(&super::keys::name_hash(name));
        let s = self.lock();
        s.kv.keys()
            .filter(|key| key.starts_with(&k.waiters))
            .count()
    }

    /// The lock key of `name`, if held.
    pub fn lock_key(&self, name: &str) -> Option<Stored> {
        let k = self.name_keys(&super::keys::name_hash(name));
        self.lock().kv.get(&k.lock).cloned()
    }

    /// Puts a waiter's entry in `name`'s queue (on no lease).
    pub fn queue_waiter(&self, name: &str) {
        let k = self.name_keys(&super::keys::name_hash(name));
        let mut key = k.waiters;
        key.extend_from_slice(b"/w");
        self.lock().put(key, b"w".to_vec(), 0);
    }

    /// Holds the cache at the revision it has seen now, as a watch that
    /// lags behind its cluster: what is written from now on (a grant
    /// above all) it neither shows held nor counts until
    /// [`FakeShard::catch_up_cache`].
    pub fn hold_cache(&self) {
        let mut s = self.lock();
        s.cache_held_at = Some(s.revision);
    }

    /// Lets the cache see every revision again.
    pub fn catch_up_cache(&self) {
        self.lock().cache_held_at = None;
    }

    /// Keepalives asked of `lease` so far (by renewals and re-acquires).
    pub fn keepalives(&self, lease: i64) -> u32 {
        self.lock().keepalives.get(&lease).copied().unwrap_or(0)
    }

    /// Keepalives go unanswered from now on (`true`), or are answered
    /// again: a grant's keepalive, a re-acquire's.
    pub fn lose_keepalives(&self, lost: bool) {
        self.lock().keepalives_unanswered = lost;
    }

    /// Forgets `lease`'s last confirmed renewal, as a router whose last
    /// one's deadline passed.
    pub fn forget_confirmed(&self, lease: i64) {
        self.lock().confirmed.remove(&lease);
    }

    /// Once the next grant txn's answer is lost, the `n` plain reads of a
    /// name that follow go unanswered too (as a follower's that lost its
    /// leader may for a while after it is back); the read that settles a
    /// cut-off grant txn's outcome reaches every member, and is answered.
    pub fn lose_reads_with_answer(&self, n: u32) {
        self.lock().reads_lost_with_answer = n;
    }

    /// Loses the answer of the next grant txn (a plain acquire's, a
    /// waiter's or an extend's move), which is then `lost`: applied, or
    /// held on its way (a waiter's or a move's is then never applied), and
    /// fails its call as a silent member's would.
    pub fn lose_next_answer(&self, lost: Lost) {
        self.lock().lose_next_answer = Some(lost);
    }

    /// Applies the grant txn held on its way, as it was sent, and says
    /// what it did.
    pub fn land_held_txn(&self) -> AcquireTxn {
        let mut s = self.lock();
        let t = s.held_txn.take().expect("a grant txn held on its way");
        s.acquire_txn(&t.k, &t.value, (t.lease, false), &t.g, None)
    }

    /// Makes the cut-off's moves fail (`true`), as on a shard that answers
    /// nobody, or succeed again.
    pub fn cutoff_unreachable(&self, unreachable: bool) {
        self.lock().cutoff_unreachable = unreachable;
    }

    /// Moves of the grant cut-off put so far.
    pub fn cutoff_moves(&self) -> u32 {
        self.lock().cutoff_moves
    }

    /// Grant txns sent so far.
    pub fn grant_txns(&self) -> u32 {
        self.lock().grant_txns
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("fake shard lock")
    }
}

impl State {
    fn put(&mut self, key: Vec<u8>, value: Vec<u8>, lease: i64) {
        self.revision += 1;
        let create_revision = self
            .kv
            .get(&key)
            .map_or(self.revision, |kv| kv.create_revision);
        let kv = Stored {
            key: key.clone(),
            value,
            create_revision,
            mod_revision: self.revision,
            lease,
        };
        self.kv.insert(key, kv);
    }

    /// The last revision the cache has seen.
    fn cache_seen(&self) -> i64 {
        self.cache_held_at.unwrap_or(self.revision)
    }

    fn grant_lease(&mut self, ttl_secs: i64, id: Option<i64>) -> i64 {
        self.next_lease += 1;
        let id = id.unwrap_or(self.next_lease);
        self.leases.insert(id, ttl_secs);
        self.confirmed.insert(id, self.renewal(id));
        id
    }

    /// What becomes of the grant txn sent now, if its answer is lost.
    fn take_lost_answer(&mut self) -> Option<Lost> {
        let lost = self.lose_next_answer.take();
        if lost.is_some() {
            self.reads_unanswered = std::mem::take(&mut self.reads_lost_with_answer);
        }
        lost
    }

    fn keepalive(&mut self, lease: i64) -> Renewal {
        *self.keepalives.entry(lease).or_default() += 1;
        let renewal = self.renewal(lease);
        self.confirmed.insert(lease, renewal);
        renewal
    }

    fn renewal(&self, lease: i64) -> Renewal {
        Renewal {
            sent_at: Instant::now(),
            ttl_secs: self.leases.get(&lease).copied().unwrap_or(0),
        }
    }

    fn name_state(&self, k: &NameKeys) -> NameState {
        NameState {
            lock: self.kv.get(&k.lock).cloned(),
            held: self.kv.get(&k.held).cloned(),
            delay: self.kv.get(&k.delay).cloned(),
            ring: self.ring.clone(),
            identity: self.identity.clone(),
        }
    }

    /// The grant txn of `name.rs`: its compares, then its writes or why not.
    /// `head`: the grant of the queue's head, which others behind it do
    /// not hold up.
    fn acquire_txn(
        &mut self,
        k: &NameKeys,
        value: &LockValue,
        (lease, head): (i64, bool),
        g: &Grantable,
        replace_held: Option<i64>,
    ) -> AcquireTxn {
        self.grant_txns += 1;
        let state = self.name_state(k);
        if state.identity.as_deref() != Some(g.identity.as_slice()) {
            return AcquireTxn::IdentityChanged;
        }
        if state.ring.as_ref() != Some(&g.ring) {
            return AcquireTxn::RingChanged(state.ring);
        }
        if let Some(kv) = state.lock {
            return AcquireTxn::Held(kv);
        }
        if let Some(kv) = state.delay {
            return AcquireTxn::Delayed(kv);
        }
        if let Some(held) = state.held.filter(|h| Some(h.mod_revision) != replace_held) {
            return AcquireTxn::Lost(held);
        }
        if g.cutoff < self.cutoff_key {
            return AcquireTxn::CutoffMoved(self.cutoff_key);
        }
        if !head && self.kv.keys().any(|key| key.starts_with(&k.waiters)) {
            return AcquireTxn::Queued;
        }
        self.grant_writes(k, value, lease);
        let revision = self.kv[&k.lock].create_revision;
        AcquireTxn::Granted { revision }
    }

    /// The writes of a grant (`name.rs`, `grant_ops`): the lock key on
    /// `lease` and its held record. A put keeps a key's create revision.
    fn grant_writes(&mut self, k: &NameKeys, value: &LockValue, lease: i64) {
        let held = HeldValue {
            name: value.name.clone(),
            ttl: value.ttl,
        };
        let value = serde_json::to_vec(value).expect("LockValue serialises");
        self.put(k.lock.clone(), value, lease);
        let held = serde_json::to_vec(&held).expect("HeldValue serialises");
        self.put(k.held.clone(), held, 0);
    }
}

impl CacheCounts for FakeShard {
    fn cache_has_seen(&self, revision: i64) -> bool {
        revision <= self.lock().cache_seen()
    }

    /// Counted from the lock keys, as the real cache counts them.
    fn held_by(&self, tag: LeaseTag) -> Option<Held> {
        let (start, end) = self.keys.locks_range();
        let s = self.lock();
        let seen = s.cache_seen();
        let locks = (s.kv.range(start..end))
            .filter(|(_, kv)| kv.create_revision <= seen)
            .map(|(_, kv)| kv.lease)
            .filter(|&lease| LeaseTag::in_lease(lease) == tag);
        let mut leases: Vec<i64> = locks.collect();
        let count = leases.len() as u64;
        leases.sort_unstable();
        leases.dedup();
        Some(Held {
            locks: count,
            sessions: leases.len() as u64,
        })
    }
}

impl LockShard for FakeShard {
    type Waiter = FakeWaiter;

    fn name(&self) -> &str {
        &self.name
    }

    fn metrics(&self) -> &crate::metrics::ShardMetrics {
        &self.metrics
    }

    fn name_keys(&self, hash: &NameHash) -> NameKeys {
        NameKeys::new(&self.keys, hash)
    }

    fn verified_identity(&self) -> Option<Vec<u8>> {
        Some(IDENTITY.to_vec())
    }

    fn cache_shows_held(&self, hash: &NameHash) -> bool {
        let s = self.lock();
        (s.kv.get(&self.keys.lock(hash))).is_some_and(|kv| kv.create_revision <= s.cache_seen())
    }

    /// The fake answers each txn as it is called: none is ever in flight
    /// for another acquire to wait for.
    async fn grant_settled(&self, _hash: &NameHash) {}

    fn grant_pending(&self, _hash: &NameHash) -> bool {
        false
    }

    async fn read_name(&self, k: &NameKeys) -> Result<NameState, EtcdError> {
        let mut s = self.lock();
        if s.reads_unanswered > 0 {
            s.reads_unanswered -= 1;
            return Err(unanswered(&self.name));
        }
        Ok(s.name_state(k))
    }

    async fn read_name_settled(&self, k: &NameKeys) -> Result<NameState, EtcdError> {
        Ok(self.lock().name_state(k))
    }

    fn cutoff(&self) -> i64 {
        self.lock().cutoff_seen
    }

    fn learn_cutoff(&self, mark: i64) {
        self.lock().cutoff_seen = mark;
    }

    async fn move_cutoff_past(&self, compared: i64) -> Result<(), EtcdError> {
        let mut s = self.lock();
        if s.cutoff_seen > compared {
            return Ok(());
        }
        s.cutoff_moves += 1;
        if s.cutoff_unreachable {
            return Err(unanswered(&self.name));
        }
        s.revision += 1;
        s.cutoff_key = s.cutoff_seen.max(compared) + 1;
        s.cutoff_seen = s.cutoff_key;
        Ok(())
    }

    async fn session<E: From<EtcdError>>(
        &self,
        holder: &str,
        ttl_secs: u32,
        tag: Option<LeaseTag>,
        usage: SessionUse,
        admit: impl Fn() -> Result<(), E>,
    ) -> Result<SessionLease, E> {
        let _ = usage; // the fake's sessions are never handed on
        let slot = (holder.to_string(), ttl_secs);
        {
            let s = self.lock();
            if let Some(session) = s.sessions.get(&slot) {
                if s.leases.contains_key(&session.id) {
                    return Ok(*session);
                }
            }
        }
        // Unlocked: the quota's hook reads this shard's counts.
        admit()?;
        let mut s = self.lock();
        let id = s.grant_lease(i64::from(ttl_secs), tag.map(LeaseTag::new_lease_id));
        let session = SessionLease { id, ttl_secs };
        s.sessions.insert(slot, session);
        Ok(session)
    }

    async fn grant_on_session(
        &self,
        k: &NameKeys,
        value: &LockValue,
        session: &SessionLease,
        _window: Duration,
        g: &Grantable,
        replace_held: Option<i64>,
    ) -> Result<SessionGrant, EtcdError> {
        let mut s = self.lock();
        if !s.leases.contains_key(&session.id) {
            s.sessions.remove(&(value.client.clone(), session.ttl_secs));
            return Ok(SessionGrant::SessionGone);
        }
        match s.take_lost_answer() {
            None => {}
            Some(Lost::Applied) => {
                s.acquire_txn(k, value, (session.id, false), g, replace_held);
                return Err(unanswered(&self.name));
            }
            Some(Lost::Held) => {
                let (k, value, g) = (k.clone(), value.clone(), g.clone());
                s.held_txn = Some(HeldTxn {
                    k,
                    value,
                    lease: session.id,
                    g,
                });
                return Err(unanswered(&self.name));
            }
        }
        let txn = s.acquire_txn(k, value, (session.id, false), g, replace_held);
        let renewal = match s.keepalives_unanswered {
            true => Err(unanswered(&self.name)),
            false => Ok(s.renewal(session.id)),
        };
        Ok(SessionGrant::Answered(txn, renewal))
    }

    async fn renew_lease(
        &self,
        lease: i64,
        _window: Duration,
        _ttl_secs: u32,
    ) -> Result<Renewal, EtcdError> {
        let mut s = self.lock();
        if s.keepalives_unanswered {
            return Err(unanswered(&self.name));
        }
        Ok(s.keepalive(lease))
    }

    async fn time_to_live(&self, lease: i64) -> Result<i64, EtcdError> {
        Ok(self.lock().leases.get(&lease).copied().unwrap_or(0))
    }

    fn confirmed_renewal(&self, lease: i64) -> Option<Renewal> {
        let s = self.lock();
        s.leases
            .contains_key(&lease)
            .then(|| s.confirmed.get(&lease).copied())?
    }

    async fn set_lock_delay(
        &self,
        k: &NameKeys,
        held: &Stored,
        identity: &[u8],
    ) -> Result<(Instant, bool), EtcdError> {
        let mut s = self.lock();
        let ttl = serde_json::from_slice::<HeldValue>(&held.value).map_or(0, |h| h.ttl);
        let secs = i64::from(ttl.max(1) + 1);
        let until = Instant::now() + Duration::from_secs(secs as u64);
        let unchanged = !s.kv.contains_key(&k.lock)
            && s.kv.get(&k.held).map(|h| h.mod_revision) == Some(held.mod_revision)
            && s.identity.as_deref() == Some(identity);
        if !unchanged {
            return Ok((until, false));
        }
        let lease = s.grant_lease(secs, None);
        s.kv.remove(&k.held);
        s.put(k.delay.clone(), held.value.clone(), lease);
        Ok((until, true))
    }

    async fn lock_entries(&self, hashes: &[NameHash]) -> Vec<Result<Option<Entry>, EtcdError>> {
        let s = self.lock();
        (hashes.iter())
            .map(|hash| {
                let kv = s.kv.get(&self.keys.lock(hash));
                Ok(kv.map(|kv| (kv.create_revision, kv.lease)))
            })
            .collect()
    }

    async fn renew_session(
        &self,
        lease: i64,
        _window: Duration,
        _ttl_secs: u32,
    ) -> Result<Renewal, EtcdError> {
        Ok(self.lock().keepalive(lease))
    }

    fn note_renewal(&self, _took: Duration, _budget: Duration, _now: Instant) -> bool {
        false
    }

    /// The move txn of `txn.rs`: the grant's writes on `lease`, if the lock
    /// key and held record are the versions read and the identity holds.
    async fn move_lock(
        &self,
        k: &NameKeys,
        (lock, held_was): (&Stored, Option<&Stored>),
        value: &LockValue,
        lease: i64,
        (identity, cutoff): (&[u8], i64),
    ) -> Result<bool, EtcdError> {
        let mut s = self.lock();
        let version = |key: &Vec<u8>| s.kv.get(key).map_or(0, |kv| kv.mod_revision);
        let unchanged = version(&k.lock) == lock.mod_revision
            && version(&k.held) == held_was.map_or(0, |h| h.mod_revision)
            && s.identity.as_deref() == Some(identity);
        if !unchanged || cutoff < s.cutoff_key {
            s.cutoff_seen = s.cutoff_key;
            return Ok(false);
        }
        if !s.leases.contains_key(&lease) {
            return Err(EtcdError::LeaseNotFound);
        }
        let lost = s.take_lost_answer();
        if !matches!(lost, Some(Lost::Held)) {
            s.grant_writes(k, value, lease);
        }
        match lost {
            Some(_) => Err(unanswered(&self.name)),
            None => Ok(true),
        }
    }

    async fn release_txn(
        &self,
        k: &NameKeys,
        revision: i64,
        lease: i64,
    ) -> Result<ReleaseTxn, EtcdError> {
        let mut s = self.lock();
        let Some(kv) = s.kv.get(&k.lock) else {
            return Ok(ReleaseTxn::NotHeld);
        };
        if (kv.create_revision, kv.lease) != (revision, lease) {
            return Ok(ReleaseTxn::NotHeld);
        }
        let at = serde_json::from_slice::<LockValue>(&kv.value).map_or(0, |v| v.at);
        s.kv.remove(&k.lock);
        s.kv.remove(&k.held);
        s.revision += 1;
        s.deletions += 1;
        self.deleted.notify_waiters();
        let granted_at = (at > 0).then(|| SystemTime::UNIX_EPOCH + Duration::from_millis(at));
        Ok(ReleaseTxn::Released { granted_at })
    }

    /// Forgets the session (the fake keeps no spares).
    async fn session_gone(&self, holder: &str, session: &SessionLease, _vouched: bool) {
        let mut s = self.lock();
        let slot = (holder.to_string(), session.ttl_secs);
        if s.sessions
            .get(&slot)
            .is_some_and(|had| had.id == session.id)
        {
            s.sessions.remove(&slot);
        }
    }

    async fn keep_session(
        &self,
        holder: &str,
        session: &SessionLease,
        _window: Duration,
    ) -> Result<Option<Renewal>, EtcdError> {
        let mut s = self.lock();
        if s.keepalives_unanswered {
            return Err(unanswered(&self.name));
        }
        let renewal = s.keepalive(session.id);
        if renewal.alive() {
            return Ok(Some(renewal));
        }
        s.sessions.remove(&(holder.to_string(), session.ttl_secs));
        Ok(None)
    }

    async fn enqueue(
        self: &Arc<Self>,
        k: NameKeys,
        holder: &str,
        session: SessionLease,
    ) -> Result<FakeWaiter, EtcdError> {
        let mut s = self.lock();
        let mut key = k.waiters.clone();
        key.extend_from_slice(format!("/{}", s.revision + 1).as_bytes());
        s.put(key.clone(), holder.as_bytes().to_vec(), 0);
        let seen = s.deletions;
        // What the entry's txn reads after its put (`queue.rs`).
        let mine = s.revision;
        let ahead = (s.kv.values())
            .filter(|kv| kv.key.starts_with(&k.waiters) && kv.create_revision < mine)
            .max_by_key(|kv| kv.create_revision)
            .cloned();
        let found = ahead.map(|a| (a, s.kv.get(&k.lock).cloned()));
        Ok(FakeWaiter {
            shard: self.clone(),
            k,
            key,
            session,
            seen,
            found,
        })
    }

    async fn queue_len(&self, k: &NameKeys) -> Result<u64, EtcdError> {
        let s = self.lock();
        let entries = s.kv.keys().filter(|key| key.starts_with(&k.waiters));
        Ok(entries.count() as u64)
    }
}

/// A waiter in a fake shard's queue; dropping it deletes its entry.
pub struct FakeWaiter {
    shard: Arc<FakeShard>,
    k: NameKeys,
    /// Its entry's key.
    key: Vec<u8>,
    session: SessionLease,
    /// The shard's deletions when it last woke: any later one wakes it.
    seen: u64,
    /// The entry just ahead of its own when it queued, and the holder.
    found: Option<(Stored, Option<Stored>)>,
}

impl Drop for FakeWaiter {
    fn drop(&mut self) {
        let mut s = self.shard.lock();
        if s.kv.remove(&self.key).is_some() {
            s.deletions += 1;
        }
        drop(s);
        self.shard.deleted.notify_waiters();
    }
}

impl QueueWaiter for FakeWaiter {
    fn keys(&self) -> &NameKeys {
        &self.k
    }

    fn session(&self) -> &SessionLease {
        &self.session
    }

    async fn keep_alive(
        &mut self,
        holder: &str,
        _window: impl Fn(u32) -> Duration,
    ) -> Result<Kept, EtcdError> {
        let mut s = self.shard.lock();
        Ok(if !s.leases.contains_key(&self.session.id) {
            s.sessions
                .remove(&(holder.to_string(), self.session.ttl_secs));
            Kept::SessionGone
        } else if !s.kv.contains_key(&self.key) {
            Kept::EntryGone
        } else {
            Kept::Alive
        })
    }

    fn set_session(&mut self, session: SessionLease) {
        self.session = session;
    }

    fn found_ahead(&mut self) -> Option<(Stored, Option<Stored>)> {
        self.found.take()
    }

    /// The grant txn at the head of the queue (`queue.rs`).
    async fn grant(
        &mut self,
        value: &LockValue,
        g: &Grantable,
        replace_held: Option<i64>,
        look_first: bool,
    ) -> Result<AcquireTxn, EtcdError> {
        let mut s = self.shard.lock();
        let k = &self.k;
        let Some(mine) = s.kv.get(&self.key).map(|kv| kv.create_revision) else {
            return Ok(AcquireTxn::Gone);
        };
        let ahead = (s.kv.values())
            .filter(|kv| kv.key.starts_with(&k.waiters) && kv.create_revision < mine)
            .max_by_key(|kv| kv.create_revision)
            .cloned();
        let held = s.kv.get(&k.lock).cloned();
        if let Some(ahead) = ahead {
            if !look_first {
                s.grant_txns += 1; // sent, and failed its compare
            }
            return Ok(AcquireTxn::Behind(ahead, held));
        }
        // A look first at a held name sends no txn.
        if let (true, Some(held)) = (look_first, held) {
            return Ok(AcquireTxn::Held(held));
        }
        // First in the queue: granted as a plain acquire would be, but for
        // its own entry, which the grant deletes.
        let entry = s.kv.remove(&self.key).expect("its entry");
        let lost = s.take_lost_answer();
        if let Some(Lost::Held) = lost {
            s.kv.insert(self.key.clone(), entry);
            return Err(unanswered(&self.shard.name));
        }
        let txn = s.acquire_txn(k, value, (self.session.id, true), g, replace_held);
        if matches!(txn, AcquireTxn::Granted { .. }) {
            s.deletions += 1;
            drop(s);
            self.shard.deleted.notify_waiters();
        } else {
            s.kv.insert(self.key.clone(), entry);
        }
        match lost {
            Some(Lost::Applied) => Err(unanswered(&self.shard.name)),
            _ => Ok(txn),
        }
    }

    async fn sleep(&mut self, _awaited: Awaited, deadline: Instant) -> Result<Woke, EtcdError> {
        let deleted = self.shard.deleted.notified();
        tokio::pin!(deleted);
        deleted.as_mut().enable();
        let now = self.shard.lock().deletions;
        if now != self.seen {
            self.seen = now;
            return Ok(Woke::Gone);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let woke = tokio::time::timeout(left, deleted).await;
        self.seen = self.shard.lock().deletions;
        Ok(if woke.is_ok() { Woke::Gone } else { Woke::Due })
    }
}

/// A call that had no answer, as a silent member's fails.
fn unanswered(shard: &str) -> EtcdError {
    EtcdError::Unavailable {
        shard: shard.into(),
        detail: "no answer within 1000 ms".into(),
    }
}
