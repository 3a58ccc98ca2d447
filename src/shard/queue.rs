//! The queue of waiting acquires of one name, as it is kept on the shard
//! (`docs/design.md`, section 13): a waiter's entry, the grant txn of the
//! waiter at its head, the watch a waiter sleeps on, and the keepalives of
//! the waiter's leases. When to queue, how long to wait, when to give up
//! and what to answer is the lock layer's (`locks/wait.rs`), which holds a
//! [`Waiter`] while it waits; what the queue is in etcd is here.
//!
//! A waiter puts `P/waiters/<hash>/<lease>` on a short lease of its
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
//! so a release or an expiry hands over at once, with no polling.
//!
//! While it waits, a waiter keeps the client's session lease and its
//! entry's lease alive, every third of their TTL, whatever wakes it.
//!
//! A wait whose grant txn etcd answered `succeeded` left its entry's lease
//! carrying nothing (the txn deleted the one key on it): the lease is
//! kept ([`EmptiedLeases`](super::spares::EmptiedLeases)) for the next waiter on the shard instead of
//! revoked, which saves that waiter the lease's grant and this one its
//! revoke (docs/design.md, section 13, "An entry's lease, used again").

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, WatchStream,
};

use super::conn::EtcdError;
use super::keepalive::Renewal;
use super::keys::{LockValue, Stored};
use super::name::{
    classify_refusal, gets, grant_compares, grant_ops, name_reads, name_state, revision,
    AcquireTxn, Grantable, NameKeys, NameState,
};
use super::sessions::SessionLease;
use super::spares::Spare;
use super::Shard;

/// The TTL of a queue entry's lease: short, so a lost entry clears soon.
const ENTRY_TTL_SECS: u32 = 5;

/// A waiter's entry in a name's queue. Its key rides on a lease of its
/// own, revoked when the entry is dropped (giving up, the request being
/// dropped, an error), which deletes the key; a lease a grant txn emptied
/// is kept for the next waiter instead ([`EmptiedLeases`](super::spares::EmptiedLeases)).
struct QueueEntry {
    shard: Arc<Shard>,
    lease: i64,
    ttl_secs: u32,
    key: Vec<u8>,
    /// Its place in the queue: the create revision of its key.
    revision: i64,
    /// etcd answered a grant txn `succeeded`, which deleted the key: the
    /// lease carries nothing now.
    emptied: bool,
}

impl Drop for QueueEntry {
    fn drop(&mut self) {
        let (shard, lease) = (self.shard.clone(), self.lease);
        if self.emptied {
            if let Some(granted) = shard.keepalive.confirmed(lease) {
                shard.entry_leases.keep(Spare { id: lease, granted });
                return;
            }
        }
        tokio::spawn(async move {
            let _ = shard.revoke(lease).await;
        });
    }
}

/// What [`Waiter::keep_alive`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// The session and the entry are alive.
    Alive,
    /// The client's session lease is gone (ended early: etcd's lease bugs,
    /// an operator's revoke, a pause past its TTL).
    SessionGone,
    /// The entry's lease is gone: the waiter lost its place.
    EntryGone,
}

/// A waiter in a name's queue, held by the lock layer while it waits: its
/// entry, the client's session lease it is to be granted on, and the watch
/// it sleeps on. Dropping it leaves the queue.
pub struct Waiter {
    /// The keys of the name it waits for.
    k: NameKeys,
    /// Its place in the queue; revoked (so gone) when the waiter drops.
    entry: QueueEntry,
    /// The one watch stream of the whole wait.
    watch: QueueWatch,
    /// The client's session lease, which the head's grant puts the lock on.
    session: SessionLease,
    /// When the session is next renewed.
    session_due: Instant,
    /// When the entry's lease is next renewed.
    entry_due: Instant,
    /// What its entry's txn read, until the wait first looks at it.
    found: Option<Found>,
}

/// What a waiter's entry's txn read after its `Put`.
struct Found {
    /// The key of the entry just ahead of the waiter's own, if any.
    ahead: Option<Stored>,
    /// The name's lock key, if held.
    holder: Option<Stored>,
}

impl Waiter {
    /// The keys of the name waited for.
    pub fn keys(&self) -> &NameKeys {
        &self.k
    }

    /// The client's session lease, which a grant puts the lock on.
    pub fn session(&self) -> &SessionLease {
        &self.session
    }

