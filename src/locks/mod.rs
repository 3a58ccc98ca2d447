//! The lock operations: acquire, renew, renew-batch, release and inspect.
//!
//! Each is a few etcd calls on the shard that owns the name (or that the
//! lockId names), with no per-lock state in the router:
//! - acquire: one txn that creates the key on the client's session lease
//!   (with its held record) only if nobody holds the name, no lost holder's
//!   lock-delay is pending, and the shard still records this router's ring
//!   and identity; the session lease is renewed alongside (coalesced).
//! - renew: a coalesced keepalive of the lock's lease plus a batched,
//!   linearizable check that the key still has the lockId's create revision
//!   and lease.
//! - release: a txn deleting the key (and its held record) only if it still
//!   has that create revision and lease, so a stale lockId never touches a
//!   later holder.
//!
//! Honest expiry: every expiry the router reports counts from the earlier of
//! the keepalive's send and the send of the etcd request that saw the lock
//! key. The key existed then, so whatever ends the lease later, the holder's
//! validity ends at most one TTL after the key is gone; the lock-delay of a
//! lost holder (one TTL, see `docs/design.md`) covers exactly that.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use etcd_client::KeyValue;
use futures::future::{join_all, Either};

use crate::config::{Limits, LockDelay};
use crate::placement::topology::{NotServing, Router};
use crate::shard::conn::EtcdError;
use crate::shard::keepalive::Renewal;
use crate::shard::keys::{name_hash, LockValue, Recorded};
use crate::shard::sessions::SessionLease;
use crate::shard::{AcquireTxn, Grantable, NameKeys, Shard};
use crate::token::fencing;
use crate::token::lock_id::LockId;
pub(crate) mod wait;

use wait::WaitSlots;

/// How long clients are told to wait before retrying an unavailable shard.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// A failed operation, as the HTTP layer maps it.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("shard {shard} is unavailable: {detail}")]
    ShardUnavailable { shard: String, detail: String },
    #[error("too many callers are waiting; retry later")]
    RateLimited,
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<EtcdError> for LockError {
    fn from(e: EtcdError) -> Self {
        match e {
            EtcdError::Unavailable { shard, detail } => {
                LockError::ShardUnavailable { shard, detail }
            }
            other => LockError::Internal(other.to_string()),
        }
    }
}

pub(crate) fn invalid(msg: impl Into<String>) -> LockError {
    LockError::InvalidArgument(msg.into())
}

/// A moment the router knows a lease lives until (never later than etcd's).
#[derive(Debug, Clone, Copy)]
pub struct Expiry(pub Instant);

impl Expiry {
    /// `(expiresInMs, expiresAt)` read off one clock sample.
    pub fn report(&self) -> (u64, SystemTime) {
        let left = self.0.saturating_duration_since(Instant::now());
        (left.as_millis() as u64, SystemTime::now() + left)
    }

    /// The expiry a renewal vouches for, counted from no later than
    /// `key_seen` (the send of the request that saw the lock key).
    pub fn vouched(renewal: &Renewal, key_seen: Instant) -> Self {
        let from = renewal.sent_at.min(key_seen);
        Self(from + Duration::from_secs(renewal.ttl_secs.max(0) as u64))
    }
}

pub struct AcquireRequest {
    pub name: String,
    pub ttl_ms: u64,
    pub client_id: String,
    pub wait_ms: u64,
}

pub struct Grant {
    pub lock_id: String,
    pub fencing_token: u64,
    pub expires: Expiry,
}

pub enum Acquired {
    Granted(Grant),
    /// Held by another client (or waiting out a lost holder's lock-delay)
    /// until at least this moment.
    Held(Expiry),
}

pub enum RenewOutcome {
    Renewed(Expiry),
    Expired,
    Stolen,
    /// Only in batches: the lock's shard did not answer (retry later).
    Unavailable,
}

pub struct Inspection {
    pub shard: String,
    pub holder: Option<(u64, Expiry)>,
}

/// Everything a config reload replaces at once.
pub struct Active {
    pub router: Arc<Router>,
    pub limits: Limits,
    /// Renewals of one lease closer together than this share a keepalive.
    pub coalesce: Duration,
    /// What happens to the name of a holder lost other than by release.
    pub lock_delay: LockDelay,
}

