//! The lock-key cache: every lock key of the shard with its create revision
//! and lease, fed by one watch, so that renewals cost a lookup instead of a
//! read per lock (`docs/design.md`, "The lock-key cache and its barriers").
//!
//! A renewal may use the cache only after a *barrier*: a put of the
//! shard's barrier key (inside the watched range) sent after the renewal
//! began, whose event the cache has applied. Every change committed before
//! the renewal began has a lower revision, so the cache then reflects it.
//! While the cache is loading, after its watch broke, or when a barrier is
//! not applied in time, it does not vouch, and callers read etcd instead.
//!
//! It also counts, per [`LeaseTag`], the lock keys and distinct leases it
//! holds: the locks and sessions of each principal on the shard, which
//! per-principal quotas read (a count, never the basis of a grant).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, EventType, GetOptions, Txn, TxnOp, WatchOptions};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::conn::{EtcdConn, EtcdError};
use super::keys::{hash_of_hex, Keys, NameHash};
use super::verify::IdentityCell;
use crate::token::lease_tag::LeaseTag;

/// Longest a renewal waits for the cache to apply its barrier before it
/// reads etcd instead.
pub const LAG_BOUND: Duration = Duration::from_millis(500);

/// A watch counts as silent when a barrier was answered this long ago and
/// nothing at all came on the watch since (a watch that is merely behind
/// keeps delivering): the cache loads again, on another member, and
/// renewals waiting for it read etcd instead.
const SILENT_WATCH: Duration = Duration::from_millis(150);

/// A lock key as the cache knows it: (create revision, lease).
pub type Entry = (i64, i64);

/// What the cache says of some lock keys after a barrier.
pub enum Vouched {
    /// The entries of the keys asked for, as of a revision after the
    /// barrier was asked for.
    Entries(Vec<Option<Entry>>),
    /// The cache cannot vouch now: read etcd.
    Unsure,
}

/// The lock keys of a principal (a lease tag) on the shard.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub locks: u64,
    /// Distinct leases (sessions) its lock keys ride on.
    pub sessions: u64,
}

/// The lock keys by name hash.
///
/// A renew-batch looks up many names at once, and at a million keys each
/// probe is a miss to memory. So a batch is hashed first and probed after:
/// with no hashing between them, the CPU overlaps the probes' misses
/// instead of waiting for each in turn behind a SipHash (a lookup at a
/// million keys takes a third to two fifths of the time;
/// docs/benchmarks.md, "The lock-key cache's lookups"). The hash stays
/// std's keyed SipHash: names are the clients' to choose, so the table
/// must not be open to chosen collisions.
#[derive(Default)]
struct KeyMap {
    table: hashbrown::HashTable<(NameHash, Entry)>,
    hasher: RandomState,
}

impl KeyMap {
    /// Puts `entry` for `name`; returns the entry it replaced.
    fn insert(&mut self, name: NameHash, entry: Entry) -> Option<Entry> {
        let Self { table, hasher } = self;
        match table.entry(
            hasher.hash_one(name),
            |(n, _)| *n == name,
            |(n, _)| hasher.hash_one(n),
        ) {
            hashbrown::hash_table::Entry::Occupied(mut old) => {
                Some(std::mem::replace(&mut old.get_mut().1, entry))
            }
            hashbrown::hash_table::Entry::Vacant(slot) => {
                slot.insert((name, entry));
                None
            }
        }
    }

    fn remove(&mut self, name: &NameHash) -> Option<Entry> {
        let hash = self.hasher.hash_one(name);
        let found = self.table.find_entry(hash, |(n, _)| n == name).ok()?;
        Some(found.remove().0 .1)
    }

    fn get(&self, name: &NameHash) -> Option<Entry> {
        let hash = self.hasher.hash_one(name);
        self.table.find(hash, |(n, _)| n == name).map(|(_, e)| *e)
    }

    /// The entries of `names`, in order: every name hashed first, then
    /// every probe (see the type's comment).
    fn get_all(&self, names: &[NameHash]) -> Vec<Option<Entry>> {
        let hashes: Vec<u64> = names.iter().map(|n| self.hasher.hash_one(n)).collect();
        names
            .iter()
            .zip(hashes)
            .map(|(name, hash)| self.table.find(hash, |(n, _)| n == name).map(|(_, e)| *e))
            .collect()
    }