    /// Renews the client's session and the entry's lease, each if a third
    /// of its TTL has passed since it was last renewed, whatever woke the
    /// waiter; `window` gives, per TTL, how long a confirmed keepalive
    /// spares another. Says which is gone, if one is (the session is then
    /// forgotten, and the client's locks went with it).
    pub async fn keep_alive(
        &mut self,
        holder: &str,
        window: impl Fn(u32) -> Duration,
    ) -> Result<Kept, EtcdError> {
        let shard = &self.entry.shard;
        let now = Instant::now();
        if now >= self.session_due {
            let ttl = self.session.ttl_secs;
            let kept = shard.keep_session(holder, &self.session, window(ttl));
            let Some(renewal) = kept.await? else {
                return Ok(Kept::SessionGone);
            };
            self.session_due = due_after(now, &renewal, ttl);
        }
        if now >= self.entry_due {
            let ttl = self.entry.ttl_secs;
            let renewal = (shard.renew_lease(self.entry.lease, window(ttl), ttl)).await?;
            if !renewal.alive() {
                // Kept alive as it was, it ended early: so may have the
                // emptied ones kept.
                shard.entry_leases.drop_all();
                return Ok(Kept::EntryGone);
            }
            self.entry_due = due_after(now, &renewal, ttl);
        }
        Ok(Kept::Alive)
    }

    /// Once, right after the waiter queued: the entry its entry's txn found
    /// just ahead of its own, if there was one, and the name's holder it
    /// read. The waiter then waits for that entry first: a grant txn would
    /// fail its compare (an older entry remains).
    pub fn found_ahead(&mut self) -> Option<(Stored, Option<Stored>)> {
        let Found { ahead, holder } = self.found.take()?;
        Some((ahead?, holder))
    }

    /// Waits on `session` from now on, the client's new session after its
    /// last was found gone ([`Kept::SessionGone`]); kept alive from the
    /// next [`Waiter::keep_alive`] on.
    pub fn set_session(&mut self, session: SessionLease) {
        self.session = session;
        self.session_due = Instant::now();
    }

    /// Grants the name to the waiter, on its session, if it is first in
    /// the queue and the name is grantable ([`Shard::head_grant_txn`]);
    /// otherwise says what it waits for. A grant deleted the entry, so its
    /// lease is kept for the next waiter when the waiter drops.
    /// `look_first`: read first, and send the txn only if the read finds
    /// the waiter first and the name grantable (docs/design.md, section
    /// 13, "Who watches what").
    pub async fn grant(
        &mut self,
        value: &LockValue,
        g: &Grantable,
        replace_held: Option<i64>,
        look_first: bool,
    ) -> Result<AcquireTxn, EtcdError> {
        let (k, lease) = (&self.k, self.session.id);
        if look_first {
            let seen = self.entry.shard.head_look(k, g, &self.entry).await?;
            if !matches!(seen, AcquireTxn::Queued) {
                return Ok(seen);
            }
        }
        let answer = (self.entry.shard)
            .head_grant_txn(k, value, lease, g, &self.entry, replace_held)
            .await;
        if let Ok(AcquireTxn::Granted { .. }) = answer {
            self.entry.emptied = true;
        }
        answer
    }

    /// Sleeps until what the waiter awaits, or its own entry, is deleted
    /// ([`Woke::Gone`]), or until `deadline` or the next keepalive of its
    /// leases is due ([`Woke::Due`]).
    pub async fn sleep(&mut self, awaited: Awaited, deadline: Instant) -> Result<Woke, EtcdError> {
        let until = deadline.min(self.session_due).min(self.entry_due);
        let shard = &self.entry.shard;
        self.watch.until_gone(shard, awaited, until).await
    }
}

/// A third of a lease's TTL: how often a waiter renews it.
fn third(ttl_secs: u32) -> Duration {
    Duration::from_millis(u64::from(ttl_secs) * 1000 / 3)
}

/// When to look at a lease again after `renewal`: a third of its TTL
/// later, or sooner if less than a third would be left by then (a renewal
/// that sent no keepalive answers the time the lease has), so its
/// keepalive always goes out with a third of the TTL to spare.
fn due_after(now: Instant, renewal: &Renewal, ttl_secs: u32) -> Instant {
    let every = third(ttl_secs);
    let early = renewal.deadline().checked_sub(every).unwrap_or(now);
    (now + every).min(early).max(now)
}

