//! Waiting acquire (`waitMs > 0`): first come, first served, through the
//! name's queue on its shard, which holds across router replicas. What the
//! queue is in etcd (a waiter's entry on a lease of its own, the grant txn
//! at its head, the watch a waiter sleeps on, the keepalives of the
//! waiter's leases) is the shard's (`shard/queue.rs`, a `Waiter`); this
//! file is the policy: the cap on waiters and on `waitMs`, when to queue,
//! the quotas a waiter is held to, when to give up, and what each answer
//! of the head's grant means for the caller. A non-waiting acquire fails
//! while anyone is queued (no barging, see `shard/name.rs`). The wait in
//! the queue is generic over the shard ([`LockShard`]) and asks the router
//! what it must through [`Standing`], so its decisions are unit-tested on
//! an in-memory shard.
//!
//! During an open migration a moved name may still be held on its previous
//! shard, where no queue exists: such waits retry every few milliseconds
//! instead of queueing.

use std::time::{Duration, Instant};

use super::acquire::{granted_before_cut_off, holds, unless_cut_off};
use crate::config::LockDelay;
use crate::locks::{
    epoch_of, lease_end, lock_value, Acquire, Acquired, Active, Expiry, LockError, WaitSlots,
};
use crate::refusal::RateLimited;
use crate::shard::conn::EtcdError;
use crate::shard::keys::{name_hash, Recorded};
use crate::shard::ops::{LockShard, QueueWaiter};
use crate::shard::queue::{Awaited, Kept};
use crate::shard::{AcquireTxn, Grantable, SessionLease, SessionUse};
use crate::token::lock_id::LockId;

/// Sessions a wait may start after its client's was found gone: one
/// ended early is rare, two in a row are etcd losing leases, which the
/// wait then reports as it finds it (not granted).
const MOST_NEW_SESSIONS: u32 = 2;

impl Active {
    /// Acquire that waits until `req.wait_until`, first come first served.
    pub(crate) async fn acquire_waiting(
        &self,
        req: &Acquire,
        slots: &WaitSlots,
    ) -> Result<Acquired, LockError> {
        let _slot = slots
            .0
            .clone()
            .try_acquire_owned()
            .map_err(|_| RateLimited {
                reason: "too many callers are waiting; retry later".into(),
                retry_after: super::RETRY_AFTER,
            })?;
        let deadline = req.deadline();
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
            let w = waiting.get_or_insert_with(|| crate::metrics::Waiting::start(req.shard.name()));
            if self.moved(req) {
                // Held where no queue exists (its previous shard): retry.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            let standing = OnRouter { active: self, req };
            // On the heap: a waiting acquire's queue is the larger
            // future by far, and inline it would make every acquire's,
            // waiting or not, that large.
            let queued = Box::pin(self.queue(req, &standing));
            if let Some(answer) = queued.await? {
                w.ended(matches!(answer, Acquired::Granted(_)));
                return Ok(answer);
            }
            // The name turned out to be moved while queued: retry as above.
        }
    }

    /// Whether an open migration moved `req`'s name to its shard from
    /// another.
    fn moved(&self, req: &Acquire) -> bool {
        let name = req.name.as_str();
        self.router
            .migration()
            .is_some_and(|m| m.previous_shard(name).name() != req.shard.name())
    }