    fn len(&self) -> usize {
        self.table.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}

/// Every lock key, and the counts per lease tag kept with them.
#[derive(Default)]
struct Table {
    keys: KeyMap,
    /// Per tag: its lock count and the lock count of each of its leases.
    tags: HashMap<LeaseTag, (u64, HashMap<i64, u64>)>,
}

impl Table {
    fn insert(&mut self, hash: NameHash, entry: Entry) {
        if let Some(old) = self.keys.insert(hash, entry) {
            self.uncount(old.1);
        }
        let (locks, leases) = self.tags.entry(LeaseTag::in_lease(entry.1)).or_default();
        *locks += 1;
        *leases.entry(entry.1).or_default() += 1;
    }

    fn remove(&mut self, hash: &NameHash) {
        if let Some(old) = self.keys.remove(hash) {
            self.uncount(old.1);
        }
    }

    fn uncount(&mut self, lease: i64) {
        let tag = LeaseTag::in_lease(lease);
        let Some((locks, leases)) = self.tags.get_mut(&tag) else {
            return;
        };
        *locks -= 1;
        if let Some(n) = leases.get_mut(&lease) {
            *n -= 1;
            if *n == 0 {
                leases.remove(&lease);
            }
        }
        if *locks == 0 {
            self.tags.remove(&tag);
        }
    }

    /// Lock keys on `lease`.
    fn on_lease(&self, lease: i64) -> u64 {
        let counts = self.tags.get(&LeaseTag::in_lease(lease));
        counts
            .and_then(|(_, leases)| leases.get(&lease).copied())
            .unwrap_or(0)
    }

    fn held(&self, tag: LeaseTag) -> Held {
        self.tags
            .get(&tag)
            .map_or(Held::default(), |(locks, leases)| Held {
                locks: *locks,
                sessions: leases.len() as u64,
            })
    }
}

/// The cache's state, shared by its feeder task and its readers.
struct State {
    /// std `RwLock`: lookups and event batches are short and never await.
    keys: RwLock<Table>,
    /// The revision up to which every change of the lock keys is applied.
    applied: watch::Sender<i64>,
    /// False while loading or after the watch broke.
    usable: AtomicBool,
    /// When the watch last delivered anything.
    last_message: Mutex<Instant>,
    /// A barrier the watch went silent on (its revision; 0: none), for the
    /// watch to end on when [`State::silent`] wakes it.
    silent_barrier: AtomicI64,
    silent: tokio::sync::Notify,
    /// Wakes lookups waiting for a barrier when the watch stops.
    stopped: tokio::sync::Notify,
    /// Grants this router committed that the cache may not show yet.
    recent: RecentGrants,
    /// Grant txns this router has in flight, by name.
    in_flight: Arc<GrantsInFlight>,
}

/// The grant txns this router has in flight on the shard, by name: one
/// mark each, which its guard removes.
#[derive(Default)]
struct GrantsInFlight(Mutex<foldhash::HashMap<NameHash, watch::Receiver<()>>>);

impl GrantsInFlight {
    fn mark(this: &Arc<Self>, hash: NameHash) -> GrantInFlight {
        let (done, mark) = watch::channel(());
        (this.0.lock().expect("in-flight lock")).insert(hash, mark.clone());
        GrantInFlight {
            marks: this.clone(),
            hash,
            mark,
            _done: done,
        }
    }

