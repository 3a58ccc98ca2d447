//! Waiting acquire (`waitMs > 0`): a FIFO queue per name, kept in etcd so
//! that it holds across router replicas.
//!
//! A waiter puts `P/waiters/<hash>/<lease>-<nonce>` on its session lease;
//! the queue's order is the keys' create revisions. The waiter at the head
//! is granted by one txn that creates the lock key on its session lease and
//! deletes its waiter key, only if the name is free, the ring unchanged, its
//! key still there (so its session is alive: a key goes with its lease) and
//! no key older than its own remains. Others watch their predecessor's key;
//! the head watches the lock key, so a release or an expiry hands over at
//! once, with no polling. A non-waiting acquire fails while anyone is
//! queued (no barging, see `shard.rs`). A waiter that gives up (deadline,
//! dropped request) deletes its key; if its client dies, the key goes with
//! the session lease.
//!
//! During an open migration a moved name may still be held on its previous
//! shard, where no queue exists: such waits retry every few milliseconds
//! instead of queueing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse,
};
use tokio::sync::Semaphore;

use crate::etcd::EtcdError;
use crate::keys::{name_hash, Recorded};
use crate::locks::{
    grant_session, invalid, lock_value, unavailable, AcquireRequest, Acquired, Active, Expiry,
    LockError, NewGrant,
};
use crate::shard::Shard;

/// Concurrent waiters a router accepts; beyond it, 429.
pub struct WaitSlots(Arc<Semaphore>);

impl WaitSlots {
    pub fn new(max: usize) -> Self {
        Self(Arc::new(Semaphore::new(max)))
    }
}

/// One step of the head-of-queue grant txn.
enum Step {
    Granted {
        revision: i64,
    },
    /// Wait for this key to be deleted.
    WaitFor {
        key: Vec<u8>,
        holder: Option<KeyValue>,
    },
    /// Our waiter key is gone: our session lease expired.
    Gone,
    RingChanged(Option<Recorded>),
}

/// Deletes the waiter key when the wait ends in any way, including the
/// request being dropped, unless the grant consumed it.
struct QueueEntry {
    shard: Arc<Shard>,
    key: Option<Vec<u8>>,
}

impl Drop for QueueEntry {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let shard = self.shard.clone();
            tokio::spawn(async move {
                let mut kv = shard.conn.client().kv_client();
                let _ = shard.conn.call("DeleteRange", kv.delete(key, None)).await;
            });
        }
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
        let ttl_secs = self.check_acquire(req)?;
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
            .map_err(|_| LockError::RateLimited)?;
        let deadline = Instant::now() + Duration::from_millis(req.wait_ms);
        let shard = self.router.shard_for(&req.name).clone();
        loop {
            let answer = self.acquire_now(req).await?;
            if !matches!(answer, Acquired::Held(_)) || Instant::now() >= deadline {
                return Ok(answer);
            }
            if self.moved(&req.name, &shard) {
                // Held where no queue exists (its previous shard): retry.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            if let Some(answer) = self.queue(req, ttl_secs, &shard, deadline).await? {
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
        let hash = name_hash(&req.name);
        let key = shard.keys.lock(&hash);
        let waiters = shard.keys.waiters(&hash);
        let session = shard
            .sessions
            .get_or_grant(&req.client_id, ttl_secs, || grant_session(shard, ttl_secs))
            .await?;
        let nonce = NONCE.fetch_add(1, Ordering::Relaxed) ^ process_salt();
        let mine = shard.keys.waiter(&hash, session.id, nonce);
        let mut kv = shard.conn.client().kv_client();
        let put = kv.put(
            mine.clone(),
            req.client_id.clone(),
            Some(PutOptions::new().with_lease(session.id)),
        );
        let my_rev = match shard.conn.call("Put", put).await {
            Ok(resp) => resp.header().map(|h| h.revision()).unwrap_or(0),
            Err(EtcdError::LeaseNotFound) => {
                shard
                    .sessions
                    .invalidate(&req.client_id, ttl_secs, session.id)
                    .await;
                return Err(unavailable(shard, "the session lease expired; retry"));
            }
            Err(e) => return Err(e.into()),
        };
        let mut entry = QueueEntry {
            shard: shard.clone(),
            key: Some(mine.clone()),
        };
        let window = self.window(ttl_secs);
        let keep_alive_every = Duration::from_millis(u64::from(ttl_secs) * 1000 / 3);
        let mut last_holder = None;
        let mut watch = QueueWatch::open(shard, &key, &mine).await?;
        loop {
            let ring = self.granting_ring(shard)?;
            if self.moved(&req.name, shard) {
                return Ok(None); // dropping the entry leaves the queue
            }
            let (epoch, value) = lock_value(req, &ring)?;
            match head_grant(
                shard, &key, value, session.id, &ring, &waiters, &mine, my_rev,
            )
            .await?
            {
                Step::Granted { revision } => {
                    entry.key = None; // the txn deleted it
                    let renewal = shard.keepalive.refresh(session.id, window).await?;
                    if !renewal.alive() {
                        // The session ran out right after: the lock went with it.
                        shard
                            .sessions
                            .invalidate(&req.client_id, ttl_secs, session.id)
                            .await;
                        return Ok(Some(Acquired::Held(Expiry(Instant::now()))));
                    }
                    let made = NewGrant {
                        epoch,
                        ttl_secs,
                        lease: session.id,
                        revision,
                        hash,
                    };
                    return Ok(Some(Acquired::Granted(made.grant(shard, renewal)?)));
                }
                Step::Gone => {
                    entry.key = None;
                    shard
                        .sessions
                        .invalidate(&req.client_id, ttl_secs, session.id)
                        .await;
                    return Ok(Some(Acquired::Held(Expiry(Instant::now()))));
                }
                Step::RingChanged(found) => {
                    self.router.ring_changed(shard, found);
                    continue; // granting_ring answers 503 if it must
                }
                Step::WaitFor {
                    key: watched,
                    holder,
                } => {
                    if holder.is_some() {
                        last_holder = holder;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        break;
                    }
                    // Wake for the deletion, the deadline, or to keep the
                    // session (and so the queue entry) alive meanwhile; the
                    // keepalive is skipped on a wake-up that may be a
                    // handover, where it would delay the grant.
                    let until = deadline.min(now + keep_alive_every);
                    if !watch.until_deleted(shard, watched, until).await? {
                        shard.keepalive.refresh(session.id, window).await?;
                    }
                }
            }
        }
        drop(entry);
        match last_holder {
            Some(h) => {
                let sent_at = Instant::now();
                let left = shard.time_to_live(h.lease()).await?;
                let expires = Expiry(sent_at + Duration::from_secs(left as u64));
                Ok(Some(Acquired::Held(expires)))
            }
            None => Ok(Some(Acquired::Held(Expiry(Instant::now())))),
        }
    }
}