/// The lock operations over the active router. Each request works on one
/// snapshot of [`Active`], so a reload never changes the ground under it.
pub struct Locks {
    active: ArcSwap<Active>,
    /// Caps concurrent waiting acquires (kept across reloads).
    waiting: WaitSlots,
}

impl Locks {
    pub fn new(active: Active) -> Self {
        Self {
            waiting: WaitSlots::new(active.limits.max_waiters),
            active: ArcSwap::from_pointee(active),
        }
    }

    pub fn active(&self) -> Arc<Active> {
        self.active.load_full()
    }

    /// Installs `active`; returns what it replaced.
    pub fn replace(&self, active: Active) -> Arc<Active> {
        self.active.swap(Arc::new(active))
    }

    pub async fn acquire(&self, req: &AcquireRequest) -> Result<Acquired, LockError> {
        let active = self.active();
        let result = if req.wait_ms == 0 {
            active.acquire_now(req).await
        } else {
            active.acquire_waiting(req, &self.waiting).await
        };
        let outcome = match &result {
            Ok(Acquired::Granted(_)) => "acquired",
            Ok(Acquired::Held(_)) => "not_acquired",
            Err(LockError::ShardUnavailable { .. }) => "shard_unavailable",
            Err(LockError::RateLimited) => "rate_limited",
            Err(LockError::Internal(_)) => "error",
            Err(LockError::InvalidArgument(_)) => return result, // no shard to speak of
        };
        crate::metrics::acquire(&active.router.shard_for(&req.name).name, outcome);
        result
    }

    pub async fn renew(
        &self,
        lock_id: &str,
        token: u64,
        ttl_ms: Option<u64>,
    ) -> Result<RenewOutcome, LockError> {
        self.active().renew(lock_id, token, ttl_ms).await
    }

    pub async fn renew_batch(
        &self,
        locks: &[(String, u64)],
    ) -> Result<Vec<RenewOutcome>, LockError> {
        self.active().renew_batch(locks).await
    }

    pub async fn release(&self, lock_id: &str, token: u64) -> Result<(), LockError> {
        self.active().release(lock_id, token).await
    }

    pub async fn inspect(&self, name: &str) -> Result<Inspection, LockError> {
        self.active().inspect(name).await
    }
}

/// What one attempt of a grant txn came to.
pub(crate) enum Attempt {
    Done(Acquired),
    /// Try again (the ring, the session or a lost holder's record moved).
    Again,
}

impl Active {
    /// Checks an acquire's name, clientId and TTL; returns the lease TTL.
    pub(crate) fn check_acquire(&self, req: &AcquireRequest) -> Result<u32, LockError> {
        check_text("name", &req.name, self.limits.max_name_bytes)?;
        check_text("clientId", &req.client_id, self.limits.max_client_id_bytes)?;
        self.ttl_secs(req.ttl_ms)
    }

    /// Acquire without waiting (`waitMs` is not looked at).
    pub async fn acquire_now(&self, req: &AcquireRequest) -> Result<Acquired, LockError> {
        let ttl_secs = self.check_acquire(req)?;
        let shard = self.router.shard_for(&req.name);
        tracing::Span::current().record("shard", shard.name.as_str());
        let k = shard.name_keys(&name_hash(&req.name));
        let window = self.window(ttl_secs);
        let mut replace_held = None;
        // Retried when the session lease expired between the cache and the
        // txn, when the shard's recorded ring moved on (a migration opened
        // or closed) under a ring this router still serves, or when a lost
        // holder's record changed under us.
        for _ in 0..3 {
            let g = self.grantable(shard)?;
            if let Some(answer) = self.handoff(&req.name, shard, &req.client_id, &k).await? {
                return Ok(answer);
            }
            let value = lock_value(req, &g.ring, ttl_secs)?;
            let session = shard
                .sessions
                .get_or_grant(&req.client_id, ttl_secs, || grant_session(shard, ttl_secs))
                .await?;
            let sent = Instant::now();
            let (txn, renewal) = tokio::join!(
                shard.acquire_txn(&k, &value, session.id, &g, replace_held),
                shard.keepalive.refresh(session.id, window, ttl_secs),
            );
            let lease_gone = matches!(txn, Err(EtcdError::LeaseNotFound))
                || matches!(renewal, Ok(r) if !r.alive());
            if lease_gone {
                // If the txn did create the key, it went with the lease.
                shard
                    .sessions
                    .invalidate(&req.client_id, ttl_secs, session.id)
                    .await;
                continue;
            }
            let own = (session, renewal);
            match self
                .settle(shard, &k, &req.client_id, txn?, sent, own, &g)
                .await?
            {
                Attempt::Done(answer) => return Ok(answer),
                Attempt::Again => {}
            }
            replace_held = None;
            if let LockDelay::Off = self.lock_delay {
                // With lock-delay off, a lost holder's record is replaced.
                replace_held = self.lost_record(shard, &k).await?;
            }
        }
        Err(unavailable(
            shard,
            "the shard's ring, session lease or lock records kept changing; retry",
        ))
    }

