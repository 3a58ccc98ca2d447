//! Waiting acquire (`waitMs > 0`): a FIFO queue per name, kept in etcd so
//! that it holds across router replicas.
//!
//! A waiter puts `P/waiters/<hash>/<lease>-<nonce>` on a short lease of its
//! own (not the client's session: an entry whose put timed out, or whose
//! cleanup failed, must never block the name for as long as the client
//! lives). The lease is granted, and its revocation armed, before the put,
//! so whatever happens to the request the entry goes within one entry TTL.
//! The queue's order is the keys' create revisions. The waiter at the head
//! is granted by one txn that creates the lock key on the client's session
//! lease and deletes its entry, only if the name is grantable (as a plain
//! acquire: free, no lock-delay, ring and identity unchanged), its entry is
//! still there and no entry older than its own remains. Others watch their
//! predecessor's entry; the head watches the lock key (or the lock-delay),
//! so a release or an expiry hands over at once, with no polling. A
//! non-waiting acquire fails while anyone is queued (no barging, see
//! `shard.rs`).
//!
//! While it waits, the router keeps the client's session lease and the
//! entry's lease alive, every third of their TTL, whatever wakes it.
//!
//! During an open migration a moved name may still be held on its previous
//! shard, where no queue exists: such waits retry every few milliseconds
//! instead of queueing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{EventType, PutOptions, Txn, TxnOp, TxnOpResponse};

use crate::config::LockDelay;
use crate::locks::{
    epoch_of, invalid, lease_end, lock_value, AcquireRequest, Acquired, Active, Expiry, LockError,
    WaitSlots,
};
use crate::shard::conn::EtcdError;
use crate::shard::keepalive::Renewal;
use crate::shard::keys::{name_hash, LockValue, Stored};
use crate::shard::sessions::SessionLease;
use crate::shard::{AcquireTxn, NameKeys, QueueHead, Shard};
use crate::token::lock_id::LockId;

/// The waiter's queue entry: its key rides on a lease of its own, revoked
/// when the wait ends in any way (a grant, giving up, the request being
/// dropped), which deletes the key if the grant did not.
struct Entry {
    shard: Arc<Shard>,
    lease: i64,
    ttl_secs: u32,
    key: Vec<u8>,
    revision: i64,
}

impl Drop for Entry {
    fn drop(&mut self) {
        let (shard, lease) = (self.shard.clone(), self.lease);
        tokio::spawn(async move {
            let _ = shard.revoke(lease).await;
        });
    }
}

/// The TTL of a queue entry's lease: short, so a lost entry clears soon.
const ENTRY_TTL_SECS: u32 = 5;

impl Entry {
    /// Grants the entry's lease, arms its revocation, then puts the key.
    async fn enter(shard: &Arc<Shard>, k: &NameKeys, client_id: &str) -> Result<Self, LockError> {
        let sent_at = Instant::now();
        let (lease, granted) = shard.grant(ENTRY_TTL_SECS).await?;
        let renewal = Renewal {
            sent_at,
            ttl_secs: granted,
        };
        shard.keepalive.seed(lease, renewal);
        let nonce = NONCE.fetch_add(1, Ordering::Relaxed) ^ process_salt();
        let mut entry = Entry {
            shard: shard.clone(),
            lease,
            ttl_secs: u32::try_from(granted).unwrap_or(ENTRY_TTL_SECS).max(1),
            key: shard.keys.waiter(&k.hash, lease, nonce),
            revision: 0,
        };
        let mut kv = shard.conn.client().kv_client();
        let put = kv.put(
            entry.key.clone(),
            client_id.to_string(),
            Some(PutOptions::new().with_lease(lease)),
        );
        let resp = shard.conn.call("Put", put).await?;
        entry.revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        Ok(entry)
    }
}

/// When the waiter next renews the session and its entry.
struct KeepAlive {
    session: SessionLease,
    session_due: Instant,
    entry_due: Instant,
}

impl KeepAlive {
    fn every(ttl_secs: u32) -> Duration {
        Duration::from_millis(u64::from(ttl_secs) * 1000 / 3)
    }

    fn next_due(&self) -> Instant {
        self.session_due.min(self.entry_due)
    }

    /// When to look at a lease again after `renewal`: a third of its TTL
    /// later, or sooner if less than a third would be left by then (a
    /// renewal that sent no keepalive answers the time the lease has), so
    /// its keepalive always goes out with a third of the TTL to spare.
    fn due_after(now: Instant, renewal: &Renewal, ttl_secs: u32) -> Instant {
        let every = Self::every(ttl_secs);
        let early = renewal.deadline().checked_sub(every).unwrap_or(now);
        (now + every).min(early).max(now)
    }
}

