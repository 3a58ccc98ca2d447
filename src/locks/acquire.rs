//! Acquire without waiting: the grant txn on the shard that owns the name,
//! the handoff check of a moved name during a migration, idempotent
//! re-acquire by the holder, and the lock-delay of a holder found lost.

use std::time::{Duration, Instant};

use super::validate::check_text;
use super::*;
use crate::config::LockDelay;
use crate::shard::conn::EtcdError;
use crate::shard::keys::{name_hash, LockValue, Recorded, Stored};
use crate::shard::ops::LockShard;
use crate::shard::{
    AcquireTxn, Grantable, NameKeys, Renewal, SessionGrant, SessionLease, SessionUse,
};
use crate::token::lock_id::LockId;

/// The answer of a grant txn (an acquire's, a waiting acquire's, an
/// extend's move) that compared the grant cut-off `compared`, or `None`
/// when it went unanswered and the cut-off has since moved past it: the
/// txn, which may still land, then grants nothing, and a read tells what
/// it did before the move (`docs/design.md`, "An acquire that was not
/// answered"). An unanswered txn whose cut-off could not be moved keeps
/// its error (its outcome is unknown), and so does one the caller's own
/// deadline cut short: that caller is answered 504 whatever comes, and a
/// move would only refuse every txn in flight on a shard too slow
/// already.
pub(super) async fn unless_cut_off<S: LockShard, T>(
    shard: &S,
    compared: i64,
    answer: Result<T, EtcdError>,
) -> Result<Option<T>, EtcdError> {
    match answer {
        Err(unanswered @ EtcdError::Unavailable { .. })
            if !crate::task::past_request_deadline() =>
        {
            match shard.move_cutoff_past(compared).await {
                Ok(()) => Ok(None),
                Err(_) => Err(unanswered),
            }
        }
        answer => answer.map(Some),
    }
}

/// What a grant txn cut off by [`unless_cut_off`] granted the caller's
/// client `client_id` before the move, read at once by the read that
/// settles it ([`LockShard::read_name_settled`]): the grant, if the name is
/// held by that client (answered as its idempotent re-acquire), else
/// `None` (the caller asks again). Read at once rather than left to the
/// caller's next steps, any of which may fail: an error then would leave
/// the caller unaware of a grant its client holds. `sent`: the send of the
/// cut-off txn.
pub(super) async fn granted_before_cut_off<S: LockShard>(
    active: &Active,
    shard: &S,
    k: &NameKeys,
    client_id: &str,
    sent: Instant,
) -> Result<Option<Acquired>, LockError> {
    let state = shard.read_name_settled(k).await?;
    match state.lock.filter(|kv| holds(kv, client_id)) {
        Some(kv) => active
            .held(shard, client_id, kv, k, None, sent)
            .await
            .map(Some),
        None => Ok(None),
    }
}

/// Whether the lock record `kv` was granted to the client `client_id`.
pub(super) fn holds(kv: &Stored, client_id: &str) -> bool {
    serde_json::from_slice::<LockValue>(kv.value()).is_ok_and(|v| v.client == client_id)
}

/// `renewal` (of `lease`, sent beside a txn that granted on it, or asked
/// for a client's own lock), or if it failed, the lease's last confirmed
/// renewal: the lock is on the lease, which lasts at least that long, and
/// an error would leave the caller unaware of a grant its client holds.
pub(super) fn or_confirmed<S: LockShard>(
    shard: &S,
    lease: i64,
    renewal: Result<Renewal, EtcdError>,
) -> Result<Renewal, EtcdError> {
    renewal.or_else(|unanswered| shard.confirmed_renewal(lease).ok_or(unanswered))
}

/// What a moved name's previous shard said of it during a migration.
pub(crate) enum Handoff {
    /// Nothing holds it there: the new shard's grant decides.
    Free,
    /// Held there (maybe by the caller), or waiting out a lock-delay.
    Answered(Acquired),
    /// The previous shard's cluster is not the one verified.
    IdentityChanged,
}

/// What one attempt of a grant txn came to.
pub(crate) enum Attempt {
    Done(Acquired),
    /// The session lease was gone, and is forgotten: try again on a new one.
    SessionGone,
    /// Try again (a lost holder's record moved).
    Again,
    /// The shard records another ring than the one compared: the router
    /// is told, and the next attempt compares what it then serves.
    RingChanged(Option<Recorded>),
    /// The cluster behind the shard's endpoints is not the one verified.
    IdentityChanged,
    /// The grant cut-off moved past the one compared: by another's move (a
    /// txn sent before it grants nothing), or by this attempt's, whose
    /// grant txn went unanswered and was found to have granted the caller
    /// nothing ([`granted_before_cut_off`]). Try again (`docs/design.md`,
    /// "An acquire that was not answered").
    CutoffMoved,
}

