//! The lock operations: acquire, renew, renew-batch, release and inspect.
//!
//! Each is a few etcd calls on the shard that owns the name (or that the
//! lockId names), with no per-lock state in the router:
//! - acquire: one txn that creates the key on the client's session lease
//!   only if nobody holds it and the shard still records this router's ring;
//!   the session lease is renewed alongside (coalesced).
//! - renew: a coalesced keepalive of the lock's lease plus a batched,
//!   linearizable check that the key still has the lockId's create revision
//!   and lease.
//! - release: a txn deleting the key only if it still has that create
//!   revision and lease, so a stale lockId never touches a later holder.

use std::time::{Duration, Instant, SystemTime};

use etcd_client::KeyValue;
use futures::future::join_all;

use crate::config::Limits;
use crate::etcd::EtcdError;
use crate::fencing;
use crate::keepalive::Renewal;
use crate::keys::{name_hash, LockValue, NameHash, Recorded};
use crate::lock_id::LockId;
use crate::router::{NotServing, Router};
use crate::session::SessionLease;
use crate::shard::{AcquireTxn, Shard};
use crate::wait::WaitSlots;

use std::sync::Arc;

use arc_swap::ArcSwap;

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
    /// Held by another client until at least this moment.
    Held(Expiry),
}

pub enum Renewed {
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
    ) -> Result<Renewed, LockError> {
        self.active().renew(lock_id, token, ttl_ms).await
    }

    pub async fn renew_batch(&self, locks: &[(String, u64)]) -> Result<Vec<Renewed>, LockError> {
        self.active().renew_batch(locks).await
    }

    pub async fn release(&self, lock_id: &str, token: u64) -> Result<(), LockError> {
        self.active().release(lock_id, token).await
    }

    pub async fn inspect(&self, name: &str) -> Result<Inspection, LockError> {
        self.active().inspect(name).await
    }
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
        let hash = name_hash(&req.name);
        let key = shard.keys.lock(&hash);
        let waiters = shard.keys.waiters(&hash);
        let window = self.window(ttl_secs);
        // Retried when the session lease expired between the cache and the
        // txn, or when the shard's recorded ring moved on (a migration
        // opened or closed) under a ring this router still serves.
        for _ in 0..3 {
            let ring = self.granting_ring(shard)?;
            if let Some(answer) = self
                .handoff(&req.name, shard, &req.client_id, &hash, window)
                .await?
            {
                return Ok(answer);
            }
            let (epoch, value) = lock_value(req, &ring)?;
            let session = shard
                .sessions
                .get_or_grant(&req.client_id, ttl_secs, || grant_session(shard, ttl_secs))
                .await?;
            let (txn, renewal) = tokio::join!(
                shard.acquire_txn(&key, value, session.id, &ring, &waiters),
                shard.keepalive.refresh(session.id, window),
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
            match txn? {
                AcquireTxn::Granted { revision } => {
                    let made = NewGrant {
                        epoch,
                        ttl_secs,
                        lease: session.id,
                        revision,
                        hash,
                    };
                    return Ok(Acquired::Granted(made.grant(shard, renewal?)?));
                }
                AcquireTxn::Held(holder) => {
                    let own = Some((session, renewal));
                    return self
                        .held(shard, &req.client_id, holder, hash, own, window)
                        .await;
                }
                // Free, but others wait for it: they come first.
                AcquireTxn::Queued => return Ok(Acquired::Held(Expiry(Instant::now()))),
                AcquireTxn::RingChanged(found) => self.router.ring_changed(shard, found),
            }
        }
        Err(unavailable(
            shard,
            "the shard's ring or session lease kept changing; retry",
        ))
    }

    /// During a migration a moved name may still be held on its previous
    /// shard: that holder keeps it (and a re-acquire by it is answered from
    /// there) until it lets go. The previous shard must already record the
    /// new ring, so that nothing can grant the name there any more.
    async fn handoff(
        &self,
        name: &str,
        shard: &Shard,
        client_id: &str,
        hash: &NameHash,
        window: Duration,
    ) -> Result<Option<Acquired>, LockError> {
        let Some(migration) = self.router.migration() else {
            return Ok(None);
        };
        let previous = migration.previous_shard(name);
        if previous.name == shard.name {
            return Ok(None);
        }
        check_up(previous)?;
        let (holder, recorded) = previous
            .read_lock_and_ring(&previous.keys.lock(hash))
            .await?;
        let fenced = recorded.is_some_and(|r| {
            r.meta.ring == self.router.ring.fingerprint()
                && r.meta.epoch >= migration.recorded.meta.epoch
        });
        if !fenced {
            return Err(unavailable(
                previous,
                "the migration has not fenced this shard yet; retry",
            ));
        }
        match holder {
            None => Ok(None),
            Some(kv) => self
                .held(previous, client_id, kv, *hash, None, window)
                .await
                .map(Some),
        }
    }

    /// The name is held: by the caller (idempotent re-acquire) or by another.
    /// `own` is the caller's session on `shard` and its renewal, if the
    /// acquire just ran there.
    async fn held(
        &self,
        shard: &Shard,
        client_id: &str,
        holder: KeyValue,
        hash: NameHash,
        own: Option<(SessionLease, Result<Renewal, EtcdError>)>,
        window: Duration,
    ) -> Result<Acquired, LockError> {
        let value: Option<LockValue> = serde_json::from_slice(holder.value()).ok();
        match value {
            Some(v) if v.client == client_id => {
                let renewal = match own {
                    Some((session, renewal)) if session.id == holder.lease() => renewal?,
                    _ => shard.keepalive.refresh(holder.lease(), window).await?,
                };
                if !renewal.alive() {
                    // Its lease just ran out; etcd deletes the key momentarily.
                    return Ok(Acquired::Held(Expiry(Instant::now())));
                }
                let lock = LockId {
                    shard: shard.name.clone(),
                    epoch: u16::try_from(v.epoch)
                        .map_err(|_| LockError::Internal("epoch out of range".into()))?,
                    ttl_secs: renewal.ttl_secs as u32,
                    lease: holder.lease(),
                    revision: holder.create_revision(),
                    name_hash: hash,
                };
                Ok(Acquired::Granted(grant(lock, renewal)?))
            }
            _ => {
                let sent_at = Instant::now();
                let left = shard.time_to_live(holder.lease()).await?;
                Ok(Acquired::Held(Expiry(
                    sent_at + Duration::from_secs(left as u64),
                )))
            }
        }
    }

    pub async fn renew(
        &self,
        lock_id: &str,
        token: u64,
        ttl_ms: Option<u64>,
    ) -> Result<Renewed, LockError> {
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
    pub async fn renew_batch(&self, locks: &[(String, u64)]) -> Result<Vec<Renewed>, LockError> {
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
                return Ok(Renewed::Unavailable);
            };
            if !shard.conn.is_up() {
                return Ok(Renewed::Unavailable);
            }
            match self.renew_on(shard, id).await {
                Err(EtcdError::Unavailable { .. }) => Ok(Renewed::Unavailable),
                other => other,
            }
        }))
        .await;
        results
            .into_iter()
            .map(|r| r.map_err(LockError::from))
            .collect()
    }

    async fn renew_on(&self, shard: &Shard, id: &LockId) -> Result<Renewed, EtcdError> {
        let key = shard.keys.lock(&id.name_hash);
        let (renewal, current) = tokio::join!(
            shard.keepalive.refresh(id.lease, self.window(id.ttl_secs)),
            shard.verifier.get(key),
        );
        Ok(match current? {
            None => Renewed::Expired,
            Some(kv) if kv.create_revision() == id.revision && kv.lease() == id.lease => {
                let renewal = renewal?;
                if renewal.alive() {
                    shard.sessions.touch(id.lease);
                    Renewed::Renewed(Expiry(renewal.deadline()))
                } else {
                    Renewed::Expired
                }
            }
            Some(_) => Renewed::Stolen,
        })
    }

    /// After this the name is not held under `lock_id` (released now or
    /// already gone).
    pub async fn release(&self, lock_id: &str, token: u64) -> Result<(), LockError> {
        let id = decode(lock_id, token)?;
        let shard = self.shard_of(&id)?;
        check_up(&shard)?;
        let key = shard.keys.lock(&id.name_hash);
        shard.release_txn(&key, id.revision, id.lease).await?;
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
            check_up(place)?;
            if let Some(kv) = place.get(&place.keys.lock(&hash)).await? {
                let value: LockValue = serde_json::from_slice(kv.value())
                    .map_err(|e| LockError::Internal(format!("unreadable lock value: {e}")))?;
                let token = fencing::token(value.epoch, kv.create_revision())
                    .ok_or_else(|| LockError::Internal("token out of range".into()))?;
                let sent_at = Instant::now();
                let left = place.time_to_live(kv.lease()).await?;
                if left == 0 {
                    continue; // its lease ran out; etcd deletes it momentarily
                }
                let expires = Expiry(sent_at + Duration::from_secs(left as u64));
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

    pub(crate) fn granting_ring(&self, shard: &Shard) -> Result<Recorded, LockError> {
        self.router.granting_ring(shard).map_err(|why| match why {
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

/// A lock key just created on a session lease.
pub(crate) struct NewGrant {
    pub epoch: u16,
    pub ttl_secs: u32,
    pub lease: i64,
    pub revision: i64,
    pub hash: NameHash,
}

impl NewGrant {
    /// The grant's answer; `renewal` is the session's latest renewal.
    pub(crate) fn grant(self, shard: &Shard, renewal: Renewal) -> Result<Grant, LockError> {
        let lock = LockId {
            shard: shard.name.clone(),
            epoch: self.epoch,
            ttl_secs: self.ttl_secs,
            lease: self.lease,
            revision: self.revision,
            name_hash: self.hash,
        };
        grant(lock, renewal)
    }
}

/// The epoch a grant under `ring` carries, and the lock key's value.
pub(crate) fn lock_value(
    req: &AcquireRequest,
    ring: &Recorded,
) -> Result<(u16, Vec<u8>), LockError> {
    let epoch = u16::try_from(ring.meta.epoch)
        .map_err(|_| LockError::Internal("ring epoch out of range".into()))?;
    let value = LockValue {
        client: req.client_id.clone(),
        epoch: ring.meta.epoch,
        name: req.name.clone(),
    };
    let bytes = serde_json::to_vec(&value).map_err(|e| LockError::Internal(e.to_string()))?;
    Ok((epoch, bytes))
}

pub(crate) async fn grant_session(shard: &Shard, ttl_secs: u32) -> Result<SessionLease, EtcdError> {
    let sent_at = Instant::now();
    let id = shard.grant(ttl_secs).await?;
    crate::metrics::session_granted(&shard.name);
    shard
        .keepalive
        .seed(
            id,
            Renewal {
                sent_at,
                ttl_secs: ttl_secs.into(),
            },
        )
        .await;
    Ok(SessionLease { id, ttl_secs })
}

pub(crate) fn grant(lock: LockId, renewal: Renewal) -> Result<Grant, LockError> {
    let fencing_token = lock
        .token()
        .ok_or_else(|| LockError::Internal("fencing token out of range".into()))?;
    Ok(Grant {
        lock_id: lock.encode(),
        fencing_token,
        expires: Expiry(renewal.deadline()),
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