static NONCE: AtomicU64 = AtomicU64::new(0);

impl Active {
    /// Acquire that waits up to `req.wait_ms`, first come first served.
    pub async fn acquire_waiting(
        &self,
        req: &AcquireRequest,
        slots: &WaitSlots,
    ) -> Result<Acquired, LockError> {
        let ttl_secs = self.ttl_secs(req.ttl_ms)?;
        if req.wait_ms > self.limits.max_wait_ms {
            return Err(invalid(format!(
                "waitMs must be at most {}",
                self.limits.max_wait_ms
            )));
        }
        let _slot = slots
            .0
            .clone()
            .try_acquire_owned()
            .map_err(|_| LockError::RateLimited {
                reason: "too many callers are waiting; retry later".into(),
                retry_after: super::RETRY_AFTER,
            })?;
        let deadline = Instant::now() + Duration::from_millis(req.wait_ms);
        let shard = self.router.shard_for(&req.name).clone();
        // A waiter from the first answer that the name is held until its
        // own answer (an acquire answered at once never waited); dropping
        // it uncounts it, however the wait ends.
        let mut waiting: Option<crate::metrics::Waiting> = None;
        loop {
            let answer = self.acquire_now(req).await?;
            if !matches!(answer, Acquired::Held(_)) || Instant::now() >= deadline {
                if let Some(w) = &mut waiting {
                    w.ended(matches!(answer, Acquired::Granted(_)));
                }
                return Ok(answer);
            }
            let w = waiting.get_or_insert_with(|| crate::metrics::Waiting::start(&shard.name));
            if self.moved(&req.name, &shard) {
                // Held where no queue exists (its previous shard): retry.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            if let Some(answer) = self.queue(req, ttl_secs, &shard, deadline).await? {
                w.ended(matches!(answer, Acquired::Granted(_)));
                return Ok(answer);
            }
            // The name turned out to be moved while queued: retry as above.
        }
    }

    /// Whether an open migration moved `name` here from another shard.
    fn moved(&self, name: &str, shard: &Shard) -> bool {
        self.router
            .migration()
            .is_some_and(|m| m.previous_shard(name).name != shard.name)
    }

