//! The lock operations: acquire, renew, renew-batch, release and inspect.
//!
//! Each is a few etcd calls on the shard that owns the name (or that the
//! lockId names), with no per-lock state in the router:
//! - [`acquire`]: one txn that creates the key on the client's session lease
//!   (with its held record) only if nobody holds the name, no lost holder's
//!   lock-delay is pending, and the shard still records this router's ring
//!   and identity; the session lease is renewed alongside (coalesced).
//!   [`wait`]: the waiting acquire, a FIFO queue per name in etcd.
//!   [`limit`]: each clientId's acquire rate.
//! - [`renew`]: a coalesced keepalive of the lock's lease plus a batched,
//!   linearizable check that the key still has the lockId's create revision
//!   and lease.
//! - [`release`]: a txn deleting the key (and its held record) only if it
//!   still has that create revision and lease, so a stale lockId never
//!   touches a later holder.
//! - [`inspect`]: who holds a name; [`force`]: an operator takes a name
//!   from its holder; [`validate`]: the input rules.
//!
//! This file holds the shared types ([`Locks`], [`Active`], errors,
//! answers); the submodules only add methods to [`Active`].
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

use crate::config::{Limits, LockDelay};
use crate::placement::topology::{NotServing, Router};
use crate::shard::conn::EtcdError;
use crate::shard::keepalive::Renewal;
use crate::shard::keys::{LockValue, Recorded};
use crate::shard::sessions::SessionLease;
use crate::shard::{Grantable, Shard};
use crate::token::lock_id::LockId;
mod acquire;
mod force;
mod inspect;
mod limit;
mod release;
mod renew;
mod validate;
mod wait;

/// How long clients are told to wait before retrying an unavailable shard.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// A failed operation, as the HTTP layer maps it.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("shard {shard} is unavailable: {detail}")]
    ShardUnavailable { shard: String, detail: String },
    /// Past the waiter cap or the caller's acquire rate.
    #[error("{reason}")]
    RateLimited {
        reason: String,
        retry_after: Duration,
    },
    /// This replica already has its most acquires in flight on the shard
    /// (a slow shard), or in all.
    #[error("shard {shard} has {in_flight} acquires in flight through this router, its limit; retry after a second")]
    Overloaded { shard: String, in_flight: usize },
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

impl From<validate::Invalid> for LockError {
    fn from(validate::Invalid(msg): validate::Invalid) -> Self {
        LockError::InvalidArgument(msg)
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

#[derive(Debug, Clone, Copy)]
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
    /// The holder's clientId (shown to admin callers only).
    pub client_id: Option<String>,
}

/// The lock a force-release took away.
#[derive(Debug, Clone)]
pub struct Forced {
    pub shard: String,
    pub fencing_token: u64,
    pub client_id: String,
}

/// Concurrent waiters a router accepts; beyond it, 429.
pub struct WaitSlots(pub(crate) Arc<tokio::sync::Semaphore>);

impl WaitSlots {
    pub fn new(max: usize) -> Self {
        Self(Arc::new(tokio::sync::Semaphore::new(max)))
    }
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

/// An acquire in flight on a shard, given back when dropped.
struct ShardSlot<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for ShardSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// The lock operations over the active router. Each request works on one
/// snapshot of [`Active`], so a reload never changes the ground under it.
pub struct Locks {
    active: ArcSwap<Active>,
    /// Caps concurrent waiting acquires (kept across reloads).
    waiting: WaitSlots,
    /// Acquires per clientId and second (kept across reloads); `None`: no limit.
    per_client: Option<limit::ClientLimiter>,
    /// Most acquires in flight on one shard, when the ring has several.
    per_shard: usize,
}

impl Locks {
    /// `per_shard`: the most acquires this replica keeps in flight on one
    /// shard of a ring with several (a slow shard then answers 503
    /// `overloaded` for its own names and leaves the rest of the replica's
    /// capacity to the others).
    pub fn new(active: Active, per_shard: usize) -> Self {
        Self {
            waiting: WaitSlots::new(active.limits.max_waiters),
            per_client: limit::ClientLimiter::new(active.limits.acquires_per_client_per_sec),
            per_shard: per_shard.max(1),
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
        let limited = match &self.per_client {
            Some(limiter) => limiter
                .check(&req.client_id)
                .map_err(|wait| LockError::RateLimited {
                    reason: format!(
                        "clientId {:?} is past {} acquires/s; retry in {} ms",
                        req.client_id,
                        limiter.per_sec(),
                        wait.as_millis().max(1)
                    ),
                    retry_after: wait.max(Duration::from_secs(1)),
                }),
            None => Ok(()),
        };
        let shard = active.router.shard_for(&req.name).clone();
        let slot = match limited {
            Ok(()) => self.shard_slot(&active, &shard),
            Err(e) => Err(e),
        };
        let result = match slot {
            Err(e) => Err(e),
            Ok(_slot) if req.wait_ms == 0 => active.acquire_now(req).await,
            Ok(_slot) => active.acquire_waiting(req, &self.waiting).await,
        };
        let outcome = match &result {
            Ok(Acquired::Granted(_)) => "acquired",
            Ok(Acquired::Held(_)) => "not_acquired",
            Err(LockError::ShardUnavailable { .. }) => "shard_unavailable",
            Err(LockError::RateLimited { .. }) => "rate_limited",
            Err(LockError::Overloaded { .. }) => "overloaded",
            Err(LockError::Internal(_)) => "error",
            Err(LockError::InvalidArgument(_)) => return result, // no shard to speak of
        };
        shard.conn.metrics().acquire(outcome);
        result
    }

    /// A slot among the acquires in flight on `shard`, when the ring has
    /// several shards.
    fn shard_slot<'a>(
        &self,
        active: &Active,
        shard: &'a Shard,
    ) -> Result<ShardSlot<'a>, LockError> {
        use std::sync::atomic::Ordering;
        let bound = if active.router.shards.len() > 1 {
            self.per_shard
        } else {
            usize::MAX
        };
        shard
            .acquiring
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < bound).then_some(n + 1)
            })
            .map(|_| ShardSlot(&shard.acquiring))
            .map_err(|in_flight| LockError::Overloaded {
                shard: shard.name.clone(),
                in_flight,
            })
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

    pub async fn force_release(&self, name: &str) -> Result<Option<Forced>, LockError> {
        self.active().force_release(name).await
    }
}

impl Active {
    /// The lease TTL of a lock asked for `ttl_ms` under this config.
    pub(crate) fn ttl_secs(&self, ttl_ms: u64) -> Result<u32, LockError> {
        Ok(validate::ttl_secs(&self.limits, ttl_ms)?)
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
    shard.keepalive.seed(id, renewal);
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