impl Attempt {
    /// What made an attempt that granted nothing try again.
    fn what_changed(&self) -> &'static str {
        match self {
            Attempt::Done(_) => "done",
            Attempt::SessionGone => "the session's lease was gone",
            Attempt::Again => "a lost holder's record moved",
            Attempt::RingChanged(_) => "the recorded ring changed",
            Attempt::IdentityChanged => "the cluster's identity changed",
            Attempt::CutoffMoved => "the grant cut-off moved",
        }
    }
}

impl Active {
    /// Checks an acquire once: its name, clientId, metadata, TTL and wait;
    /// scopes its clientId to `caller`'s principal, and looks up the shard
    /// that owns its name.
    pub(crate) fn check_acquire(
        &self,
        req: AcquireRequest,
        caller: Caller<'_>,
    ) -> Result<Acquire, LockError> {
        let name = self.lock_name(req.name)?;
        check_text("clientId", &req.client_id, self.limits.max_client_id_bytes)?;
        if let Some(meta) = &req.metadata {
            validate::check_metadata(meta, self.limits.max_metadata_bytes)?;
        }
        let ttl = self.ttl(req.ttl_ms)?;
        if req.wait_ms > self.limits.max_wait_ms {
            return Err(invalid(format!(
                "waitMs must be at most {}",
                self.limits.max_wait_ms
            )));
        }
        let wait_until =
            (req.wait_ms > 0).then(|| Instant::now() + Duration::from_millis(req.wait_ms));
        Ok(Acquire {
            shard: self.router.shard_for(name.as_str()).clone(),
            name,
            ttl,
            holder: Holder::new(caller, &req.client_id),
            owner: owner_of(caller),
            wait_until,
            metadata: req.metadata,
            received: req.received,
        })
    }

    /// Acquire without waiting (`waitMs` is not looked at), once
    /// [`Active::check_acquire`] passed.
    pub(crate) async fn acquire_now(&self, req: &Acquire) -> Result<Acquired, LockError> {
        let shard = &req.shard;
        crate::task::name_shard(shard.name());
        let k = shard.name_keys(&name_hash(req.name.as_str()));
        let mut replace_held = None;
        // What each attempt ran into, for the answer if all do.
        let mut changed = Vec::new();
        // Retried when the session lease expired between the cache and the
        // txn, when the shard's recorded ring moved on (a migration opened
        // or closed) under a ring this router still serves, or when a lost
        // holder's record changed under us.
        for _ in 0..3 {
            let g = self.grantable(shard)?;
            if let Some(answer) = self.handoff(req, &k).await? {
                return Ok(answer);
            }
            let attempt = self.attempt(req, &k, &g, replace_held).await?;
            changed.push(attempt.what_changed());
            match attempt {
                Attempt::Done(answer) => return Ok(answer),
                // Forgotten: the next attempt gets a new session.
                Attempt::SessionGone | Attempt::CutoffMoved => continue,
                Attempt::Again => {}
                Attempt::RingChanged(found) => self.router.ring_changed(shard, found),
                Attempt::IdentityChanged => self.router.identity_changed(shard),
            }
            replace_held = None;
            if let LockDelay::Off = self.lock_delay {
                // With lock-delay off, a lost holder's record is replaced.
                replace_held = self.lost_record(shard.as_ref(), &k).await?;
            }
        }
        Err(unavailable(
            shard.as_ref(),
            &format!(
                "the shard's ring, session lease or lock records kept changing ({}); retry",
                changed.join(", ")
            ),
        ))
    }