    /// Waits in the name's queue on `shard`; `None` if a migration moved the
    /// name meanwhile (then the queue no longer decides who gets it).
    async fn queue(
        &self,
        req: &AcquireRequest,
        ttl_secs: u32,
        shard: &Arc<Shard>,
        deadline: Instant,
    ) -> Result<Option<Acquired>, LockError> {
        let k = shard.name_keys(&name_hash(&req.name));
        // A principal at its quota is refused before it queues (as an
        // acquire that does not wait), and again at each grant below.
        let session = {
            let reservation = self.reserve_lock(req.owner.as_ref())?;
            shard
                .sessions
                .get_or_grant(&req.client_id, ttl_secs, || {
                    self.new_session(shard, ttl_secs, req.owner.as_ref(), reservation.as_ref())
                })
                .await?
        };
        let entry = Entry::enter(shard, &k, &req.client_id).await?;
        let now = Instant::now();
        let mut alive = KeepAlive {
            session,
            session_due: now,
            entry_due: now + KeepAlive::every(entry.ttl_secs),
        };
        let mut last_holder = None;
        let mut replace_held = None;
        let mut watch = QueueWatch::open(shard, &k.lock, &entry.key).await?;
        loop {
            if !self.keep_alive(shard, req, &entry, &mut alive).await? {
                return Ok(Some(Acquired::Held(Expiry(Instant::now()))));
            }
            let g = self.grantable(shard)?;
            if self.moved(&req.name, shard) {
                return Ok(None); // dropping the entry leaves the queue
            }
            let value = lock_value(req, &g.ring, ttl_secs)?;
            let mine = QueueHead {
                key: &entry.key,
                revision: entry.revision,
            };
            let reservation = self.reserve_lock(req.owner.as_ref())?;
            let sent = Instant::now();
            let step = shard
                .head_grant_txn(&k, &value, alive.session.id, &g, mine, replace_held.take())
                .await?;
            let target = match step {
                AcquireTxn::Granted { revision } => {
                    if let Some(r) = reservation {
                        r.granted(shard, revision);
                    }
                    let window = self.window(ttl_secs);
                    let renewal = shard
                        .keepalive
                        .refresh(alive.session.id, window, ttl_secs)
                        .await?;
                    if !renewal.alive() {
                        // The session ran out right after: the lock went with it.
                        shard
                            .sessions
                            .invalidate(&req.client_id, ttl_secs, alive.session.id)
                            .await;
                        return Ok(Some(Acquired::Held(Expiry(Instant::now()))));
                    }
                    let lock = LockId {
                        shard: shard.name.as_str().into(),
                        epoch: epoch_of(&g.ring)?,
                        ttl_secs,
                        lease: alive.session.id,
                        revision,
                        name_hash: k.hash,
                        owner: Default::default(),
                    };
                    let granted = self.grant(lock, &req.client_id, &renewal, sent)?;
                    return Ok(Some(Acquired::Granted(granted)));
                }
                // Our entry's lease ended (it could not be kept alive).
                AcquireTxn::Gone => return Ok(Some(Acquired::Held(Expiry(Instant::now())))),
                AcquireTxn::RingChanged(found) => {
                    self.router.ring_changed(shard, found);
                    continue; // grantable answers 503 if it must
                }
                AcquireTxn::IdentityChanged => {
                    self.router.identity_changed(shard);
                    continue;
                }
                AcquireTxn::Held(holder) | AcquireTxn::Behind(_, Some(holder))
                    if holds(&holder, &req.client_id) =>
                {
                    // The caller's own client holds the name (granted through
                    // another request): the answer is that grant.
                    let held = self.held(shard, &req.client_id, holder, &k, None, sent);
                    return held.await.map(Some);
                }
                AcquireTxn::Held(holder) => {
                    last_holder = Some(holder);
                    k.lock.clone()
                }
                AcquireTxn::Behind(ahead, holder) => {
                    last_holder = holder.or(last_holder);
                    ahead
                }
                AcquireTxn::Delayed(delay) => {
                    last_holder = Some(delay);
                    k.delay.clone()
                }
                AcquireTxn::Lost(held) => {
                    match self.lost(shard, &k, &held, &g.identity).await? {
                        Some(_) => {}
                        None if self.lock_delay == LockDelay::Off => {
                            replace_held = Some(held.mod_revision());
                        }
                        None => {}
                    }
                    continue;
                }
                // Free and first, yet the txn failed: something changed.
                AcquireTxn::Queued => Vec::new(),
            };
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            // Wake for the deletion, the deadline, or to keep the session
            // and the entry alive.
            let until = deadline.min(alive.next_due());
            watch.until_deleted(shard, target, until).await?;
        }
        drop(entry);
        match last_holder {
            Some(h) => Ok(Some(Acquired::Held(lease_end(shard, &h).await?))),
            None => Ok(Some(Acquired::Held(Expiry(Instant::now())))),
        }
    }

    /// Renews the client's session and the entry's lease if a third of
    /// their TTL has passed since they were last renewed, whatever woke the
    /// waiter. False if the session is gone (the client's locks with it).
    async fn keep_alive(
        &self,
        shard: &Shard,
        req: &AcquireRequest,
        entry: &Entry,
        alive: &mut KeepAlive,
    ) -> Result<bool, LockError> {
        let now = Instant::now();
        let ttl = alive.session.ttl_secs;
        if now >= alive.session_due {
            let renewal = shard
                .keepalive
                .refresh(alive.session.id, self.window(ttl), ttl)
                .await?;
            if !renewal.alive() {
                shard
                    .sessions
                    .invalidate(&req.client_id, ttl, alive.session.id)
                    .await;
                return Ok(false);
            }
            alive.session_due = KeepAlive::due_after(now, &renewal, ttl);
        }
        if now >= alive.entry_due {
            let window = self.window(entry.ttl_secs);
            let renewal = shard
                .keepalive
                .refresh(entry.lease, window, entry.ttl_secs)
                .await?;
            if !renewal.alive() {
                return Ok(false);
            }
            alive.entry_due = KeepAlive::due_after(now, &renewal, entry.ttl_secs);
        }
        Ok(true)
    }
}

/// Whether the lock key `kv` is held by `client_id`.
fn holds(kv: &Stored, client_id: &str) -> bool {
    serde_json::from_slice::<LockValue>(kv.value()).is_ok_and(|v| v.client == client_id)
}

/// One watch stream for a whole wait: on the lock key and the waiter's own
/// entry from the start, and on each entry that comes to be ahead of it.
///
/// Watches start at the current revision: etcd 3.4 serves those at once,
/// while a watch from a past revision waits for its catch-up loop (up to
/// 100 ms, which showed as a p99 handover of ~90 ms). A key whose watch
/// begins after the txn that named it is read once more, so a deletion in
/// between is not missed. Keeping the stream means the head, when the
/// holder releases, is already watching.
struct QueueWatch {
    stream: etcd_client::WatchStream,
    lock_key: Vec<u8>,
    mine: Vec<u8>,
    /// Entries ahead of us already watched.
    watched: Vec<Vec<u8>>,
}