    async fn settled(&self, hash: &NameHash) {
        let flight = (self.0.lock().expect("in-flight lock")).get(hash).cloned();
        if let Some(mut flight) = flight {
            // Nothing is ever sent: this ends when the guard drops.
            let _ = flight.changed().await;
        }
    }
}

/// A grant txn in flight ([`LockCache::granting`]); dropping it ends the
/// wait of the acquires of the same name.
pub struct GrantInFlight {
    marks: Arc<GrantsInFlight>,
    hash: NameHash,
    /// Its mark in `marks`.
    mark: watch::Receiver<()>,
    _done: watch::Sender<()>,
}

impl Drop for GrantInFlight {
    fn drop(&mut self) {
        let mut marks = self.marks.0.lock().expect("in-flight lock");
        // Another grant of the name may have been marked since: only this
        // one's mark goes.
        if (marks.get(&self.hash)).is_some_and(|m| m.same_channel(&self.mark)) {
            marks.remove(&self.hash);
        }
    }
}

/// Most grants [`RecentGrants`] keeps: past it, those the cache has applied
/// are dropped, and if that is not enough (the cache is far behind, or
/// stopped), all of them: they are hints.
const RECENT_GRANTS_MAX: usize = 4_096;

/// The grants this router committed on the shard, each until the cache has
/// applied its revision or the router released the lock: with the cache's
/// entries, what an acquire looks at before it writes. The acquires of a
/// contended name that waited for its grant in flight ([`GrantsInFlight`])
/// would otherwise find it still free in the cache (the watch's lag) and
/// each send a grant txn that fails, which etcd 3.4 still proposes. A hint
/// like the cache's entries, stale either way (another router may have
/// released the name since): the acquire reads the name before it answers
/// from it.
#[derive(Default)]
struct RecentGrants(Mutex<foldhash::HashMap<NameHash, i64>>);

impl RecentGrants {
    /// `hash`'s name was granted at `revision`; the cache has applied
    /// changes up to `applied`.
    fn granted(&self, hash: NameHash, revision: i64, applied: i64) {
        let mut grants = self.0.lock().expect("recent grants lock");
        if grants.len() >= RECENT_GRANTS_MAX {
            grants.retain(|_, r| *r > applied);
            if grants.len() >= RECENT_GRANTS_MAX {
                grants.clear();
            }
        }
        grants.insert(hash, revision);
    }

    /// The lock that `hash`'s grant at `revision` made was released.
    fn released(&self, hash: &NameHash, revision: i64) {
        let mut grants = self.0.lock().expect("recent grants lock");
        if grants.get(hash) == Some(&revision) {
            grants.remove(hash);
        }
    }

    /// Whether a grant of `hash`'s name is newer than what the cache has
    /// applied (`applied`).
    fn shows(&self, hash: &NameHash, applied: i64) -> bool {
        let mut grants = self.0.lock().expect("recent grants lock");
        match grants.get(hash) {
            Some(&revision) if revision > applied => true,
            Some(_) => {
                grants.remove(hash);
                false
            }
            None => false,
        }
    }
}

/// What a barrier tells the renewals that waited for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Barrier {
    /// The cache has applied the barrier's revision.
    Applied,
    /// It did not within [`LAG_BOUND`], or its watch stopped: read etcd.
    Lagging,
}

type BarrierReply = oneshot::Sender<Result<Barrier, EtcdError>>;

/// Handle to a shard's lock-key cache; dropping it stops its tasks.
pub struct LockCache {
    state: Arc<State>,
    barriers: mpsc::Sender<BarrierReply>,
    _feeder: crate::task::TaskGuard,
    _barrier: crate::task::TaskGuard,
}

/// What the cache's tasks need of the shard.
#[derive(Clone)]
struct Source {
    conn: EtcdConn,
    keys: Keys,
    identity: IdentityCell,
}

impl LockCache {
    /// `spacing`: the least time between two barriers
    /// (`etcd.barrier_spacing_ms`).
    pub fn start(
        conn: EtcdConn,
        keys: Keys,
        identity: IdentityCell,
        spacing: Duration,
        cancel: &CancellationToken,
    ) -> Self {
        let state = Arc::new(State {
            keys: RwLock::new(Table::default()),
            applied: watch::Sender::new(0),
            usable: AtomicBool::new(false),
            last_message: Mutex::new(Instant::now()),
            silent_barrier: AtomicI64::new(0),
            silent: tokio::sync::Notify::new(),
            stopped: tokio::sync::Notify::new(),
            recent: RecentGrants::default(),
            in_flight: Arc::default(),
        });
        let source = Source {
            conn,
            keys,
            identity,
        };
        let (tx, rx) = mpsc::channel(16_384);
        let feeder_cancel = cancel.child_token();
        let barrier_cancel = cancel.child_token();
        let feeder = tokio::spawn(feed(source.clone(), state.clone(), feeder_cancel.clone()));
        let barrier = tokio::spawn(barriers(
            source,
            state.clone(),
            rx,
            spacing,
            barrier_cancel.clone(),
        ));
        Self {
            state,
            barriers: tx,
            _feeder: crate::task::TaskGuard::new(feeder, feeder_cancel),
            _barrier: crate::task::TaskGuard::new(barrier, barrier_cancel),
        }
    }

