//! Waiting acquire (`waitMs > 0`): first come, first served, through the
//! name's queue on its shard, which holds across router replicas. What the
//! queue is in etcd (a waiter's entry on a lease of its own, the grant txn
//! at its head, the watch a waiter sleeps on) is the shard's
//! (`shard/queue.rs`); this file is the policy: the cap on waiters and on
//! `waitMs`, when to queue, keeping the waiter's leases alive, when to give
//! up, and what each answer of the head's grant means for the caller. A
//! non-waiting acquire fails while anyone is queued (no barging, see
//! `shard/name.rs`).
//!
//! While it waits, the router keeps the client's session lease and the
//! entry's lease alive, every third of their TTL, whatever wakes it.
//!
//! During an open migration a moved name may still be held on its previous
//! shard, where no queue exists: such waits retry every few milliseconds
//! instead of queueing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::LockDelay;
use crate::locks::{
    epoch_of, lease_end, lock_value, Acquire, Acquired, Active, Expiry, LockError, WaitSlots,
};
use crate::refusal::RateLimited;
use crate::shard::keys::{name_hash, LockValue, Stored};
use crate::shard::queue::{Awaited, QueueEntry};
use crate::shard::{AcquireTxn, Renewal, SessionLease, Shard};
use crate::token::lock_id::LockId;

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

impl Active {
    /// Acquire that waits up to `req.wait_ms`, first come first served.
    pub(crate) async fn acquire_waiting(
        &self,
        req: &Acquire,
        slots: &WaitSlots,
    ) -> Result<Acquired, LockError> {
        let ttl_secs = req.ttl_secs;
        let _slot = slots
            .0
            .clone()
            .try_acquire_owned()
            .map_err(|_| RateLimited {
                reason: "too many callers are waiting; retry later".into(),
                retry_after: super::RETRY_AFTER,
            })?;
        let deadline = Instant::now() + req.wait;
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
            let w = waiting.get_or_insert_with(|| crate::metrics::Waiting::start(shard.name()));
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
            .is_some_and(|m| m.previous_shard(name).name() != shard.name())
    }

    /// Waits in the name's queue on `shard`; `None` if a migration moved the
    /// name meanwhile (then the queue no longer decides who gets it).
    async fn queue(
        &self,
        req: &Acquire,
        ttl_secs: u32,
        shard: &Arc<Shard>,
        deadline: Instant,
    ) -> Result<Option<Acquired>, LockError> {
        let k = shard.name_keys(&name_hash(&req.name));
        // A principal at its quota is refused before it queues (as an
        // acquire that does not wait), and again at each grant below.
        let session = {
            let reservation = self.reserve_lock(req.owner.as_ref())?;
            let owner = req.owner.as_ref();
            shard
                .session(req.holder.as_str(), ttl_secs, owner.map(|o| o.tag), || {
                    self.admit_session(owner, reservation.as_ref())
                })
                .await?
        };
        let entry = shard.enqueue(&k, req.holder.as_str()).await?;
        let now = Instant::now();
        let mut alive = KeepAlive {
            session,
            session_due: now,
            entry_due: now + KeepAlive::every(entry.ttl_secs()),
        };
        let mut last_holder = None;
        let mut replace_held = None;
        let mut watch = shard.watch_queue(&k, &entry).await?;
        loop {
            if !self.keep_alive(shard, req, &entry, &mut alive).await? {
                return Ok(Some(Acquired::Held(Expiry(Instant::now()))));
            }
            let g = self.grantable(shard)?;
            if self.moved(&req.name, shard) {
                return Ok(None); // dropping the entry leaves the queue
            }
            let value = lock_value(req, &g.ring)?;
            let reservation = self.reserve_lock(req.owner.as_ref())?;
            let sent = Instant::now();
            let step = shard
                .head_grant_txn(
                    &k,
                    &value,
                    alive.session.id,
                    &g,
                    &entry,
                    replace_held.take(),
                )
                .await?;
            let awaited = match step {
                AcquireTxn::Granted { revision } => {
                    if let Some(r) = reservation {
                        r.granted(shard, revision);
                    }
                    let window = self.window(ttl_secs);
                    let session = shard.keep_session(req.holder.as_str(), &alive.session, window);
                    let Some(renewal) = session.await? else {
                        // The session ran out right after: the lock went with it.
                        return Ok(Some(Acquired::Held(Expiry(Instant::now()))));
                    };
                    let lock = LockId {
                        shard: shard.name().into(),
                        epoch: epoch_of(&g.ring)?,
                        ttl_secs,
                        lease: alive.session.id,
                        revision,
                        name_hash: k.hash,
                        owner: Default::default(),
                    };
                    let granted = self.grant(lock, req.holder.as_str(), &renewal, sent)?;
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
                    if holds(&holder, req.holder.as_str()) =>
                {
                    // The caller's own client holds the name (granted through
                    // another request): the answer is that grant.
                    let held = self.held(shard, req.holder.as_str(), holder, &k, None, sent);
                    return held.await.map(Some);
                }
                AcquireTxn::Held(holder) => {
                    last_holder = Some(holder);
                    Awaited::Holder
                }
                AcquireTxn::Behind(ahead, holder) => {
                    last_holder = holder.or(last_holder);
                    Awaited::Ahead(ahead)
                }
                AcquireTxn::Delayed(delay) => {
                    last_holder = Some(delay);
                    Awaited::Delay
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
                AcquireTxn::Queued => Awaited::Nothing,
            };
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            // Wake for the deletion, the deadline, or to keep the session
            // and the entry alive; whatever woke it, the next txn reads
            // the name afresh.
            let until = deadline.min(alive.next_due());
            watch.until_gone(shard, awaited, until).await?;
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
        req: &Acquire,
        entry: &QueueEntry,
        alive: &mut KeepAlive,
    ) -> Result<bool, LockError> {
        let now = Instant::now();
        let ttl = alive.session.ttl_secs;
        if now >= alive.session_due {
            let window = self.window(ttl);
            let session = shard.keep_session(req.holder.as_str(), &alive.session, window);
            let Some(renewal) = session.await? else {
                return Ok(false);
            };
            alive.session_due = KeepAlive::due_after(now, &renewal, ttl);
        }
        if now >= alive.entry_due {
            let ttl = entry.ttl_secs();
            let window = self.window(ttl);
            let renewal = shard.renew_lease(entry.lease(), window, ttl).await?;
            if !renewal.alive() {
                return Ok(false);
            }
            alive.entry_due = KeepAlive::due_after(now, &renewal, ttl);
        }
        Ok(true)
    }
}

/// Whether the lock key `kv` is held by `client_id`.
fn holds(kv: &Stored, client_id: &str) -> bool {
    serde_json::from_slice::<LockValue>(kv.value()).is_ok_and(|v| v.client == client_id)
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