    /// Waits in the name's queue on `req`'s shard until `req`'s deadline;
    /// `None` if a migration moved the name meanwhile (then the queue no
    /// longer decides who gets it). `standing`: what the router says of
    /// the shard meanwhile.
    pub(crate) async fn queue<S: LockShard>(
        &self,
        req: &Acquire<S>,
        standing: &impl Standing,
    ) -> Result<Option<Acquired>, LockError> {
        let (shard, holder, deadline) = (&req.shard, req.holder.as_str(), req.deadline());
        let ttl_secs = req.ttl.secs();
        let k = shard.name_keys(&name_hash(req.name.as_str()));
        let session = self.waiting_session(req).await?;
        let mut waiter = shard.enqueue(k, holder, session).await?;
        let mut last_holder = None;
        let mut replace_held = None;
        // Sessions the wait may start after its client's was found gone.
        let mut new_sessions = MOST_NEW_SESSIONS;
        // Woken by the entry ahead leaving: read before a grant txn.
        let mut look_first = false;
        let not_granted = || Ok(Some(Acquired::Held(Expiry(Instant::now()))));
        loop {
            match waiter.keep_alive(holder, |ttl| self.window(ttl)).await? {
                Kept::Alive => {}
                Kept::SessionGone
                    if self
                        .new_session(req, &mut waiter, &mut new_sessions)
                        .await? =>
                {
                    continue;
                }
                Kept::SessionGone | Kept::EntryGone => return not_granted(),
            }
            let g = standing.grantable()?;
            if standing.moved() {
                return Ok(None); // dropping the waiter leaves the queue
            }
            if let Some((ahead, holder)) = waiter.found_ahead() {
                // Queued behind another: its grant txn would fail.
                last_holder = holder.or(last_holder);
                waiter.sleep(Awaited::Ahead(ahead), deadline).await?;
                look_first = true;
                continue;
            }
            let value = lock_value(req, &g.ring)?;
            let reservation = self.reserve_lock(shard.as_ref(), req.owner.as_ref())?;
            let sent = Instant::now();
            let look = std::mem::take(&mut look_first);
            let granted = match waiter.grant(&value, &g, replace_held.take(), look).await {
                // The txn puts the lock key on the session's lease (and
                // only deletes the entry's key): the session is gone, kept
                // alive as it was, so it ended early.
                Err(EtcdError::LeaseNotFound) => {
                    shard.session_gone(holder, waiter.session(), true).await;
                    if self
                        .new_session(req, &mut waiter, &mut new_sessions)
                        .await?
                    {
                        continue;
                    }
                    return not_granted();
                }
                granted => granted,
            };
            let Some(step) = unless_cut_off(&**shard, g.cutoff, granted).await? else {
                // Unanswered, and cut off: what it granted, if anything,
                // is the answer.
                let keys = waiter.keys();
                match granted_before_cut_off(self, &**shard, keys, holder, sent).await? {
                    Some(answer) => return Ok(Some(answer)),
                    None => continue,
                }
            };
            let awaited = match step {
                AcquireTxn::Granted { revision } => {
                    if let Some(r) = reservation {
                        r.granted(shard.clone(), revision);
                    }
                    let window = self.window(ttl_secs);
                    let session = waiter.session();
                    // Unanswered, the keepalive leaves the lock on the lease
                    // for as long as its last confirmed renewal vouches.
                    let kept = shard.keep_session(holder, session, window).await;
                    let kept =
                        kept.or_else(|e| shard.confirmed_renewal(session.id).map(Some).ok_or(e));
                    let Some(renewal) = kept? else {
                        // The session ran out right after: the lock went with it.
                        return Ok(Some(Acquired::Held(Expiry(Instant::now()))));
                    };
                    let lock = LockId {
                        shard: shard.name().into(),
                        epoch: epoch_of(&g.ring)?,
                        ttl_secs,
                        lease: session.id,
                        revision,
                        name_hash: waiter.keys().hash,
                        owner: Default::default(),
                    };
                    let granted = self.grant(lock, holder, &renewal, sent)?;
                    return Ok(Some(Acquired::Granted(granted)));
                }
                // Our entry's lease ended (it could not be kept alive).
                AcquireTxn::Gone => return Ok(Some(Acquired::Held(Expiry(Instant::now())))),
                AcquireTxn::RingChanged(found) => {
                    standing.ring_changed(found);
                    continue; // grantable answers 503 if it must
                }
                AcquireTxn::IdentityChanged => {
                    standing.identity_changed();
                    continue;
                }
                AcquireTxn::Held(kv) | AcquireTxn::Behind(_, Some(kv)) if holds(&kv, holder) => {
                    // The caller's own client holds the name (granted through
                    // another request): the answer is that grant.
                    let held = self.held(&**shard, holder, kv, waiter.keys(), None, sent);
                    return held.await.map(Some);
                }
                AcquireTxn::Held(kv) => {
                    last_holder = Some(kv);
                    Awaited::Holder
                }
                AcquireTxn::Behind(ahead, kv) => {
                    last_holder = kv.or(last_holder);
                    Awaited::Ahead(ahead)
                }
                AcquireTxn::Delayed(delay) => {
                    last_holder = Some(delay);
                    Awaited::Delay
                }
                AcquireTxn::Lost(held) => {
                    match self
                        .lost(&**shard, waiter.keys(), &held, &g.identity)
                        .await?
                    {
                        Some(_) => {}
                        None if self.lock_delay == LockDelay::Off => {
                            replace_held = Some(held.mod_revision());
                        }
                        None => {}
                    }
                    continue;
                }
                AcquireTxn::CutoffMoved(mark) => {
                    shard.learn_cutoff(mark);
                    continue;
                }
                // Free and first, yet the txn failed: something changed.
                AcquireTxn::Queued => Awaited::Nothing,
            };
            if Instant::now() >= deadline {
                break;
            }
            // Wakes for the deletion, the deadline, or to keep the session
            // and the entry alive; whatever woke it, the next txn reads the
            // name afresh.
            look_first = matches!(awaited, Awaited::Ahead(_));
            waiter.sleep(awaited, deadline).await?;
        }
        drop(waiter);
        match last_holder {
            Some(h) => Ok(Some(Acquired::Held(lease_end(&**shard, &h).await?))),
            None => Ok(Some(Acquired::Held(Expiry(Instant::now())))),
        }
    }