/// Grants the name to the head of its queue if that is `mine`.
#[allow(clippy::too_many_arguments)]
async fn head_grant(
    shard: &Shard,
    key: &[u8],
    value: Vec<u8>,
    lease: i64,
    ring: &Recorded,
    waiters: &[u8],
    mine: &[u8],
    my_rev: i64,
) -> Result<Step, EtcdError> {
    let ring_key = shard.keys.ring();
    let predecessor = GetOptions::new()
        .with_prefix()
        .with_max_create_revision(my_rev - 1)
        .with_sort(SortTarget::Create, SortOrder::Descend)
        .with_limit(1);
    let txn = Txn::new()
        .when([
            Compare::create_revision(key, CompareOp::Equal, 0),
            Compare::value(ring_key.clone(), CompareOp::Equal, ring.bytes.clone()),
            Compare::create_revision(mine, CompareOp::Equal, my_rev),
            // Every queued key is as young as ours or younger: we are first.
            Compare::create_revision(waiters, CompareOp::Greater, my_rev - 1).with_prefix(),
        ])
        .and_then([
            TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease))),
            TxnOp::delete(mine, None),
        ])
        .or_else([
            TxnOp::get(key, None),
            TxnOp::get(ring_key, None),
            TxnOp::get(mine, None),
            TxnOp::get(waiters, Some(predecessor)),
        ]);
    let mut kv = shard.conn.client().kv_client();
    let resp = shard.conn.call("Txn", kv.txn(txn)).await?;
    let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
    if resp.succeeded() {
        return Ok(Step::Granted { revision });
    }
    let mut gets = resp.op_responses().into_iter().map(|op| match op {
        TxnOpResponse::Get(mut g) => g.take_kvs().into_iter().next(),
        _ => None,
    });
    let (holder, recorded, me, before) = (
        gets.next().flatten(),
        gets.next().flatten(),
        gets.next().flatten(),
        gets.next().flatten(),
    );
    let recorded = recorded.map(|kv| Recorded::parse(kv.value()));
    if recorded.as_ref() != Some(ring) {
        return Ok(Step::RingChanged(recorded));
    }
    if me.is_none() {
        return Ok(Step::Gone);
    }
    Ok(match (before, holder) {
        (Some(p), holder) => Step::WaitFor {
            key: p.key().to_vec(),
            holder,
        },
        (None, Some(h)) => Step::WaitFor {
            key: key.to_vec(),
            holder: Some(h),
        },
        // Free and first, yet the txn failed: something changed; look again.
        (None, None) => Step::WaitFor {
            key: Vec::new(),
            holder: None,
        },
    })
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