impl QueueWatch {
    async fn open(shard: &Shard, lock_key: &[u8], mine: &[u8]) -> Result<Self, EtcdError> {
        let mut client = shard.conn.client().watch_client();
        let stream = shard
            .conn
            .call("Watch", client.watch(lock_key.to_vec(), None))
            .await?;
        let mut w = Self {
            stream,
            lock_key: lock_key.to_vec(),
            mine: mine.to_vec(),
            watched: Vec::new(),
        };
        w.created(shard).await?;
        w.stream
            .watch(mine.to_vec(), None)
            .await
            .map_err(|e| shard.conn.classify(e))?;
        w.created(shard).await?;
        Ok(w)
    }

    /// Waits for etcd to confirm the watch just asked for.
    async fn created(&mut self, shard: &Shard) -> Result<(), EtcdError> {
        let confirm = async {
            loop {
                match self.stream.message().await {
                    Ok(Some(resp)) if resp.created() => return Ok(()),
                    Ok(Some(_)) => continue, // an event; the txn that follows reads state anyway
                    Ok(None) => return Err(shard.conn.unavailable("watch stream closed")),
                    Err(e) => return Err(shard.conn.classify(e)),
                }
            }
        };
        match tokio::time::timeout(shard.conn.timeout(), confirm).await {
            Ok(r) => r,
            Err(_) => Err(shard.conn.unavailable("watch not confirmed in time")),
        }
    }

    /// Waits until `target` (the lock key, or the entry ahead) or our own
    /// entry is deleted: true; or until `until`: false.
    async fn until_deleted(
        &mut self,
        shard: &Shard,
        target: Vec<u8>,
        until: Instant,
    ) -> Result<bool, EtcdError> {
        if target.is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
            return Ok(true);
        }
        if target != self.lock_key && !self.watched.contains(&target) {
            self.stream
                .watch(target.clone(), None)
                .await
                .map_err(|e| shard.conn.classify(e))?;
            self.created(shard).await?;
            self.watched.push(target.clone());
            if !both_present(shard, &target, &self.mine).await {
                return Ok(true);
            }
        }
        let (target, mine) = (&target, &self.mine);
        let stream = &mut self.stream;
        let wait = async {
            loop {
                match stream.message().await {
                    Ok(Some(resp)) if resp.canceled() => {
                        return Err(shard.conn.unavailable("watch cancelled by etcd"));
                    }
                    Ok(Some(resp)) => {
                        let hit = resp.events().iter().any(|e| {
                            e.event_type() == EventType::Delete
                                && e.kv()
                                    .is_some_and(|kv| kv.key() == target || kv.key() == mine)
                        });
                        if hit {
                            return Ok(true);
                        }
                    }
                    Ok(None) => return Err(shard.conn.unavailable("watch stream closed")),
                    Err(e) => return Err(shard.conn.classify(e)),
                }
            }
        };
        tokio::time::timeout_at(until.into(), wait)
            .await
            .unwrap_or(Ok(false))
    }
}

/// Whether both keys exist (one linearizable read); false on any error, so
/// the caller looks again rather than waits.
async fn both_present(shard: &Shard, a: &[u8], b: &[u8]) -> bool {
    let txn = Txn::new().and_then([TxnOp::get(a, None), TxnOp::get(b, None)]);
    let mut kv = shard.conn.client().kv_client();
    match shard.conn.call("Txn", kv.txn(txn)).await {
        Ok(resp) => resp.op_responses().into_iter().all(|op| match op {
            TxnOpResponse::Get(g) => !g.kvs().is_empty(),
            _ => false,
        }),
        Err(_) => false,
    }
}

/// Differs between processes, so two replicas' waiter keys never collide.
fn process_salt() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    static SALT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SALT.get_or_init(|| RandomState::new().hash_one(std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiters_lease_is_looked_at_with_a_third_of_its_ttl_to_spare() {
        let now = Instant::now();
        let renewed = |ago_ms: u64| Renewal {
            sent_at: now - Duration::from_millis(ago_ms),
            ttl_secs: 30,
        };
        // Just renewed: a third of the TTL later.
        assert_eq!(
            KeepAlive::due_after(now, &renewed(0), 30),
            now + Duration::from_secs(10)
        );
        // Answered from a keepalive 12 s old (18 s left): when 10 s are left.
        assert_eq!(
            KeepAlive::due_after(now, &renewed(12_000), 30),
            now + Duration::from_secs(8)
        );
        // Less than a third left: at once.
        assert_eq!(KeepAlive::due_after(now, &renewed(25_000), 30), now);
    }
}