    /// Turns a refused grant txn into an answer (or a retry).
    #[allow(clippy::too_many_arguments)]
    async fn settle(
        &self,
        shard: &Shard,
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
                    shard: shard.name.clone(),
                    epoch: epoch_of(&g.ring)?,
                    ttl_secs: session.ttl_secs,
                    lease: session.id,
                    revision,
                    name_hash: k.hash,
                };
                Acquired::Granted(grant(lock, &renewal?, sent)?)
            }
            AcquireTxn::Held(holder) => {
                let own = (session.id == holder.lease()).then_some(renewal);
                self.held(shard, client_id, holder, k, own, sent).await?
            }
            AcquireTxn::Delayed(delay) => Acquired::Held(lease_end(shard, &delay).await?),
            AcquireTxn::Lost(held) => match self.lost(shard, k, &held, &g.identity).await? {
                Some(until) => Acquired::Held(until),
                None => return Ok(Attempt::Again),
            },
            // Free, but others wait for it: they come first.
            AcquireTxn::Queued | AcquireTxn::Gone | AcquireTxn::Behind(..) => {
                Acquired::Held(Expiry(Instant::now()))
            }
            AcquireTxn::RingChanged(found) => {
                self.router.ring_changed(shard, found);
                return Ok(Attempt::Again);
            }
            AcquireTxn::IdentityChanged => {
                self.router.identity_changed(shard);
                return Ok(Attempt::Again);
            }
        }))
    }

    /// The holder of the name was lost (its lease ended, it did not
    /// release): sets the name's lock-delay, a fresh lease of the lost
    /// lock's TTL, so nobody gets the name before any validity the lost
    /// holder was told of has passed. Returns when the delay ends, or
    /// `None` if the record changed meanwhile (look again). With lock-delay
    /// off, `None` at once: the caller replaces the record.
    pub(crate) async fn lost(
        &self,
        shard: &Shard,
        k: &NameKeys,
        held: &KeyValue,
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
    async fn lost_record(&self, shard: &Shard, k: &NameKeys) -> Result<Option<i64>, LockError> {
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
    async fn handoff(
        &self,
        name: &str,
        shard: &Shard,
        client_id: &str,
        k: &NameKeys,
    ) -> Result<Option<Acquired>, LockError> {
        let Some(migration) = self.router.migration() else {
            return Ok(None);
        };
        let previous = migration.previous_shard(name);
        if previous.name == shard.name {
            return Ok(None);
        }
        check_up(previous)?;
        let identity = previous.verified_identity().ok_or_else(|| {
            unavailable(previous, "the shard's identity is not verified yet; retry")
        })?;
        let pk = previous.name_keys(&k.hash);
        let sent = Instant::now();
        let state = previous.read_name(&pk).await?;
        if state.identity.as_deref() != Some(identity.as_slice()) {
            self.router.identity_changed(previous);
            return Err(unavailable(
                previous,
                "the cluster behind this shard's endpoints is not this shard",
            ));
        }
        let fenced = state.ring.is_some_and(|r| {
            r.meta.ring == self.router.ring.fingerprint()
                && r.meta.epoch >= migration.recorded.meta.epoch
        });
        if !fenced {
            return Err(unavailable(
                previous,
                "the migration has not fenced this shard yet; retry",
            ));
        }
        if let Some(kv) = state.lock {
            return self
                .held(previous, client_id, kv, &pk, None, sent)
                .await
                .map(Some);
        }
        if let Some(delay) = state.delay {
            return Ok(Some(Acquired::Held(lease_end(previous, &delay).await?)));
        }
        if let Some(held) = state.held {
            return match self.lost(previous, &pk, &held, &identity).await? {
                Some(until) => Ok(Some(Acquired::Held(until))),
                // Lock-delay off, or the record changed: nothing there can
                // be granted again (the shard is fenced), so it is free.
                None => Ok(None),
            };
        }
        Ok(None)
    }

    /// The name is held: by the caller (idempotent re-acquire) or by another.
    /// `own` is the renewal of the caller's session on `shard` if the holder
    /// rides on it; `sent` when the request that read the holder was sent.
    pub(crate) async fn held(
        &self,
        shard: &Shard,
        client_id: &str,
        holder: KeyValue,
        k: &NameKeys,
        own: Option<Result<Renewal, EtcdError>>,
        sent: Instant,
    ) -> Result<Acquired, LockError> {
        let value: Option<LockValue> = serde_json::from_slice(holder.value()).ok();
        match value {
            Some(v) if v.client == client_id => {
                let renewal = match own {
                    Some(renewal) => renewal?,
                    None => {
                        let ttl = v.ttl.max(2);
                        let window = self.window(ttl);
                        shard.keepalive.refresh(holder.lease(), window, ttl).await?
                    }
                };
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
                    shard: shard.name.clone(),
                    epoch: u16::try_from(v.epoch)
                        .map_err(|_| LockError::Internal("epoch out of range".into()))?,
                    ttl_secs,
                    lease: holder.lease(),
                    revision: holder.create_revision(),
                    name_hash: k.hash,
                };
                Ok(Acquired::Granted(grant(lock, &renewal, sent)?))
            }
            _ => Ok(Acquired::Held(lease_end(shard, &holder).await?)),
        }
    }

    pub async fn renew(
        &self,
        lock_id: &str,
        token: u64,
        ttl_ms: Option<u64>,
    ) -> Result<RenewOutcome, LockError> {
        let id = decode(lock_id, token)?;
        if let Some(ttl_ms) = ttl_ms {
            let secs = self.ttl_secs(ttl_ms)?;
            if secs != id.ttl_secs {
                return Err(invalid(format!(
                    "ttlMs {ttl_ms} does not match the lock's TTL of {} s: a lock's TTL is fixed when it is acquired",
                    id.ttl_secs
                )));
            }
        }
        // A shard no longer in any ring was drained: the lock is gone.
        let shard = self.shard_of(&id)?;
        check_up(&shard)?;
        Ok(self.renew_on(&shard, &id).await?)
    }

    /// Renews every lock in `locks`; malformed entries fail the whole call
    /// (a client only sends lockIds it was given), shard outages only theirs.
    pub async fn renew_batch(
        &self,
        locks: &[(String, u64)],
    ) -> Result<Vec<RenewOutcome>, LockError> {
        if locks.is_empty() || locks.len() > self.limits.max_batch {
            return Err(invalid(format!(
                "locks must hold 1 to {} entries",
                self.limits.max_batch
            )));
        }
        let mut ids = Vec::with_capacity(locks.len());
        for (i, (lock_id, token)) in locks.iter().enumerate() {
            let id = decode(lock_id, *token).map_err(|e| invalid(format!("locks[{i}]: {e}")))?;
            let shard = self.shard_of(&id).ok();
            ids.push((id, shard));
        }
        let results = join_all(ids.iter().map(|(id, shard)| async move {
            let Some(shard) = shard else {
                return Ok(RenewOutcome::Unavailable);
            };
            if !shard.conn.is_up() {
                return Ok(RenewOutcome::Unavailable);
            }
            match self.renew_on(shard, id).await {
                Err(EtcdError::Unavailable { .. }) => Ok(RenewOutcome::Unavailable),
                other => other,
            }
        }))
        .await;
        results
            .into_iter()
            .map(|r| r.map_err(LockError::from))
            .collect()
    }

    /// The keepalive and the check run in parallel; a lock the check finds
    /// gone is answered at once, without waiting for the keepalive.
    async fn renew_on(&self, shard: &Shard, id: &LockId) -> Result<RenewOutcome, EtcdError> {
        let key = shard.keys.lock(&id.name_hash);
        let sent = Instant::now();
        let keepalive = shard
            .keepalive
            .refresh(id.lease, self.window(id.ttl_secs), id.ttl_secs);
        let verify = shard.verifier.get(key);
        let (mut keepalive, verify) = (std::pin::pin!(keepalive), std::pin::pin!(verify));
        let (current, early) = match futures::future::select(verify, &mut keepalive).await {
            Either::Left((current, _)) => (current, None),
            Either::Right((renewal, verify)) => (verify.await, Some(renewal)),
        };
        match current? {
            None => Ok(RenewOutcome::Expired),
            Some(kv) if kv.create_revision() == id.revision && kv.lease() == id.lease => {
                let renewal = match early {
                    Some(renewal) => renewal?,
                    None => keepalive.await?,
                };
                if !renewal.alive() {
                    return Ok(RenewOutcome::Expired);
                }
                shard.sessions.touch(id.lease);
                Ok(RenewOutcome::Renewed(Expiry::vouched(&renewal, sent)))
            }
            Some(_) => Ok(RenewOutcome::Stolen),
        }
    }

    /// After this the name is not held under `lock_id` (released now or
    /// already gone).
    pub async fn release(&self, lock_id: &str, token: u64) -> Result<(), LockError> {
        let id = decode(lock_id, token)?;
        let shard = self.shard_of(&id)?;
        check_identity(&shard)?;
        let k = shard.name_keys(&id.name_hash);
        shard.release_txn(&k, id.revision, id.lease).await?;
        Ok(())
    }

    pub async fn inspect(&self, name: &str) -> Result<Inspection, LockError> {
        check_text("name", name, self.limits.max_name_bytes)?;
        let shard = self.router.shard_for(name);
        tracing::Span::current().record("shard", shard.name.as_str());
        let hash = name_hash(name);
        // During a migration a moved name may still be held where it was.
        let mut places = vec![shard.clone()];
        if let Some(m) = self.router.migration() {
            let previous = m.previous_shard(name);
            if previous.name != shard.name {
                places.push(previous.clone());
            }
        }
        for place in &places {
            check_identity(place)?;
            let state = place.read_name(&place.name_keys(&hash)).await?;
            if state.identity != place.verified_identity() {
                self.router.identity_changed(place);
                return Err(unavailable(
                    place,
                    "the cluster behind this shard's endpoints is not this shard",
                ));
            }
            if let Some(kv) = state.lock {
                let value: LockValue = serde_json::from_slice(kv.value())
                    .map_err(|e| LockError::Internal(format!("unreadable lock value: {e}")))?;
                let token = fencing::token(value.epoch, kv.create_revision())
                    .ok_or_else(|| LockError::Internal("token out of range".into()))?;
                let expires = lease_end(place, &kv).await?;
                if expires.0 <= Instant::now() {
                    continue; // its lease ran out; etcd deletes it momentarily
                }
                return Ok(Inspection {
                    shard: place.name.clone(),
                    holder: Some((token, expires)),
                });
            }
        }
        Ok(Inspection {
            shard: shard.name.clone(),
            holder: None,
        })
    }

    pub(crate) fn ttl_secs(&self, ttl_ms: u64) -> Result<u32, LockError> {
        let (min, max) = (self.limits.min_ttl_ms, self.limits.max_ttl_ms);
        if !(min..=max).contains(&ttl_ms) {
            return Err(invalid(format!(
                "ttlMs must be {min} to {max}, got {ttl_ms}"
            )));
        }
        // etcd leases are whole seconds: round up so the lock lives at least ttlMs.
        Ok(ttl_ms.div_ceil(1000) as u32)
    }

    /// Renewals of one lease closer together than this share a keepalive.
    pub(crate) fn window(&self, ttl_secs: u32) -> Duration {
        self.coalesce
            .min(Duration::from_millis(u64::from(ttl_secs) * 100))
    }

    /// What a grant on `shard` compares, if it may grant now.
    pub(crate) fn grantable(&self, shard: &Shard) -> Result<Grantable, LockError> {
        self.router.grantable(shard).map_err(|why| match why {
            NotServing::Down => unavailable(shard, "the shard does not answer"),
            NotServing::Ring(detail) => unavailable(shard, &detail),
        })
    }

    /// The shard a lockId names: in this ring or, during a migration, the
    /// previous one. A shard this router does not know is unavailable, not
    /// gone: the router may not have reloaded yet, and a drained shard is
    /// indistinguishable from one still to be learned of.
    fn shard_of(&self, id: &LockId) -> Result<Arc<Shard>, LockError> {
        tracing::Span::current().record("shard", id.shard.as_str());
        self.router.shard_named(&id.shard).ok_or_else(|| LockError::ShardUnavailable {
            shard: id.shard.clone(),
            detail: "this router does not know the shard (not reloaded yet, or the shard was removed)".into(),
        })
    }
}