    /// One attempt at granting `k`'s name on `req`'s shard, which may grant
    /// under `g`: the read first of a name the cache shows held, the quota's
    /// reservation, the holder's session, the grant txn, and what its
    /// answer means. `replace_held`: a lost holder's record to overwrite
    /// (lock-delay off).
    pub(crate) async fn attempt<S: LockShard>(
        &self,
        req: &Acquire<S>,
        k: &NameKeys,
        g: &Grantable,
        replace_held: Option<i64>,
    ) -> Result<Attempt, LockError> {
        let (shard, holder) = (&req.shard, req.holder.as_str());
        // A name looked at free may have been taken by another acquire
        // through this router while it was read: then it is waited for and
        // read once more, rather than sent a txn that would fail.
        let mut looks = 0;
        let shown_held = loop {
            shard.grant_settled(&k.hash).await;
            let shown_held = shard.cache_shows_held(&k.hash);
            if !shown_held || looks == 2 {
                break shown_held;
            }
            looks += 1;
            // The rarer paths' futures (this read, a refused grant's
            // settling, a cut-off grant's) go to the heap only when taken,
            // and the grant's always (below): inline, each would make
            // every acquire's future as large as the largest of them.
            let looked = Box::pin(self.look_first(shard.as_ref(), k, holder, g));
            if let Some(answer) = looked.await? {
                return Ok(Attempt::Done(answer));
            }
            if !shard.grant_pending(&k.hash) {
                break true;
            }
        };
        // Not the holder's own re-acquire (that answered above): a new
        // grant, reserved in the owner's quota until its cache counts it.
        let value = lock_value(req, &g.ring)?;
        let (reservation, session) = match self.reserve_with_session(req, SessionUse::Acquire).await
        {
            Ok(reserved) => reserved,
            // The cache may not show yet a grant made a moment ago (its
            // reservation is what fills the quota): before refusing, the
            // name is read, and a name held (the holder's own grant
            // above all) is answered as such, never refused by a quota.
            Err(LockError::PermissionDenied(refused)) if !shown_held => {
                return match Box::pin(self.look_first(shard.as_ref(), k, holder, g)).await? {
                    Some(answer) => Ok(Attempt::Done(answer)),
                    None => Err(refused.into()),
                };
            }
            Err(e) => return Err(e),
        };
        let window = self.window(session.ttl_secs);
        let sent = Instant::now();
        // On the heap: the grant's future (its txn and keepalive side by
        // side) is most of an acquire's, and inline it would be copied
        // with the handler's future on every request.
        let grant = Box::pin(shard.grant_on_session(k, &value, &session, window, g, replace_held));
        let (txn, renewal) = match unless_cut_off(shard.as_ref(), g.cutoff, grant.await).await? {
            Some(SessionGrant::SessionGone) => return Ok(Attempt::SessionGone),
            Some(SessionGrant::Answered(txn, renewal)) => (txn, renewal),
            // Unanswered, and cut off: what the txn granted before the
            // move, if anything, is the answer.
            None => {
                let granted = Box::pin(granted_before_cut_off(
                    self,
                    shard.as_ref(),
                    k,
                    holder,
                    sent,
                ));
                return Ok(match granted.await? {
                    Some(answer) => Attempt::Done(answer),
                    None => Attempt::CutoffMoved,
                });
            }
        };
        if let (AcquireTxn::Granted { revision }, Some(r)) = (&txn, reservation) {
            r.granted(shard.clone(), *revision);
        }
        let own = (session, renewal);
        self.settle(shard.as_ref(), k, holder, txn, sent, own, g)
            .await
    }

    /// `req`'s new lock reserved in its owner's quota, and the session
    /// lease it will ride on (a new one admitted by the quota too), used
    /// as `usage` says.
    pub(super) async fn reserve_with_session<S: LockShard>(
        &self,
        req: &Acquire<S>,
        usage: SessionUse,
    ) -> Result<(Option<quota::Reservation>, SessionLease), LockError> {
        let (shard, owner) = (&req.shard, req.owner.as_ref());
        let reservation = self.reserve_lock(shard.as_ref(), owner)?;
        let session = shard
            .session(
                req.holder.as_str(),
                req.ttl.secs(),
                owner.map(|o| o.tag),
                usage,
                || self.admit_session(shard.as_ref(), owner, reservation.as_ref()),
            )
            .await?;
        Ok((reservation, session))
    }

    /// A name is read before its grant txn when the lock-key cache says it
    /// is held (a hint, maybe stale), and when a quota would refuse it,
    /// with a read-only txn: if it is held (or waits out a lock-delay) the
    /// answer comes from that read, and the acquire costs no raft write
    /// (etcd 3.4 proposes every txn that may write, even one whose compare
    /// fails). `None`: go on with the grant txn, which decides (or the
    /// quota's refusal stands). A refusal (or the caller's own grant, as an
    /// idempotent re-acquire) read at the shard the router verified, under
    /// the ring it serves, is what the txn would have answered.
    async fn look_first<S: LockShard>(
        &self,
        shard: &S,
        k: &NameKeys,
        client_id: &str,
        g: &Grantable,
    ) -> Result<Option<Acquired>, LockError> {
        let sent = Instant::now();
        let state = shard.read_name(k).await?;
        let verified = state.identity.as_deref() == Some(g.identity.as_slice())
            && state.ring.as_ref() == Some(&g.ring);
        if !verified {
            return Ok(None); // the txn finds out what changed
        }
        let answered = state.lock.is_some() || state.delay.is_some();
        crate::metrics::acquire_read_first(shard.name(), answered);
        match (state.lock, state.delay) {
            (Some(holder), _) => self
                .held(shard, client_id, holder, k, None, sent)
                .await
                .map(Some),
            (None, Some(delay)) => Ok(Some(Acquired::Held(lease_end(shard, &delay).await?))),
            _ => Ok(None),
        }
    }