/// What a waiter waits to see go before it looks again (from the answer
/// of [`Waiter::grant`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Awaited {
    /// The name's holder: its lock key.
    Holder,
    /// A lost holder's lock-delay.
    Delay,
    /// The entry just ahead of the waiter's own, as
    /// [`AcquireTxn::Behind`] gave it (its key may come back later, younger:
    /// its create revision says which entry is awaited).
    Ahead(Stored),
    /// Nothing: the name is free and the waiter first, yet the txn failed
    /// (something changed meanwhile); look again in a moment.
    Nothing,
}

/// Why [`Waiter::sleep`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woke {
    /// What it waited for, or the waiter's own entry, is gone (or may be:
    /// look again).
    Gone,
    /// The time it was given came first.
    Due,
}

impl Shard {
    /// Queues `holder`, whose session lease on this shard is `session`,
    /// for `k`'s name: puts its entry at the end of the queue and opens the
    /// watch it sleeps on. The session is kept alive from the first
    /// [`Waiter::keep_alive`] on; the entry's lease, a third of its TTL
    /// after its grant or last renewal.
    pub async fn enqueue(
        self: &Arc<Self>,
        k: NameKeys,
        holder: &str,
        session: SessionLease,
    ) -> Result<Waiter, EtcdError> {
        let (entry, renewed, found) = self.put_entry(&k, holder).await?;
        let now = Instant::now();
        let entry_due = due_after(now, &renewed, entry.ttl_secs);
        let watch = QueueWatch::open(self, &k, &entry.key).await?;
        Ok(Waiter {
            k,
            entry,
            watch,
            session,
            session_due: now,
            entry_due,
            found: Some(found),
        })
    }

    /// Puts an entry of `client_id` at the end of the queue of `k`'s name,
    /// on a lease a granted wait emptied if one is kept, else on one granted
    /// now; returns it with its lease's grant or last renewal. A kept lease
    /// found gone drops them all (one of the shard's leases ended early),
    /// and the entry goes on a new one.
    async fn put_entry(
        self: &Arc<Self>,
        k: &NameKeys,
        client_id: &str,
    ) -> Result<(QueueEntry, Renewal, Found), EtcdError> {
        if let Some(kept) = self.entry_leases.take(Instant::now()) {
            match self.put_entry_on(k, client_id, kept).await {
                Err(EtcdError::LeaseNotFound) => self.entry_leases.drop_all(),
                put => return put.map(|(entry, found)| (entry, kept.granted, found)),
            }
        }
        let sent_at = Instant::now();
        let (lease, granted) = self.grant(ENTRY_TTL_SECS).await?;
        let renewal = Renewal {
            sent_at,
            ttl_secs: granted,
        };
        self.keepalive.seed(lease, renewal);
        let lease = Spare {
            id: lease,
            granted: renewal,
        };
        let (entry, found) = self.put_entry_on(k, client_id, lease).await?;
        Ok((entry, renewal, found))
    }

    /// Puts an entry of `client_id` for `k`'s name on `lease`, whose
    /// revocation it arms first, in a txn that then reads the entry just
    /// ahead of it and the name's holder (docs/design.md, section 13, "The
    /// entry's txn").
    async fn put_entry_on(
        self: &Arc<Self>,
        k: &NameKeys,
        client_id: &str,
        Spare { id: lease, granted }: Spare,
    ) -> Result<(QueueEntry, Found), EtcdError> {
        let mut entry = QueueEntry {
            shard: self.clone(),
            lease,
            ttl_secs: u32::try_from(granted.ttl_secs)
                .unwrap_or(ENTRY_TTL_SECS)
                .max(1),
            key: self.keys.waiter(&k.hash, lease),
            revision: 0,
            emptied: false,
        };
        let newest_two = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(2);
        let put = TxnOp::put(
            entry.key.as_slice(),
            client_id,
            Some(PutOptions::new().with_lease(lease)),
        );
        let ops = [
            put,
            TxnOp::get(k.waiters.clone(), Some(newest_two)),
            TxnOp::get(k.lock.clone(), None),
        ];
        let resp = self.txn(Txn::new().and_then(ops)).await?;
        entry.revision = revision(&resp);
        let mut ops = resp.op_responses().into_iter().skip(1);
        let mut read = || match ops.next() {
            Some(TxnOpResponse::Get(mut g)) => g.take_kvs(),
            _ => Vec::new(),
        };
        let ahead = (read().into_iter())
            .find(|kv| kv.key() != entry.key.as_slice() && kv.create_revision() < entry.revision)
            .map(Stored::from);
        let holder = read().into_iter().next().map(Stored::from);
        Ok((entry, Found { ahead, holder }))
    }