/// When the lease of `kv` ends, as far as the router knows now.
pub(crate) async fn lease_end(shard: &Shard, kv: &KeyValue) -> Result<Expiry, EtcdError> {
    let sent = Instant::now();
    let left = shard.time_to_live(kv.lease()).await?;
    Ok(Expiry(sent + Duration::from_secs(left as u64)))
}

/// The lock key's value for a grant under `ring`.
pub(crate) fn lock_value(
    req: &AcquireRequest,
    ring: &Recorded,
    ttl_secs: u32,
) -> Result<LockValue, LockError> {
    epoch_of(ring)?;
    Ok(LockValue {
        client: req.client_id.clone(),
        epoch: ring.meta.epoch,
        name: req.name.clone(),
        ttl: ttl_secs,
    })
}

pub(crate) fn epoch_of(ring: &Recorded) -> Result<u16, LockError> {
    u16::try_from(ring.meta.epoch)
        .map_err(|_| LockError::Internal("ring epoch out of range".into()))
}

pub(crate) async fn grant_session(shard: &Shard, ttl_secs: u32) -> Result<SessionLease, EtcdError> {
    let sent_at = Instant::now();
    let (id, granted) = shard.grant(ttl_secs).await?;
    crate::metrics::session_granted(&shard.name);
    let renewal = Renewal {
        sent_at,
        ttl_secs: granted,
    };
    shard.keepalive.seed(id, renewal).await;
    Ok(SessionLease { id, ttl_secs })
}