    /// The entries of `hashes` as of a revision committed after this call
    /// began, or `Unsure`. An error means the barrier could not be written
    /// (the shard is unavailable, or is not the shard it was verified as).
    pub async fn lookup(&self, hashes: &[NameHash]) -> Result<Vouched, EtcdError> {
        // One wake-up: the barrier task answers once the cache has applied
        // the barrier (or gave up waiting), not when etcd answered it.
        if !self.barrier_applied().await? {
            return Ok(Vouched::Unsure);
        }
        let keys = self.state.keys.read().expect("cache lock");
        // Checked under the lock: a watch that broke after applying the
        // barrier cleared `usable` before touching the map.
        if !self.state.usable.load(Ordering::Acquire) {
            return Ok(Vouched::Unsure);
        }
        Ok(Vouched::Entries(keys.keys.get_all(hashes)))
    }

    /// How many lock keys ride on each of `leases`, as of a revision
    /// committed after this call began (a barrier, as for
    /// [`LockCache::lookup`]); `None` when the cache cannot vouch.
    pub async fn locks_on(&self, leases: &[i64]) -> Result<Option<Vec<u64>>, EtcdError> {
        if !self.barrier_applied().await? {
            return Ok(None);
        }
        let table = self.state.keys.read().expect("cache lock");
        // Under the lock, as in `lookup`.
        if !self.state.usable.load(Ordering::Acquire) {
            return Ok(None);
        }
        Ok(Some(leases.iter().map(|l| table.on_lease(*l)).collect()))
    }

    /// Whether the cache has applied a barrier written after this call
    /// began (`false`: it cannot vouch, or lags).
    async fn barrier_applied(&self) -> Result<bool, EtcdError> {
        if !self.state.usable.load(Ordering::Acquire) {
            return Ok(false);
        }
        let (reply, rx) = oneshot::channel();
        if self.barriers.send(reply).await.is_err() {
            return Ok(false);
        }
        let Ok(barrier) = rx.await else {
            return Ok(false);
        };
        Ok(barrier? == Barrier::Applied)
    }

    /// The revision up to which the cache has applied every change (its
    /// counts included); 0 before its first load.
    pub fn applied(&self) -> i64 {
        *self.state.applied.borrow()
    }

    /// The entry of `hash` as the cache has it now, with no barrier: a
    /// hint that may be stale either way, never the basis of an answer.
    /// Acquires use it to look before they write (a held name is refused
    /// by a read instead of a txn).
    pub fn hint(&self, hash: &NameHash) -> Option<Entry> {
        if !self.state.usable.load(Ordering::Acquire) {
            return None;
        }
        self.state.keys.read().expect("cache lock").keys.get(hash)
    }

    /// Whether the name of `hash` looks held: the cache shows its key, or
    /// this router granted it at a revision the cache has not applied yet.
    /// A hint with no barrier, stale either way ([`LockCache::hint`]).
    pub fn shows_held(&self, hash: &NameHash) -> bool {
        self.hint(hash).is_some() || self.state.recent.shows(hash, self.applied())
    }

    /// This router granted `hash`'s name at `revision` (the lock key's
    /// create revision): until the cache applies it, the name looks held.
    pub fn granted(&self, hash: NameHash, revision: i64) {
        self.state.recent.granted(hash, revision, self.applied());
    }

    /// This router released the lock granted at `revision` on `hash`'s
    /// name.
    pub fn released(&self, hash: &NameHash, revision: i64) {
        self.state.recent.released(hash, revision);
    }

    /// Marks a grant txn of `hash`'s name in flight from this router until
    /// the guard is dropped (answered, failed or cancelled alike).
    pub fn granting(&self, hash: NameHash) -> GrantInFlight {
        GrantsInFlight::mark(&self.state.in_flight, hash)
    }