    /// Waiting acquires queued for `k`'s name (on its own shard: the only
    /// one with a queue for it). A count-only range.
    pub async fn queue_len(&self, k: &NameKeys) -> Result<u64, EtcdError> {
        Ok(self.count_prefix(&k.waiters).await?.max(0) as u64)
    }

    /// Grants the name to the waiter `mine` if it is first in the queue and
    /// the name is grantable (as [`acquire_txn`](Self::acquire_txn)),
    /// deleting its entry; otherwise says what it waits for.
    async fn head_grant_txn(
        &self,
        k: &NameKeys,
        value: &LockValue,
        lease: i64,
        g: &Grantable,
        mine: &QueueEntry,
        replace_held: Option<i64>,
    ) -> Result<AcquireTxn, EtcdError> {
        let mut when = grant_compares(&self.keys, k, g, replace_held);
        when.push(Compare::create_revision(
            mine.key.as_slice(),
            CompareOp::Equal,
            mine.revision,
        ));
        // Every queued key is as young as ours or younger: we are first.
        when.push(
            Compare::create_revision(k.waiters.clone(), CompareOp::Greater, mine.revision - 1)
                .with_prefix(),
        );
        when.push(self.keys.cutoff_compare(g.cutoff));
        let mut then = grant_ops(k, value, lease);
        then.push(TxnOp::delete(mine.key.as_slice(), None));
        let txn = (Txn::new().when(when).and_then(then)).or_else(self.head_reads(k, mine));
        let resp = self.txn(txn).await?;
        if resp.succeeded() {
            return Ok(AcquireTxn::Granted {
                revision: revision(&resp),
            });
        }
        Ok(self.refusal_read(resp, g))
    }

    /// What the waiter `mine` would be refused for now, from one read-only
    /// txn of what its grant txn reads when it fails;
    /// [`AcquireTxn::Queued`] if it is first and the name grantable, so
    /// that its grant txn may go.
    async fn head_look(
        &self,
        k: &NameKeys,
        g: &Grantable,
        mine: &QueueEntry,
    ) -> Result<AcquireTxn, EtcdError> {
        let resp = self
            .txn(Txn::new().and_then(self.head_reads(k, mine)))
            .await?;
        Ok(self.refusal_read(resp, g))
    }

    /// What the grant txn of the waiter `mine` reads when it fails: the
    /// name, the waiter's own entry, the entry just ahead of it and the
    /// grant cut-off.
    fn head_reads(&self, k: &NameKeys, mine: &QueueEntry) -> Vec<TxnOp> {
        let predecessor = GetOptions::new()
            .with_prefix()
            .with_max_create_revision(mine.revision - 1)
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1);
        let mut reads = name_reads(&self.keys, k);
        reads.push(TxnOp::get(mine.key.as_slice(), None));
        reads.push(TxnOp::get(k.waiters.clone(), Some(predecessor)));
        reads.push(self.keys.cutoff_read());
        reads
    }

    /// Why the waiter is not granted, from the answers of [`head_reads`](Self::head_reads).
    fn refusal_read(&self, resp: etcd_client::TxnResponse, g: &Grantable) -> AcquireTxn {
        let mut gets = gets(resp);
        let state = name_state(&mut gets);
        let (me, ahead) = (gets.next().flatten(), gets.next().flatten());
        let cutoff = self.keys.cutoff_of(gets.next().flatten());
        head_refusal(state, me, ahead, (g, cutoff))
    }
}

/// One watch stream for a whole wait: on the lock key and the waiter's own
/// entry from the start, and on each entry that comes to be ahead of it
/// (and on the lock-delay, if one is waited out).
///
/// Watches start at the current revision: etcd 3.4 serves those at once,
/// while a watch from a past revision waits for its catch-up loop (up to
/// 100 ms, which showed as a p99 handover of ~90 ms). A key whose watch
/// begins after the txn that named it is read once more, so a deletion in
/// between is not missed. Keeping the stream means the head, when the
/// holder releases, is already watching.
struct QueueWatch {
    stream: WatchStream,
    lock_key: Vec<u8>,
    delay_key: Vec<u8>,
    mine: Vec<u8>,
    /// Keys other than the lock key already watched (entries ahead of
    /// ours, the lock-delay).
    watched: Vec<Vec<u8>>,
}