    /// Turns a refused grant txn into an answer (or a retry).
    #[allow(clippy::too_many_arguments)]
    async fn settle<S: LockShard>(
        &self,
        shard: &S,
        k: &NameKeys,
        client_id: &str,
        txn: AcquireTxn,
        sent: Instant,
        (session, renewal): (SessionLease, Result<Renewal, EtcdError>),
        g: &Grantable,
    ) -> Result<Attempt, LockError> {
        Ok(Attempt::Done(match txn {
            AcquireTxn::Granted { revision } => {
                let lock = LockId {
                    shard: shard.name().into(),
                    epoch: epoch_of(&g.ring)?,
                    ttl_secs: session.ttl_secs,
                    lease: session.id,
                    revision,
                    name_hash: k.hash,
                    owner: Default::default(),
                };
                let renewal = or_confirmed(shard, session.id, renewal)?;
                Acquired::Granted(self.grant(lock, client_id, &renewal, sent)?)
            }
            AcquireTxn::Held(holder) => {
                let own = (session.id == holder.lease()).then_some(renewal);
                Box::pin(self.held(shard, client_id, holder, k, own, sent)).await?
            }
            AcquireTxn::Delayed(delay) => Acquired::Held(Box::pin(lease_end(shard, &delay)).await?),
            AcquireTxn::Lost(held) => {
                match Box::pin(self.lost(shard, k, &held, &g.identity)).await? {
                    Some(until) => Acquired::Held(until),
                    None => return Ok(Attempt::Again),
                }
            }
            // Free, but others wait for it: they come first.
            AcquireTxn::Queued | AcquireTxn::Gone | AcquireTxn::Behind(..) => {
                Acquired::Held(Expiry(Instant::now()))
            }
            AcquireTxn::RingChanged(found) => return Ok(Attempt::RingChanged(found)),
            AcquireTxn::IdentityChanged => return Ok(Attempt::IdentityChanged),
            AcquireTxn::CutoffMoved(mark) => {
                shard.learn_cutoff(mark);
                return Ok(Attempt::CutoffMoved);
            }
        }))
    }

    /// The holder of the name was lost (its lease ended, it did not
    /// release): sets the name's lock-delay, a fresh lease of the lost
    /// lock's TTL, so nobody gets the name before any validity the lost
    /// holder was told of has passed. Returns when the delay ends, or
    /// `None` if the record changed meanwhile (look again). With lock-delay
    /// off, `None` at once: the caller replaces the record.
    pub(crate) async fn lost<S: LockShard>(
        &self,
        shard: &S,
        k: &NameKeys,
        held: &Stored,
        identity: &[u8],
    ) -> Result<Option<Expiry>, LockError> {
        if let LockDelay::Off = self.lock_delay {
            return Ok(None);
        }
        let (until, set) = shard.set_lock_delay(k, held, identity).await?;
        Ok(set.then_some(Expiry(until)))
    }

    /// With lock-delay off: the mod revision of a lost holder's record, to
    /// be replaced by the next grant.
    pub(crate) async fn lost_record<S: LockShard>(
        &self,
        shard: &S,
        k: &NameKeys,
    ) -> Result<Option<i64>, LockError> {
        let state = shard.read_name(k).await?;
        Ok(match (state.lock, state.held) {
            (None, Some(held)) => Some(held.mod_revision()),
            _ => None,
        })
    }