    /// A new session for `waiter`, whose client's session was found gone
    /// (ended early: etcd's lease bugs, an operator's revoke, a pause):
    /// nothing was granted on it in this wait, which goes on, in its place
    /// in the queue, on the new one. `false`, with nothing changed, once
    /// the wait has used up its `left` new sessions.
    async fn new_session<S: LockShard>(
        &self,
        req: &Acquire<S>,
        waiter: &mut S::Waiter,
        left: &mut u32,
    ) -> Result<bool, LockError> {
        if *left == 0 {
            return Ok(false);
        }
        *left -= 1;
        waiter.set_session(self.waiting_session(req).await?);
        Ok(true)
    }

    /// The session a waiting acquire's grant goes on, pinned (never handed
    /// on). A principal at its quota is refused before it queues (as an
    /// acquire that does not wait), and again at each grant.
    pub(crate) async fn waiting_session<S: LockShard>(
        &self,
        req: &Acquire<S>,
    ) -> Result<SessionLease, LockError> {
        let (_, session) = self.reserve_with_session(req, SessionUse::Pinned).await?;
        Ok(session)
    }
}

/// What a wait asks the router of the shard it waits on, each time it
/// looks again.
pub(crate) trait Standing {
    /// What a grant compares, if the shard may grant now.
    fn grantable(&self) -> Result<Grantable, LockError>;
    /// Whether an open migration moved the name here from another shard.
    fn moved(&self) -> bool;
    /// The shard records another ring than the one compared.
    fn ring_changed(&self, found: Option<Recorded>);
    /// The cluster behind the shard's endpoints is not the one verified.
    fn identity_changed(&self);
}

/// The router's word on the shard of an acquire's name.
struct OnRouter<'a> {
    active: &'a Active,
    req: &'a Acquire,
}

impl Standing for OnRouter<'_> {
    fn grantable(&self) -> Result<Grantable, LockError> {
        self.active.grantable(&self.req.shard)
    }

    fn moved(&self) -> bool {
        self.active.moved(self.req)
    }

    fn ring_changed(&self, found: Option<Recorded>) {
        self.active.router.ring_changed(&self.req.shard, found);
    }

    fn identity_changed(&self) {
        self.active.router.identity_changed(&self.req.shard);
    }
}