    /// Whether this router has a grant txn of `hash`'s name in flight, or
    /// granted it at a revision the cache has not applied yet.
    pub fn grant_pending(&self, hash: &NameHash) -> bool {
        (self.state.in_flight.0.lock().expect("in-flight lock")).contains_key(hash)
            || self.state.recent.shows(hash, self.applied())
    }

    /// Returns once no grant txn of `hash`'s name that this router had in
    /// flight when called is in flight any more: an acquire that would
    /// race it to the same name waits for its outcome (then looks again)
    /// instead of sending a txn that fails once the other grants.
    pub async fn grant_settled(&self, hash: &NameHash) {
        self.state.in_flight.settled(hash).await
    }

    /// Whether each of `hashes` has a lock key, as of a revision at or
    /// after `revision`; `None` when the cache cannot say (loading, broken,
    /// or not yet at `revision`). Not a barrier: for candidates that a txn
    /// then checks, never for an answer to a client.
    pub fn present(&self, hashes: &[NameHash], revision: i64) -> Option<Vec<bool>> {
        let table = self.state.keys.read().expect("cache lock");
        let ready = self.state.usable.load(Ordering::Acquire) && self.applied() >= revision;
        ready.then(|| {
            let entries = table.keys.get_all(hashes);
            entries.iter().map(Option::is_some).collect()
        })
    }

    /// The locks and sessions of `tag` on the shard as the cache has them
    /// now (no barrier), while it vouches.
    pub fn held(&self, tag: LeaseTag) -> Option<Held> {
        let table = self.state.keys.read().expect("cache lock");
        self.state
            .usable
            .load(Ordering::Acquire)
            .then(|| table.held(tag))
    }

    /// Lock keys the cache holds (for metrics), while it vouches.
    pub fn len(&self) -> Option<usize> {
        self.state
            .usable
            .load(Ordering::Acquire)
            .then(|| self.state.keys.read().expect("cache lock").keys.len())
    }
}

/// Writes barriers: one at a time, at least `spacing` apart, each
/// answering every request that arrived before it was sent, once the cache
/// has applied it (so a renewal waits for one message, not two).
async fn barriers(
    source: Source,
    state: Arc<State>,
    mut rx: mpsc::Receiver<BarrierReply>,
    spacing: Duration,
    cancel: CancellationToken,
) {
    let mut last_sent: Option<tokio::time::Instant> = None;
    loop {
        let first = tokio::select! {
            r = rx.recv() => match r { Some(r) => r, None => return },
            _ = cancel.cancelled() => return,
        };
        let next = last_sent.map(|t| t + spacing);
        if let Some(next) = next.filter(|&n| n > tokio::time::Instant::now()) {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                _ = cancel.cancelled() => return,
            }
        }
        last_sent = Some(tokio::time::Instant::now());
        let mut waiting = vec![first];
        while let Ok(r) = rx.try_recv() {
            waiting.push(r);
        }
        let result = match write_barrier(&source, waiting.len()).await {
            Ok(revision) => {
                tokio::select! {
                    b = applied(&state, revision, Instant::now()) => Ok(b),
                    _ = cancel.cancelled() => return,
                }
            }
            Err(e) => Err(e),
        };
        for w in waiting {
            let _ = w.send(result.clone());
        }
    }
}

/// Waits until the cache has applied the barrier at `revision`, answered
/// at `answered`: [`Barrier::Lagging`] if that takes over [`LAG_BOUND`],
/// or the watch stops or is not usable. If nothing at all came on the
/// watch within [`SILENT_WATCH`] of the answer, the watch is silent: it is
/// told to end (the cache loads again), and this barrier lags.
async fn applied(state: &State, revision: i64, answered: Instant) -> Barrier {
    let mut applied = state.applied.subscribe();
    let stopped = state.stopped.notified();
    tokio::pin!(stopped);
    if !state.usable.load(Ordering::Acquire) {
        return Barrier::Lagging;
    }
    let caught_up = applied.wait_for(|r| *r >= revision);
    tokio::pin!(caught_up);
    // Looked at once: what makes a watch silent for this barrier (nothing
    // came since its answer, the barrier not applied) can only stop being
    // true, so a later look would find nothing the first did not.
    tokio::select! {
        r = tokio::time::timeout_at((answered + SILENT_WATCH).into(), &mut caught_up) => match r {
            Ok(Ok(_)) => return Barrier::Applied,
            Ok(Err(_)) => return Barrier::Lagging,
            Err(_) => {}
        },
        _ = &mut stopped => return Barrier::Lagging,
    }
    if silent(state, revision, answered) {
        state.silent_barrier.store(revision, Ordering::Release);
        state.silent.notify_one();
        return Barrier::Lagging;
    }
    tokio::select! {
        r = tokio::time::timeout_at((answered + LAG_BOUND).into(), caught_up) => match r {
            Ok(Ok(_)) => Barrier::Applied,
            _ => Barrier::Lagging,
        },
        _ = stopped => Barrier::Lagging,
    }
}