/// The answer to a grant (or re-acquire) confirmed by a txn sent at `sent`.
pub(crate) fn grant(lock: LockId, renewal: &Renewal, sent: Instant) -> Result<Grant, LockError> {
    let fencing_token = lock
        .token()
        .ok_or_else(|| LockError::Internal("fencing token out of range".into()))?;
    Ok(Grant {
        lock_id: lock.encode(),
        fencing_token,
        expires: Expiry::vouched(renewal, sent),
    })
}

fn decode(lock_id: &str, token: u64) -> Result<LockId, LockError> {
    let id = LockId::decode(lock_id).map_err(|e| invalid(e.to_string()))?;
    if id.token() != Some(token) {
        return Err(invalid("fencingToken does not belong to this lockId"));
    }
    Ok(id)
}

pub(crate) fn check_up(shard: &Shard) -> Result<(), LockError> {
    if shard.conn.is_up() {
        Ok(())
    } else {
        Err(unavailable(shard, "the shard does not answer"))
    }
}

/// The shard answers and its cluster was verified to be this shard.
pub(crate) fn check_identity(shard: &Shard) -> Result<(), LockError> {
    check_up(shard)?;
    if shard.verified_identity().is_none() {
        return Err(unavailable(
            shard,
            "the shard's identity is not verified (see the router log)",
        ));
    }
    Ok(())
}

pub(crate) fn unavailable(shard: &Shard, detail: &str) -> LockError {
    LockError::ShardUnavailable {
        shard: shard.name.clone(),
        detail: detail.to_string(),
    }
}

/// 1 to `max` bytes of UTF-8 without control characters.
pub(crate) fn check_text(field: &str, value: &str, max: usize) -> Result<(), LockError> {
    if value.is_empty() || value.len() > max {
        return Err(invalid(format!(
            "{field} must be 1 to {max} bytes, got {}",
            value.len()
        )));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid(format!(
            "{field} must not contain control characters"
        )));
    }
    Ok(())
}