impl QueueWatch {
    /// Opens the one watch stream of a whole wait in `k`'s queue, on the
    /// lock key and on the waiter's own entry `mine`.
    async fn open(shard: &Shard, k: &NameKeys, mine: &[u8]) -> Result<Self, EtcdError> {
        let mut client = shard.conn.client().watch_client();
        let stream = shard
            .conn
            .call("Watch", client.watch(k.lock.clone(), None))
            .await?;
        let mut w = Self {
            stream,
            lock_key: k.lock.clone(),
            delay_key: k.delay.clone(),
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

    /// Waits until what the waiter awaits, or its own entry, is deleted
    /// ([`Woke::Gone`]), or until `until` ([`Woke::Due`]).
    async fn until_gone(
        &mut self,
        shard: &Shard,
        awaited: Awaited,
        until: Instant,
    ) -> Result<Woke, EtcdError> {
        let (target, ahead) = match awaited {
            Awaited::Holder => (self.lock_key.clone(), None),
            Awaited::Delay => (self.delay_key.clone(), None),
            Awaited::Ahead(entry) => (entry.key().to_vec(), Some(entry)),
            Awaited::Nothing => {
                tokio::time::sleep(Duration::from_millis(5)).await;
                return Ok(Woke::Gone);
            }
        };
        if target != self.lock_key && !self.watched.contains(&target) {
            self.stream
                .watch(target.clone(), None)
                .await
                .map_err(|e| shard.conn.classify(e))?;
            self.created(shard).await?;
            self.watched.push(target.clone());
            if !still_there(shard, &target, ahead.as_ref(), &self.mine).await {
                return Ok(Woke::Gone);
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
                            return Ok(Woke::Gone);
                        }
                    }
                    Ok(None) => return Err(shard.conn.unavailable("watch stream closed")),
                    Err(e) => return Err(shard.conn.classify(e)),
                }
            }
        };
        tokio::time::timeout_at(until.into(), wait)
            .await
            .unwrap_or(Ok(Woke::Due))
    }
}

/// Why a head-of-queue grant did not grant, from what its `Else` read:
/// the name's state, the waiter's own entry, the entry just ahead of it
/// and the grant cut-off. A changed ring or identity first (nothing else
/// read means much then), then a waiter whose entry is gone, then the
/// entry ahead of it, and only for the first in line the name's own
/// refusal, or else the cut-off's move.
fn head_refusal(
    state: NameState,
    me: Option<Stored>,
    ahead: Option<Stored>,
    (g, cutoff): (&Grantable, i64),
) -> AcquireTxn {
    let holder = state.lock.clone();
    match (classify_refusal(state, g), ahead) {
        (Some(r @ (AcquireTxn::RingChanged(_) | AcquireTxn::IdentityChanged)), _) => r,
        _ if me.is_none() => AcquireTxn::Gone,
        (_, Some(ahead)) => AcquireTxn::Behind(ahead, holder),
        (Some(other), None) => other,
        (None, None) if cutoff > g.cutoff => AcquireTxn::CutoffMoved(cutoff),
        // Free and first, yet the txn failed: something changed; look again.
        (None, None) => AcquireTxn::Queued,
    }
}

/// Whether what a waiter is to wait for, `target` (the entry `ahead` of
/// it, if it is one), and its own entry `mine` are both still there (one
/// linearizable read); false on any error, so the caller looks again
/// rather than waits.
async fn still_there(shard: &Shard, target: &[u8], ahead: Option<&Stored>, mine: &[u8]) -> bool {
    let txn = Txn::new().and_then([TxnOp::get(target, None), TxnOp::get(mine, None)]);
    let Ok(resp) = shard.txn(txn).await else {
        return false;
    };
    let mut read = gets(resp);
    let (found, mine) = (read.next().flatten(), read.next().flatten());
    mine.is_some() && found.is_some_and(|kv| ahead.is_none_or(|a| the_same_entry(&kv, a)))
}