/// Puts the barrier key, for `renewals` waiting ones, if the shard still
/// carries its verified identity; returns the put's revision.
async fn write_barrier(source: &Source, renewals: usize) -> Result<i64, EtcdError> {
    let identity = source.identity.read().expect("identity lock").clone();
    let Some(identity) = identity else {
        return Err(source
            .conn
            .unavailable("the shard's identity is not verified"));
    };
    let k = &source.keys;
    let txn = Txn::new()
        .when([Compare::value(k.identity(), CompareOp::Equal, identity)])
        .and_then([TxnOp::put(k.barrier(), Vec::new(), None)]);
    crate::metrics::cache_barrier(source.conn.shard(), renewals);
    // Hedged: a barrier put twice is two barriers, either of which proves
    // the cache current once applied; the first answer's revision counts.
    let resp = source.conn.txn_hedged(txn).await?;
    if !resp.succeeded() {
        return Err(source
            .conn
            .unavailable("the cluster does not carry this shard's verified identity"));
    }
    Ok(resp.header().map(|h| h.revision()).unwrap_or(0))
}

/// Loads the cache and follows the watch; loads again whenever the watch
/// breaks, backing off while the shard does not answer.
async fn feed(source: Source, state: Arc<State>, cancel: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    let mut member = None;
    loop {
        state.usable.store(false, Ordering::Release);
        // Each load watches through a member of its own, in turn, so a
        // watch that went silent is not opened on the same member again.
        let picked = source.conn.member(member);
        member = picked.as_ref().map(|(i, _)| *i);
        let client = picked.map_or_else(|| source.conn.client().clone(), |(_, c)| c);
        let run = async {
            let revision = load(&source, &state).await?;
            follow(&source, &state, &client, revision).await
        };
        let ended = tokio::select! {
            r = run => r,
            _ = cancel.cancelled() => return,
        };
        state.usable.store(false, Ordering::Release);
        state.stopped.notify_waiters();
        if let Err(e) = ended {
            // Renewals fall back to reads meanwhile: worth an operator's eye.
            tracing::info!(shard = %source.conn.shard(), error = %e, "lock-key cache stopped; loading it again");
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = cancel.cancelled() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Reads every lock key (keys only), page by page at one revision, into the
/// cache; returns that revision.
async fn load(source: &Source, state: &State) -> Result<i64, EtcdError> {
    let (start, end) = source.keys.locks_range();
    let prefix = start.len();
    let mut keys = Table::default();
    let mut from = start;
    let mut revision = 0;
    loop {
        let mut opts = GetOptions::new()
            .with_range(end.clone())
            .with_limit(10_000)
            .with_keys_only();
        if revision > 0 {
            opts = opts.with_revision(revision);
        }
        let key = from.clone();
        let mut resp = source
            .conn
            .call_hedged("Range", |client| {
                let (key, opts) = (key.clone(), opts.clone());
                async move { client.kv_client().get(key, Some(opts)).await }
            })
            .await?;
        if revision == 0 {
            revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        }
        let more = resp.more();
        let kvs = resp.take_kvs();
        for kv in &kvs {
            if let Some(hash) = hash_of_hex(&kv.key()[prefix..]) {
                keys.insert(hash, (kv.create_revision(), kv.lease()));
            }
        }
        match kvs.last() {
            Some(last) if more => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => break,
        }
    }
    *state.keys.write().expect("cache lock") = keys;
    state.applied.send_replace(revision);
    Ok(revision)
}

/// Applies the watch's events from `revision + 1` until it breaks or goes
/// silent.
async fn follow(
    source: &Source,
    state: &State,
    client: &etcd_client::Client,
    revision: i64,
) -> Result<(), EtcdError> {
    let (start, _) = source.keys.locks_range();
    let opts = WatchOptions::new()
        .with_range(source.keys.cache_range_end())
        .with_start_revision(revision + 1);
    let mut watcher = client.watch_client();
    let mut stream = source
        .conn
        .call("Watch", watcher.watch(start.clone(), Some(opts)))
        .await?;
    *state.last_message.lock().expect("watch lock") = Instant::now();
    state.usable.store(true, Ordering::Release);
    loop {
        // No timer here: the barrier task finds a silent watch (`applied`).
        let message = tokio::select! {
            m = stream.message() => m,
            _ = state.silent.notified() => {
                // A barrier before this load was applied by the load itself.
                let missing = state.silent_barrier.load(Ordering::Acquire);
                if missing > revision && *state.applied.borrow() < missing {
                    return Err(source.conn.unavailable(format!(
                        "the watch went silent: barrier {missing} answered but not delivered"
                    )));
                }
                continue;
            }
        };
        let Some(resp) = message.map_err(|e| source.conn.classify(e))? else {
            return Err(source.conn.unavailable("the watch ended"));
        };
        *state.last_message.lock().expect("watch lock") = Instant::now();
        if resp.canceled() || resp.compact_revision() > 0 {
            return Err(source.conn.unavailable(format!(
                "the watch was cancelled (compacted at {})",
                resp.compact_revision()
            )));
        }
        let mut last = None;
        {
            let mut keys = state.keys.write().expect("cache lock");
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                last = Some(kv.mod_revision());
                let Some(hash) = kv
                    .key()
                    .strip_prefix(start.as_slice())
                    .and_then(hash_of_hex)
                else {
                    continue; // the barrier key
                };
                match event.event_type() {
                    EventType::Put => {
                        keys.insert(hash, (kv.create_revision(), kv.lease()));
                    }
                    EventType::Delete => {
                        keys.remove(&hash);
                    }
                }
            }
        }
        if let Some(rev) = last {
            state.applied.send_if_modified(|a| {
                let moved = rev > *a;
                *a = (*a).max(rev);
                moved
            });
        }
    }
}

/// Whether the barrier at `revision`, answered at `answered` more than
/// [`SILENT_WATCH`] ago, is still not applied with nothing at all come on
/// the watch since its answer.
fn silent(state: &State, revision: i64, answered: Instant) -> bool {
    let quiet = *state.last_message.lock().expect("watch lock") < answered;
    *state.applied.borrow() < revision && quiet && answered.elapsed() >= SILENT_WATCH
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An acquire waits for the grant of its name in flight, whichever way
    /// that ends, and only for the one marked last; other names do not wait.
    #[tokio::test]
    async fn an_acquire_waits_for_the_grant_of_its_name_in_flight() {
        use crate::shard::keys::name_hash;
        use futures::FutureExt;
        let marks = Arc::new(GrantsInFlight::default());
        let (a, b) = (name_hash("a"), name_hash("b"));
        marks.settled(&a).now_or_never().expect("nothing in flight");
        let first = GrantsInFlight::mark(&marks, a);
        marks.settled(&b).now_or_never().expect("another name");
        let mut waiting = Box::pin(marks.settled(&a));
        assert!((&mut waiting).now_or_never().is_none());
        drop(first);
        waiting.now_or_never().expect("the grant ended");
        // Two grants of one name in flight: the first's end leaves the
        // second's mark.
        let first = GrantsInFlight::mark(&marks, a);
        let second = GrantsInFlight::mark(&marks, a);
        drop(first);
        let mut waiting = Box::pin(marks.settled(&a));
        assert!((&mut waiting).now_or_never().is_none());
        drop(second);
        waiting.now_or_never().expect("the second grant ended");
        assert!(marks.0.lock().unwrap().is_empty());
    }

    /// A grant looks held until the cache applies its revision or the
    /// router releases that very grant; a release of an older grant of the
    /// name leaves a newer one; the hints stay bounded.
    #[test]
    fn a_grant_looks_held_until_the_cache_applies_it_or_it_is_released() {
        use crate::shard::keys::name_hash;
        let recent = RecentGrants::default();
        let (a, b) = (name_hash("a"), name_hash("b"));
        assert!(!recent.shows(&a, 0));
        recent.granted(a, 10, 5);
        assert!(recent.shows(&a, 5) && recent.shows(&a, 9));
        assert!(!recent.shows(&b, 5));
        // The cache has applied the grant: its own entry speaks now.
        assert!(!recent.shows(&a, 10));
        assert!(!recent.shows(&a, 5), "forgotten once applied");
        recent.granted(a, 20, 10);
        recent.released(&a, 12);
        assert!(recent.shows(&a, 10), "a release of another grant");
        recent.released(&a, 20);
        assert!(!recent.shows(&a, 10));
        // Bounded: those applied go first, then all.
        for i in 0..RECENT_GRANTS_MAX as i64 {
            recent.granted(name_hash(&format!("n{i}")), 100 + i, 0);
        }
        recent.granted(b, 50_000, 100 + RECENT_GRANTS_MAX as i64 / 2);
        let kept = recent.0.lock().unwrap().len();
        assert_eq!(kept, RECENT_GRANTS_MAX / 2);
        assert!(recent.shows(&b, 0));
        for i in 0..RECENT_GRANTS_MAX as i64 {
            recent.granted(name_hash(&format!("m{i}")), 100_000 + i, 0);
        }
        assert!(recent.0.lock().unwrap().len() < RECENT_GRANTS_MAX);
    }

    #[test]
    fn the_key_map_answers_as_a_map_does_through_puts_replacements_and_deletes() {
        let mut map = KeyMap::default();
        let mut model: HashMap<NameHash, Entry> = HashMap::new();
        let name = |i: u64| crate::shard::keys::name_hash(&format!("order-{}", i % 5_000));
        // A fixed walk over puts, re-puts and deletes of 5,000 names.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..40_000_i64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = name(x);
            if x % 3 == 0 {
                assert_eq!(map.remove(&n), model.remove(&n));
            } else {
                let entry = (step, (x % 7) as i64);
                assert_eq!(map.insert(n, entry), model.insert(n, entry));
            }
        }
        assert_eq!(map.len(), model.len());
        let names: Vec<NameHash> = (0..6_000)
            .map(name)
            .chain((5_000..5_100).map(|i| crate::shard::keys::name_hash(&format!("absent-{i}"))))
            .collect();
        let want: Vec<Option<Entry>> = names.iter().map(|n| model.get(n).copied()).collect();
        assert_eq!(map.get_all(&names), want);
        assert!(want.iter().any(Option::is_some) && want.iter().any(Option::is_none));
        for n in &names {
            assert_eq!(map.get(n), model.get(n).copied());
        }
    }

    #[test]
    fn counts_per_tag_follow_puts_replacements_and_deletes() {
        let (pay, ship) = (LeaseTag::of("pay"), LeaseTag::of("ship"));
        let (a, b) = (pay.new_lease_id(), pay.new_lease_id());
        let s = ship.new_lease_id();
        let h = |n: &str| crate::shard::keys::name_hash(n);
        let mut t = Table::default();
        t.insert(h("1"), (10, a));
        t.insert(h("2"), (11, a));
        t.insert(h("3"), (12, b));
        t.insert(h("4"), (13, s));
        let held = |locks, sessions| Held { locks, sessions };
        assert_eq!(t.held(pay), held(3, 2));
        assert_eq!(t.held(ship), held(1, 1));
        // The same name put again (a new grant after a delete we missed):
        // counted once, under its new lease.
        t.insert(h("3"), (14, s));
        assert_eq!((t.held(pay), t.held(ship)), (held(2, 1), held(2, 1)));
        t.remove(&h("1"));
        t.remove(&h("1"));
        t.remove(&h("2"));
        assert_eq!(t.held(pay), held(0, 0));
        assert!(!t.tags.contains_key(&pay), "an empty tag is forgotten");
        t.remove(&h("3"));
        t.remove(&h("4"));
        assert!(t.tags.is_empty() && t.keys.is_empty());
    }
}