    /// During a migration a moved name may still be held on its previous
    /// shard (or wait out a lost holder's lock-delay there): that holder
    /// keeps it (and a re-acquire by it is answered from there) until it
    /// lets go. The previous shard must already record the new ring, so that
    /// nothing can grant the name there any more, and carry the identity
    /// this router verified for it.
    async fn handoff(&self, req: &Acquire, k: &NameKeys) -> Result<Option<Acquired>, LockError> {
        let Some(migration) = self.router.migration() else {
            return Ok(None);
        };
        let previous = migration.previous_shard(req.name.as_str());
        if previous.name() == req.shard.name() {
            return Ok(None);
        }
        check_up(previous)?;
        let identity = previous.verified_identity().ok_or_else(|| {
            unavailable(
                &**previous,
                "the shard's identity is not verified yet; retry",
            )
        })?;
        let pk = previous.name_keys(&k.hash);
        let fence = (
            self.router.ring.fingerprint(),
            migration.recorded.meta.epoch,
        );
        let client_id = req.holder.as_str();
        let found = self.handoff_on(previous.as_ref(), client_id, &pk, &identity, fence);
        match found.await? {
            Handoff::Free => Ok(None),
            Handoff::Answered(answer) => Ok(Some(answer)),
            Handoff::IdentityChanged => {
                self.router.identity_changed(previous);
                Err(unavailable(
                    previous.as_ref(),
                    "the cluster behind this shard's endpoints is not this shard",
                ))
            }
        }
    }

    /// What a moved name's previous shard says of it: still held there (or
    /// waiting out a lost holder's lock-delay), or free to be granted on
    /// its new shard. The previous shard must carry `identity` and record
    /// a ring at least as new as the migration's (`fence`: its fingerprint
    /// and epoch), so that nothing can grant the name there any more.
    pub(crate) async fn handoff_on<S: LockShard>(
        &self,
        previous: &S,
        client_id: &str,
        pk: &NameKeys,
        identity: &[u8],
        (fingerprint, epoch): (&str, u64),
    ) -> Result<Handoff, LockError> {
        let sent = Instant::now();
        let state = previous.read_name(pk).await?;
        if state.identity.as_deref() != Some(identity) {
            return Ok(Handoff::IdentityChanged);
        }
        let fenced = state
            .ring
            .is_some_and(|r| r.meta.ring == fingerprint && r.meta.epoch >= epoch);
        if !fenced {
            return Err(unavailable(
                previous,
                "the migration has not fenced this shard yet; retry",
            ));
        }
        if let Some(kv) = state.lock {
            let held = self.held(previous, client_id, kv, pk, None, sent).await?;
            return Ok(Handoff::Answered(held));
        }
        if let Some(delay) = state.delay {
            let until = lease_end(previous, &delay).await?;
            return Ok(Handoff::Answered(Acquired::Held(until)));
        }
        if let Some(held) = state.held {
            return match self.lost(previous, pk, &held, identity).await? {
                Some(until) => Ok(Handoff::Answered(Acquired::Held(until))),
                // Lock-delay off, or the record changed: nothing there can
                // be granted again (the shard is fenced), so it is free.
                None => Ok(Handoff::Free),
            };
        }
        Ok(Handoff::Free)
    }

    /// The name is held: by the caller (idempotent re-acquire) or by another.
    /// `own` is the renewal of the caller's session on `shard` if the holder
    /// rides on it; `sent` when the request that read the holder was sent.
    pub(crate) async fn held<S: LockShard>(
        &self,
        shard: &S,
        client_id: &str,
        holder: Stored,
        k: &NameKeys,
        own: Option<Result<Renewal, EtcdError>>,
        sent: Instant,
    ) -> Result<Acquired, LockError> {
        let value: Option<LockValue> = serde_json::from_slice(holder.value()).ok();
        match value {
            Some(v) if v.client == client_id => {
                let renewal = match own {
                    Some(renewal) => renewal,
                    None => {
                        let ttl = v.ttl.max(2);
                        let window = self.window(ttl);
                        shard.renew_lease(holder.lease(), window, ttl).await
                    }
                };
                let renewal = or_confirmed(shard, holder.lease(), renewal)?;
                if !renewal.alive() {
                    // Its lease just ran out; etcd deletes the key momentarily.
                    return Ok(Acquired::Held(Expiry(Instant::now())));
                }
                // The TTL the lock was granted with (older locks: etcd's).
                let ttl_secs = match v.ttl {
                    0 => u32::try_from(renewal.ttl_secs).unwrap_or(u32::MAX),
                    ttl => ttl,
                };
                let lock = LockId {
                    shard: shard.name().into(),
                    epoch: u16::try_from(v.epoch).map_err(|_| Corrupt::Epoch(v.epoch))?,
                    ttl_secs,
                    lease: holder.lease(),
                    revision: holder.create_revision(),
                    name_hash: k.hash,
                    owner: Default::default(),
                };
                Ok(Acquired::Granted(
                    self.grant(lock, client_id, &renewal, sent)?,
                ))
            }
            _ => Ok(Acquired::Held(lease_end(shard, &holder).await?)),
        }
    }
}