/// Whether `read` is the entry `ahead` and not a later one under its key
/// (a key comes back when its lease is used again for the same name, as a
/// new entry, behind every one then queued).
fn the_same_entry(read: &Stored, ahead: &Stored) -> bool {
    read.key() == ahead.key() && read.create_revision() == ahead.create_revision()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::keys::{Recorded, RingMeta};

    fn ring(fingerprint: &str) -> Recorded {
        Recorded::new(RingMeta {
            epoch: 1,
            ring: fingerprint.into(),
            previous: None,
        })
    }

    fn grantable() -> Grantable {
        Grantable {
            ring: ring("r1"),
            identity: b"id".to_vec(),
            cutoff: 0,
        }
    }

    fn kv(key: &str) -> Stored {
        Stored {
            key: key.as_bytes().to_vec(),
            ..Default::default()
        }
    }

    /// The name as read: held or not, under our ring or another.
    fn state(held: bool, fingerprint: &str) -> NameState {
        NameState {
            lock: held.then(|| kv("K")),
            held: held.then(|| kv("H")),
            delay: None,
            ring: Some(ring(fingerprint)),
            identity: Some(b"id".to_vec()),
        }
    }

    #[test]
    fn a_waiter_behind_another_waits_for_that_entry_and_learns_the_holder() {
        let g = grantable();
        let refusal = head_refusal(state(true, "r1"), Some(kv("me")), Some(kv("W1")), (&g, 0));
        assert!(matches!(
            refusal,
            AcquireTxn::Behind(ahead, Some(holder)) if ahead.key() == b"W1" && holder.key() == b"K"
        ));
        let free = head_refusal(state(false, "r1"), Some(kv("me")), Some(kv("W1")), (&g, 0));
        assert!(matches!(free, AcquireTxn::Behind(ahead, None) if ahead.key() == b"W1"));
    }

    #[test]
    fn the_first_in_line_gets_the_names_own_refusal() {
        let g = grantable();
        let held = head_refusal(state(true, "r1"), Some(kv("me")), None, (&g, 0));
        assert!(matches!(held, AcquireTxn::Held(h) if h.key() == b"K"));
        // Free and first, yet refused: something changed; look again.
        let changed = head_refusal(state(false, "r1"), Some(kv("me")), None, (&g, 0));
        assert!(matches!(changed, AcquireTxn::Queued));
        // The grant cut-off moved since the router last saw it.
        let moved = head_refusal(state(false, "r1"), Some(kv("me")), None, (&g, 9));
        assert!(matches!(moved, AcquireTxn::CutoffMoved(9)));
    }

    #[test]
    fn a_waiters_lease_is_looked_at_with_a_third_of_its_ttl_to_spare() {
        let now = Instant::now();
        let renewed = |ago_ms: u64| Renewal {
            sent_at: now - Duration::from_millis(ago_ms),
            ttl_secs: 30,
        };
        // Just renewed: a third of the TTL later.
        assert_eq!(
            due_after(now, &renewed(0), 30),
            now + Duration::from_secs(10)
        );
        // Answered from a keepalive 12 s old (18 s left): when 10 s are left.
        assert_eq!(
            due_after(now, &renewed(12_000), 30),
            now + Duration::from_secs(8)
        );
        // Less than a third left: at once.
        assert_eq!(due_after(now, &renewed(25_000), 30), now);
    }

    #[test]
    fn an_entry_ahead_whose_key_came_back_is_not_waited_for() {
        let entry = |key: &str, revision| Stored {
            key: key.as_bytes().to_vec(),
            create_revision: revision,
            ..Default::default()
        };
        let ahead = entry("W/lease", 10);
        assert!(the_same_entry(&entry("W/lease", 10), &ahead));
        // Deleted, then put again on its lease used again: behind us now.
        assert!(!the_same_entry(&entry("W/lease", 25), &ahead));
        assert!(!the_same_entry(&entry("W/other", 10), &ahead));
    }

    #[test]
    fn a_gone_entry_ends_the_wait_unless_the_shard_changed() {
        let g = grantable();
        let gone = head_refusal(state(true, "r1"), None, Some(kv("W1")), (&g, 0));
        assert!(matches!(gone, AcquireTxn::Gone));
        // Another ring first: nothing else read under it means much.
        let other_ring = head_refusal(state(true, "r2"), None, Some(kv("W1")), (&g, 0));
        assert!(matches!(other_ring, AcquireTxn::RingChanged(Some(_))));
        let mut other_cluster = state(true, "r1");
        other_cluster.identity = Some(b"other".to_vec());
        let refusal = head_refusal(other_cluster, Some(kv("me")), Some(kv("W1")), (&g, 0));
        assert!(matches!(refusal, AcquireTxn::IdentityChanged));
    }
}
